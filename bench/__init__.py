"""pdserve bench."""
