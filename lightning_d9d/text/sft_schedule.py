"""Steps of loss-masked data: each step's exact count of trained targets, and the fine-tuning fingerprint.

``length - 1`` per sample is wrong once labels are masked, so ``LabelCountSchedule`` wraps a schedule and sums
per-sample trained targets over the step; order and budgets stay the wrapped schedule's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lightning_d9d.core.resume import Fingerprint


class LabelCountSchedule:
    """A step schedule whose ``step_label_tokens`` sums per-sample trained targets (everything else delegated).

    Args:
        schedule: the wrapped schedule.
        label_counts: trained targets of every sample, after the shift.
    """

    def __init__(self, schedule: Any, label_counts: np.ndarray):
        self.schedule, self.label_counts = schedule, np.asarray(label_counts, dtype=np.int64)

    def steps_in_epoch(self, epoch: int) -> int:
        return self.schedule.steps_in_epoch(epoch)

    def rank_microbatches(self, epoch: int, step: int, dp_size: int, dp_rank: int) -> list[np.ndarray]:
        return self.schedule.rank_microbatches(epoch, step, dp_size, dp_rank)

    def step_label_tokens(self, epoch: int, step: int) -> int:
        """Trained targets of the step over all ranks."""
        microbatches = self.schedule.rank_microbatches(epoch, step, 1, 0)
        indices = np.concatenate([np.asarray(part, dtype=np.int64) for part in microbatches]) if microbatches else []
        return int(self.label_counts[indices].sum())

    def __getattr__(self, name: str) -> Any:
        schedule = self.__dict__.get("schedule")  # absent while unpickling: no recursion through __getattr__
        if schedule is None:
            raise AttributeError(name)
        return getattr(schedule, name)


@dataclasses.dataclass(frozen=True)
class FineTuningFingerprint(Fingerprint):
    """The order's fingerprint plus the settings that decide which tokens are trained.

    Attributes:
        order: the wrapped fingerprint.
        chat_template: SHA-256 of the chat template and its special tokens (``None`` without one).
    """

    order: Fingerprint = dataclasses.field(compare=False)
    format: str = "text"
    loss_on: str = "all"
    truncation: str = "drop"
    chat_template: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.order.to_dict(), **super().to_dict()}

    def describe_difference(self, name: str, then: Any, now: Any) -> str:
        if name in self.order.to_dict():
            return self.order.describe_difference(name, then, now)
        return super().describe_difference(name, then, now)
