"""pdserve decode."""
