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

from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing import bestfit_loop as loop
from lightning_d9d.streaming.packing.bestfit_restore import BufferedTexts, UnitTokens, buffer_fetch
from lightning_d9d.streaming.packing.buffer_rows import BufferRows
from lightning_d9d.streaming.packing.rows import (
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
            raise ValueError(f"rows of {capacity} tokens need documents' prefixes of as many, this packer keeps "
                             f"{self.hold}")  # fmt: skip
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
