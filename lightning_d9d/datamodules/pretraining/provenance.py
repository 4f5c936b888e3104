"""The provenance ledger, a part of PretrainingDataModule: which data trained step s.

Rows are a pure function of (data, tokenizer, settings, K) and of the edits recorded, so the pieces of any step are
rebuilt by replaying every stream from a saved state at or before it: the ledger's records (every
``provenance_every`` steps and at every resume), a checkpoint, or this process's own position. A replay packs the
steps between (reading tokens from the token cache where it holds them) and notes, for every piece of every row,
which document and which of its tokens it holds. Records are read only where their lineage (the edits and the plan
in force) is the run's, and the edits are the run's own (a checkpoint's, or those trained under), so a rolled-back
run's abandoned records or a DataModule built without the run's edits never name data the run did not train.
Trade-off: a query costs up to ``provenance_every`` steps of packing, in exchange for records of tens of KiB per
stream instead of a per-step ledger of pieces.
It owns where the ledger lives and how often it records; it saves nothing in a checkpoint (the records are files
of their own, and the edits and plan they are read under are the run plan's state). The DataModule's position is an
argument of every query, so one ledger answers for whichever position a fit or a restore left.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_d9d.core.digest import digest
from lightning_d9d.datamodules.pretraining.edits import excluding
from lightning_d9d.datamodules.pretraining.plan import RunPlan
from lightning_d9d.streaming.loading.loader import StreamPosition
from lightning_d9d.streaming.plans.edits import DataEdits, DocumentRef, resolve_reference
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.provenance.ledger import StreamLedger
from lightning_d9d.streaming.provenance.pieces import Piece, file_namer, pieces_of_step, recording, replay
from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.streams.mixture_stream import MixtureState, StepRows
from lightning_d9d.streaming.tokens.tokenize import encode_documents


def steps_asked(steps: Any) -> list[int]:
    """``steps`` (one step or an iterable of them, of any integer type) as ascending distinct ints.

    Raises:
        ValueError: a bool, a float or other non-integer, a negative step, or no steps at all.
    """

    def one(value: Any) -> int:
        boolean = isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
        try:
            step = None if boolean else operator.index(value)
        except TypeError:
            step = None
        if step is None or step < 0:
            raise ValueError(f"steps={steps!r}: {value!r} is not a step; give global optimizer steps, integers >= 0")
        return step

    if (isinstance(steps, torch.Tensor) and steps.dim() == 0) or not isinstance(steps, Iterable):
        wanted = [one(steps)]
    else:
        wanted = sorted({one(value) for value in steps})
    if not wanted:
        raise ValueError(f"steps={steps!r}: no steps given; give global optimizer steps, integers >= 0")
    return wanted


def ledger_of(
    provenance_dir: str | None, default_root: str | None, storage: Storage, every: int
) -> StreamLedger | None:
    """The ledger at ``provenance_dir``, else ``<default_root>/data_provenance`` (a Trainer's), else none."""
    root = provenance_dir if provenance_dir is not None else (
        os.path.join(default_root, "data_provenance") if default_root is not None else None
    )  # fmt: skip
    return None if root is None else StreamLedger(root, storage, every)


class ProvenanceLedger:
    """Which data trained step s: the ledger of stream states this run records, and the replays that answer.

    Args:
        plan: the run's plan (the spec trained, the edits in force, the epoch length).
        storage: how the ledger's folder or URL is written and read.
        provenance_dir: the ledger's folder; ``None``: ``<default_root>/data_provenance`` where there is one.
        every: optimizer steps between records.
        default_root: the Trainer's ``default_root_dir`` now (``None`` without a Trainer).
    """

    def __init__(
        self,
        plan: RunPlan,
        storage: Storage,
        provenance_dir: str | None,
        every: int,
        default_root: Callable[[], str | None] = lambda: None,
    ):
        self.plan, self.storage, self.provenance_dir, self.every = plan, storage, provenance_dir, every
        self._default_root = default_root

    # ------------------------------------------------------------------ the ledger
    def ledger(self) -> StreamLedger | None:
        """The ledger records are written to and read from, where there is one."""
        return ledger_of(self.provenance_dir, self._default_root(), self.storage, self.every)

    def lineage(self, step: int) -> str:
        """The edits in force at ``step`` and the plan trained under (shares, rows and shapes per step): a resume
        with other weights or shapes under ``on_mixture_change="continue"`` starts a lineage of its own, so the
        records an abandoned run left after that step are never read for the continuation."""
        spec = self.plan.require()
        plan = json.dumps({"mixture": spec.plan.to_dict(), "shapes": spec.shapes.to_dict()}, sort_keys=True)
        return digest(self.plan.edits.lineage(step), plan)

    def record(self, epoch: int, step: int, states: Mapping[int, Any], resumed: bool = False) -> None:
        """Record the streams' states at a step boundary where the ledger keeps one (every ``every`` steps, and at
        every resume, so that a query never replays from before the resume)."""
        global_step = epoch * self.plan.steps_per_epoch + step
        if not (resumed or global_step % self.every == 0) or not states:
            return
        ledger = self.ledger()
        if ledger is not None:
            lineage = self.lineage(global_step)
            saved = {sid: state.to_dict() for sid, state in states.items()}
            ledger.write(global_step, saved, lineage, self.plan.edits.to_dict())

    # ------------------------------------------------------------------ queries
    def provenance(
        self,
        steps: int | Iterable[int],
        position: StreamPosition,
        max_replay: int | None = None,
        untrained: bool = False,
    ) -> list[Piece]:
        """Every piece of every row of the given global optimizer steps, in step and row order: which tokens
        ``[start, stop)`` of which document (source, file, row group, row) sit at ``column`` of row ``batch_row``
        (rank-independent: rank 0's rows, then rank 1's, ...). Re-tokenizing those spans rebuilds the rows' tokens
        exactly (``dm.document``); positions no piece covers are padding.

        Every stream is replayed from the latest state at or before the first step asked: a ledger record of this
        run's lineage, this process's own position, or the start. The edits replayed are the run's: a checkpoint's
        (``load_state_dict``) or those this DataModule trained under; a DataModule holding neither that finds
        records written under other edits refuses rather than name documents the run never trained.

        Args:
            steps: a global step or several (a ``range``): ints of any integer type (numpy, a torch scalar).
            position: the DataModule's position (what this process trained or restored).
            max_replay: refuse to replay more than this many steps for one stream (``None``: no limit).
            untrained: answer steps past what this DataModule knows the run trained (its position, the ledger's
                latest record of this run) with the rows the run would train there; refused otherwise.

        Raises:
            ValueError: a step that is no integer >= 0 (``True`` included), a step not known trained without
                ``untrained=True``, ledger records of other edits for a DataModule without the run's state, or a
                replay longer than ``max_replay``.
        """
        spec = recording(self.plan.require())
        wanted = steps_asked(steps)
        _check_plan_start(wanted[0], spec)
        edits = self.plan.edits
        excluded_from = sorted({start for start, _ in edits.exclusions})
        starts = self.replay_starts(wanted[0], spec, position)
        if not untrained:
            self._check_trained(wanted[-1], position)
        _check_replay(wanted[-1], starts, max_replay)
        per_step: dict[int, dict[int, Any]] = {step: {} for step in wanted}
        # One plan for every stream replayed (data steps: skips make them run ahead of training steps).
        shared = StepRows(spec.plan, spec.num_streams, keep=self.plan.data_step(wanted[-1]) + 1)
        specs: dict[frozenset, MixtureSpec] = {}

        def spec_at(step: int) -> MixtureSpec:  # the exclusions in force from a resume at ``step`` on
            excluded = edits.excluded(step)
            if excluded not in specs:
                specs[excluded] = excluding(spec, excluded)
            return specs[excluded]

        for stream, (first, state) in starts.items():
            for step, pieces in replay(spec_at, stream, state, first, wanted, excluded_from, shared):
                per_step[step][stream] = pieces
        name = file_namer(spec)
        out = []
        for step in wanted:
            rows = self.plan.shape_at(step).global_batch_size // spec.num_streams
            out += pieces_of_step(spec, step, per_step[step], rows, name)
        return out

    def trained_until(self, position: StreamPosition) -> int:
        """The first step this DataModule does not know the run trained: the later of its own position (trained
        or restored from a checkpoint) and the ledger's latest record of the run's lineage."""
        epoch, at, _ = position.committed
        known = epoch * self.plan.steps_per_epoch + at
        ledger = self.ledger()
        if ledger is not None:
            for step in reversed(ledger.steps()):
                if step <= known:
                    break
                record = ledger.read(step, 0)
                if record is not None and record[1] == self.lineage(step):
                    return step
        return known

    def _check_trained(self, last: int, position: StreamPosition) -> None:
        known = self.trained_until(position)
        if last >= known:
            raise ValueError(
                f"step {last} is past what this DataModule knows the run trained (steps before {known}: its own "
                "or its checkpoint's position and the ledger's records of this run): give untrained=True "
                "(--untrained in the command) for the rows the run would train there, or load the run's latest "
                "checkpoint"
            )

    def replay_starts(self, step: int, spec: MixtureSpec, position: StreamPosition) -> dict[int, tuple[int, Any]]:
        """Per stream, ``(training step, state)`` of the latest known state of this lineage at or before ``step``.

        Raises:
            ValueError: records of other edits passed over by a DataModule that holds no state of the run (built
                without its ``skip_data`` / ``exclude_documents``, no checkpoint loaded).
        """
        starts: dict[int, tuple[int, Any]] = {stream: (0, None) for stream in range(spec.num_streams)}
        epoch, at, states = position.committed
        here = epoch * self.plan.steps_per_epoch + at
        if here <= step:
            for stream, state in states.items():
                starts[stream] = (here, state)
        ledger = self.ledger()
        if ledger is None:
            return starts
        passed: list[tuple[int, Any]] = []
        for stream in starts:
            found = ledger.latest(stream, step, self.lineage, passed)
            if found is not None and found[0] > starts[stream][0]:
                starts[stream] = (found[0], MixtureState.from_dict(found[1], spec, f"ledger.{stream}"))
        holds_run = self.plan.holds_run or here > 0
        if passed and not holds_run:
            at_step, recorded = max(passed, key=lambda item: item[0])
            described = DataEdits.from_dict(recorded).describe() if isinstance(recorded, Mapping) else ["unknown"]
            ours = "; ".join(self.plan.edits.describe()) or "none"
            raise ValueError(
                f"the run's ledger record of step {at_step} was written under other data edits "
                f"({'; '.join(described)}) than this DataModule's ({ours}), or other weights or batch/seq_len phases: "
                "its answer would name data the run did not train; load the run's checkpoint (dm.load_state_dict, "
                "--ckpt_path) or build the DataModule with the run's settings, skip_data and exclude_documents"
            )
        return starts

    def document(self, ref: DocumentRef | Piece | Sequence[Any]) -> dict[str, Any]:
        """A document named as provenance names it (a piece, a ``DocumentRef`` or ``[source, file, row_group,
        row]``): ``{"text": ..., "tokens": ...}``, its tokens as training lays them out (BOS first), so a piece's
        tokens are ``tokens[start:stop]``.

        Raises:
            ValueError: a reference to no document of this corpus.
        """
        if isinstance(ref, Piece):
            ref = DocumentRef(ref.source, ref.file, ref.row_group, ref.document_row)
        spec = self.plan.require()
        source, group, row = resolve_reference(spec.names, [s.index for s in spec.sources], DocumentRef.of(ref))
        text = spec.sources[source].index.read_texts(group, [row])[0] or ""
        ids = encode_documents(spec.sources[source].encoder(), [text])[0].ids
        return {"text": text, "tokens": np.asarray([spec.bos_id, *ids], np.int64)}


def _check_plan_start(first: int, spec: MixtureSpec) -> None:
    """``ValueError`` for a step before a plan continued under other shares or shapes starts (its rows are another
    plan's)."""
    if first < spec.plan.start_step:
        raise ValueError(
            f"step {first} was trained before this run resumed at step {spec.plan.start_step} with other "
            "weights or batch/seq_len phases (on_mixture_change='continue'): this DataModule's plan starts there; "
            f"ask one built with the settings of that time, or give steps from {spec.plan.start_step} on"
        )


def _check_replay(last: int, starts: Mapping[int, tuple[int, Any]], max_replay: int | None) -> None:
    """``ValueError`` where answering step ``last`` would replay more than ``max_replay`` steps for a stream."""
    if max_replay is not None and any(last - first > max_replay for first, _ in starts.values()):
        nearest = min(first for first, _ in starts.values())
        raise ValueError(f"answering step {last} would replay {last - nearest} steps (more than "
                         f"max_replay={max_replay}): keep records closer (provenance_every)")  # fmt: skip
