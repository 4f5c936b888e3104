"""Reader: one stream's texts, pass after pass, from any position, in chunks for the tokenizer.

Chunks grow Fibonacci-like after a start, so a resume's first batch waits for a few documents only. Null, empty,
text-free and too-long texts are skipped, and each document carries the skips since the one before it, so counters
never depend on batching. Trade-off: a unit is read whole even when reading resumes inside it, which keeps reads
columnar and simple at the cost of re-reading a unit's head once per resume.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.plans.state import integer, mapping
from lightning_d9d.streaming.sources.source import RowGroupIndex, Units, deal, pass_order

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec

# A stream that meets this many passes in a row without a single document stops with an error instead of
# spinning: with text anywhere in the corpus, shuffled passes make that practically impossible.
MAX_PASSES_WITHOUT_TEXT = 100
# Documents already named in a warning, by (file, row group of the file, row): one warning per document per process.
_WARNED_TOO_LONG: set[tuple[str, int, int]] = set()


@dataclass(frozen=True)
class ReadPosition:
    """The reader's state: it reads next row ``row`` (of its row group) of unit ``slot`` of pass ``pass_index``."""

    pass_index: int = 0
    slot: int = 0
    row: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"pass": self.pass_index, "slot": self.slot, "row": self.row}

    @classmethod
    def from_dict(cls, state: Any, path: str = "reader") -> ReadPosition:
        """Read a saved position; :class:`InvalidDataState` for a field missing or not an integer >= 0."""
        state = mapping(state, path)
        return cls(integer(state, "pass", path), integer(state, "slot", path), integer(state, "row", path))

    def check(self, units: StreamUnits, path: str = "reader") -> None:
        """Raises :class:`InvalidDataState` unless the (normalised) position is inside one of ``units``' units."""
        slots = units.of_pass(self.pass_index)
        if not 0 <= self.slot < len(slots):
            raise InvalidDataState(
                f"{path}.slot",
                self.slot,
                f"stream {units.stream} reads {len(slots)} units per pass (0..{len(slots) - 1})",
            )
        unit = int(slots[self.slot])
        start, stop = int(units.units.start[unit]), int(units.units.stop[unit])
        if not start <= self.row < stop:
            raise InvalidDataState(
                f"{path}.row", self.row, f"unit {self.slot} of pass {self.pass_index} holds rows {start}..{stop - 1}"
            )


@dataclass
class TextChunk:
    """Consecutive non-empty documents of one unit, as the reader hands them to the tokenizer.

    Attributes:
        pass_index, slot: the unit they come from.
        group: its global row group.
        rows: each document's row in the row group.
        texts: the documents.
        empty_before, units_before: per document, the null or empty rows and text-free units skipped since the last.
        long_before: ``{document: too-long rows skipped before it}``, only where there were any.
        excluded_before: ``{document: excluded documents passed over before it}``, only where there were any.
        tokens: for a chunk replayed from the token cache, its ids (BOS not included) and counts; ``texts`` is empty.
        record: what records the chunk's tokens for the cache, or ``None``.
        closes_unit: the last chunk of a recorded unit (the cache stores the unit once it is tokenized).
        record_part: the chunk's place among its unit's recorded chunks (0, 1, ...).
    """

    pass_index: int
    slot: int
    group: int
    rows: np.ndarray
    texts: list[str]
    empty_before: np.ndarray
    units_before: np.ndarray
    long_before: dict[int, int] = field(default_factory=dict)
    tokens: tuple[np.ndarray, np.ndarray] | None = None
    record: Any = None
    closes_unit: bool = False
    excluded_before: dict[int, int] = field(default_factory=dict)
    record_part: int = 0

    def position_of(self, doc: int) -> ReadPosition:
        """The position of document ``doc`` (reading from there yields it first)."""
        return ReadPosition(self.pass_index, self.slot, int(self.rows[doc]))


