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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_d9d.streaming.packing import bestfit_loop as loop
from lightning_d9d.streaming.packing.buffer_rows import BufferRows
from lightning_d9d.streaming.packing.rows import (
    StreamCounters,
    prefix_hash,
)
from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth

if TYPE_CHECKING:
    pass

Fetch = Callable[[np.ndarray, int], np.ndarray]
"""``fetch(row, need)``: a buffered piece's tokens from its ``offset`` on, at least ``need`` where there are as many."""

META_COLUMNS = ("seq", "length", "key0", "key1", "offset", "final", "hash", "hashed")
"""The integers that describe a buffered piece, none of them tied to a row length: its insertion number, its length
(``bestfit``: its document's), its document's row group and row (``key0``/``key1``), where it starts in its
BOS-prefixed document, whether it runs to the document's end, and the CRC-32 of its first ``hashed`` tokens
(``hashed`` 0: a whole document, verified by its length)."""


_LOGGED = 1 << 16  # changes logged at most between two rows() (more: the next rows() is a snapshot)


class _PieceBuffer:
    """The buffered pieces in the compiled loop's tables (:mod:`bestfit_loop`): slots in per-length FIFO lists, their
    tokens in one arena; the rows pushed and insertion numbers popped since the last :meth:`rows` logged beside them.
    """

    def __init__(self, capacity: int, settings: dict[int, int]) -> None:
        self.sc = np.zeros(loop.SCALARS, np.int64)
        for index, value in settings.items():
            self.sc[index] = value
        self.sc[loop.CAP] = capacity
        self.slots = np.zeros((0, loop.SLOT_COLUMNS), np.int64)
        self.free = np.zeros(0, np.int64)
        self.heads = np.full(capacity + 2, -1, np.int64)
        self.tails = np.full(capacity + 2, -1, np.int64)
        self.pushed = np.zeros((64, len(META_COLUMNS)), np.int64)
        self.popped = np.zeros(64, np.int64)
        self.record = np.zeros((64, 6), np.int64)
        self.arena = np.zeros(1 << 12, np.int32)
        self._grow_slots(64)
        self.rebuilt = False  # pieces re-arranged since the last rows(): their changes are not logged

    @property
    def count(self) -> int:
        return int(self.sc[loop.COUNT])

    def _grow_slots(self, need: int) -> None:
        have = len(self.slots)
        size = max(2 * have, have + need, 64)
        slots = np.zeros((size, loop.SLOT_COLUMNS), np.int64)
        slots[:have] = self.slots
        slots[have:, loop.TOKENS_AT] = loop.FREE
        top = int(self.sc[loop.FREE_TOP])
        free = np.zeros(size, np.int64)
        free[:top] = self.free[:top]
        free[top : top + size - have] = np.arange(size - 1, have - 1, -1)  # the lowest free slot is taken first
        self.slots, self.free = slots, free
        self.sc[loop.FREE_TOP] = top + size - have

    def grow(self) -> None:
        """Room for what the loop asked (``NEED_*``) and at least one more pick, in every table."""
        sc = self.sc
        need_arena, need_slots = int(sc[loop.NEED_ARENA]), int(sc[loop.NEED_SLOTS])
        if sc[loop.FREE_TOP] < need_slots:
            self._grow_slots(need_slots)
        for name, used, extra in (("pushed", loop.PUSHED, need_slots), ("popped", loop.POPPED, 1),
                                  ("record", loop.RECORDED, 1)):  # fmt: skip
            table = getattr(self, name)
            if sc[used] + extra > len(table):
                bigger = np.zeros((max(2 * len(table), int(sc[used]) + extra), *table.shape[1:]), np.int64)
                bigger[: len(table)] = table
                setattr(self, name, bigger)
        self.room(need_arena)
        sc[loop.NEED_ARENA] = sc[loop.NEED_SLOTS] = 0
        if sc[loop.PUSHED] > _LOGGED or sc[loop.POPPED] > _LOGGED:  # nobody reads the changes: a snapshot follows
            sc[loop.PUSHED] = sc[loop.POPPED] = 0
            self.rebuilt = True

    def room(self, tokens: int) -> None:
        """At least ``tokens`` free at the arena's end: the held tokens compacted (into a larger arena if needed)."""
        if self.sc[loop.ARENA_END] + tokens <= len(self.arena):
            return
        held = int(self.slots[self.slots[:, loop.TOKENS_AT] >= 0, loop.TOKENS_HELD].sum())
        size = len(self.arena)
        while size < 2 * (held + tokens):
            size *= 2
        fresh = np.empty(size, np.int32)
        self.sc[loop.ARENA_END] = loop.compact(self.slots, self.arena, fresh)
        self.arena = fresh

    def place(self, slot: int, tokens: np.ndarray) -> None:
        """Hold a lazily restored piece's fetched tokens."""
        self.room(len(tokens))
        end = int(self.sc[loop.ARENA_END])
        self.arena[end : end + len(tokens)] = tokens
        self.slots[slot, loop.TOKENS_AT], self.slots[slot, loop.TOKENS_HELD] = end, len(tokens)
        self.sc[loop.ARENA_END] = end + len(tokens)

    def add_all(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, keys0: np.ndarray,
                keys1: np.ndarray) -> None:  # fmt: skip
        """Buffer every document given now (the fed source, if any, is kept where it was)."""
        sc = self.sc
        kept = int(sc[loop.SOURCE_NEXT]), int(sc[loop.SOURCE_STOP])
        sc[loop.SOURCE_NEXT], sc[loop.SOURCE_STOP] = 0, len(lengths)
        while loop.add_documents(sc, self.slots, self.free, self.heads, self.tails, self.pushed, self.arena, tokens,
                                 starts, lengths, keys0, keys1) != loop.DONE:  # fmt: skip
            self.grow()
        sc[loop.SOURCE_NEXT], sc[loop.SOURCE_STOP] = kept

    def extend(self, rows: np.ndarray, payloads: list[Any]) -> None:
        """Buffer many pieces (rows in insertion order, numbered above every piece here) with their payloads
        (``(tokens or None: restored lazily, continuation?)``); the next :meth:`rows` is a snapshot."""
        n = len(rows)
        if not n:
            return
        self.rebuilt = True
        held = np.array([0 if tokens is None else len(tokens) for tokens, _ in payloads], np.int64)
        self.sc[loop.NEED_SLOTS] = n
        self.grow()
        self.room(int(held.sum()))
        end = int(self.sc[loop.ARENA_END])
        at = np.where(held > 0, end + np.cumsum(held) - held, loop.LAZY_TOKENS)
        lazy = np.array([tokens is None for tokens, _ in payloads], bool)
        at[lazy] = loop.LAZY_TOKENS
        if (~lazy).any():
            self.arena[end : end + int(held.sum())] = np.concatenate(
                [tokens for tokens, _ in payloads if tokens is not None], dtype=np.int32, casting="unsafe"
            )
        self.sc[loop.ARENA_END] = end + int(held.sum())
        continues = np.array([int(bool(c)) for _, c in payloads], np.int64)
        loop.push_rows(self.sc, self.slots, self.free, self.heads, self.tails, self.pushed,
                       np.ascontiguousarray(rows, np.int64), at, held, continues)  # fmt: skip

    def live(self) -> np.ndarray:
        """The slots of the buffered pieces, by insertion number."""
        slots = np.flatnonzero(self.slots[:, loop.TOKENS_AT] != loop.FREE)
        return slots[np.argsort(self.slots[slots, 0], kind="stable")]

    def payloads(self) -> dict[int, Any]:
        """Every buffered piece's ``(tokens or None, continuation?)`` by insertion number (a copy of its tokens)."""
        out = {}
        for s in self.live().tolist():
            seq, at, held, continues = self.slots[s, [0, loop.TOKENS_AT, loop.TOKENS_HELD, loop.CONTINUES]].tolist()
            out[seq] = (None if at < 0 else self.arena[at : at + held].copy(), bool(continues))
        return out

    def rows(self, before: BufferRows | None) -> BufferRows:
        """The buffered pieces' rows: ``before`` (the rows at the last call) and the changes since, or (``before``
        ``None``, or after :meth:`extend`) a snapshot; the changes count from here."""
        sc = self.sc
        pushed, popped = self.pushed[: sc[loop.PUSHED]].copy(), self.popped[: sc[loop.POPPED]].copy()
        sc[loop.PUSHED] = sc[loop.POPPED] = 0
        if before is None or self.rebuilt:
            self.rebuilt = False
            return BufferRows(self.snapshot())
        return before.after(pushed, popped)

    def snapshot(self) -> np.ndarray:
        """The rows of the buffered pieces, sorted by insertion number."""
        return self.slots[self.live(), :8].copy()


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
        _check_sizes(buffer_size, cp_multiple)
        self.buffer_size, self.growth, self.cp_multiple, self.pad_id = buffer_size, growth, cp_multiple, pad_id
        self._set_capacity(capacity)
        self.hold = capacity if hold is None else hold
        if self.hold < capacity:
            raise ValueError(f"hold={self.hold} must be at least the row capacity {capacity}")
        self.flagged = self.split or cp_multiple > 1  # rows carry START / NO_TARGET (/ CP_PAD) flags
        self.counters = counters if counters is not None else StreamCounters()
        self._full_from = _rows_until_full(growth, buffer_size)
        self._buffer = self._new_buffer(capacity, 0, 0)
        self._staged: list[tuple[np.ndarray, int, int, int]] = []  # documents add()ed, not yet in the buffer
        self._source: tuple[np.ndarray, ...] = _NO_SOURCE  # documents fed, buffered one per top-up
        self._fetch: Fetch | None = None
        # Tables of (row, column, length, row group, row, offset) of every piece placed, where provenance is asked for
        self.record: list[np.ndarray] | None = None

    def _new_buffer(self, capacity: int, next_seq: int, rows_taken: int) -> _PieceBuffer:
        growth = self.growth
        return _PieceBuffer(capacity, {
            loop.BUF: self.buffer_size, loop.FULL_FROM: self._full_from, loop.GROW_START: growth.start,
            loop.GROW_PER_ROW: growth.per_row, loop.MULTIPLE: self.cp_multiple, loop.PAD_ID: self.pad_id,
            loop.SPLIT: int(self.split), loop.FLAGGED: int(self.flagged), loop.HOLD: self.hold,
            loop.NEXT_SEQ: next_seq, loop.ROWS_TAKEN: rows_taken,
        })  # fmt: skip

    def _set_capacity(self, capacity: int) -> None:
        if capacity <= 1:
            raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
        if (capacity - 1) % self.cp_multiple:
            raise ValueError(f"cp_multiple={self.cp_multiple} must divide seq_len={capacity - 1}")
        self.capacity = capacity

    # The loop's scalars that callers read and set (a resumed stage sets the rows taken).
    next_seq = property(lambda self: int(self._buffer.sc[loop.NEXT_SEQ]),
                        lambda self, value: self._buffer.sc.__setitem__(loop.NEXT_SEQ, value))  # fmt: skip
    rows_taken = property(lambda self: int(self._buffer.sc[loop.ROWS_TAKEN]),
                          lambda self, value: self._buffer.sc.__setitem__(loop.ROWS_TAKEN, value))  # fmt: skip

    @property
    def added(self) -> int:
        """Documents added (staged, fed and buffered, or buffered)."""
        return int(self._buffer.sc[loop.ADDED]) + len(self._staged)

    def __len__(self) -> int:
        self._flush()
        return self._buffer.count

    def add(self, tokens: np.ndarray, length: int, key: tuple[int, int]) -> None:
        """Buffer one document's first ``min(length, hold)`` tokens (BOS first), ordered by ``length``."""
        keep = length if length < self.hold else self.hold
        if len(tokens) < keep:
            raise ValueError(f"document prefix has {len(tokens)} tokens, expected {keep}")
        self._staged.append((tokens[:keep], length, key[0], key[1]))

    def feed(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, key0: int, keys1: np.ndarray) -> None:
        """Documents to buffer one per top-up, as many ``refill()`` calls would: document ``i`` is
        ``tokens[starts[i]:]`` (BOS first; ``bestfit``: its first ``min(lengths[i], hold)`` tokens, at least, are
        there), ``lengths[i]`` long, keyed ``(key0, keys1[i])``. Replaces what is left of an earlier feed
        (:attr:`fed` says how much of it was buffered).

        Raises:
            ValueError: a document of no tokens, or one whose tokens ``tokens`` does not hold.
        """
        lengths = np.asarray(lengths, np.int64)
        starts = np.asarray(starts, np.int64)
        tokens = np.ascontiguousarray(tokens, np.int32)
        if len(lengths):
            if lengths.min() <= 0:
                raise ValueError(f"a document must have tokens, got lengths {lengths[lengths <= 0][:5].tolist()}")
            held = np.minimum(lengths, self.hold) if not self.split else lengths
            short = starts + held > len(tokens)
            if short.any() or starts.min() < 0:
                at = int(np.flatnonzero(short | (starts < 0))[0])
                raise ValueError(f"document {at} needs tokens [{starts[at]}, {starts[at] + held[at]}) of the "
                                 f"{len(tokens)} fed")  # fmt: skip
        self._source = (tokens, starts, lengths, np.full(len(lengths), key0, np.int64), np.asarray(keys1, np.int64))
        self._buffer.sc[loop.SOURCE_NEXT], self._buffer.sc[loop.SOURCE_STOP] = 0, len(lengths)

    @property
    def fed(self) -> int:
        """Documents of the last :meth:`feed` buffered so far."""
        return int(self._buffer.sc[loop.SOURCE_NEXT])

    def _flush(self) -> None:
        """Buffer the documents add()ed since the last flush (before anything reads the buffer)."""
        staged = self._staged
        if not staged:
            return
        self._staged = []
        lengths = np.array([length for _, length, _, _ in staged], np.int64)
        sizes = np.array([len(tokens) for tokens, _, _, _ in staged], np.int64)
        tokens = np.concatenate([tokens for tokens, _, _, _ in staged], dtype=np.int32, casting="unsafe")
        starts = np.cumsum(sizes) - sizes
        keys0 = np.array([k for _, _, k, _ in staged], np.int64)
        keys1 = np.array([k for _, _, _, k in staged], np.int64)
        self._buffer.add_all(tokens, starts, lengths, keys0, keys1)
        self._sync()

    def _sync(self) -> None:
        """Move the loop's counts into the stream's counters."""
        sc, counters = self._buffer.sc, self.counters
        docs, split_docs, chunks, _, _, crops, cropped = sc[loop.DOCS : loop.CROPPED + 1].tolist()
        sc[loop.DOCS : loop.CHUNKS + 1] = 0  # (the paddings are the take's: it reads and resets them)
        sc[loop.CROPS : loop.CROPPED + 1] = 0
        counters.docs += docs
        counters.split_docs += split_docs
        counters.chunks += chunks
        counters.crops += crops
        counters.cropped += cropped

    def take(self, num_rows: int, refill: Callable[[], None]) -> tuple[np.ndarray, np.ndarray | None]:
        """Pack ``num_rows`` rows; whenever the buffer needs a document and none is fed, ``refill()`` must add (or
        feed) at least one.

        Returns:
            ``(tokens, flags)``: ``(num_rows, capacity)`` int32 ids and uint8 flag bits (``None`` when not flagged).

        Raises:
            RuntimeError: a ``refill()`` call added no document.
            ValueError: a restored piece no longer matches its saved length or checksum.
        """
        self._flush()
        buffer, capacity = self._buffer, self.capacity
        sc = buffer.sc
        out = np.empty(num_rows * capacity, np.int32)
        flags = np.zeros(num_rows * capacity, np.uint8) if self.flagged else _NO_FLAGS
        sc[loop.ROW], sc[loop.ROWS], sc[loop.IN_ROW] = 0, num_rows, 0
        sc[loop.RECORD], sc[loop.RECORDED] = int(self.record is not None), 0
        sc[loop.GAP_PADDING : loop.CP_PADDING + 1] = 0
        while True:
            source = self._source
            code = loop.pack(sc, buffer.slots, buffer.free, buffer.heads, buffer.tails, buffer.pushed, buffer.popped,
                             buffer.record, buffer.arena, *source, out, flags)  # fmt: skip
            if code == loop.DONE:
                break
            if code == loop.REFILL:
                added, fed = self.added, self._source
                refill()
                if self.added == added and (self._source is fed or not len(self._source[2])):
                    raise RuntimeError("refill() added no document")
                self._flush()
            elif code == loop.FETCH:
                slot = int(sc[loop.LAZY])
                buffer.place(slot, self._materialize(buffer.slots[slot, :8]))
            else:
                buffer.grow()
        padding, cp_padding = sc[loop.GAP_PADDING : loop.CP_PADDING + 1].tolist()
        self._sync()
        self.counters.emitted += num_rows * capacity - padding - cp_padding
        self.counters.padding += padding + cp_padding
        self.counters.cp_padding += cp_padding
        if self.record is not None:
            self.record.append(buffer.record[: sc[loop.RECORDED]].copy())
        return out.reshape(num_rows, capacity), (flags.reshape(num_rows, capacity) if self.flagged else None)

    def reset(self, buffer: np.ndarray, next_seq: int, fetch: Fetch | None) -> None:
        """Continue from a saved buffer, lazily: a piece's tokens are fetched (``fetch(row, need) -> tokens`` from its
        ``offset``, at least ``need`` of them where the document has as many) and verified when first picked, so a
        resume tokenizes a few documents, not the buffer. Pieces longer than this packer's rows
        (``bestfit_split``, saved under a shorter ``seq_len``... or a longer one) are split now, as :meth:`reshape`.

        Raises:
            RuntimeError: the packer is not empty.
            ValueError: a malformed buffer, or pieces but no ``fetch``.
        """
        if len(self):
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
            raise ValueError(
                f"rows of {capacity} tokens need documents' prefixes of as many, this packer keeps {self.hold}"
            )
        self._set_capacity(capacity)  # (checked before anything changes)
        self._flush()
        old = self._buffer
        payloads, rows = old.payloads(), old.snapshot()
        self._buffer = self._new_buffer(capacity, self.next_seq, self.rows_taken)
        self._buffer.sc[loop.SOURCE_NEXT], self._buffer.sc[loop.SOURCE_STOP] = old.sc[[loop.SOURCE_NEXT,
                                                                                       loop.SOURCE_STOP]]  # fmt: skip
        self._buffer.sc[loop.ADDED] = old.sc[loop.ADDED]
        self._arrange(rows, payloads)

    def _arrange(self, rows: np.ndarray, payloads: dict[int, Any]) -> None:
        """Buffer ``rows`` (by insertion number) with ``payloads`` (lazy where missing), re-cut (:func:`recut`)."""
        arranged, self.next_seq = recut(rows, payloads, self.capacity, self.split, self._materialize, self.next_seq)
        self._buffer.extend(*arranged)

    def _materialize(self, row: Any, keep: int | None = None) -> np.ndarray:
        return verified_piece(self._fetch, self.capacity, row, keep)

    def snapshot(self) -> np.ndarray:
        """The buffered pieces as int64 rows of ``META_COLUMNS``, in insertion order."""
        self._flush()
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
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError(f"a document must be a non-empty 1-D token array, got shape {tokens.shape}")
        self._staged.append((tokens, len(tokens), key[0], key[1]))


