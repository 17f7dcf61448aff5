"""pdserve router."""
