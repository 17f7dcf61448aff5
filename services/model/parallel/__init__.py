"""Splitting one worker's model over several processes (docs/parallel.md)."""
