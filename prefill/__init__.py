"""pdserve prefill."""