@dataclass(frozen=True)
class StreamUnits:
    """The units one stream reads and how they are dealt (``index``, ``units``, ``stream``, ``num_streams``,
    ``seed``, ``shuffle``): enough to walk any pass from any position.
    """

    index: RowGroupIndex
    units: Units
    stream: int
    num_streams: int
    seed: int
    shuffle: bool
    # A pass's units, by pass: a seeded permutation of every unit costs far more than the lookups that need it
    # (the reader once per pass, the packer at every block), and a stream walks one or two passes at a time.
    _passes: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of_spec(cls, spec: StreamSpec, stream: int) -> StreamUnits:
        """Stream ``stream``'s units as ``spec`` deals them."""
        return cls(spec.index, spec.units, stream, spec.num_streams, spec.settings.seed, spec.shuffle)

    def of_pass(self, pass_index: int) -> np.ndarray:
        slots = self._passes.get(pass_index)
        if slots is None:
            if len(self._passes) >= 4:
                self._passes.clear()
            order = pass_order(len(self.units), self.seed, pass_index, self.shuffle)
            slots = self._passes[pass_index] = deal(order, self.stream, self.num_streams)
            slots.flags.writeable = False  # shared by every caller
        return slots

    def normalise(self, position: ReadPosition) -> ReadPosition:
        """The same position with its row inside its unit (past the end: the next unit, or the next pass)."""
        pass_index, slot, row = position.pass_index, position.slot, position.row
        slots = self.of_pass(pass_index)
        while True:
            if slot < len(slots):
                unit = int(slots[slot])
                start, stop = int(self.units.start[unit]), int(self.units.stop[unit])
                if row < stop:
                    return ReadPosition(pass_index, slot, max(row, start))
                slot, row = slot + 1, 0
                continue
            pass_index, slot, row = pass_index + 1, 0, 0
            slots = self.of_pass(pass_index)


@dataclass
class _UnitRead:
    """One unit's kept and too-long rows, with texts or cached tokens (or both: cached tokens of its rows before
    ``cached.stop``, a partial entry, and texts for the rest), and its cache recorder."""

    rows: np.ndarray
    too_long: dict[int, int]
    texts: list[str | None] | None
    cached: Any = None
    recorder: Any = None
    parts: int = 0  # text chunks handed to the recorder so far

    def cached_rows(self, kept: list[int]) -> int:
        """How many of the leading ``kept`` rows are read from cached tokens."""
        if self.cached is None:
            return 0
        return len(kept) if self.texts is None else bisect.bisect_left(kept, self.cached.stop)

    def chunk(self, where: tuple[int, int, int], rows: list[int], before: tuple, closes: bool) -> TextChunk:
        cached = self.cached
        if cached is None or (self.texts is not None and rows[0] >= cached.stop):
            texts = [self.texts[r] for r in rows]
            part, self.parts = self.parts, self.parts + (self.recorder is not None)
            return TextChunk(*where, np.asarray(rows, np.int64), texts, *before[:3], None, self.recorder, closes,
                             before[3], part)  # fmt: skip
        at = np.searchsorted(cached.rows, rows)
        starts, stops = cached.offsets[at], cached.offsets[at + 1]
        if len(rows) and stops[-1] - starts[0] == int((stops - starts).sum()):  # consecutive documents: one slice
            ids = cached.tokens[int(starts[0]) : int(stops[-1])]
        else:  # excluded documents among them: their tokens are left out
            ids = np.concatenate([cached.tokens[int(a) : int(b)] for a, b in zip(starts, stops)])
        return TextChunk(*where, np.asarray(rows, np.int64), [], *before[:3], (ids, stops - starts),
                         excluded_before=before[3])  # fmt: skip


