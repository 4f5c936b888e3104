"""Shard: split each global batch across data-parallel ranks as equal numbers of microbatches.

A sorted global batch is cut into ``D·M`` microbatches of length neighbours, dealt to ranks in snake order
(0…D-1, D-1…0, …), which balances tokens per rank without reading a key; every rank gets exactly M, so none waits.
Validation must see every sample once, so it is dealt round-robin without dropping or duplicating.

Trade-off: snake dealing is not optimal packing, but it is free and keeps the per-rank spread within one
microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lightning_d9d.mapstyle.order import GlobalBatchOrder


def snake_owner(microbatch: int, dp_size: int) -> int:
    """The data-parallel rank that receives microbatch number ``microbatch`` of a step under snake dealing."""
    lap, offset = divmod(microbatch, dp_size)
    return offset if lap % 2 == 0 else dp_size - 1 - offset


def rank_microbatches(global_batch: np.ndarray, dp_size: int, dp_rank: int, microbatch_size: int) -> list[np.ndarray]:
    """Data-parallel rank ``dp_rank``'s M microbatches (arrays of sample indices) of one global batch."""
    microbatches = global_batch.reshape(-1, microbatch_size)
    return [microbatches[i] for i in range(len(microbatches)) if snake_owner(i, dp_size) == dp_rank]


def validation_microbatches(
    ordered_indices: np.ndarray, dp_size: int, dp_rank: int, microbatch_size: int
) -> list[np.ndarray]:
    """A replica's share of an exactly-once validation pass: round-robin over consecutive microbatches."""
    chunks = [
        ordered_indices[start : start + microbatch_size] for start in range(0, len(ordered_indices), microbatch_size)
    ]
    return chunks[dp_rank::dp_size]


class GlobalBatchSchedule:
    """The sample-count schedule: ``floor(N / G)`` steps per epoch, each the order's global batch cut into m's.

    Args:
        order: the epoch order.
        microbatch_size: m.
        lengths: optional ``indices -> lengths``, for each step's predicted tokens.
    """

    def __init__(
        self,
        order: GlobalBatchOrder,
        microbatch_size: int,
        lengths: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        self.order, self.microbatch_size, self.lengths = order, microbatch_size, lengths

    def steps_in_epoch(self, epoch: int) -> int:
        return self.order.steps_per_epoch

    def rank_microbatches(self, epoch: int, step: int, dp_size: int, dp_rank: int) -> list[np.ndarray]:
        return rank_microbatches(self.order.global_batch(epoch, step), dp_size, dp_rank, self.microbatch_size)

    def step_label_tokens(self, epoch: int, step: int) -> int | None:
        """Predicted tokens of the step over all ranks, or ``None`` when the sort keys are not lengths."""
        if self.lengths is None:
            return None
        keys = self.order.global_batch_keys(epoch, step) if self.lengths is self.order.key_lookup else None
        if keys is None:
            keys = np.asarray(self.lengths(self.order.global_batch(epoch, step)))
        if keys.dtype == object or keys.dtype.kind not in "biuf":
            return None
        return int(np.maximum(keys.astype(np.int64) - 1, 0).sum())
