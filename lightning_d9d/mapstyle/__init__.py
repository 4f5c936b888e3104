"""The map-style path: order → shard → load, for datasets with ``__getitem__`` and ``__len__``."""
