"""Best-fit packing: every row filled with the largest buffered piece that still fits, two rules for a gap.

The buffer is topped up before every pick, one document per refill, so it never depends on tokenizer batching.
``bestfit`` (nanochat's): a piece is a document's row-sized prefix; when nothing fits, the shortest is cropped to
fill the row, so every row starts at BOS, unpadded. ``bestfit_split``: long documents become row-sized chunks, a gap
is padding, and rows carry ``START`` / ``NO_TARGET`` flags. Under context parallelism each piece is padded to a
multiple of ``2·c`` (``CP_PAD``). A saved state is only the pieces' integer rows; restored pieces are fetched and
verified when first picked. Trade-off: ``bestfit`` trades tokens for alignment; ``bestfit_split`` keeps every token
for a little padding, but a chunk loses attention to its predecessors.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing.bestfit_restore import BufferedTexts, UnitTokens, buffer_fetch
from lightning_d9d.streaming.packing.buffer_rows import BufferRows
from lightning_d9d.streaming.packing.rows import (
    CP_PAD,
    NO_TARGET,
    START,
    PackingStage,
    RowBlock,
    StreamCounters,
    bos_tensors,
    flagged_tensors,
    prefix_hash,
    read_kind,
)
from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth, register_packing
from lightning_d9d.streaming.plans.state import check_column, int_table, integer, join
from lightning_d9d.streaming.plans.state import field as state_field
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec

Fetch = Callable[[np.ndarray, int], np.ndarray]
"""``fetch(row, need)``: a buffered piece's tokens from its ``offset`` on, at least ``need`` where there are as many."""

META_COLUMNS = ("seq", "length", "key0", "key1", "offset", "final", "hash", "hashed")
"""The integers that describe a buffered piece, none of them tied to a row length: its insertion number, its length
(``bestfit``: its document's), its document's row group and row (``key0``/``key1``), where it starts in its
BOS-prefixed document, whether it runs to the document's end, and the CRC-32 of its first ``hashed`` tokens
(``hashed`` 0: a whole document, verified by its length)."""


