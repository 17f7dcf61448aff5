"""pdserve kvstore."""
