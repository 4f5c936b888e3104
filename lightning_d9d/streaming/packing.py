"""Token packing: turn tokenized documents into rows of ``seq_len + 1`` tokens, and position ids for them.

Two packers, both fed documents that already start with BOS:

* ``ConcatPacker`` (the reference's original loader): documents are concatenated into one stream, which is cut
  into rows. Nothing is wasted; rows usually start mid-document. The stream is a numpy array, and a row is a
  slice of it, so packing costs one copy per token.
* ``BestFitPacker`` (the reference's best-fit loader): every row starts at a document's BOS. Each row is filled
  with the *largest* buffered document that still fits; when none fits, the *shortest* buffered document is
  cropped to fill the row exactly and its remainder is dropped (no padding, ever). Ties go to the document
  that entered the buffer first, which is exactly the choice of the reference's linear scan. Instead of that
  scan (O(buffer) Python steps per pick), the buffer is kept as a sorted list of the distinct lengths present
  plus a FIFO per length, so a pick is one ``bisect`` (O(log buffer)) and a refill is an ``insort``.

Trade-off: best-fit trades tokens for alignment: its *yield* (tokens emitted / tokens tokenized) is below 1,
and far below on long-document corpora, because every cropped remainder is thrown away. Only a row-sized
prefix of each buffered document is kept (the rest can never be emitted), which bounds memory by
``buffer_size * (seq_len + 1)`` tokens.

State: both packers describe their content by *positions* (opaque integer keys given by the caller) rather
than tokens, so the caller can save a few integers and rebuild the content from the source on resume.
"""

from __future__ import annotations

import bisect
import zlib
from collections import deque
from collections.abc import Callable

import numpy as np
import torch


def position_ids(inputs: np.ndarray, bos_id: int) -> np.ndarray:
    """Positions that count from 0 at the start of every row and restart at every BOS token.

    Args:
        inputs: ``(rows, seq_len)`` token ids.
        bos_id: the BOS token id that marks a document start.

    Returns:
        ``(rows, seq_len)`` int64 positions, suitable for block-causal / varlen attention (a row that starts
        mid-document counts that fragment from 0).
    """
    rows, width = inputs.shape
    size = rows * width
    starts = inputs.ravel() == bos_id
    starts[::width] = True  # column 0 is a start either way
    start_at = np.flatnonzero(starts)
    # Each token's position is its distance from the last start at or before it (one repeat, no scan).
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


def prefix_hash(tokens: np.ndarray) -> int:
    """A 32-bit checksum of a token prefix, used to verify a prefix rebuilt on resume."""
    return zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())


class ConcatPacker:
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


class BestFitPacker:
    """Pack rows that all start at BOS: largest fitting document first, crop the shortest when none fits.

    Each buffered document is described by one row of integers (``seq``, ``length``, two caller ``key``
    values, ``hash`` of the kept prefix for documents longer than a row), which is all its state needs.
    """

    META_COLUMNS = ("seq", "length", "key0", "key1", "hash")

    def __init__(self, capacity: int, buffer_size: int = 1000) -> None:
        if capacity <= 1:
            raise ValueError(f"row capacity must be > 1 (seq_len >= 1), got {capacity}")
        if buffer_size <= 0:
            raise ValueError(f"bestfit buffer_size must be > 0, got {buffer_size}")
        self.capacity = capacity
        self.buffer_size = buffer_size
        self._lengths: list[int] = []  # distinct lengths present, sorted
        self._by_length: dict[int, deque] = {}  # length -> FIFO of (slot, prefix tokens)
        self._meta = np.zeros((max(16, 2 * buffer_size), len(self.META_COLUMNS)), np.int64)
        self._used = np.zeros(len(self._meta), bool)
        self._free = list(range(len(self._meta) - 1, -1, -1))
        self.count = 0
        self.next_seq = 0
        self.crops = 0
        self.tokens_cropped = 0  # tokenized, then dropped with a cropped document's remainder
        self.tokens_emitted = 0
        self._fetch: Callable[[np.ndarray], np.ndarray] | None = None

    def __len__(self) -> int:
        return self.count

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
        if not self._free:
            grow = len(self._meta)
            self._meta = np.concatenate([self._meta, np.zeros_like(self._meta)])
            self._used = np.concatenate([self._used, np.zeros(grow, bool)])
            self._free = list(range(2 * grow - 1, grow - 1, -1))
        slot = self._free.pop()
        self._meta[slot] = (seq, length, key[0], key[1], checksum)
        self._used[slot] = True
        bucket = self._by_length.get(length)
        if bucket is None:
            bucket = self._by_length[length] = deque()
            bisect.insort(self._lengths, length)
        bucket.append((slot, tokens))
        self.count += 1

    def _pop(self, index: int) -> tuple[np.ndarray, int]:
        length = self._lengths[index]
        bucket = self._by_length[length]
        slot, tokens = bucket.popleft()
        if not bucket:
            del self._by_length[length]
            del self._lengths[index]
        if tokens is None:  # restored lazily: fetch and verify it now
            tokens = self._materialize(self._meta[slot].copy())
        self._used[slot] = False
        self._free.append(slot)
        self.count -= 1
        return tokens, length

    def take(self, num_rows: int, refill: Callable[[], None]) -> np.ndarray:
        """Pack ``num_rows`` rows; ``refill()`` must add at least one document each call.

        The buffer is topped up to ``buffer_size`` before every pick, so the choice always sees a full buffer.
        (The reference tops up a whole tokenizer batch at a time; refilling one document per call makes the
        result independent of how the caller batches its tokenization.)
        """
        out = np.empty((num_rows, self.capacity), np.int32)
        for r in range(num_rows):
            pos = 0
            while pos < self.capacity:
                while self.count < self.buffer_size:
                    before = self.count
                    refill()
                    if self.count == before:
                        raise RuntimeError("refill() added no document")
                remaining = self.capacity - pos
                i = bisect.bisect_right(self._lengths, remaining) - 1
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

    def snapshot(self) -> np.ndarray:
        """The buffered documents as ``(count, 5)`` int64 rows of ``META_COLUMNS``, in insertion order."""
        meta = self._meta[self._used]
        return meta[np.argsort(meta[:, 0], kind="stable")]

    def restore(self, meta: np.ndarray, next_seq: int, fetch: Callable[[np.ndarray], np.ndarray]) -> None:
        """Rebuild a buffer from :meth:`snapshot` rows, lazily.

        Picks need only lengths and insertion numbers, so the buffer is usable at once; a document's tokens are
        fetched (``fetch(meta_row) -> prefix``) only when it is picked, so the first batch after a resume
        re-tokenizes a few documents, not the whole buffer.

        Raises:
            ValueError: (when a fetched document is picked) its prefix does not match its saved length or
                checksum — the data or the tokenizer changed since the checkpoint.
        """
        if self.count:
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
