"""Best-fit stage: the best-fit packers run as a stream's packing stage, their state saved and restored.

A stage feeds each chunk's documents to the packer (one document per refill inside the compiled loop), takes a
block of rows per step, and saves the packer's buffer as integer rows (``BestFitState``) with the reader's position
after the last document it holds; a resume fetches and verifies the buffered pieces lazily. ``BestFitPacking`` is
the strategy the plans name (``bestfit``, ``bestfit_split``), registered when this module is imported. Trade-off: a
saved buffer costs a row of integers per piece, but a resume rereads the units its pieces came from.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing.bestfit_restore import BufferedTexts, UnitTokens, buffer_fetch
from lightning_d9d.streaming.packing.buffer_rows import BufferRows
from lightning_d9d.streaming.packing.rows import (
    PackingStage,
    RowBlock,
    StreamCounters,
    bos_tensors,
    flagged_tensors,
    read_kind,
)
from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth, register_packing
from lightning_d9d.streaming.plans.state import check_column, int_table, integer, join
from lightning_d9d.streaming.plans.state import field as state_field
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec
from lightning_d9d.streaming.packing.bestfit import META_COLUMNS, BestFitPacker, BestFitSplitPacker, recorded_pieces


@dataclass(frozen=True, eq=False)
class BestFitState:
    """A best-fit packing's state: the reader's position after the last document added, and the buffer's rows (one
    int64 ``META_COLUMNS`` row per piece, in insertion order: :attr:`buffer`), built only when read
    (:class:`BufferRows`; a table given is wrapped as it is). Two states are equal when every field is, the
    buffer's rows by value.
    """

    kind: str = "bestfit"
    read: ReadPosition = field(default_factory=ReadPosition)
    rows: BufferRows = field(default_factory=BufferRows.empty)
    next_seq: int = 0
    growth: BufferGrowth = FULL_BUFFER

    def __post_init__(self) -> None:
        if isinstance(self.rows, np.ndarray):
            object.__setattr__(self, "rows", BufferRows.of(self.rows))

    @property
    def buffer(self) -> np.ndarray:
        """The buffered pieces' rows (built now if they were not)."""
        return self.rows.table()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BestFitState):
            return NotImplemented
        return (self.kind, self.read, self.next_seq, self.growth) == (
            other.kind, other.read, other.next_seq, other.growth
        ) and np.array_equal(self.buffer, other.buffer)  # fmt: skip

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "reader": self.read.to_dict(),
            "buffer": np.asarray(self.buffer, np.int64),
            "next_seq": self.next_seq,
            "buffer_start": self.growth.start,
            "buffer_growth": self.growth.per_row,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], path: str, kind: str) -> BestFitState:
        """Raises :class:`InvalidDataState` for a missing or mistyped field, or another packing's state."""
        read_kind(state, path, kind)
        start, per_row = integer(state, "buffer_start", path), integer(state, "buffer_growth", path)
        try:
            growth = BufferGrowth(start, per_row)
        except ValueError as error:
            raise InvalidDataState(join(path, "buffer_start"), start, str(error)) from error
        read = ReadPosition.from_dict(state_field(state, "reader", path), join(path, "reader"))
        buffer = int_table(state, "buffer", path, len(META_COLUMNS))
        return cls(kind, read, buffer, integer(state, "next_seq", path), growth)

    def check(self, spec: StreamSpec, units: StreamUnits, path: str) -> None:
        """Raises :class:`InvalidDataState` unless every buffered row names a row of the data and fits the rows."""
        self.read.check(units, join(path, "reader"))
        buffer, where = self.buffer, join(path, "buffer")
        if not len(buffer):
            return
        check_column(buffer, 0, "seq", where, 0, self.next_seq)
        if len(np.unique(buffer[:, 0])) != len(buffer):
            raise InvalidDataState(f"{where}.seq", buffer[:, 0].tolist()[:20], "insertion numbers must be distinct")
        split, unbounded = self.kind == "bestfit_split", np.iinfo(np.int64).max
        check_column(buffer, 1, "length", where, 1, unbounded)
        check_column(buffer, 2, "key0 (row group)", where, 0, len(spec.index.num_rows))
        check_column(buffer, 3, "key1 (row)", where, 0, spec.index.num_rows[buffer[:, 2]])
        check_column(buffer, 4, "offset", where, 0, unbounded if split else 1)
        check_column(buffer, 5, "final", where, 0, 2)
        check_column(buffer, 6, "hash", where, 0, 1 << 32)
        check_column(buffer, 7, "hashed", where, 0, unbounded)


@dataclass(slots=True)
class _Cursor:
    """The chunk whose documents are being fed, and its first document not yet counted."""

    laid: Any = None
    next_doc: int = 0


