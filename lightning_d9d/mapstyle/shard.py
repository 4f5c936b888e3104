"""Shard: split each global batch across data-parallel ranks as equal numbers of microbatches.

Algorithm: a global batch of G samples, in sorted order, is cut into ``W·M`` microbatches of ``m`` consecutive
samples (``M = G / (W·m)``), so each microbatch holds length neighbours and pads little. Microbatches are then
dealt to ranks in snake order (0, 1, …, W-1, W-1, …, 1, 0, 0, 1, …): because they ascend in length, every
rank receives a mix of short and long ones, which balances tokens per rank per step without reading a single
sort key. Every rank gets exactly M microbatches per step, so no rank ever waits for another.

Validation is different: every sample must be evaluated exactly once, so nothing is dropped or padded with
duplicates. The (sorted) validation set is cut into microbatches (the last may be short) and dealt round-robin;
rank counts differ by at most one microbatch.

Trade-off: snake dealing is not an optimal bin packing (that would need keys and a solver per step), but it
is free and keeps the per-rank token spread within one microbatch's worth.
"""

from __future__ import annotations

import numpy as np


def snake_owner(microbatch: int, world_size: int) -> int:
    """The rank that receives microbatch number ``microbatch`` of a step under snake dealing."""
    lap, offset = divmod(microbatch, world_size)
    return offset if lap % 2 == 0 else world_size - 1 - offset


def rank_microbatches(global_batch: np.ndarray, world_size: int, rank: int, microbatch_size: int) -> list[np.ndarray]:
    """This rank's M microbatches (arrays of sample indices) of one global batch."""
    microbatches = global_batch.reshape(-1, microbatch_size)
    return [microbatches[i] for i in range(len(microbatches)) if snake_owner(i, world_size) == rank]


def validation_microbatches(
    ordered_indices: np.ndarray, world_size: int, rank: int, microbatch_size: int
) -> list[np.ndarray]:
    """This rank's share of an exactly-once validation pass: round-robin over consecutive microbatches."""
    chunks = [
        ordered_indices[start : start + microbatch_size] for start in range(0, len(ordered_indices), microbatch_size)
    ]
    return chunks[rank::world_size]
