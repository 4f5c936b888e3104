"""The run's plan, a part of PretrainingDataModule: the shapes of its steps (global batch size and ``seq_len`` by
step), the mixture's shares, the data edits in force (skips, exclusions) and the epoch length.

It owns the training spec in force (the corpus' spec with the plan, skips and exclusions applied) and everything a
step's size is derived from, so the loader, the callback and provenance ask one object which data a step trains and
how many microbatches it has. ``state_dict()`` is ``{"mixture", "shapes", "edits", "steps_per_epoch"}``: what a
resume must keep even where this run's settings say otherwise. The data-parallel size is an argument of every answer
that depends on it, never stored: the layout is the trainer's, the plan the run's. The layout of an epoch is a few
stretches of one M (``StepLayout``), so a step's microbatches and a microbatch's step are found without a table per
step.

Trade-off: where M changes, Lightning's accumulation is answered from this layout (``callback.StepSizes``), an
internal of Lightning's loops pinned by tests; and restoring runs in two halves (edits, then the mixture), because
the streams' saved states are read under the restored edits and decide the step the mixture continues from.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from lightning_d9d.core.checks import microbatches_per_step
from lightning_d9d.core.resume import InvalidDataState, StepLayout
from lightning_d9d.datamodules.pretraining.edits import excluding, read_references
from lightning_d9d.datamodules.pretraining.mixture import OnMixtureChange, resumed_plan, shape_differences
from lightning_d9d.streaming.plans.edits import DataEdits, DocumentRef
from lightning_d9d.streaming.plans.shape import Shape, ShapeSchedule
from lightning_d9d.streaming.plans.spec import MixtureSpec, StreamSettings

# The layouts kept: a few epochs' under a few data-parallel sizes; more are rebuilt (they cost a few phases each).
MAX_LAYOUTS = 64


class RunPlan:
    """Shapes, shares, edits and epoch length of a PretrainingDataModule's run.

    Args:
        settings: the stream settings (the shape schedule among them).
        microbatch_size: rows per forward/backward on one rank.
        steps_per_epoch: the epoch length asked (``None``: one pass, sized at ``setup``).
        val_seq_len: validation rows' ``seq_len`` (``None``: the last phase's).
        skip_data: ranges ``(start, stop)`` of optimizer steps asked to be skipped from this run on.
        exclude_documents: document references asked to be excluded, or the path of a file of them.
    """

    def __init__(
        self,
        settings: StreamSettings,
        microbatch_size: int,
        steps_per_epoch: int | None = None,
        val_seq_len: int | None = None,
        skip_data: tuple[tuple[int, int], ...] = (),
        exclude_documents: Any = None,
    ):
        self.settings, self.microbatch_size, self.val_seq_len = settings, microbatch_size, val_seq_len
        self.steps_per_epoch_asked = steps_per_epoch
        self.steps_per_epoch: int | None = None  # sized at setup (the asked one, or one pass's)
        self.skip_data, self.exclude_documents = skip_data, exclude_documents
        self.spec: MixtureSpec | None = None  # the training spec in force, set at setup
        self.edits = DataEdits()  # skips and exclusions recorded
        # Whether the edits are the run's own (a checkpoint's): the ledger's records of other lineages are then
        # not this run's, and provenance may pass over them.
        self.holds_run = False
        self._layouts: dict[tuple, StepLayout] = {}

    # ------------------------------------------------------------------ shapes
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
        """The shape of global optimizer step ``step``: its data step's."""
        return self.shapes.at(self.data_step(step))

    def microbatches_at(self, step: int, dp_size: int) -> int:
        """M of global optimizer step ``step`` on one of ``dp_size`` data-parallel replicas."""
        return self.shape_at(step).global_batch_size // (dp_size * self.microbatch_size)

    def microbatches_for(self, dp_size: int) -> int:
        """M at data-parallel size ``dp_size``.

        Raises:
            ValueError: the global batch size has phases (M depends on the step), or is no multiple of ``D·m``.
        """
        sizes = self.shapes.global_batch_sizes
        if not sizes.fixed:
            raise ValueError(
                f"global_batch_size={self.settings.global_batch_size} has phases, so the microbatches per step depend "
                "on the step: ask dm.microbatches_at(step) or dm.step_layout(epoch)"
            )
        return microbatches_per_step(sizes.values[0], dp_size, self.microbatch_size)

    def check_microbatches(self, dp_size: int) -> None:
        """``ValueError`` naming the first phase whose G is not a multiple of ``dp_size × microbatch_size``."""
        check_microbatches(self.shapes, dp_size, self.microbatch_size)

    @property
    def step_sizes_vary(self) -> bool:
        """Whether M changes during the run (the global batch size has phases)."""
        return not self.shapes.global_batch_sizes.fixed

    def step_layout(self, epoch: int, dp_size: int) -> StepLayout:
        """One replica's microbatches of each step of ``epoch`` (global steps ``epoch × steps_per_epoch`` on)."""
        per_epoch = self.steps_per_epoch
        key = (epoch, per_epoch, dp_size, self.edits)
        layout = self._layouts.get(key)
        if layout is None:
            first, unit = epoch * per_epoch, dp_size * self.microbatch_size
            starts = self._size_changes(first, first + per_epoch)
            layout = StepLayout(tuple(s - first for s in starts), tuple(self.shape_at(s).global_batch_size // unit
                                                                         for s in starts))  # fmt: skip
            self._layouts = {**self._layouts, key: layout} if len(self._layouts) < MAX_LAYOUTS else {key: layout}
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

    def describe_phases(self, dp_size: int) -> str:
        """How the global batch size's phases give the microbatches, for messages."""
        sizes = self.shapes.global_batch_sizes
        phases = ", ".join(f"{g} from step {a}" for a, g in zip(sizes.starts, sizes.values))
        return (
            f"global_batch_size phases ({phases}), data-parallel size {dp_size} and microbatch_size="
            f"{self.microbatch_size} give {dp_size * self.microbatch_size} rows per microbatch over all ranks"
        )

    # ------------------------------------------------------------------ edits
    def start(self) -> None:
        """Train the spec read from step 0 under the edits asked (a fit that starts, or resumes later)."""
        self.use_edits(DataEdits().with_new(0, self.skip_data, self._excluded_refs()))

    def use_edits(self, edits: DataEdits) -> None:
        """Train under ``edits``: skipped data consumed by the streams, excluded documents never read."""
        self.edits = edits
        self.spec = excluding(self.require().with_skipped(edits.skipped_data()), edits.excluded())
        self._layouts = {}  # a skip moves where G changes

    def _excluded_refs(self) -> tuple[DocumentRef, ...]:
        refs = self.exclude_documents
        if refs is None:
            return ()
        return read_references(refs) if isinstance(refs, (str, os.PathLike)) else tuple(refs)

    def check_run(self, total_steps: int | None) -> None:
        """Raises ValueError for a skip that starts where the run has ended (nothing after it would train)."""
        for at, count in self.edits.skips:
            if total_steps is not None and at >= total_steps:
                raise ValueError(
                    f"skip_data range [{at}, {at + count}) starts at or after the run's last step ({total_steps - 1}): "
                    "nothing after it would be trained; give a range inside the run or more steps"
                )

    # ------------------------------------------------------------------ the resume contract
    def state_dict(self) -> dict[str, Any]:
        """The shares and shapes trained under, the edits recorded and the epoch length (plain values only)."""
        spec = self.require()
        return {
            "mixture": spec.plan.to_dict(),
            "shapes": spec.shapes.to_dict(),
            "edits": self.edits.to_dict(),
            "steps_per_epoch": int(self.steps_per_epoch or 0),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], global_step: int, on_mixture_change: OnMixtureChange = "raise"
    ) -> None:
        """Continue the saved plan at global step ``global_step``: its epoch length (unless one was asked), its
        edits with those asked now, and its shares and shapes from the data step the saved edits give (where a
        consistent save left the streams). The DataModule runs the same steps with its streams read between them.

        Raises:
            ValueError: as ``saved_epoch_length``, ``load_edits`` and ``load_mixture``.
        """
        saved = self.saved_epoch_length(state)
        if self.steps_per_epoch_asked is None and saved is not None:
            self.keep_epoch_length(saved)
        self.load_edits(state, global_step)
        self.load_mixture(state, self.saved_edits(state).data_step(global_step), on_mixture_change)

    def load_edits(self, state: Mapping[str, Any], global_step: int) -> None:
        """Train under the saved edits and those asked now (in force from ``global_step``); they are the run's.

        Raises:
            InvalidDataState: a malformed record of edits.
        """
        self.holds_run = True
        self.use_edits(self.saved_edits(state).with_new(global_step, self.skip_data, self._excluded_refs()))

    @staticmethod
    def saved_edits(state: Mapping[str, Any]) -> DataEdits:
        """The edits ``state`` recorded (``InvalidDataState`` for a malformed record)."""
        try:
            return DataEdits.from_dict(state["edits"])
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidDataState(
                "edits", state.get("edits"), f"the skips and exclusions a state records ({error})"
            ) from error

    def load_mixture(self, state: Mapping[str, Any], data_step: int, on_mixture_change: OnMixtureChange) -> None:
        """Continue the saved shares and shapes, read at the streams' data step ``data_step``.

        Raises:
            ValueError: other shares, sources or shapes than the checkpoint's under ``on_mixture_change="raise"``.
            InvalidDataState: a malformed saved plan or shape schedule.
        """
        spec = self.require()
        plan = resumed_plan(spec, state.get("mixture"), state.get("shapes"), data_step, on_mixture_change)
        self.spec = spec.with_plan(plan)

    def saved_epoch_length(self, state: Mapping[str, Any]) -> int | None:
        """The epoch length ``state`` saved (``None``: a state from before epoch lengths were saved).

        Raises:
            InvalidDataState: a saved length that is no whole number >= 1.
        """
        saved = state.get("steps_per_epoch")
        if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int) or saved < 1):
            raise InvalidDataState("steps_per_epoch", saved, "a whole number of optimizer steps >= 1")
        return saved

    def keep_epoch_length(self, steps: int) -> None:
        """Size epochs as a resumed run did (``steps`` optimizer steps each), not by this run's own count."""
        if steps != self.steps_per_epoch:
            self.steps_per_epoch, self._layouts = steps, {}

    def other_differences(self, state: Mapping[str, Any]) -> list[str]:
        """The global batch size and ``seq_len`` (phases) a saved plan differs in."""
        try:
            saved = ShapeSchedule.from_dict(state["shapes"])
        except (KeyError, TypeError, ValueError):
            return []  # a malformed state is named when it is read
        return shape_differences(saved, self.shapes)[1]

    def require(self) -> MixtureSpec:
        """The training spec in force (``RuntimeError`` before ``setup``)."""
        if self.spec is None:
            raise RuntimeError("call dm.setup('fit') first (Trainer.fit does it)")
        return self.spec


def check_microbatches(shapes: ShapeSchedule, dp_size: int, microbatch_size: int) -> None:
    """``ValueError`` naming the first phase whose G is not a multiple of ``dp_size × microbatch_size``."""
    sizes = shapes.global_batch_sizes
    for start, size in zip(sizes.starts, sizes.values):
        try:
            microbatches_per_step(size, dp_size, microbatch_size)
        except ValueError as error:
            if len(sizes.starts) == 1:
                raise
            raise ValueError(f"global_batch_size phase from step {start}: {error}") from error