class _PieceBuffer:
    """Buffered pieces by length (a pick is one ``bisect``), each described by its ``META_COLUMNS`` row, a tuple of
    Python ints: a pick reads it without numpy, and the rows become a table only for a snapshot."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.by_length: dict[int, deque] = {}  # length -> FIFO of (row, payload)
        self.count = 0
        # The values of the rows pushed, one after another (a flat list becomes an array at half the cost of a list
        # of tuples), and the insertion numbers popped, since the last rows().
        self.pushed: list[int] = []
        self.popped: list[int] = []
        self.rebuilt = False  # extend() ran since the last rows(): its changes are not listed (a snapshot follows)

    def push(self, length: int, row: tuple[int, ...], payload: Any) -> None:
        """Buffer one piece of ``length`` (its sort key) described by ``row`` (numbered above every piece here);
        ``payload`` comes back on pop."""
        self.pushed.extend(row)
        bucket = self.by_length.get(length)
        if bucket is None:
            bucket = self.by_length[length] = deque()
            bisect.insort(self.lengths, length)
        bucket.append((row, payload))
        self.count += 1

    def extend(self, rows: np.ndarray, payloads: list[Any]) -> None:
        """Buffer many pieces (rows in insertion order, numbered above every piece here, each its length as sort
        key): as :meth:`push` of each in turn, grouped by length; the next :meth:`rows` is a snapshot."""
        n = len(rows)
        if not n:
            return
        listed = list(map(tuple, rows.tolist()))
        self.rebuilt = True
        lengths = rows[:, 1]
        order = np.argsort(lengths, kind="stable")  # each length's pieces in insertion order
        values, firsts = np.unique(lengths[order], return_index=True)
        bounds = [*firsts.tolist(), n]
        order_list = order.tolist()
        for length, first, last in zip(values.tolist(), bounds[:-1], bounds[1:]):
            bucket = self.by_length.get(length)
            if bucket is None:
                bucket = self.by_length[length] = deque()
                bisect.insort(self.lengths, length)
            picked = order_list[first:last]
            bucket.extend(zip([listed[i] for i in picked], [payloads[i] for i in picked]))
        self.count += n

    def pop(self, index: int) -> tuple[int, Any, tuple[int, ...]]:
        """Remove the oldest piece of the ``index``-th smallest length: ``(length, payload, row)``."""
        length = self.lengths[index]
        bucket = self.by_length[length]
        row, payload = bucket.popleft()
        self.popped.append(row[0])
        if not bucket:
            del self.by_length[length]
            del self.lengths[index]
        self.count -= 1
        return length, payload, row

    def rows(self, before: BufferRows | None) -> BufferRows:
        """The buffered pieces' rows: ``before`` (the rows at the last call) and the changes since, or (``before``
        ``None``, or after :meth:`extend`) a snapshot; the changes count from here."""
        pushed, popped = self.pushed, self.popped
        self.pushed, self.popped = [], []
        if before is None or self.rebuilt:
            self.rebuilt = False
            return BufferRows(self.snapshot())
        return before.after(np.array(pushed, np.int64).reshape(-1, len(META_COLUMNS)), np.array(popped, np.int64))

    def snapshot(self) -> np.ndarray:
        """The rows of the buffered pieces, sorted by insertion number."""
        # Read from the buckets (a snapshot is rare: a rebuilt buffer, a reshape), so a push or pop keeps no index.
        rows = [row for bucket in self.by_length.values() for row, _ in bucket]
        rows.sort()
        return np.asarray(rows, np.int64).reshape(-1, len(META_COLUMNS))


class BestFitPacker:
    """``bestfit``: rows that all start at BOS; largest fitting document first, the shortest cropped when none fits.

    Args:
        capacity: tokens per row (``seq_len + 1``).
        buffer_size: pieces the buffer is topped up to before every pick.
        growth: how the buffer grows to ``buffer_size`` as the stream starts (default: full from the start).
        counters: the stream's counters (the packer adds what it emits, pads, crops and splits).
        cp_multiple: pieces are padded to a multiple of this (``2·context_parallel_size``; 1: no CP padding).
        pad_id: the token id written at padding positions.
        hold: tokens a document's buffered prefix keeps (``bestfit``; default ``capacity``): the largest row it may
            meet, so that rows may grow (:meth:`reshape`) without reading it again.

    Raises:
        ValueError: ``capacity <= 1``, ``buffer_size <= 0``, ``cp_multiple`` not dividing ``capacity - 1``, or
            ``hold < capacity``.
    """

    split = False  # documents longer than a row are split into chunks (else kept as a row-sized prefix)

    def __init__(
        self,
        capacity: int,
        buffer_size: int = 1000,
        growth: BufferGrowth = FULL_BUFFER,
        counters: StreamCounters | None = None,
        cp_multiple: int = 1,
        pad_id: int = 0,
        hold: int | None = None,
    ) -> None:
        if buffer_size <= 0:
            raise ValueError(f"best-fit buffer_size must be > 0, got {buffer_size}")
        if cp_multiple < 1:
            raise ValueError(f"cp_multiple={cp_multiple} must be >= 1")
        self.buffer_size, self.growth, self.cp_multiple, self.pad_id = buffer_size, growth, cp_multiple, pad_id
        self._set_capacity(capacity)
        self.hold = capacity if hold is None else hold
        if self.hold < capacity:
            raise ValueError(f"hold={self.hold} must be at least the row capacity {capacity}")
        self.flagged = self.split or cp_multiple > 1  # rows carry START / NO_TARGET (/ CP_PAD) flags
        self.counters = counters if counters is not None else StreamCounters()
        self.rows_taken = 0  # rows packed so far (set back on resume): the buffer's size follows it
        self._full_from = _rows_until_full(growth, buffer_size)
        self.next_seq = 0
        self.added = 0  # documents added: each refill() must add one
        self._buffer = _PieceBuffer()
        self._fetch: Fetch | None = None
        # (row, column, length, row group, row, offset) of every piece placed, where provenance is asked for
        self.record: list[tuple[int, ...]] | None = None

    def _set_capacity(self, capacity: int) -> None:
        if capacity <= 1:
            raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
        if (capacity - 1) % self.cp_multiple:
            raise ValueError(f"cp_multiple={self.cp_multiple} must divide seq_len={capacity - 1}")
        self.capacity = capacity
        self._padding = np.full(capacity, self.pad_id, np.int32)  # padding runs are slices of it

    def __len__(self) -> int:
        return self._buffer.count

    def add(self, tokens: np.ndarray, length: int, key: tuple[int, int]) -> None:
        """Buffer one document's first ``min(length, hold)`` tokens (BOS first), ordered by ``length``."""
        hold = self.hold
        keep = length if length < hold else hold
        if len(tokens) != keep:
            if len(tokens) < keep:
                raise ValueError(f"document prefix has {len(tokens)} tokens, expected {keep}")
            tokens = tokens[:keep]
        whole = length <= hold
        seq = self.next_seq
        checksum, hashed = (0, 0) if whole else (prefix_hash(tokens), hold)
        self._buffer.push(length, (seq, length, key[0], key[1], 0, int(whole), checksum, hashed), (tokens, False))
        self.next_seq = seq + 1
        self.added += 1
        self.counters.docs += 1

    def take(self, num_rows: int, refill: Callable[[], None]) -> tuple[np.ndarray, np.ndarray | None]:
        """Pack ``num_rows`` rows; each ``refill()`` must add one document.

        Returns:
            ``(tokens, flags)``: ``(num_rows, capacity)`` int32 ids and uint8 flag bits (``None`` when not flagged).

        Raises:
            RuntimeError: a ``refill()`` call added no document.
            ValueError: a restored piece no longer matches its saved length or checksum.
        """
        capacity, buffer, multiple, record = self.capacity, self._buffer, self.cp_multiple, self.record
        flagged = self.flagged
        lengths, find = buffer.lengths, bisect.bisect_right
        # The rows' tokens in order, pieces and padding runs alike, joined once at the end: no numpy call per piece.
        parts: list[np.ndarray] = []
        # Flat offsets where a piece or a padding run starts, of pieces' first tokens that are no target (after
        # another document or CP padding), of each padding run, and (start, stop) of each CP padding.
        marks: tuple[list[int], list[int], list[int], list] = ([], [], [], [])
        starts, blocked = marks[0], marks[1]
        padding = cp_padding = 0
        for r in range(num_rows):
            pos, open_end, at = 0, False, r * capacity  # open_end: the piece before ends inside its document
            size = self._size_before_row()
            while pos < capacity:
                if buffer.count < size:
                    self._top_up(size, refill)
                i = find(lengths, capacity - pos) - 1
                if i < 0:  # nothing fits
                    padding += self._gap(parts, r, pos, marks)
                    break
                length, (tokens, continuation), row = buffer.pop(i)
                parts.append(tokens if tokens is not None else self._materialize(row))  # None: restored lazily
                if record is not None:
                    record.append((r, pos, length, row[2], row[3], row[4]))
                if flagged:
                    starts.append(at + pos)
                    # Not the target of the token before it: that token is another document's, or (a piece cut at
                    # a shorter row length, now sharing a row) it is followed in its own document by other text.
                    if continuation or open_end:
                        blocked.append(at + pos)
                    open_end = not row[5]
                pos += length
                if multiple > 1 and pos < capacity:
                    pos, padded = self._cp_pad(parts, r, pos, marks)
                    cp_padding += padded
        padding += cp_padding
        self.counters.emitted += num_rows * capacity - padding
        self.counters.padding += padding
        self.counters.cp_padding += cp_padding
        out = np.concatenate(parts, dtype=np.int32, casting="unsafe") if parts else np.empty(0, np.int32)
        out = out.reshape(num_rows, capacity)
        return out, (_flags(out.shape, *marks) if flagged else None)

    def _size_before_row(self) -> int:
        """The buffer's size before the next row (counted as taken)."""
        taken = self.rows_taken
        self.rows_taken = taken + 1
        if taken >= self._full_from:
            return self.buffer_size
        return self.growth.size(self.buffer_size, taken)

    def _top_up(self, size: int, refill: Callable[[], None]) -> None:
        while self._buffer.count < size:
            added = self.added
            refill()
            if self.added == added:
                raise RuntimeError("refill() added no document")

    def _gap(self, parts: list[np.ndarray], row: int, pos: int, marks: Any) -> int:
        """No piece fits the rest of row ``row`` from ``pos``: crop the shortest to fill it; returns 0 (padding)."""
        remaining = self.capacity - pos
        length, (tokens, _), piece = self._buffer.pop(0)
        if tokens is None:
            tokens = self._materialize(piece)
        parts.append(tokens[:remaining])
        if self.record is not None:
            self.record.append((row, pos, remaining, piece[2], piece[3], piece[4]))
        if self.flagged:  # rows flagged for CP: the cropped piece starts a sequence
            marks[0].append(row * self.capacity + pos)
        self.counters.crops += 1
        self.counters.cropped += length - remaining
        return 0

    def _cp_pad(self, parts: list[np.ndarray], row: int, pos: int, marks: Any) -> tuple[int, int]:
        """Pad from ``pos`` to the next multiple of ``cp_multiple`` (or row end); returns new position, padding."""
        stop = -(-pos // self.cp_multiple) * self.cp_multiple
        if stop >= self.capacity - 1:
            stop = self.capacity
        if stop == pos:
            return pos, 0
        parts.append(self._padding[: stop - pos])
        at = row * self.capacity
        marks[3].append((at + pos, at + stop))
        if stop < self.capacity:  # what follows must not be the target of padding
            marks[1].append(at + stop)
        return stop, stop - pos

    def reset(self, buffer: np.ndarray, next_seq: int, fetch: Fetch | None) -> None:
        """Continue from a saved buffer, lazily: a piece's tokens are fetched (``fetch(row, need) -> tokens`` from its
        ``offset``, at least ``need`` of them where the document has as many) and verified when first picked, so a
        resume tokenizes a few documents, not the buffer. Pieces longer than this packer's rows
        (``bestfit_split``, saved under a shorter ``seq_len``... or a longer one) are split now, as :meth:`reshape`.

        Raises:
            RuntimeError: the packer is not empty.
            ValueError: a malformed buffer, or pieces but no ``fetch``.
        """
        if self._buffer.count:
            raise RuntimeError("reset() needs an empty packer")
        buffer = np.asarray(buffer, np.int64)
        if buffer.ndim != 2 or (len(buffer) and buffer.shape[1] != len(META_COLUMNS)):
            raise ValueError(f"a best-fit buffer must be (pieces, {len(META_COLUMNS)}), got {buffer.shape}")
        if len(buffer) and fetch is None:
            raise ValueError("a state with buffered pieces needs fetch() to rebuild their tokens")
        self._fetch = fetch
        self.next_seq = next_seq
        self._arrange(buffer, {})

    def reshape(self, capacity: int) -> None:
        """Pack rows of ``capacity`` tokens from now on, keeping every buffered piece: under ``bestfit_split`` a piece
        longer than the new rows is split into row-sized pieces now (its tokens verified as on a resume). The
        result depends only on the buffer's rows, so a stream resumed at the same point reshapes alike.

        Raises:
            ValueError: a capacity that is not > 1, is below what the buffer holds (``bestfit``), or that the CP
                multiple does not divide; a piece that no longer matches its checksum.
        """
        if capacity == self.capacity:
            return
        if not self.split and capacity > self.hold:
            raise ValueError(f"rows of {capacity} tokens need documents' prefixes of as many, this packer keeps "
                             f"{self.hold}")  # fmt: skip
        payloads = {}
        for bucket in self._buffer.by_length.values():
            for row, payload in bucket:
                payloads[row[0]] = payload
        rows = self.snapshot()
        self._set_capacity(capacity)
        self._buffer = _PieceBuffer()
        self._arrange(rows, payloads)

    def _arrange(self, rows: np.ndarray, payloads: dict[int, Any]) -> None:
        """Buffer ``rows`` (sorted by insertion number) with their ``payloads`` (by insertion number; lazy where
        missing), ``bestfit_split`` pieces longer than a row re-cut (:func:`recut`)."""
        arranged, self.next_seq = recut(rows, payloads, self.capacity, self.split, self._materialize, self.next_seq)
        self._buffer.extend(*arranged)

    def _materialize(self, row: Any, keep: int | None = None) -> np.ndarray:
        """A lazily restored piece's tokens (``row``: its ``META_COLUMNS`` values), fetched and verified: its first
        ``keep`` (default: what a row takes)."""
        row = np.asarray(row, np.int64)
        _seq, length, key0, key1, offset, _final, checksum, hashed = row.tolist()
        keep = min(length, self.capacity) if keep is None else keep
        need = max(keep, hashed) if hashed else length
        tokens = np.asarray(self._fetch(row, need), np.int32)
        if (len(tokens) < hashed or prefix_hash(tokens[:hashed]) != checksum) if hashed else len(tokens) != length:
            raise ValueError(
                f"buffered piece at token {offset} of document {(key0, key1)} does not match its saved length "
                f"{length}" + (" / checksum" if hashed else "") + f" (got {len(tokens)} tokens; did the data files "
                "or the tokenizer change since the checkpoint?)"
            )
        return tokens[:keep]

    def snapshot(self) -> np.ndarray:
        """The buffered pieces as int64 rows of ``META_COLUMNS``, in insertion order."""
        return self._buffer.snapshot()

    @property
    def buffered_tokens(self) -> int:
        """Tokens in the buffered pieces (costs a :meth:`snapshot`)."""
        rows = self.snapshot()
        return int(np.minimum(rows[:, 1], self.capacity).sum())


class BestFitSplitPacker(BestFitPacker):
    """``bestfit_split``: documents longer than a row split into row-sized chunks; a gap no piece fits is padding.

    Args:
        capacity: tokens per row (``seq_len + 1``).
        pad_id: the token id written at padding positions.
        buffer_size, growth, counters, cp_multiple: as :class:`BestFitPacker`'s (a split piece never exceeds a row,
            so nothing is held beyond it).
    """

    split = True

    def __init__(
        self,
        capacity: int,
        pad_id: int,
        buffer_size: int = 1000,
        growth: BufferGrowth = FULL_BUFFER,
        counters: StreamCounters | None = None,
        cp_multiple: int = 1,
    ) -> None:
        super().__init__(capacity, buffer_size, growth, counters, cp_multiple, pad_id)

    def add(self, tokens: np.ndarray, key: tuple[int, int]) -> None:  # type: ignore[override]
        """Buffer one whole document (1-D ids, BOS first): one piece, or all its chunks when longer than a row."""
        tokens = np.ascontiguousarray(tokens, np.int32)  # its chunks are then contiguous: hashed as they are
        length = len(tokens)
        if tokens.ndim != 1 or length == 0:
            raise ValueError(f"a document must be a non-empty 1-D token array, got shape {tokens.shape}")
        capacity, seq, push = self.capacity, self.next_seq, self._buffer.push
        key0, key1 = key
        if length <= capacity:
            push(length, (seq, length, key0, key1, 0, 1, 0, 0), (tokens, False))
            self.next_seq = seq + 1
        else:
            last = (length - 1) // capacity
            for chunk, at in enumerate(range(0, length, capacity)):
                piece = tokens[at : at + capacity]
                size = capacity if chunk < last else length - at
                push(size, (seq + chunk, size, key0, key1, at, int(chunk == last), prefix_hash(piece), size),
                     (piece, chunk > 0))  # fmt: skip
            self.next_seq = seq + last + 1
            self.counters.split_docs += 1
            self.counters.chunks += last + 1
        self.added += 1
        self.counters.docs += 1

    def _gap(self, parts: list[np.ndarray], row: int, pos: int, marks: Any) -> int:
        """Pad the rest of the row (a run that starts positions and trains nothing); returns the padding written."""
        parts.append(self._padding[: self.capacity - pos])
        marks[0].append(row * self.capacity + pos)
        marks[2].append(row * self.capacity + pos)
        return self.capacity - pos


def _rows_until_full(growth: BufferGrowth, buffer_size: int) -> int:
    """The rows taken from which ``growth`` gives the full ``buffer_size``."""
    if not growth.per_row:
        return 0
    return max(0, -(-(buffer_size - growth.start) // growth.per_row))


_LAZY = ((None, False), (None, True))  # the payload of a piece restored lazily: (no tokens yet, continuation?)


def recut(
    rows: np.ndarray, payloads: dict[int, Any], capacity: int, split: bool, materialize: Callable, next_seq: int
) -> tuple[tuple[np.ndarray, list[Any]], int]:
    """``(rows, payloads)`` of every piece to buffer for rows of ``capacity`` tokens (a payload from ``payloads`` by
    insertion number, else lazy), and the next insertion number: a ``bestfit_split`` piece longer than a row is
    replaced by its row-sized pieces (its tokens from ``payloads`` or ``materialize(row, length)``), numbered after
    every other piece, so insertion order and numbers agree."""
    rows = np.asarray(rows, np.int64).reshape(-1, len(META_COLUMNS))
    long = rows[:, 1] > capacity if split else np.zeros(len(rows), bool)
    kept = rows[~long] if long.any() else rows
    kept_payloads = [payloads.get(seq) or _LAZY[offset > 0] for seq, offset in kept[:, [0, 4]].tolist()]
    pieces: list[list[int]] = []
    for row in rows[long].tolist():
        payload = payloads.get(row[0], _LAZY[row[4] > 0])
        tokens = payload[0] if payload[0] is not None else materialize(row, row[1])
        count = -(-row[1] // capacity)
        for j in range(count):
            piece, offset = tokens[j * capacity : (j + 1) * capacity], row[4] + j * capacity
            final = int(bool(row[5]) and j == count - 1)
            pieces.append([next_seq, len(piece), row[2], row[3], offset, final, prefix_hash(piece), len(piece)])
            kept_payloads.append((piece, offset > 0))
            next_seq += 1
    if pieces:
        kept = np.concatenate([kept, np.asarray(pieces, np.int64)])
    return (kept, kept_payloads), next_seq


def recorded_pieces(record: list[tuple[int, ...]] | None) -> np.ndarray | None:
    """The pieces a packer noted since the last block, as ``PIECE_COLUMNS`` rows (source 0); the note is emptied."""
    if record is None:
        return None
    table = np.zeros((len(record), 7), np.int64)
    if record:
        table[:, :6] = record
    record.clear()
    return table


def _flags(
    shape: tuple[int, int], starts: list[int], blocked: list[int], padded: list[int], cp_padded: list
) -> np.ndarray:
    """The rows' flag bits from flat offsets of starts, no-target first tokens, padding runs and CP padding spans."""
    rows, capacity = shape
    flags = np.zeros(rows * capacity, np.uint8)
    flags[starts] = START
    flags[blocked] |= NO_TARGET
    for at in padded:
        flags[at : at - at % capacity + capacity] |= NO_TARGET
    for start, stop in cp_padded:
        flags[start:stop] |= CP_PAD | NO_TARGET
    return flags.reshape(shape)


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
    """The chunk whose documents are being added, and its next document (columns as lists, converted once)."""

    laid: Any = None
    next_doc: int = 0
    payload: Any = None
    lengths: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    group: int = 0
    starts: list[int] = field(default_factory=list)
    empty_before: list[int] = field(default_factory=list)
    units_before: list[int] = field(default_factory=list)
    long_before: dict[int, int] = field(default_factory=dict)
    excluded_before: dict[int, int] = field(default_factory=dict)

    def load(self, laid: Any) -> None:
        chunk, self.laid = laid.chunk, laid
        self.next_doc, self.payload, self.group = 0, laid.payload, chunk.group
        self.lengths, self.rows, self.starts = laid.lengths.tolist(), chunk.rows.tolist(), laid.starts.tolist()
        self.empty_before, self.units_before = chunk.empty_before.tolist(), chunk.units_before.tolist()
        self.long_before, self.excluded_before = chunk.long_before, chunk.excluded_before


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
            added = packer.added
            tokens, flags = packer.take(rows_per_block, refill)
            read = state.read
            if packer.added != added:  # only the last document added names the position
                read = self.after(cursor.laid.chunk, cursor.next_doc - 1)
            rows = packer._buffer.rows(rows)  # the rows built only if something reads them
            state = BestFitState(start.kind, read, rows, packer.next_seq, start.growth)
            yield RowBlock(tokens, flags, pieces=recorded_pieces(packer.record)), state

    def _refiller(self, chunks: Iterator[Any], cursor: _Cursor, packer: BestFitPacker) -> Callable[[], None]:
        """``refill()``: add the next document (one per call, so the buffer never depends on chunk sizes)."""
        counters = self.counters
        split = packer.split
        add = packer.add

        def refill() -> None:
            doc = cursor.next_doc
            while cursor.laid is None or doc >= len(cursor.lengths):
                cursor.load(next(chunks))
                doc = 0
            length = cursor.lengths[doc]
            if split:
                start = cursor.starts[doc]
                add(cursor.payload[start : start + length], (cursor.group, cursor.rows[doc]))
            else:
                add(cursor.payload[doc], length, (cursor.group, cursor.rows[doc]))
            counters.tokens += length
            counters.empty += cursor.empty_before[doc]
            counters.text_free_units += cursor.units_before[doc]
            if cursor.long_before:
                counters.too_long += cursor.long_before.get(doc, 0)
            if cursor.excluded_before:
                counters.excluded += cursor.excluded_before.get(doc, 0)
            cursor.next_doc = doc + 1

        return refill


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
