"""Token packing: turn tokenized documents into rows of ``seq_len + 1`` tokens, and position ids for them.

Three packers, all fed documents that already start with BOS:

* ``ConcatPacker`` (nanochat's original loader): documents are concatenated into one stream, which is cut
  into rows. Nothing is wasted; rows usually start mid-document. The stream is a numpy array, and a row is a
  slice of it, so packing costs one copy per token.
* ``BestFitPacker`` (nanochat's best-fit loader): every row starts at a document's BOS. Each row is filled
  with the *largest* buffered document that still fits; when none fits, the *shortest* buffered document is
  cropped to fill the row exactly and its remainder is dropped (no padding, ever). Ties go to the document
  that entered the buffer first, which is exactly the choice of nanochat's linear scan.
* ``BestFitSplitPacker`` (best-fit without cropping, as in "Fewer Truncations Improve Language Modeling"): a
  document longer than a row is split into consecutive row-sized chunks (the last may be shorter), and every
  document or chunk is a *piece*. Each row is filled with the largest buffered piece that still fits (ties:
  the oldest); when none fits, the rest of the row is padding. Nothing is cropped or dropped, and a document
  that fits in a row is never cut. Besides the tokens it emits per-token flags: where a piece (or a padding
  run) starts, so that positions restart there, and which tokens must not be targets: padding, and the first
  token of a continuation chunk (its predecessor in the row is another document). A token after a non-final
  chunk would be no target either (the document goes on elsewhere, so "the document ends here" would be
  false), but a non-final chunk is a whole row, so nothing in its row follows it. A BOS after a whole
  document or a final chunk stays a target, as in the other packings ("the document ends here").
  ``split_microbatch_tensors`` turns tokens and flags into ``inputs``/``targets``/``position_ids``.

Both best-fit packers keep their buffer as a sorted list of the distinct lengths present plus a FIFO per
length, so a pick is one ``bisect`` (O(log buffer)) and a refill is an ``insort``, instead of nanochat's
scan (O(buffer) Python steps per pick). Each buffered item's state is one row of integers in a slot table,
so a snapshot is a few whole-table numpy operations whatever the buffer holds.

Trade-off: best-fit trades tokens for alignment: its *yield* (tokens emitted / tokens tokenized) is below 1,
and far below on long-document corpora, because every cropped remainder is thrown away. Only a row-sized
prefix of each buffered document is kept (the rest can never be emitted), which bounds memory by
``buffer_size * (seq_len + 1)`` tokens. Best-fit-split keeps every token and pays in padding instead, which
is small when the buffer holds many short pieces to fill gaps with (long documents yield short final chunks
too); its rows start at a BOS less often (a row-sized chunk of a long document fills a row on its own), and
a long document's chunks lose the attention to their predecessors. Its buffer counts pieces, so a long
document briefly pushes it past ``buffer_size`` (all of a document's chunks enter at once, as views of its
token array): memory is about ``(buffer_size + the longest document's chunks) * (seq_len + 1)`` tokens.

State: the packers describe their content by *positions* (opaque integer keys given by the caller) rather
than tokens, so the caller can save a few integers and rebuild the content from the source on resume.
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_d9d.text.collate import IGNORE_INDEX  # the target of a token with nothing to predict

START = 1  # flag bit: this token starts a piece (or a padding run); positions restart here
NO_TARGET = 2  # flag bit: this token must not be the training target of the token before it


def position_ids(inputs: np.ndarray, bos_id: int) -> np.ndarray:
    """Positions that count from 0 at the start of every row and restart at every BOS token.

    Args:
        inputs: ``(rows, seq_len)`` token ids.
        bos_id: the BOS token id that marks a document start.

    Returns:
        ``(rows, seq_len)`` int64 positions, suitable for block-causal / varlen attention (a row that starts
        mid-document counts that fragment from 0).
    """
    return _restart_positions(inputs == bos_id)


def _restart_positions(starts: np.ndarray) -> np.ndarray:
    """Each token's distance from the last start at or before it in its row (column 0 is always a start).

    ``starts`` (a boolean ``(rows, width)`` array the caller no longer needs) gets its column 0 set.
    """
    rows, width = starts.shape
    size = rows * width
    flat = starts.reshape(-1)
    flat[::width] = True
    start_at = np.flatnonzero(flat)
    # One repeat of each start over the run it opens, no scan.
    last_start = np.repeat(start_at, np.diff(start_at, append=size))
    return (np.arange(size, dtype=np.int64) - last_start).reshape(rows, width)


def microbatch_tensors(rows: np.ndarray, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, position_ids)`` int64 tensors of a microbatch of packed rows.

    Args:
        rows: ``(microbatch_size, seq_len + 1)`` token ids.
        bos_id: the BOS token id (position ids restart there).

    Returns:
        ``inputs = rows[:, :-1]``, ``targets = rows[:, 1:]`` (the next token) and ``position_ids(inputs)``,
        each ``(microbatch_size, seq_len)`` and contiguous.
    """
    inputs = torch.from_numpy(rows[:, :-1].astype(np.int64))  # one contiguous copy each
    targets = torch.from_numpy(rows[:, 1:].astype(np.int64))
    return inputs, targets, torch.from_numpy(position_ids(rows[:, :-1], bos_id))


