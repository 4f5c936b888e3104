"""Progress bars that count optimizer steps, not the microbatches the training loop receives.

Lightning's bars count batches: 528/528 for an epoch of 132 optimizer steps of 4 microbatches. A DataModule swaps
Lightning's own two bars (``TQDMProgressBar``, ``RichProgressBar``: exact types, a bar of the user's own is left
as it is) for the subclasses below when it attaches to a Trainer; they show the epoch's optimizer steps, labelled
so. After ``n`` microbatches of an epoch, the steps completed are found by adding each step's microbatch count,
asked of the DataModule one step at a time (:func:`microbatches_in_step`, the one place that knows it), so the
count stays right when steps differ in size.

Trade-off: the bar's class is swapped in place (its settings and state kept) rather than a new bar added, so a
Trainer shows one bar whatever its configuration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

LABEL = "optimizer steps"


def microbatches_in_step(datamodule: Any, step: int) -> int:
    """The batches the training loop receives in optimizer step ``step`` (counted from the run's first, 0)."""
    return int(datamodule.batches_in_global_step(step))


class StepWalk:
    """Optimizer steps completed after the first ``n`` microbatches of an epoch whose first step is ``first``.

    Args:
        sizes: the microbatches of each (global) step.
        first: the epoch's first step.
    """

    def __init__(self, sizes: Callable[[int], int], first: int):
        self._sizes, self.first = sizes, first
        self._step, self._consumed = first, 0  # the next step to complete, and the microbatches before it

    def steps_after(self, microbatches: int) -> int:
        """Steps completed once ``microbatches`` of the epoch were trained (``microbatches`` never decreases)."""
        while True:
            size = self._sizes(self._step)
            if size < 1:
                raise ValueError(f"optimizer step {self._step} has {size} microbatches; every step has at least 1")
            if self._consumed + size > microbatches:
                return self._step - self.first
            self._consumed += size
            self._step += 1


class _CountsSteps:
    """Over a Lightning progress bar: the training bar's total and position in optimizer steps."""

    trainer: pl.Trainer
    _walk: StepWalk | None = None
    _walk_epoch = -1

    def _epoch_walk(self, trainer: pl.Trainer) -> StepWalk | None:
        """The walk of this epoch's steps, from its first (a resumed epoch began before the restored step)."""
        datamodule = getattr(trainer, "datamodule", None)
        if not hasattr(type(datamodule), "batches_in_global_step"):
            return None  # not a lightning_d9d DataModule: microbatches, as Lightning counts
        restored = getattr(datamodule, "restored", None)
        done = restored[1] if restored is not None and restored[0] == trainer.current_epoch else 0
        self._walk_epoch = trainer.current_epoch
        return StepWalk(lambda step: microbatches_in_step(datamodule, step), trainer.global_step - done)

    @property
    def total_train_batches(self) -> int | float:
        walk = self._walk
        if walk is None:
            return super().total_train_batches  # type: ignore[misc]
        batches = self.trainer.num_training_batches
        if math.isinf(batches):
            return batches
        steps = StepWalk(walk._sizes, walk.first).steps_after(int(batches))
        max_steps = self.trainer.max_steps
        return min(steps, max_steps - walk.first) if max_steps is not None and max_steps > 0 else steps

    def on_train_start(self, *args: Any) -> None:
        self._walk = None
        super().on_train_start(*args)  # type: ignore[misc]

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._walk = self._epoch_walk(trainer)
        super().on_train_epoch_start(trainer, *args)  # type: ignore[misc]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._walk is None or self._walk_epoch != trainer.current_epoch:  # resumed mid-epoch: no epoch start
            self._walk = self._epoch_walk(trainer)
            self._resumed_mid_epoch(trainer)
        if self._walk is not None:
            batch_idx = self._walk.steps_after(batch_idx + 1) - 1  # the bar shows batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]

    def _resumed_mid_epoch(self, trainer: pl.Trainer) -> None:
        """Set up the training bar that a mid-epoch resume starts without ``on_train_epoch_start``."""


class StepTQDMProgressBar(_CountsSteps, TQDMProgressBar):
    """``TQDMProgressBar`` whose training bar counts optimizer steps."""

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._label(trainer)

    def _resumed_mid_epoch(self, trainer: pl.Trainer) -> None:
        if self._walk is not None and self.train_progress_bar is not None:
            self.train_progress_bar.total = convert_inf(self.total_train_batches)
            self._label(trainer)

    def _label(self, trainer: pl.Trainer) -> None:
        if self._walk is not None:
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch} ({LABEL})")


class StepRichProgressBar(_CountsSteps, RichProgressBar):
    """``RichProgressBar`` whose training bar counts optimizer steps (a mid-epoch resume makes its bar itself)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        last = self.trainer.max_epochs
        if last is not None and last < 0:  # only max_steps bounds the fit: there is no last epoch to show
            description = description.replace(f"Epoch {current_epoch}/{last - 1}", f"Epoch {current_epoch}", 1)
        return f"{description} ({LABEL})" if self._walk is not None else description


_SWAPS: dict[type, type] = {TQDMProgressBar: StepTQDMProgressBar, RichProgressBar: StepRichProgressBar}


def count_optimizer_steps(trainer: pl.Trainer) -> None:
    """Make the Trainer's progress bar count optimizer steps, if it is one of Lightning's own."""
    for callback in trainer.callbacks:
        swapped = _SWAPS.get(type(callback))
        if swapped is not None:
            callback.__class__ = swapped
