"""The prefill worker (`pdserve prefill`)."""