def split_microbatch_tensors(tokens: np.ndarray, flags: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, position_ids)`` int64 tensors of a microbatch from :class:`BestFitSplitPacker`.

    Args:
        tokens: ``(microbatch_size, seq_len + 1)`` token ids.
        flags: the same shape, ``START`` / ``NO_TARGET`` bits per token (uint8).

    Returns:
        ``inputs = tokens[:, :-1]``; ``targets = tokens[:, 1:]`` with ``IGNORE_INDEX`` (-100) wherever the target
        token has ``NO_TARGET``; positions that count from 0 at column 0 and at every ``START`` (a padding run
        counts from 0 too). Each ``(microbatch_size, seq_len)`` and contiguous.

    Raises:
        ValueError: ``tokens`` and ``flags`` differ in shape, or are not 2-D with at least 2 columns.
    """
    if tokens.shape != flags.shape or tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"tokens {tokens.shape} and flags {flags.shape} must be the same (rows, seq_len + 1) shape, seq_len >= 1"
        )
    inputs = tokens[:, :-1].astype(np.int64)
    targets = tokens[:, 1:].astype(np.int64)
    targets[(flags[:, 1:] & NO_TARGET) != 0] = IGNORE_INDEX
    positions = _restart_positions((flags[:, :-1] & START) != 0)
    return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions)


def prefix_hash(tokens: np.ndarray) -> int:
    """A 32-bit checksum of a token prefix, used to verify a prefix rebuilt on resume."""
    return zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int32))  # crc32 reads the buffer itself, no copy


@dataclass(frozen=True)
class PackerCounters:
    """What a packer has done so far, the same fields for every packer (save them with the state, set them back
    on resume through ``packer.counters``); a field a packing does not use stays 0.

    Attributes:
        docs: documents added (best-fit-split).
        split_docs: documents longer than a row, split into chunks (best-fit-split).
        chunks: pieces that came from split documents (best-fit-split).
        tokens_emitted: non-padding tokens in the rows taken.
        padding: padding tokens in the rows taken (best-fit-split).
        crops: documents cropped (best-fit).
        tokens_cropped: tokens dropped with cropped documents' remainders (best-fit).
    """

    docs: int = 0
    split_docs: int = 0
    chunks: int = 0
    tokens_emitted: int = 0
    padding: int = 0
    crops: int = 0
    tokens_cropped: int = 0


SplitPackerCounters = PackerCounters  # the name of the best-fit-split packer's counters before all shared one


@dataclass(frozen=True)
class BufferState:
    """A best-fit packer's state: its buffered items' rows (``META_COLUMNS``, in insertion order), the next
    insertion number and the counters. The items' tokens are not in it: a packer reset from it fetches them."""

    rows: np.ndarray
    next_seq: int = 0
    counters: PackerCounters = PackerCounters()