class BestFitStage(PackingStage):
    """A best-fit packing's stage: its packer fed one document per refill, blocks of rows out."""

    def __init__(
        self,
        spec: StreamSpec,
        units: StreamUnits,
        state: BestFitState,
        counters: StreamCounters,
        texts: BufferedTexts | UnitTokens | None,
    ):
        super().__init__(spec, units, counters)
        self.start, self.buffer, self.dropped = state, state.buffer, 0
        if spec.excluded and len(self.buffer):  # documents excluded since the state was saved leave the buffer
            keys = self.buffer[:, 2:4].tolist()
            out = np.asarray([(key0, key1) in spec.excluded for key0, key1 in keys], bool)
            self.dropped = len({tuple(key) for key in self.buffer[out, 2:4].tolist()})
            self.buffer = self.buffer[~out]
        self.fetch = buffer_fetch(spec, self.buffer, texts) if len(self.buffer) else None
        self.packer: BestFitPacker | None = None  # made at the first block that takes rows, at its row length

    def _packer(self, capacity: int) -> BestFitPacker:
        """The packer of the first block that takes rows, holding the start's buffer (split at ``capacity``)."""
        spec, state, counters = self.spec, self.start, self.counters
        multiple = spec.settings.cp_multiple
        if state.kind == "bestfit_split":
            packer = BestFitSplitPacker(capacity, spec.pad_id, spec.buffer_size, state.growth, counters, multiple)
        else:
            packer = BestFitPacker(capacity, spec.buffer_size, state.growth, counters, multiple, spec.pad_id,
                                   hold=max(capacity, spec.max_capacity))  # fmt: skip
        packer.rows_taken = counters.rows  # the buffer's size follows the rows packed
        packer.record = [] if spec.record_pieces else None
        counters.excluded += self.dropped
        packer.reset(self.buffer, state.next_seq, self.fetch)
        return packer

    def blocks(
        self, chunks: Iterator[Any], sizes: Iterator[tuple[int, int]]
    ) -> Generator[tuple[RowBlock, Any], None, None]:
        spec, start = self.spec, self.start
        cursor = _Cursor()
        state, rows = start, None
        packer: BestFitPacker | None = None
        while True:
            rows_per_block, capacity = next(sizes)
            if rows_per_block == 0:  # nothing taken: the buffer and the position stay
                yield RowBlock.empty(capacity, spec.packing.flagged or spec.settings.cp_multiple > 1), state
                continue
            if packer is None:
                packer = self.packer = self._packer(capacity)
                refill = self._refiller(chunks, cursor, packer)
            elif capacity != packer.capacity:  # a new row length: the buffer carries over, re-cut where needed
                packer.reshape(capacity)
            tokens, flags = packer.take(rows_per_block, refill)
            read = state.read
            if self._count(cursor, packer.fed):  # only the last document added names the position
                read = self.after(cursor.laid.chunk, cursor.next_doc - 1)
            rows = packer._buffer.rows(rows)  # the rows built only if something reads them
            state = BestFitState(start.kind, read, rows, packer.next_seq, start.growth)
            yield RowBlock(tokens, flags, pieces=recorded_pieces(packer.record)), state

    def _refiller(self, chunks: Iterator[Any], cursor: _Cursor, packer: BestFitPacker) -> Callable[[], None]:
        """``refill()``: feed the next chunk's documents (the packer buffers them one per top-up, so the buffer never
        depends on chunk sizes), once the last chunk's are counted."""

        def refill() -> None:
            if cursor.laid is not None:
                self._count(cursor, len(cursor.laid.lengths))
            laid = next(chunks)
            while not len(laid.lengths):
                laid = next(chunks)
            cursor.laid, cursor.next_doc = laid, 0
            chunk = laid.chunk
            if packer.split:
                packer.feed(laid.payload, laid.starts, laid.lengths, chunk.group, chunk.rows)
            else:  # row-sized prefixes, one after another
                held = np.fromiter(map(len, laid.payload), np.int64, len(laid.payload))
                tokens = np.concatenate(laid.payload) if len(laid.payload) else np.zeros(0, np.int32)
                packer.feed(tokens, np.cumsum(held) - held, laid.lengths, chunk.group, chunk.rows)

        return refill

    def _count(self, cursor: _Cursor, stop: int) -> bool:
        """Count the documents of the cursor's chunk buffered since the last count (up to ``stop``); whether any."""
        first = cursor.next_doc
        if stop <= first:
            return False
        laid, counters = cursor.laid, self.counters
        chunk = laid.chunk
        counters.tokens += int(laid.lengths[first:stop].sum())
        counters.empty += int(chunk.empty_before[first:stop].sum())
        counters.text_free_units += int(chunk.units_before[first:stop].sum())
        for doc, count in chunk.long_before.items():
            if first <= doc < stop:
                counters.too_long += count
        for doc, count in chunk.excluded_before.items():
            if first <= doc < stop:
                counters.excluded += count
        cursor.next_doc = stop
        return True


@dataclass(frozen=True)
class BestFitPacking:
    """A best-fit strategy: ``bestfit`` (crop) or ``bestfit_split`` (split and pad)."""

    name: str = "bestfit"

    @property
    def crops_to_row(self) -> bool:
        return self.name == "bestfit"

    @property
    def flagged(self) -> bool:
        """Rows carry flags without context parallelism (with it, ``bestfit``'s rows do too)."""
        return self.name == "bestfit_split"

    def fresh_state(self, spec: StreamSpec) -> BestFitState:
        return BestFitState(kind=self.name, growth=spec.growth)

    def state_from_dict(self, state: Mapping[str, Any], path: str) -> BestFitState:
        return BestFitState.from_dict(state, path, self.name)

    def stage(
        self, spec: StreamSpec, units: StreamUnits, state: BestFitState, counters: StreamCounters, texts: Any
    ) -> BestFitStage:
        return BestFitStage(spec, units, state, counters, texts)

    def tensors(self, rows: RowBlock, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if rows.flags is None:
            return bos_tensors(rows.tokens, bos_id)
        return flagged_tensors(rows.tokens, rows.flags)


register_packing(BestFitPacking("bestfit"))
register_packing(BestFitPacking("bestfit_split"))
