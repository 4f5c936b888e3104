"""The shapes of a PretrainingDataModule's steps: global batch size and seq_len by step, the microbatches of each
step on one replica.

A read-only mixin over the DataModule's settings and data-parallel layout. The layout of an epoch is a few stretches
of one M (``StepLayout``), so a step's microbatches and a microbatch's step are found without a table per step.
Trade-off: where M changes, Lightning's accumulation is answered from this layout (``callback.StepSizes``), an
internal of Lightning's loops pinned by tests.
"""

from __future__ import annotations

import itertools
from typing import Any

from lightning_d9d.core.checks import microbatches_per_step
from lightning_d9d.core.resume import StepLayout
from lightning_d9d.datamodules.pretraining_mixture import shape_differences
from lightning_d9d.datamodules.pretraining_state import migrate
from lightning_d9d.streaming.plans.edits import DataEdits
from lightning_d9d.streaming.plans.shape import Shape, ShapeSchedule, StepValues
from lightning_d9d.streaming.plans.spec import StreamSettings


class PretrainingShapes:
    settings: StreamSettings
    microbatch_size: int
    val_seq_len: int | None
    steps_per_epoch: int | None
    _layouts: dict = {}  # noqa: RUF012 (replaced, never changed in place)
    edits: DataEdits = DataEdits()  # skips and exclusions recorded

    @property
    def shapes(self) -> ShapeSchedule:
        """The global batch size and ``seq_len`` of every step."""
        return self.settings.shapes

    @property
    def max_seq_len(self) -> int:
        """The longest rows of the run, training phases and validation."""
        return max(self.shapes.max_seq_len, self.val_seq_len or 0)

    def data_step(self, step: int) -> int:
        """The step of data that global optimizer step ``step`` trains (``step`` itself unless data was skipped)."""
        return self.edits.data_step(step)

    def shape_at(self, step: int) -> Shape:
        """The shape (global batch size, ``seq_len``) of global optimizer step ``step``: its data step's."""
        return self.shapes.at(self.data_step(step))

    def global_batch_size_at(self, step: int) -> int:
        """Rows of global optimizer step ``step`` over all ranks (for models and learning-rate schedules)."""
        return self.shape_at(step).global_batch_size

    def seq_len_at(self, step: int) -> int:
        """Inputs per row of global optimizer step ``step``."""
        return self.shape_at(step).seq_len

    def microbatches_at(self, step: int) -> int:
        """M of global optimizer step ``step`` on one data-parallel replica."""
        return self.global_batch_size_at(step) // (self.dp_size * self.microbatch_size)

    def batches_in_global_step(self, step: int) -> int:
        return self.microbatches_at(step)

    def microbatches_for(self, dp_size: int) -> int:
        """M at data-parallel size ``dp_size`` (``ValueError`` where the global batch size has phases)."""
        sizes = self.shapes.global_batch_sizes
        if not sizes.fixed:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} has phases, so the microbatches per step depend on the "
                "step: ask dm.microbatches_at(step) or dm.step_layout(epoch)"
            )
        return microbatches_per_step(sizes.values[0], dp_size, self.microbatch_size)

    def _check_microbatches(self, dp_size: int) -> None:
        """``ValueError`` naming the first phase whose G is not a multiple of ``dp_size × microbatch_size``."""
        sizes = self.shapes.global_batch_sizes
        for start, size in zip(sizes.starts, sizes.values):
            try:
                microbatches_per_step(size, dp_size, self.microbatch_size)
            except ValueError as error:
                if len(sizes.starts) == 1:
                    raise
                raise ValueError(f"global_batch_size phase from step {start}: {error}") from error

    @property
    def step_sizes_vary(self) -> bool:
        return not self.shapes.global_batch_sizes.fixed

    @property
    def reloads_train_loader_every_epoch(self) -> bool:  # type: ignore[override]
        return self.step_sizes_vary  # epochs may differ in microbatches: Lightning reads each epoch's length

    def step_layout(self, epoch: int) -> StepLayout:
        """This replica's microbatches of each step of ``epoch`` (global steps ``epoch × steps_per_epoch`` on)."""
        per_epoch = self.steps_per_epoch
        key = (epoch, per_epoch, self.dp_size, self.edits)
        layout = self._layouts.get(key)
        if layout is None:
            first, unit = epoch * per_epoch, self.dp_size * self.microbatch_size
            starts = self._size_changes(first, first + per_epoch)
            layout = StepLayout(tuple(s - first for s in starts), tuple(self.global_batch_size_at(s) // unit
                                                                         for s in starts))  # fmt: skip
            self._layouts = {**self._layouts, key: layout} if len(self._layouts) < 64 else {key: layout}
        return layout

    def _size_changes(self, first: int, stop: int) -> list[int]:
        """The training steps of ``[first, stop)`` where G may change: ``first``, every skip's start, and every
        start of a G phase met by the data steps trained (``d(s) = s + shift`` between skips)."""
        points = {first} | {at for at, _ in self.edits.skips if first < at < stop}
        cuts = sorted(points | {stop})
        for start, end in itertools.pairwise(cuts):
            shift = self.data_step(start) - start
            points.update(b - shift for b in self.shapes.global_batch_sizes.starts if start < b - shift < end)
        return sorted(points)

    def other_differences(self, state_dict: dict[str, Any]) -> list[str]:
        """The global batch size and ``seq_len`` (phases) the checkpoint differs in."""
        try:
            saved = ShapeSchedule.from_dict(migrate(state_dict)["shapes"])
        except (KeyError, TypeError, ValueError):
            return []  # a malformed state is named when it is read
        return shape_differences(saved, self.shapes)[1]

    def describe_step(self) -> str:
        if self.step_sizes_vary:
            phases = ", ".join(f"{g} from step {a}" for a, g in zip(*_phases(self.shapes.global_batch_sizes)))
            return (
                f"global_batch_size phases ({phases}), data-parallel size {self.dp_size} and microbatch_size="
                f"{self.microbatch_size} give {self.dp_size * self.microbatch_size} rows per microbatch over all ranks"
            )
        return super().describe_step()


def _phases(values: StepValues) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return values.starts, values.values