@dataclass(frozen=True)
class BufferGrowth:
    """How a best-fit buffer grows to its size as a stream starts: before each row it is topped up to
    ``min(buffer_size, start + rows_taken * per_row)`` items, so a fresh stream's first rows wait for ``start``
    documents instead of a whole buffer. The size depends only on the rows the stream has packed, never on time
    or on the process that hosts it, so rows stay a function of the data and settings.

    Attributes:
        start: the buffer's size for the first row.
        per_row: items the size grows by per row packed (0: no growth; the full size from the first row).
    """

    start: int = 8
    per_row: int = 4

    def size(self, buffer_size: int, rows_taken: int) -> int:
        """The buffer's size before a stream's row ``rows_taken`` (counting from 0)."""
        if self.per_row <= 0:
            return buffer_size
        return min(buffer_size, self.start + rows_taken * self.per_row)


FULL_BUFFER = BufferGrowth(0, 0)  # no growth: the full buffer from the first row


class _Counted:
    """The counters every packer keeps: plain integer attributes (a packer adds to them per document, where
    an attribute is the cheapest), read and set back as one :class:`PackerCounters` through ``counters``."""

    docs = split_docs = chunks = tokens_emitted = padding = crops = tokens_cropped = 0

    @property
    def counters(self) -> PackerCounters:
        """The counters now (a frozen copy); assigning a saved value sets them back."""
        return PackerCounters(
            self.docs, self.split_docs, self.chunks, self.tokens_emitted, self.padding, self.crops, self.tokens_cropped
        )

    @counters.setter
    def counters(self, value: PackerCounters) -> None:
        self.docs, self.split_docs, self.chunks = value.docs, value.split_docs, value.chunks
        self.tokens_emitted, self.padding = value.tokens_emitted, value.padding
        self.crops, self.tokens_cropped = value.crops, value.tokens_cropped


