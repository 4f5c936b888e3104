"""Edits: deliberate changes to what a run trains from a resume on — steps of data skipped, documents excluded.

A skip ``(step, count)`` makes training step ``step`` train what step ``step + count`` would have: the streams
consume ``count`` steps of data there, so data step ``d(s) = s + Σ count`` over the skips at or before ``s``. An
exclusion ``(from_step, references)`` removes documents from the resume at ``from_step`` on: readers pass over them
(counted) and a restored best-fit buffer drops them, so only the streams that held them change, and only from
the first of them on. Edits are recorded in the data state, so every later resume, on any layout, keeps them; a
run's *lineage* at a step (the edits in force there) tells which saved stream states still describe it.
Trade-off: a skip is consumed by packing the skipped steps (exact, the same on every layout), not by jumping to a
position, which no stream could compute without packing what lies before it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_d9d.core.digest import digest
from lightning_d9d.core.urls import redact


@dataclass(frozen=True, order=True)
class DocumentRef:
    """A document as provenance names it: its source, its file (the resolved path, or its label relative to the
    source's common folder), the row group in that file (a JSONL group of lines) and its row in the row group."""

    source: str
    file: str
    row_group: int
    row: int

    def to_list(self) -> list:
        return [self.source, self.file, self.row_group, self.row]

    @classmethod
    def of(cls, value: Any, number: int = 0) -> DocumentRef:
        """A reference from ``[source, file, row_group, row]``, ``{source, file, row_group, row}``, a provenance
        ``Piece`` or one of its ``to_dict`` lines (``document_row`` for ``row``).

        Raises:
            ValueError: anything else, naming the reference and its position in the list.
        """
        if isinstance(value, DocumentRef):
            return value
        if all(hasattr(value, name) for name in ("source", "file", "row_group", "document_row")):
            value = [value.source, value.file, value.row_group, value.document_row]  # a provenance Piece
        elif isinstance(value, Mapping) and "document_row" in value and "row" not in value:  # a provenance line
            value = {**value, "row": value["document_row"]}
        fields = ("source", "file", "row_group", "row")
        if isinstance(value, Mapping) and set(value) >= set(fields):
            value = [value[name] for name in fields]
        ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 4
        if ok:
            source, file, group, row = value
            ok = (
                isinstance(source, str)
                and isinstance(file, str)
                and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in (group, row))
            )
        if not ok:
            raise ValueError(
                f"exclude_documents[{number}] = {value!r} is not a document reference: give [source, file, "
                "row_group, row] (or a mapping of those keys) as dm.provenance() names documents, with row_group "
                "and row integers >= 0"
            )
        return cls(source, file, int(group), int(row))