class TextReader:
    """Yields a stream's :class:`TextChunk` s from a position on, forever.

    Args:
        units: what the stream reads.
        start: where to start (a position yielded with an earlier state).
        tokenizer_batch_size: documents per chunk, at most.
        chunk_chars: a chunk also ends before its text passes this many characters (0: no limit).
        max_document_chars: texts over this many characters are skipped, counted and warned about (``None``: no limit).
        cache: the source's ``StreamCache``: a unit it holds is replayed from its tokens, one read whole is recorded.
        excluded: documents ``(row group, row)`` passed over (counted, never read into a chunk).

    Raises:
        ValueError: (when iterated) ``MAX_PASSES_WITHOUT_TEXT`` passes in a row without a document.
    """

    def __init__(
        self,
        units: StreamUnits,
        start: ReadPosition,
        tokenizer_batch_size: int,
        chunk_chars: int = 0,
        max_document_chars: int | None = None,
        cache: Any = None,
        excluded: frozenset[tuple[int, int]] = frozenset(),
    ):
        self.units = units
        self.tokenizer_batch_size, self.chunk_chars = tokenizer_batch_size, chunk_chars
        self.max_document_chars, self.cache = max_document_chars, cache
        self.excluded: dict[int, np.ndarray] = {}  # row group -> its excluded rows, ascending
        for group, row in sorted(excluded):
            self.excluded[group] = np.append(self.excluded.get(group, np.zeros(0, np.int64)), row)
        self._recording: list[Any] = []  # recorders of units not yet stored whole
        self.reset(start)

    def reset(self, initial_state: ReadPosition) -> None:
        self.start = self._next = self.units.normalise(initial_state)

    def get_state(self) -> ReadPosition:
        """Where reading resumes: just after the last chunk handed out (or the start, before any)."""
        return self.units.normalise(self._next)

    def __iter__(self) -> Iterator[TextChunk]:
        try:
            yield from self._chunks()
        finally:
            # Stopped (closed, or freed with its reader thread): what the units being read recorded so far is kept.
            for recorder in self._recording:
                recorder.close()
            self._recording.clear()

    def _chunks(self) -> Iterator[TextChunk]:
        units, index = self.units, self.units.index
        size = 1  # grows to tokenizer_batch_size
        start = self._next
        pass_index, slot, row = start.pass_index, start.slot, start.row
        empty_since = units_since = long_since = excluded_since = 0  # skipped since the last document handed out
        passes_without_text = 0
        while True:
            slots = units.of_pass(pass_index)
            found = False
            while slot < len(slots):
                unit = int(slots[slot])
                group, stop = int(units.units.group[unit]), int(units.units.stop[unit])
                row = max(row, first_row := int(units.units.start[unit]))
                read = self._read_unit(group, first_row, stop, row)
                if read is None:
                    units_since += 1  # a text-free unit is counted as one, not as its rows
                    slot, row = slot + 1, 0
                    continue
                long_rows = _skipped_long(index, group, read.too_long, row, stop, self.max_document_chars)
                documents = read.rows[read.rows >= row]
                excluded = self.excluded.get(group)
                out = documents[np.isin(documents, excluded)].tolist() if excluded is not None else []
                kept = documents[~np.isin(documents, excluded)].tolist() if out else documents.tolist()
                if not kept:  # resumed after the unit's last document (or none of its documents is read)
                    skipped = len(long_rows) + len(out)
                    empty_since, long_since = empty_since + stop - row - skipped, long_since + len(long_rows)
                    excluded_since += len(out)
                    slot, row = slot + 1, 0
                    continue
                found = True
                gaps = np.diff(np.asarray([row - 1, *kept], np.int64)) - 1
                gaps[0] += empty_since
                long_before, long_after = _long_before(kept, long_rows, long_since, gaps)
                excluded_before, excluded_after = _long_before(kept, out, excluded_since, gaps)
                units_before = np.asarray([units_since] + [0] * (len(kept) - 1), np.int64)
                empty_since = stop - 1 - kept[-1] - long_after - excluded_after
                units_since, long_since, excluded_since = 0, long_after, excluded_after
                first = 0
                for last in self._chunk_ends(read, kept, size):
                    before = (gaps[first:last], units_before[first:last],
                              {d - first: n for d, n in long_before.items() if first <= d < last},
                              {d - first: n for d, n in excluded_before.items() if first <= d < last})  # fmt: skip
                    chunk = read.chunk((pass_index, slot, group), kept[first:last], before, last == len(kept))
                    self._next = ReadPosition(pass_index, slot, kept[last - 1] + 1)
                    yield chunk
                    first = last
                    size = min(size + (size + 1) // 2, self.tokenizer_batch_size)
                slot, row = slot + 1, 0
            passes_without_text = 0 if found else passes_without_text + 1
            if passes_without_text >= MAX_PASSES_WITHOUT_TEXT:
                raise ValueError(
                    f"stream {units.stream} of {units.num_streams} read {MAX_PASSES_WITHOUT_TEXT} passes over its "
                    f"units without a non-empty text in column {index.text_column!r}"
                )
            pass_index, slot, row = pass_index + 1, 0, 0

    def _read_unit(self, group: int, start: int, stop: int, row: int) -> _UnitRead | None:
        """From the token cache if it holds the unit whole; else read, its rows before ``cached.stop`` from its partial
        entry where there is one, and recorded from where the cache's documents end (the start without a partial
        entry) where reading begins there or before (at ``row``); ``None``: no text."""
        if self.units.index.text_free[group]:
            return None
        whole, partial, content = self.cache.lookup(group, start, stop) if self.cache is not None else (None,) * 3
        if whole is not None:
            too_long = dict(zip(whole.too_long_rows.tolist(), whole.too_long_chars.tolist()))
            return _UnitRead(whole.rows, too_long, None, whole) if len(whole.rows) or too_long else None
        # Recorded under the key of the bytes its texts were decoded from; a partial entry is used (and continued)
        # only where those are the bytes its key was made of.
        covered = partial.stop if partial is not None else start
        keyed = self.cache is not None and row <= covered
        texts, too_long, read_content = self.units.index.read_keyed(group, self.max_document_chars, keyed)
        if partial is not None and read_content != content:
            partial, covered = None, start
        too_long = {r: n for r, n in too_long.items() if start <= r < stop}
        rows = np.asarray([r for r in range(start, stop) if texts[r]], np.int64)
        recorder = None
        if read_content is not None and row <= covered:
            recorder = self.cache.recorder(group, start, stop, too_long, read_content, partial)
        excluded = self.excluded.get(group)
        if excluded is not None and ((excluded >= start) & (excluded < stop)).any():
            recorder = None  # its documents are not all read: the cache keeps units whose documents all are
        read = _UnitRead(rows, too_long, texts, partial if partial is not None and row < covered else None, recorder)
        if recorder is not None:
            if not len(rows) or rows[-1] < covered:
                # Nothing to tokenize (or nothing past its partial entry): stored now, so that the cache holds (and
                # counts) every unit.
                recorder.store()
            else:
                self._recording = [*(other for other in self._recording if not other.done), recorder]
        return read if len(read.rows) or read.too_long else None

    def _chunk_ends(self, read: _UnitRead, kept: list[int], size: int) -> Iterator[int]:
        """Where each chunk of ``kept`` ends: one chunk of cached tokens, then (the rest of a partially cached unit, or
        one not cached) growing sizes capped by both limits."""
        first = read.cached_rows(kept)
        if first:
            yield first
        if first == len(kept):
            return
        lengths = np.fromiter((len(read.texts[r]) for r in kept), np.int64, len(kept)) if self.chunk_chars else None
        while first < len(kept):
            last = min(first + size, len(kept))
            if lengths is not None:
                last = first + max(1, _fitting(lengths[first:last], self.chunk_chars))
            yield last
            first = last
            size = min(size + (size + 1) // 2, self.tokenizer_batch_size)


def _long_before(kept: list[int], long_rows: list[int], since: int, gaps: np.ndarray) -> tuple[dict[int, int], int]:
    """``({document: long rows before it}, long rows after the last document)``; takes them out of ``gaps`` in place."""
    if not long_rows and not since:
        return {}, 0
    counts = np.bincount(np.searchsorted(kept, long_rows), minlength=len(kept) + 1)
    gaps -= counts[:-1]
    counts[0] += since
    return {int(doc): int(counts[doc]) for doc in np.flatnonzero(counts[:-1])}, int(counts[-1])


def _skipped_long(
    index: RowGroupIndex, group: int, lengths: dict[int, int], row: int, stop: int, cap: int | None
) -> list[int]:
    """The rows of ``[row, stop)`` skipped for their length; one warning per document and process."""
    rows = sorted(r for r in lengths if row <= r < stop)
    path, in_file = redact(index.files[int(index.file_of[group])]), int(index.group_in_file[group])
    for skipped in rows:
        if (path, in_file, skipped) in _WARNED_TOO_LONG:
            continue
        _WARNED_TOO_LONG.add((path, in_file, skipped))
        warnings.warn(
            f"skipped a document of {lengths[skipped]} characters (over max_document_chars={cap}): "
            f"{index.describe_rows(group, skipped, skipped + 1)}; raise max_document_chars (None: no limit) to train "
            "on it",
            stacklevel=2,
        )
    return rows


def _fitting(lengths: np.ndarray, budget: int) -> int:
    """How many of the leading documents fit in ``budget`` characters together."""
    return int(np.searchsorted(np.cumsum(lengths), budget, side="right"))