class ConcatPacker(_Counted):
    """Concatenate BOS-prefixed documents into one stream and cut it into rows of ``capacity`` tokens.

    Documents arrive in chunks, each tagged with a caller-chosen ``ref``; the position of the next unemitted
    token is reported as ``(ref of its chunk, document index in the chunk, offset in the document)``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 1:
            raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
        self.capacity = capacity
        self._tokens = np.empty(0, np.int32)
        self._pos = 0
        self._chunk_starts: list[int] = []  # offset of each buffered chunk in _tokens
        self._chunk_docs: list[np.ndarray] = []  # each chunk's document offsets, relative to the chunk
        self._chunk_refs: list[object] = []
        self.tokens_emitted = 0

    @property
    def available(self) -> int:
        """Tokens buffered and not yet emitted."""
        return len(self._tokens) - self._pos

    def add(self, tokens: np.ndarray, doc_starts: np.ndarray, ref: object, skip: int = 0) -> None:
        """Append one chunk's tokens (BOS-prefixed documents, concatenated).

        Args:
            tokens: 1-D int32 token ids.
            doc_starts: where each document starts in ``tokens`` (ascending, the first is 0).
            ref: what the caller needs to find this chunk again.
            skip: tokens of this chunk already emitted (used once, when resuming inside a document).
        """
        # Drop fully consumed chunks, keeping the one that holds the next token.
        first_live = bisect.bisect_right(self._chunk_starts, self._pos) - 1
        if first_live > 0:
            cut = self._chunk_starts[first_live]
            self._tokens = self._tokens[cut:]
            self._pos -= cut
            self._chunk_starts = [s - cut for s in self._chunk_starts[first_live:]]
            self._chunk_docs = self._chunk_docs[first_live:]
            self._chunk_refs = self._chunk_refs[first_live:]
        if self._chunk_starts:
            self._chunk_starts.append(len(self._tokens))
            self._tokens = np.concatenate([self._tokens, np.asarray(tokens, np.int32)])
        else:
            self._chunk_starts = [0]
            self._tokens = np.asarray(tokens, np.int32)
        self._chunk_docs.append(np.asarray(doc_starts, np.int64))
        self._chunk_refs.append(ref)
        self._pos += skip

    def take(self, num_rows: int) -> np.ndarray | None:
        """Return ``(num_rows, capacity)`` tokens, or ``None`` when fewer are buffered (add more, retry)."""
        need = num_rows * self.capacity
        if self.available < need:
            return None
        rows = self._tokens[self._pos : self._pos + need].reshape(num_rows, self.capacity)
        self._pos += need
        self.tokens_emitted += need
        return rows

    def position(self) -> tuple[object, int, int]:
        """``(ref, document, offset)`` of the next unemitted token.

        When every buffered token was emitted, it is the position just after the last buffered document:
        ``(ref of the last chunk, its number of documents, 0)``.
        """
        if not self._chunk_starts:
            raise RuntimeError("the packer holds no chunk yet")
        if self._pos == len(self._tokens):
            return self._chunk_refs[-1], len(self._chunk_docs[-1]), 0
        i = bisect.bisect_right(self._chunk_starts, self._pos) - 1
        offset = self._pos - self._chunk_starts[i]
        doc = int(np.searchsorted(self._chunk_docs[i], offset, side="right")) - 1
        return self._chunk_refs[i], doc, offset - int(self._chunk_docs[i][doc])


class _PieceBuffer:
    """Buffered items by length, for best-fit picks, each with one row of integers describing it.

    The distinct lengths present are kept sorted (``lengths``), each with a FIFO of its items (``by_length``),
    so the largest item that fits a space is one ``bisect`` and ties go to the item buffered first. Each item
    owns a slot of an int64 table holding its row, so a snapshot is a few whole-table numpy operations, not a
    conversion of Python objects. A row is written with one ``struct.pack_into``, cheaper than a numpy row
    assignment from a tuple: short documents make this a per-few-dozen-tokens cost.
    """

    def __init__(self, columns: int, slots: int) -> None:
        self.lengths: list[int] = []
        self.by_length: dict[int, deque] = {}  # length -> FIFO of (slot, payload)
        self.count = 0
        self.table = np.zeros((slots, columns), np.int64)
        self.used = bytearray(slots)  # 1 where a slot holds a buffered item (a numpy view is made per snapshot)
        self.free = list(range(slots - 1, -1, -1))
        self.row_bytes = 8 * columns
        self.pack_into = struct.Struct(f"={columns}q").pack_into

    def grow(self) -> None:
        """Double the slots (call when ``free`` is empty)."""
        size = len(self.table)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.used.extend(bytes(size))
        self.free = list(range(2 * size - 1, size - 1, -1))

    def push(self, length: int, row: tuple[int, ...], payload: Any) -> None:
        """Buffer one item of ``length`` (its sort key) described by ``row``; ``payload`` comes back on pop."""
        if not self.free:
            self.grow()
        slot = self.free.pop()
        self.pack_into(self.table, slot * self.row_bytes, *row)
        self.used[slot] = 1
        bucket = self.by_length.get(length)
        if bucket is None:
            bucket = self.by_length[length] = deque()
            bisect.insort(self.lengths, length)
        bucket.append((slot, payload))
        self.count += 1

    def pop(self, index: int) -> tuple[int, Any, int]:
        """Remove the oldest item of the ``index``-th smallest length: ``(length, payload, slot)``.

        The slot's row stays readable (``table[slot]``) until the next :meth:`push`.
        """
        length = self.lengths[index]
        bucket = self.by_length[length]
        slot, payload = bucket.popleft()
        if not bucket:
            del self.by_length[length]
            del self.lengths[index]
        self.used[slot] = 0
        self.free.append(slot)
        self.count -= 1
        return length, payload, slot

    def snapshot(self) -> np.ndarray:
        """The rows of the buffered items, sorted by their first column (a unique insertion number)."""
        slots = np.flatnonzero(np.frombuffer(self.used, np.bool_))
        # Sorting insertion numbers with the slot in the low bits is a plain sort, cheaper than an argsort.
        shift = max(1, len(self.table) - 1).bit_length()
        keys = np.sort((self.table[slots, 0] << shift) | slots)
        return self.table[keys & ((1 << shift) - 1)]


class _Buffered(_Counted):
    """What both best-fit packers share: the checks of their sizes and a growing buffer of items described by
    ``META_COLUMNS`` rows, saved and set back as one :class:`BufferState` (the rows, the next insertion number
    and the counters)."""

    META_COLUMNS: tuple[str, ...]

    def __init__(self, capacity: int, buffer_size: int, growth: BufferGrowth, packing: str) -> None:
        if capacity <= 1:
            raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
        if buffer_size <= 0:
            raise ValueError(f"{packing} buffer_size must be > 0, got {buffer_size}")
        _check_growth(growth)
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.growth = growth
        self.rows_taken = 0  # rows packed so far (set back on resume): the buffer's size follows it
        self._buffer = _PieceBuffer(len(self.META_COLUMNS), max(16, 2 * buffer_size))
        self.next_seq = 0
        self._fetch: Callable[[np.ndarray], np.ndarray] | None = None

    def restore(self, meta: np.ndarray, next_seq: int, fetch: Callable[[np.ndarray], np.ndarray]) -> None:
        """Rebuild the buffer from :meth:`snapshot` rows (each packer's own columns)."""
        raise NotImplementedError

    def get_state(self) -> BufferState:
        """The buffer's rows, the next insertion number and the counters."""
        return BufferState(self.snapshot(), self.next_seq, self.counters)

    def reset(self, initial_state: BufferState, fetch: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Continue from ``initial_state`` (an empty packer); ``fetch`` supplies buffered items' tokens
        (see :meth:`restore`), needed when the state holds any."""
        if len(initial_state.rows):
            if fetch is None:
                raise ValueError("a state with buffered items needs fetch() to rebuild their tokens")
            self.restore(initial_state.rows, initial_state.next_seq, fetch)
        self.next_seq, self.counters = initial_state.next_seq, initial_state.counters

    def snapshot(self) -> np.ndarray:
        """The buffered items (documents, or pieces) as int64 rows of ``META_COLUMNS``, in insertion order."""
        return self._buffer.snapshot()


class BestFitPacker(_Buffered):
    """Pack rows that all start at BOS: largest fitting document first, crop the shortest when none fits.

    Each buffered document is described by one row of integers (``seq``, ``length``, two caller ``key``
    values, ``hash`` of the kept prefix for documents longer than a row), which is all its state needs.
    """

    META_COLUMNS = ("seq", "length", "key0", "key1", "hash")

    def __init__(self, capacity: int, buffer_size: int = 1000, growth: BufferGrowth = FULL_BUFFER) -> None:
        super().__init__(capacity, buffer_size, growth, "bestfit")
        self.crops = 0
        self.tokens_cropped = 0  # tokenized, then dropped with a cropped document's remainder
        self.tokens_emitted = 0

    @property
    def count(self) -> int:
        """Documents buffered."""
        return self._buffer.count

    def __len__(self) -> int:
        return self._buffer.count

    def add(
        self, tokens: np.ndarray | None, length: int, key: tuple[int, int], seq: int | None = None, checksum: int = 0
    ) -> None:
        """Buffer one document.

        Args:
            tokens: the document's first ``min(length, capacity)`` tokens (starting with BOS); ``None`` when
                restoring lazily (the ``fetch`` given to :meth:`restore` supplies them when first picked).
            length: the document's full token count (orders the buffer; only a prefix is kept).
            key: two integers that locate the document in the source, for the state.
            seq: the insertion number (only given when restoring a saved buffer).
            checksum: the saved prefix checksum (only given with ``tokens=None``).
        """
        capacity = self.capacity
        keep = length if length < capacity else capacity
        if tokens is not None:
            size = len(tokens)
            if size != keep:
                if size < keep:
                    raise ValueError(f"document prefix has {size} tokens, expected {keep}")
                tokens = tokens[:keep]
            checksum = prefix_hash(tokens) if length > capacity else 0
        if seq is None:
            seq = self.next_seq
            self.next_seq += 1
        self._buffer.push(length, (seq, length, key[0], key[1], checksum), tokens)

    def _pop(self, index: int) -> tuple[np.ndarray, int]:
        length, tokens, slot = self._buffer.pop(index)
        if tokens is None:  # restored lazily: fetch and verify it now
            tokens = self._materialize(self._buffer.table[slot].copy())
        return tokens, length

    def take(self, num_rows: int, refill: Callable[[], None]) -> np.ndarray:
        """Pack ``num_rows`` rows; ``refill()`` must add at least one document each call.

        The buffer is topped up to its size (``buffer_size``, or less while it grows: :class:`BufferGrowth`)
        before every pick, so the choice always sees a full buffer.
        (nanochat tops up a whole tokenizer batch at a time; refilling one document per call makes the
        result independent of how the caller batches its tokenization.)
        """
        out = np.empty((num_rows, self.capacity), np.int32)
        buffer, lengths = self._buffer, self._buffer.lengths
        for r in range(num_rows):
            pos = 0
            size = self.growth.size(self.buffer_size, self.rows_taken)
            self.rows_taken += 1
            while pos < self.capacity:
                while buffer.count < size:
                    before = buffer.count
                    refill()
                    if buffer.count == before:
                        raise RuntimeError("refill() added no document")
                remaining = self.capacity - pos
                i = bisect.bisect_right(lengths, remaining) - 1
                if i >= 0:  # the largest document that fits entirely
                    tokens, length = self._pop(i)
                    out[r, pos : pos + length] = tokens
                    pos += length
                else:  # nothing fits: crop the shortest to fill the row exactly
                    tokens, length = self._pop(0)
                    out[r, pos:] = tokens[:remaining]
                    self.crops += 1
                    self.tokens_cropped += length - remaining
                    pos = self.capacity
        self.tokens_emitted += num_rows * self.capacity
        return out

    def restore(self, meta: np.ndarray, next_seq: int, fetch: Callable[[np.ndarray], np.ndarray]) -> None:
        """Rebuild a buffer from :meth:`snapshot` rows, lazily.

        Picks need only lengths and insertion numbers, so the buffer is usable at once; a document's tokens are
        fetched (``fetch(meta_row) -> prefix``) only when it is picked, so the first batch after a resume
        re-tokenizes a few documents, not the whole buffer.

        Raises:
            ValueError: (when a fetched document is picked) its prefix does not match its saved length or
                checksum — the data or the tokenizer changed since the checkpoint.
        """
        if self._buffer.count:
            raise RuntimeError("restore() needs an empty packer")
        self._fetch = fetch
        for row in meta:
            seq, length, key0, key1, checksum = (int(v) for v in row)
            self.add(None, length, (key0, key1), seq=seq, checksum=checksum)
        self.next_seq = next_seq

    def _materialize(self, row: np.ndarray) -> np.ndarray:
        _seq, length, key0, key1, checksum = (int(v) for v in row)
        tokens = np.asarray(self._fetch(row), np.int32)
        expected = min(length, self.capacity)
        if (
            len(tokens) < expected
            or (length > self.capacity and prefix_hash(tokens[:expected]) != checksum)
            or (length <= self.capacity and len(tokens) != length)
        ):
            raise ValueError(
                f"buffered document {(key0, key1)} does not match its saved length {length} / checksum "
                "(did the data files or the tokenizer change since the checkpoint?)"
            )
        return tokens[:expected]


class BestFitSplitPacker(_Buffered):
    """Pack rows from whole documents and row-sized chunks of longer ones, best fit first, padding the rest.

    A document of at most ``capacity`` tokens is one piece; a longer one is split into the pieces
    ``tokens[k * capacity : (k + 1) * capacity]``. Each buffered piece is described by one row of integers
    (``META_COLUMNS``): insertion number, length, the two caller keys of its document, its chunk index, whether
    it is the document's last piece, and a checksum of its tokens for pieces of split documents (0 for whole
    documents, whose length check is enough). That row is all its state needs.

    Args:
        capacity: tokens per row (``seq_len + 1``).
        pad_id: the token id written at padding positions (any valid id: padding is never a target, and its
            flags mark it).
        buffer_size: pieces the buffer is topped up to before every pick.
        growth: how the buffer grows to ``buffer_size`` as the stream starts (default: full from the start).

    Raises:
        ValueError: ``capacity <= 1``, ``buffer_size <= 0`` or a negative ``growth`` field.
    """

    META_COLUMNS = ("seq", "length", "key0", "key1", "chunk", "final", "hash")

    def __init__(self, capacity: int, pad_id: int, buffer_size: int = 1000, growth: BufferGrowth = FULL_BUFFER) -> None:
        super().__init__(capacity, buffer_size, growth, "bestfit_split")
        self.pad_id = pad_id
        self._padding_run = np.full(capacity, pad_id, np.int32)
        self.docs = 0
        self.split_docs = 0
        self.chunks = 0
        self.tokens_emitted = 0
        self.padding = 0

    def __len__(self) -> int:
        """Pieces buffered."""
        return self._buffer.count

    @property
    def buffered_tokens(self) -> int:
        """Tokens in the buffered pieces (added, not yet emitted); costs a :meth:`snapshot`."""
        return int(self.snapshot()[:, 1].sum())

    def add(self, tokens: np.ndarray, key: tuple[int, int]) -> None:
        """Buffer one whole document: one piece, or all its chunks when it is longer than a row.

        Args:
            tokens: the document's 1-D token ids, starting with BOS (int32; other integer types are converted).
            key: two integers that locate the document in the source, for the state.

        Raises:
            ValueError: ``tokens`` is empty or not 1-D.
        """
        tokens = np.asarray(tokens, np.int32)
        length = len(tokens)
        if tokens.ndim != 1 or length == 0:
            raise ValueError(f"a document must be a non-empty 1-D token array, got shape {tokens.shape}")
        capacity, seq, push = self.capacity, self.next_seq, self._buffer.push
        key0, key1 = key
        if length <= capacity:
            push(length, (seq, length, key0, key1, 0, 1, 0), (tokens, False))
            self.next_seq = seq + 1
        else:
            pieces = -(-length // capacity)
            last = pieces - 1
            for chunk in range(pieces):
                piece = tokens[chunk * capacity : (chunk + 1) * capacity]
                size = len(piece)
                row = (seq + chunk, size, key0, key1, chunk, int(chunk == last), prefix_hash(piece))
                push(size, row, (piece, chunk > 0))
            self.next_seq = seq + pieces
            self.split_docs += 1
            self.chunks += pieces
        self.docs += 1

    def take(self, num_rows: int, refill: Callable[[], None]) -> tuple[np.ndarray, np.ndarray]:
        """Pack ``num_rows`` rows; ``refill()`` must add exactly one document (:meth:`add`) per call.

        The buffer is topped up to its size in pieces (:class:`BufferGrowth`) before every pick, one document
        per call, so the rows never depend on how the caller batches its tokenization.

        Returns:
            ``(tokens, flags)``: ``(num_rows, capacity)`` int32 token ids and uint8 ``START`` / ``NO_TARGET``
            bits (:func:`split_microbatch_tensors` turns them into tensors).

        Raises:
            RuntimeError: a ``refill()`` call did not add exactly one document.
            ValueError: a piece restored by :meth:`restore` no longer matches its saved length or checksum.
        """
        capacity, growth = self.capacity, self.growth
        buffer = self._buffer
        lengths, pop = buffer.lengths, buffer.pop
        find = bisect.bisect_right
        parts: list[np.ndarray] = []  # the rows' pieces and padding runs, in order, concatenated once at the end
        starts: list[int] = []  # flat offsets where a piece or a padding run starts
        blocked: list[int] = []  # flat offsets of continuation chunks' first tokens (no target)
        padded: list[int] = []  # flat offset of each row's padding run
        row_start = 0
        for _ in range(num_rows):
            pos = 0
            size = growth.size(self.buffer_size, self.rows_taken)
            self.rows_taken += 1
            while True:
                while buffer.count < size:
                    docs = self.docs
                    refill()
                    if self.docs != docs + 1:
                        raise RuntimeError(f"refill() must add exactly one document, it added {self.docs - docs}")
                i = find(lengths, capacity - pos) - 1
                if i < 0:  # nothing fits: pad the rest of the row
                    parts.append(self._padding_run[: capacity - pos])
                    starts.append(row_start + pos)
                    padded.append(row_start + pos)
                    break
                length, (piece, continuation), slot = pop(i)
                if piece is None:  # restored lazily: fetch and verify it now
                    piece = self._materialize(buffer.table[slot].copy())
                parts.append(piece)
                at = row_start + pos
                starts.append(at)
                if continuation:  # its predecessor in the row is another document
                    blocked.append(at)
                pos += length
                if pos == capacity:
                    break
            row_start += capacity
        tokens = np.concatenate(parts).reshape(num_rows, capacity) if parts else np.empty((0, capacity), np.int32)
        return tokens, self._flags(num_rows, starts, blocked, padded)

    def _flags(self, num_rows: int, starts: list[int], blocked: list[int], padded: list[int]) -> np.ndarray:
        """The rows' ``START`` / ``NO_TARGET`` bits from flat offsets (counting the padding and tokens emitted)."""
        capacity = self.capacity
        total = num_rows * capacity
        flags = np.zeros(total, np.uint8)
        flags[starts] = START
        flags[blocked] |= NO_TARGET
        pad = 0
        for at in padded:
            end = at - at % capacity + capacity
            flags[at:end] |= NO_TARGET
            pad += end - at
        self.padding += pad
        self.tokens_emitted += total - pad
        return flags.reshape(num_rows, capacity)

    def restore(self, meta: np.ndarray, next_seq: int, fetch: Callable[[np.ndarray], np.ndarray]) -> None:
        """Rebuild a buffer from :meth:`snapshot` rows, lazily (counters are set back with :attr:`counters`).

        Picks need only lengths and insertion numbers, so the buffer is usable at once; a piece's tokens are
        fetched only when it is picked, so the first batch after a resume re-tokenizes a few documents, not the
        whole buffer.

        Args:
            meta: rows from :meth:`snapshot`.
            next_seq: :attr:`next_seq` when the snapshot was taken.
            fetch: ``fetch(meta_row) -> tokens`` of the piece the int64 row describes: tokens
                ``[chunk * capacity, chunk * capacity + length)`` of document ``(key0, key1)``.

        Raises:
            RuntimeError: the packer is not empty.
            ValueError: ``meta`` is not ``(pieces, 7)`` or names a piece that does not fit this packer's rows;
                (when a restored piece is picked) its tokens do not match the saved length or checksum.
        """
        if self._buffer.count:
            raise RuntimeError("restore() needs an empty packer")
        meta = np.asarray(meta, np.int64)
        if meta.ndim != 2 or meta.shape[1] != len(self.META_COLUMNS):
            raise ValueError(f"bestfit_split state must be (pieces, {len(self.META_COLUMNS)}), got {meta.shape}")
        if len(meta) and not ((meta[:, 1] >= 1) & (meta[:, 1] <= self.capacity)).all():
            raise ValueError(
                f"bestfit_split state holds pieces of {int(meta[:, 1].min())}..{int(meta[:, 1].max())} tokens, "
                f"rows here hold {self.capacity} (was seq_len changed since the checkpoint?)"
            )
        self._fetch = fetch
        for row in meta[np.argsort(meta[:, 0], kind="stable")].tolist():
            _seq, length, _key0, _key1, chunk, _final, _checksum = row
            self._buffer.push(length, tuple(row), (None, chunk > 0))
        self.next_seq = next_seq

    def _materialize(self, meta: np.ndarray) -> np.ndarray:
        _seq, length, key0, key1, chunk, final, checksum = meta.tolist()
        tokens = np.asarray(self._fetch(meta), np.int32)
        split = chunk > 0 or not final
        if len(tokens) != length or (split and prefix_hash(tokens) != checksum):
            raise ValueError(
                f"buffered piece {chunk} of document {(key0, key1)} does not match its saved length {length}"
                + (" / checksum" if split else "")
                + f" (got {len(tokens)} tokens; did the data files or the tokenizer change since the checkpoint?)"
            )
        return tokens


def _check_growth(growth: BufferGrowth) -> None:
    if growth.start < 0 or growth.per_row < 0 or (growth.per_row and not growth.start):
        raise ValueError(f"buffer growth {growth} must have start > 0 and per_row >= 0 (per_row 0: no growth)")
