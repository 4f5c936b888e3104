"""Pinning host memory and moving batches to the training device."""
