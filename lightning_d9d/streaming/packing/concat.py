"""Concat packing (nanochat's original loader): documents concatenated into one token stream, cut into rows.

A row is a slice of ``seq_len + 1`` tokens of one array of BOS-prefixed documents: one copy per token, nothing
wasted. The state is the reader's position of the document holding the next unemitted token and ``offset``, its
tokens already emitted. Trade-off: nothing is dropped or padded, but rows usually start mid-document, whose tokens
lose attention to their own beginning.
"""

from __future__ import annotations

import bisect
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing.rows import (
    DocumentSums,
    PackingStage,
    RowBlock,
    StreamCounters,
    bos_tensors,
    read_kind,
)
from lightning_d9d.streaming.plans.packings import register_packing
from lightning_d9d.streaming.plans.state import field as state_field
from lightning_d9d.streaming.plans.state import integer, join
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits, TextChunk

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec


class ConcatPacker:
    """Concatenate BOS-prefixed documents into one stream and cut it into rows of ``capacity`` tokens (a take may
    ask another row length: the stream is the same, only where it is cut changes).

    Raises:
        ValueError: ``capacity <= 1``.
    """

    def __init__(self, capacity: int, counters: StreamCounters | None = None) -> None:
        self.capacity = _checked_capacity(capacity)
        self.counters = counters if counters is not None else StreamCounters()
        # The live chunks as they came (never concatenated: a row inside one chunk is a view of it), each one's
        # offset in the stream of live tokens, its document offsets (relative to it) and its ref.
        self._chunks: list[np.ndarray] = []
        self._chunk_starts: list[int] = []
        self._chunk_docs: list[list[int]] = []  # as ints: bisect on them costs less than numpy per take
        self._chunk_refs: list[object] = []
        self._end = 0  # live tokens buffered
        self._pos = 0  # the next unemitted one

    @property
    def available(self) -> int:
        """Tokens buffered and not yet emitted."""
        return self._end - self._pos

    def add(self, tokens: np.ndarray, doc_starts: np.ndarray, ref: object, skip: int = 0) -> None:
        """Append one chunk's tokens (BOS-prefixed documents, concatenated).

        Args:
            tokens: 1-D int32 token ids.
            doc_starts: where each document starts in ``tokens`` (ascending, the first is 0).
            ref: what the caller needs to find this chunk again.
            skip: tokens of this chunk already emitted (when resuming inside a document).
        """
        # Drop fully consumed chunks, keeping the one that holds the next token.
        first_live = bisect.bisect_right(self._chunk_starts, self._pos) - 1
        if first_live > 0:
            cut = self._chunk_starts[first_live]
            self._pos -= cut
            self._end -= cut
            self._chunk_starts = [s - cut for s in self._chunk_starts[first_live:]]
            del self._chunks[:first_live], self._chunk_docs[:first_live], self._chunk_refs[:first_live]
        tokens = np.asarray(tokens, np.int32)
        self._chunk_starts.append(self._end)
        self._chunks.append(tokens)
        self._end += len(tokens)
        self._chunk_docs.append(np.asarray(doc_starts, np.int64).tolist())
        self._chunk_refs.append(ref)
        self._pos += skip

    def take(self, num_rows: int, capacity: int | None = None) -> np.ndarray | None:
        """``(num_rows, capacity)`` tokens (default: the packer's capacity), or ``None`` when fewer are buffered (add
        more, retry)."""
        capacity = self.capacity if capacity is None else _checked_capacity(capacity)
        need, pos = num_rows * capacity, self._pos
        if self._end - pos < need:
            return None
        starts = self._chunk_starts
        i = bisect.bisect_right(starts, pos) - 1
        offset = pos - starts[i]
        chunk = self._chunks[i]
        if offset + need <= len(chunk):
            rows = chunk[offset : offset + need]
        else:  # the rows span chunks: only these tokens are copied
            parts, left = [chunk[offset:]], need - (len(chunk) - offset)
            while left > 0:
                i += 1
                parts.append(self._chunks[i][:left])
                left -= len(parts[-1])
            rows = np.concatenate(parts)
        self._pos = pos + need
        self.counters.emitted += need
        return rows.reshape(num_rows, capacity)

    def document_spans(self, start: int, stop: int) -> list[tuple[int, int, object, int, int]]:
        """``(position, length, ref, document, its token)`` of every document's part in live tokens ``[start,
        stop)`` (taken, not yet dropped): what provenance names."""
        spans = []
        i = bisect.bisect_right(self._chunk_starts, start) - 1
        while start < stop:
            base, docs, size = self._chunk_starts[i], self._chunk_docs[i], len(self._chunks[i])
            doc = bisect.bisect_right(docs, start - base) - 1
            while start < stop and start - base < size:
                end = min(base + (docs[doc + 1] if doc + 1 < len(docs) else size), stop)
                spans.append((start, end - start, self._chunk_refs[i], doc, start - base - docs[doc]))
                start, doc = end, doc + 1
            i += 1
        return spans

    def position(self) -> tuple[object, int, int]:
        """``(ref, document, offset)`` of the next unemitted token; all emitted: ``(last ref, its documents, 0)``."""
        if not self._chunk_starts:
            raise RuntimeError("the packer holds no chunk yet")
        if self._pos == self._end:
            return self._chunk_refs[-1], len(self._chunk_docs[-1]), 0
        i = bisect.bisect_right(self._chunk_starts, self._pos) - 1
        offset = self._pos - self._chunk_starts[i]
        docs = self._chunk_docs[i]
        doc = bisect.bisect_right(docs, offset) - 1
        return self._chunk_refs[i], doc, offset - docs[doc]