def _check_sizes(buffer_size: int, cp_multiple: int) -> None:
    if buffer_size <= 0:
        raise ValueError(f"best-fit buffer_size must be > 0, got {buffer_size}")
    if cp_multiple < 1:
        raise ValueError(f"cp_multiple={cp_multiple} must be >= 1")


def _rows_until_full(growth: BufferGrowth, buffer_size: int) -> int:
    """The rows taken from which ``growth`` gives the full ``buffer_size``."""
    if not growth.per_row:
        return 0
    return max(0, -(-(buffer_size - growth.start) // growth.per_row))


_NO_FLAGS = np.zeros(1, np.uint8)  # what the loop is given where rows carry no flags (it writes none)
_NO_SOURCE = (np.zeros(0, np.int32), *(np.zeros(0, np.int64) for _ in range(4)))  # nothing fed
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


def recorded_pieces(record: list[np.ndarray] | None) -> np.ndarray | None:
    """The pieces a packer noted since the last block, as ``PIECE_COLUMNS`` rows (source 0); the note is emptied."""
    if record is None:
        return None
    noted = [table for table in record if len(table)]
    table = np.zeros((sum(map(len, noted)), 7), np.int64)
    if noted:
        table[:, :6] = np.concatenate(noted)
    record.clear()
    return table


def verified_piece(fetch: Fetch, capacity: int, row: Any, keep: int | None = None) -> np.ndarray:
    """A lazily restored piece's tokens (``row``: its ``META_COLUMNS`` values), fetched and verified: its first
    ``keep`` (default: what a row of ``capacity`` takes).

    Raises:
        ValueError: the tokens fetched no longer match the piece's saved length or checksum.
    """
    row = np.asarray(row, np.int64)
    _seq, length, key0, key1, offset, _final, checksum, hashed = row.tolist()
    keep = min(length, capacity) if keep is None else keep
    need = max(keep, hashed) if hashed else length
    tokens = np.asarray(fetch(row, need), np.int32)
    if (len(tokens) < hashed or prefix_hash(tokens[:hashed]) != checksum) if hashed else len(tokens) != length:
        raise ValueError(
            f"buffered piece at token {offset} of document {(key0, key1)} does not match its saved length "
            f"{length}" + (" / checksum" if hashed else "") + f" (got {len(tokens)} tokens; did the data files "
            "or the tokenizer change since the checkpoint?)"
        )
    return tokens[:keep]
