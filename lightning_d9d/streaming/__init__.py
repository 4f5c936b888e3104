"""The streaming path: parquet → batched tokenization → packed token rows, resumable by position."""
