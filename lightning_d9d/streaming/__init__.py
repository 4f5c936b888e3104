"""The streaming path: parquet or JSONL → batched tokenization → packed token rows, resumable by position.

Stages, low to high (one folder each; docs/design.md draws the map): ``plans`` → ``sources`` → ``tokens`` →
``packing`` → ``streams`` → ``loading``, with ``provenance`` beside the loader. The packing strategies are
imported here so that a plan can name one however the streaming path was entered.
"""

import lightning_d9d.streaming.packing.concat  # noqa: F401  (the packing package registers every strategy)