@dataclass(frozen=True)
class DataEdits:
    """The skips and exclusions recorded for a run.

    Attributes:
        skips: ``(step, count)`` pairs, ascending and apart: at training step ``step``, ``count`` steps of data are
            consumed untrained.
        exclusions: ``(from_step, references)`` pairs, ascending: documents never read from ``from_step`` on.
    """

    skips: tuple[tuple[int, int], ...] = ()
    exclusions: tuple[tuple[int, tuple[DocumentRef, ...]], ...] = field(default=())

    def data_step(self, step: int) -> int:
        """The data step that training step ``step`` trains."""
        return step + sum(count for at, count in self.skips if at <= step)

    def skipped_data(self) -> tuple[tuple[int, int], ...]:
        """The data steps ``[start, stop)`` consumed untrained, ascending."""
        out, shift = [], 0
        for at, count in self.skips:
            out.append((at + shift, at + shift + count))
            shift += count
        return tuple(out)

    def excluded(self, step: int | None = None) -> frozenset[DocumentRef]:
        """The documents excluded at training step ``step`` (``None``: every exclusion recorded)."""
        return frozenset(
            ref for start, refs in self.exclusions for ref in refs if step is None or start <= step
        )  # fmt: skip

    def lineage(self, step: int) -> str:
        """A digest of the edits in force at training step ``step``: saved states of the same lineage describe it."""
        skips = [f"{at}:{count}" for at, count in self.skips if at <= step]
        refs = sorted("\0".join(map(str, ref.to_list())) for ref in self.excluded(step))
        return digest(",".join(skips), *refs)

    def changes_after(self, step: int) -> list[int]:
        """The training steps after ``step`` where the lineage changes (a skip starts, an exclusion applies)."""
        starts = {at for at, _ in self.skips} | {start for start, _ in self.exclusions}
        return sorted(s for s in starts if s > step)

    def with_new(self, resume_step: int, skips: Iterable[Sequence[int]], excluded: Iterable[DocumentRef]) -> DataEdits:
        """These edits and those a resume at ``resume_step`` asks for: skips ``[start, stop)`` in training steps
        (one already recorded is no change), and documents to exclude from ``resume_step`` on (those already excluded
        are no change).

        Raises:
            ValueError: a range that is not ``0 <= start < stop``, one that starts before the resume (its data was
                trained already), or ranges that overlap each other or a recorded one.
        """
        recorded = {(at, at + count) for at, count in self.skips}
        ranges = sorted({step_range(r, n) for n, r in enumerate(skips)})
        for first, second in itertools.pairwise(sorted(recorded | set(ranges))):
            if second[0] < first[1]:
                raise ValueError(
                    f"skip_data ranges {list(first)} and {list(second)} overlap (recorded and asked: "
                    f"{sorted(list(r) for r in recorded | set(ranges))}): give ranges that are apart"
                )
        new = [r for r in ranges if r not in recorded]
        for start, stop in new:
            if start < resume_step:
                raise ValueError(
                    f"skip_data range [{start}, {stop}) starts before the resumed step {resume_step}: its data was "
                    f"trained already; resume from a checkpoint at or before step {start}, or skip from step "
                    f"{resume_step} on"
                )
        skips_now = tuple(sorted([*self.skips, *((start, stop - start) for start, stop in new)]))
        fresh = tuple(sorted(set(excluded) - self.excluded()))
        exclusions = self.exclusions + (((resume_step, fresh),) if fresh else ())
        return DataEdits(skips_now, exclusions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "skips": [[at, count] for at, count in self.skips],
            "exclusions": [[start, [ref.to_list() for ref in refs]] for start, refs in self.exclusions],
        }

    @classmethod
    def from_dict(cls, state: Any) -> DataEdits:
        """Read what :meth:`to_dict` wrote (``ValueError`` for anything else)."""
        try:
            skips = tuple((int(at), int(count)) for at, count in state["skips"])
            exclusions = tuple(
                (int(start), tuple(DocumentRef.of(ref, n) for n, ref in enumerate(refs)))
                for start, refs in state["exclusions"]
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not the edits a data state records: {error}") from error
        if any(count < 1 or at < 0 for at, count in skips) or list(skips) != sorted(skips):
            raise ValueError(f"skips {list(skips)} must be ascending (step >= 0, count >= 1)")
        return cls(skips, exclusions)

    def describe(self) -> list[str]:
        """One line per edit (for ``inspect`` and logs)."""
        lines = [f"skip: step {at} trains what step {at + count} would have ({count} steps of data skipped)"
                 for at, count in self.skips]  # fmt: skip
        lines += [f"exclude from step {start}: {len(refs)} document(s)" for start, refs in self.exclusions]
        return lines


def step_range(value: Any, number: int) -> tuple[int, int]:
    ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
    ok = ok and all(isinstance(n, int) and not isinstance(n, bool) for n in value) and 0 <= value[0] < value[1]
    if not ok:
        raise ValueError(
            f"skip_data[{number}] = {value!r} is not a range of optimizer steps: give [start, stop) with "
            "0 <= start < stop (the data of steps start..stop-1 is never trained)"
        )
    return int(value[0]), int(value[1])


def is_skipped(data_step: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether ``data_step`` lies in one of the ascending ``[start, stop)`` ``ranges``."""
    i = bisect.bisect_right(ranges, (data_step, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= data_step < ranges[i][1]


def resolve_reference(names: Sequence[str], indexes: Sequence[Any], ref: DocumentRef) -> tuple[int, int, int]:
    """``(source, global row group, row)`` of a reference to one of ``names``' documents (``indexes``: each source's
    ``RowGroupIndex``); the file may be named by its resolved path or its label.

    Raises:
        ValueError: an unknown source, a file the source does not hold, or a row group or row out of range.
    """
    if ref.source not in names:
        raise ValueError(f"document reference {ref.to_list()}: no source {ref.source!r} (the sources: {list(names)})")
    source = list(names).index(ref.source)
    index = indexes[source]
    paths = [redact(path) for path in index.files]
    labels = index.file_labels()
    matches = [i for i, (path, label) in enumerate(zip(paths, labels)) if ref.file in (path, label, index.files[i])]
    if not matches:
        shown = labels[:5] + (["..."] if len(labels) > 5 else [])
        raise ValueError(f"document reference {ref.to_list()}: source {ref.source!r} holds no file {ref.file!r} (its "
                         f"files, by label: {shown})")  # fmt: skip
    file = matches[0]
    groups = np.flatnonzero(index.file_of == file)
    if not 0 <= ref.row_group < len(groups):
        raise ValueError(f"document reference {ref.to_list()}: {ref.file!r} has {len(groups)} row groups "
                         f"(0..{len(groups) - 1})")  # fmt: skip
    group = int(groups[ref.row_group])
    rows = int(index.num_rows[group])
    if not 0 <= ref.row < rows:
        raise ValueError(f"document reference {ref.to_list()}: row group {ref.row_group} of {ref.file!r} has "
                         f"{rows} rows (0..{rows - 1})")  # fmt: skip
    return source, group, ref.row
