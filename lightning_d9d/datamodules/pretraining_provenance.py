"""Which data trained step s, and deliberate edits of what is trained: a PretrainingDataModule's provenance,
skipped data ranges and excluded documents.

Rows are a pure function of (data, tokenizer, settings, K) and of the edits recorded, so the pieces of any step are
rebuilt by replaying every stream from a saved state at or before it: the ledger's records (every
``provenance_every`` steps and at every resume), a checkpoint, or this process's own position. A replay packs the
steps between (reading tokens from the token cache where it holds them) and notes, for every piece of every row,
which document and which of its tokens it holds. Records are read only where their lineage (the edits and the plan
in force) is the run's, and the edits are the run's own (a checkpoint's, or those trained under), so a rolled-back
run's abandoned records or a DataModule built without the run's edits never name data the run did not train.
Trade-off: a query costs up to ``provenance_every`` steps of packing, in exchange for records of tens of KiB per
stream instead of a per-step ledger of pieces.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_d9d.core.digest import digest
from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.pretraining_state import migrate, restored_streams, saved_streams
from lightning_d9d.streaming.plans.edits import DataEdits, DocumentRef, resolve_reference, step_range
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.provenance.ledger import StreamLedger
from lightning_d9d.streaming.provenance.pieces import Piece, file_namer, pieces_of_step, recording, replay
from lightning_d9d.streaming.streams.mixture_stream import MixtureState, StepRows
from lightning_d9d.streaming.tokens.tokenize import encode_documents


def edits_asked(skip_data: Any, exclude_documents: Any) -> tuple[tuple[tuple[int, int], ...], Any]:
    """``skip_data`` checked as ranges of optimizer steps, and ``exclude_documents`` (references checked now, a file
    read at ``setup``).

    Raises:
        ValueError: a range that is not ``[start, stop)`` with ``0 <= start < stop``, a reference that is not
            ``[source, file, row_group, row]``, or something else in their place.
    """
    if skip_data is None:
        ranges: tuple[tuple[int, int], ...] = ()
    elif isinstance(skip_data, Sequence) and not isinstance(skip_data, str):
        ranges = tuple(step_range(value, number) for number, value in enumerate(skip_data))
    else:
        raise ValueError(f"skip_data={skip_data!r} is not valid: give ranges [[start, stop], ...] of optimizer steps")
    if exclude_documents is None or isinstance(exclude_documents, (str, os.PathLike)):
        return ranges, exclude_documents
    if not isinstance(exclude_documents, Sequence):
        raise ValueError(
            f"exclude_documents={exclude_documents!r} is not valid: give a list of document references "
            "[source, file, row_group, row] or the path of a JSONL file of them"
        )
    return ranges, tuple(DocumentRef.of(value, number) for number, value in enumerate(exclude_documents))


def read_references(path: str | os.PathLike) -> tuple[DocumentRef, ...]:
    """The document references of a file: JSONL (one ``[source, file, row_group, row]`` or object per line; blank
    lines and ``#`` comments ignored; a provenance or loss-spike JSONL works as it is) or the ``.parquet`` the
    provenance command writes (columns ``source, file, row_group, document_row``).

    Raises:
        ValueError: a file that cannot be read (missing, not UTF-8 text, not parquet) or a line that is no
            reference, naming ``exclude_documents``, the file and the line.
    """
    name = os.fspath(path)
    if name.endswith(".parquet"):
        return _parquet_references(name)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"exclude_documents={name!r}: cannot read it ({error}); give a JSONL file of document references or "
            "the .parquet the provenance command writes"
        ) from error
    refs = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            refs.append(DocumentRef.of(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as error:
            raise ValueError(f"line {number} of exclude_documents={name!r}: {error}") from error
    return tuple(refs)


def _parquet_references(name: str) -> tuple[DocumentRef, ...]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["source", "file", "row_group", "document_row"]
    try:
        table = pq.read_table(name, columns=columns)
    except (OSError, pa.ArrowException, KeyError) as error:
        raise ValueError(
            f"exclude_documents={name!r}: cannot read it as the provenance command's .parquet (columns {columns}): "
            f"{error}"
        ) from error
    rows = zip(*(table.column(column).to_pylist() for column in columns))
    return tuple(DocumentRef.of(list(row), number) for number, row in enumerate(rows))


def resumed_edits(
    saved: DataEdits, resume_step: int, skips: Iterable[Sequence[int]], excluded: Iterable[DocumentRef]
) -> DataEdits:
    """The edits after a resume at global step ``resume_step``: the checkpoint's, and those asked now."""
    return saved.with_new(resume_step, skips, excluded)


def excluding(spec: MixtureSpec, refs: Iterable[DocumentRef]) -> MixtureSpec:
    """``spec`` with every source passing over the documents ``refs`` name (``ValueError`` for a bad reference)."""
    indexes = [source.index for source in spec.sources]
    keys: list[set[tuple[int, int]]] = [set() for _ in spec.sources]
    for ref in refs:
        source, group, row = resolve_reference(spec.names, indexes, ref)
        keys[source].add((group, row))
    sources = tuple(dataclasses.replace(s, excluded=frozenset(k)) for s, k in zip(spec.sources, keys))
    return dataclasses.replace(spec, sources=sources)


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


def ledger_of(provenance_dir: str | None, default_root: str | None, storage: Any, every: int) -> StreamLedger | None:
    """The ledger at ``provenance_dir``, else ``<default_root>/data_provenance`` (a Trainer's), else none."""
    root = provenance_dir if provenance_dir is not None else (
        os.path.join(default_root, "data_provenance") if default_root is not None else None
    )  # fmt: skip
    return None if root is None else StreamLedger(root, storage, every)


class PretrainingProvenance:
    """A PretrainingDataModule's saved state (streams and edits), the edits it records, and what it answers about
    the data of its steps."""

    edits: DataEdits
    skip_data: tuple[tuple[int, int], ...]
    exclude_documents: Any
    provenance_dir: str | None
    provenance_every: int

    # ------------------------------------------------------------------ the resume contract
    def extra_state(self) -> dict[str, Any]:
        """Every stream's state at the last optimizer step, gathered from all ranks (only rank 0 saves), and the
        data edits recorded."""
        _epoch, step = self.saved_position()
        states = self.position.committed_states(step)
        saved = saved_streams(states, self._require(self.train_spec), gather=self.dp_size > 1)
        return {**saved, "edits": self.edits.to_dict()}

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore the streams this rank owns to the checkpoint's last optimizer step, validated first, under the
        checkpoint's edits and those asked now (recorded from this step on)."""
        states, global_step = {}, epoch * self.steps_per_epoch + step
        if state is not None:
            self._holds_run = True  # its edits are the run's: the ledger's records of other lineages are not this run's
            state = migrate(state)
            self._use_edits(self._resumed_edits(state, global_step))
            spec = self._require(self.train_spec)
            self.train_spec, states = restored_streams(state, spec, self.owned_streams, step, self.on_mixture_change)
            expected = DataEdits.from_dict(state["edits"]).data_step(global_step)
            if any(saved.step != expected for saved in states.values()):
                found = sorted({saved.step for saved in states.values()})
                raise InvalidDataState(
                    "streams.*.step", found, f"the data step of global step {global_step}: {expected}"
                )
        self.position.restart(epoch, step, states, self.step_layout(epoch))
        self._record_step(epoch, step, states, resumed=True)

    # ------------------------------------------------------------------ edits
    def _excluded_refs(self) -> tuple[DocumentRef, ...]:
        refs = self.exclude_documents
        if refs is None:
            return ()
        return read_references(refs) if isinstance(refs, (str, os.PathLike)) else tuple(refs)

    def _use_edits(self, edits: DataEdits) -> None:
        """Train under ``edits``: skipped data consumed by the streams, excluded documents never read."""
        self.edits = edits
        self.train_spec = excluding(self.train_spec.with_skipped(edits.skipped_data()), edits.excluded())
        self._layouts = {}

    def _fresh_edits(self) -> None:
        self._use_edits(DataEdits().with_new(0, self.skip_data, self._excluded_refs()))

    def _resumed_edits(self, state: Mapping[str, Any], global_step: int) -> DataEdits:
        """The checkpoint's edits and those asked now, in force from ``global_step`` (``InvalidDataState`` for a
        malformed record)."""
        try:
            saved = DataEdits.from_dict(state["edits"])
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidDataState(
                "edits", state.get("edits"), f"the skips and exclusions a state records ({error})"
            ) from error
        return saved.with_new(global_step, self.skip_data, self._excluded_refs())

    # ------------------------------------------------------------------ the ledger
    def _ledger(self) -> StreamLedger | None:
        trainer = getattr(self, "trainer", None)
        default_root = getattr(trainer, "default_root_dir", None) if trainer is not None else None
        return ledger_of(self.provenance_dir, default_root, self.storage, self.provenance_every)

    def _lineage(self, step: int) -> str:
        """The edits in force at ``step`` and the plan trained under (shares, rows and shapes per step): a resume
        with other weights or shapes under ``on_mixture_change="continue"`` starts a lineage of its own, so the
        records an abandoned run left after that step are never read for the continuation."""
        spec = self._require(self.train_spec)
        plan = json.dumps({"mixture": spec.plan.to_dict(), "shapes": spec.shapes.to_dict()}, sort_keys=True)
        return digest(self.edits.lineage(step), plan)

    def _record_step(self, epoch: int, step: int, states: Mapping[int, Any], resumed: bool = False) -> None:
        """Record the streams' states at a step boundary where the ledger keeps one (every ``provenance_every``
        steps, and at every resume)."""
        global_step = epoch * self.steps_per_epoch + step
        if not (resumed or global_step % self.provenance_every == 0) or not states:
            return
        ledger = self._ledger()
        if ledger is not None:
            lineage = self._lineage(global_step)
            saved = {sid: state.to_dict() for sid, state in states.items()}
            ledger.write(global_step, saved, lineage, self.edits.to_dict())

    # ------------------------------------------------------------------ queries
    def provenance(
        self, steps: int | Iterable[int], max_replay: int | None = None, untrained: bool = False
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
            max_replay: refuse to replay more than this many steps for one stream (``None``: no limit).
            untrained: answer steps past what this DataModule knows the run trained (its position, the ledger's
                latest record of this run) with the rows the run would train there; refused otherwise.

        Raises:
            ValueError: a step that is no integer >= 0 (``True`` included), a step not known trained without
                ``untrained=True``, ledger records of other edits for a DataModule without the run's state, or a
                replay longer than ``max_replay``.
        """
        spec = recording(self._require(self.train_spec))
        wanted = steps_asked(steps)
        if wanted[0] < spec.plan.start_step:
            raise ValueError(
                f"step {wanted[0]} was trained before this run resumed at step {spec.plan.start_step} with other "
                "weights or batch/seq_len phases (on_mixture_change='continue'): this DataModule's plan starts there; "
                f"ask one built with the settings of that time, or give steps from {spec.plan.start_step} on"
            )
        edits, excluded_from = self.edits, sorted({start for start, _ in self.edits.exclusions})
        starts = self._replay_starts(wanted[0], spec)
        if not untrained:
            self._check_trained(wanted[-1], starts)
        if max_replay is not None and any(wanted[-1] - first > max_replay for first, _ in starts.values()):
            nearest = min(first for first, _ in starts.values())
            raise ValueError(f"answering step {wanted[-1]} would replay {wanted[-1] - nearest} steps (more than "
                             f"max_replay={max_replay}): keep records closer (provenance_every)")  # fmt: skip
        per_step: dict[int, dict[int, Any]] = {step: {} for step in wanted}
        # One plan for every stream replayed (data steps: skips make them run ahead of training steps).
        shared = StepRows(spec.plan, spec.num_streams, keep=self.data_step(wanted[-1]) + 1)
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
            rows = self.global_batch_size_at(step) // spec.num_streams
            out += pieces_of_step(spec, step, per_step[step], rows, name)
        return out

    def trained_until(self) -> int:
        """The first step this DataModule does not know the run trained: the later of its own position (trained
        or restored from a checkpoint) and the ledger's latest record of the run's lineage."""
        epoch, at, _ = self.position.committed
        known = epoch * self.steps_per_epoch + at
        ledger = self._ledger()
        if ledger is not None:
            for step in reversed(ledger.steps()):
                if step <= known:
                    break
                record = ledger.read(step, 0)
                if record is not None and record[1] == self._lineage(step):
                    return step
        return known

    def _check_trained(self, last: int, starts: Mapping[int, tuple[int, Any]]) -> None:
        known = self.trained_until()
        if last >= known:
            raise ValueError(
                f"step {last} is past what this DataModule knows the run trained (steps before {known}: its own "
                "or its checkpoint's position and the ledger's records of this run): give untrained=True "
                "(--untrained in the command) for the rows the run would train there, or load the run's latest "
                "checkpoint"
            )

    def _replay_starts(self, step: int, spec: Any) -> dict[int, tuple[int, Any]]:
        """Per stream, ``(training step, state)`` of the latest known state of this lineage at or before ``step``.

        Raises:
            ValueError: records of other edits passed over by a DataModule that holds no state of the run (built
                without its ``skip_data`` / ``exclude_documents``, no checkpoint loaded).
        """
        starts: dict[int, tuple[int, Any]] = {stream: (0, None) for stream in range(spec.num_streams)}
        epoch, at, states = self.position.committed
        here = epoch * self.steps_per_epoch + at
        if here <= step:
            for stream, state in states.items():
                starts[stream] = (here, state)
        ledger = self._ledger()
        if ledger is None:
            return starts
        passed: list[tuple[int, Any]] = []
        for stream in starts:
            found = ledger.latest(stream, step, self._lineage, passed)
            if found is not None and found[0] > starts[stream][0]:
                starts[stream] = (found[0], MixtureState.from_dict(found[1], spec, f"ledger.{stream}"))
        holds_run = getattr(self, "_holds_run", False) or here > 0
        if passed and not holds_run:
            at_step, recorded = max(passed, key=lambda item: item[0])
            described = DataEdits.from_dict(recorded).describe() if isinstance(recorded, Mapping) else ["unknown"]
            ours = "; ".join(self.edits.describe()) or "none"
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
        spec = self._require(self.train_spec)
        source, group, row = resolve_reference(spec.names, [s.index for s in spec.sources], DocumentRef.of(ref))
        text = spec.sources[source].index.read_texts(group, [row])[0] or ""
        ids = encode_documents(spec.sources[source].encoder(), [text])[0].ids
        return {"text": text, "tokens": np.asarray([spec.bos_id, *ids], np.int64)}

    def check_run(self, total_steps: int | None) -> None:
        """Raises ValueError for a skip that starts where the run has ended (nothing after it would train)."""
        for at, count in self.edits.skips:
            if total_steps is not None and at >= total_steps:
                raise ValueError(
                    f"skip_data range [{at}, {at + count}) starts at or after the run's last step ({total_steps - 1}): "
                    "nothing after it would be trained; give a range inside the run or more steps"
                )