def _checked_capacity(capacity: int) -> int:
    if capacity <= 1:
        raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
    return capacity


@dataclass(frozen=True)
class ConcatState:
    """Concat's state: the reader's position and the tokens of the document there already emitted."""

    kind: ClassVar[str] = "concat"

    read: ReadPosition = field(default_factory=ReadPosition)
    offset: int = 0

    @property
    def buffer(self) -> np.ndarray:
        """Nothing is buffered between blocks that a resume would rebuild (the carried tokens are re-read)."""
        return np.zeros((0, 0), np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reader": self.read.to_dict(), "offset": self.offset}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], path: str) -> ConcatState:
        """Raises :class:`InvalidDataState` for a missing or mistyped field, or another packing's state."""
        read_kind(state, path, cls.kind)
        reader = ReadPosition.from_dict(state_field(state, "reader", path), join(path, "reader"))
        return cls(reader, integer(state, "offset", path))

    def check(self, spec: StreamSpec, units: StreamUnits, path: str) -> None:
        self.read.check(units, join(path, "reader"))


class _Begun:
    """A chunk whose documents are being begun: ``counted`` of them are counted."""

    __slots__ = ("counted", "laid", "sums")

    def __init__(self, laid: Any):
        self.laid, self.counted = laid, 0
        self.sums = DocumentSums(laid.chunk, laid.lengths)


class ConcatStage(PackingStage):
    """Concat's stage: chunks in, blocks of rows out; a document counts once, when its first token is emitted."""

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: ConcatState, counters: StreamCounters):
        super().__init__(spec, units, counters)
        self.start = state

    def blocks(
        self, chunks: Iterator[Any], sizes: Iterator[tuple[int, int]]
    ) -> Generator[tuple[RowBlock, Any], None, None]:
        start = self.start
        packer = ConcatPacker(2, self.counters)
        skip = start.offset
        if skip and self._excluded(start.read):  # resumed inside a document excluded since: its rest is never read
            skip = 0
        self.carried = skip > 0  # resumed inside a document: it was counted before the checkpoint
        after_last = start.read  # the position after the last document begun (or where reading started)
        pending: list[_Begun] = []  # chunks not yet all begun, oldest first
        last_begun: tuple[TextChunk, int] | None = None  # (chunk, document) begun last, once after_last is stale
        state, record_pieces = start, self.spec.record_pieces
        placed: tuple[Any, int, ReadPosition | None] = (None, -1, None)  # (chunk, document, its position) last placed
        while True:
            rows_per_block, capacity = next(sizes)
            if rows_per_block == 0:  # nothing taken: the position stays
                yield RowBlock.empty(capacity, False), state
                continue
            rows = packer.take(rows_per_block, capacity)
            while rows is None:
                laid = next(chunks)
                if skip and skip >= laid.lengths[0]:
                    raise InvalidDataState(
                        "packing.offset", skip, f"the document there holds {int(laid.lengths[0])} tokens"
                    )
                packer.add(laid.payload, laid.starts, laid, skip=skip)
                pending.append(_Begun(laid))
                skip = 0
                rows = packer.take(rows_per_block, capacity)
            laid, doc, offset = packer.position()
            begun = doc + 1 if offset > 0 else doc
            if pending and (pending[0].laid is not laid or pending[0].counted != begun):  # a document begun
                counted_last = self._count_begun(pending, laid, begun)
                if counted_last is not None:
                    last_begun = counted_last
            if offset > 0:
                if laid is not placed[0] or doc != placed[1]:  # a document spanning blocks is placed once
                    placed = (laid, doc, laid.chunk.position_of(doc))
                read = placed[2]
            else:
                if last_begun is not None:  # only the last document begun names the position, so only it is placed
                    after_last, last_begun = self.after(*last_begun), None
                read = after_last
            state = ConcatState(read, offset)
            pieces = self._pieces(packer, rows_per_block, capacity) if record_pieces else None
            yield RowBlock(rows, pieces=pieces), state

    def _excluded(self, read: ReadPosition) -> bool:
        unit = int(self.units.of_pass(read.pass_index)[read.slot])
        return (int(self.units.units.group[unit]), read.row) in self.spec.excluded

    @staticmethod
    def _pieces(packer: ConcatPacker, rows: int, capacity: int) -> np.ndarray:
        """The pieces of the rows just taken: each document's part, cut at row ends (per chunk, in numpy: the cuts
        are the rows' and the documents' starts in the taken range)."""
        stop = packer._pos
        start = stop - rows * capacity
        tables = []
        i = bisect.bisect_right(packer._chunk_starts, start) - 1
        while i < len(packer._chunks) and packer._chunk_starts[i] < stop:
            base, laid = packer._chunk_starts[i], packer._chunk_refs[i]
            docs = np.asarray(packer._chunk_docs[i], np.int64)
            low, high = max(start, base) - base, min(stop, base + len(packer._chunks[i])) - base
            row_starts = np.arange(-(-(low + base - start) // capacity), -(-(high + base - start) // capacity))
            cuts = np.union1d(np.concatenate([[low], docs[(docs > low) & (docs < high)]]),
                              row_starts * capacity + start - base)  # fmt: skip
            cuts = cuts[(cuts >= low) & (cuts < high)]
            doc = np.searchsorted(docs, cuts, side="right") - 1
            table = np.zeros((len(cuts), 7), np.int64)
            table[:, 0], table[:, 1] = np.divmod(cuts + base - start, capacity)
            table[:, 2] = np.diff(np.append(cuts, high))
            table[:, 3], table[:, 4] = laid.chunk.group, np.asarray(laid.chunk.rows)[doc]
            table[:, 5] = cuts - docs[doc]
            tables.append(table)
            i += 1
        return np.concatenate(tables) if tables else np.zeros((0, 7), np.int64)

    def _count_begun(self, pending: list[_Begun], laid: Any, begun: int) -> tuple[TextChunk, int] | None:
        """Count every document begun by now (``begun`` of ``laid``'s), each once, in stream order; the last one."""
        last = None
        while pending:
            current = pending[0]
            upto = begun if current.laid is laid else len(current.laid.lengths)
            if upto > current.counted:
                first = current.counted + (1 if self.carried else 0)
                self.carried = False
                self.took_range(current.sums, first, upto)
                last = (current.laid.chunk, upto - 1)
            if current.laid is not laid:
                pending.pop(0)
                continue
            current.counted = upto
            break
        return last


@dataclass(frozen=True)
class ConcatPacking:
    """The concat strategy."""

    name: ClassVar[str] = "concat"
    crops_to_row: ClassVar[bool] = False
    flagged: ClassVar[bool] = False

    def fresh_state(self, spec: StreamSpec) -> ConcatState:
        return ConcatState()

    def state_from_dict(self, state: Mapping[str, Any], path: str) -> ConcatState:
        return ConcatState.from_dict(state, path)

    def stage(
        self, spec: StreamSpec, units: StreamUnits, state: ConcatState, counters: StreamCounters, texts: Any
    ) -> ConcatStage:
        return ConcatStage(spec, units, state, counters)

    def tensors(self, rows: RowBlock, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return bos_tensors(rows.tokens, bos_id)


register_packing(ConcatPacking())
