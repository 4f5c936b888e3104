"""Tokenize: the tokenizer as the streams use it, and a prefetching stage that tokenizes chunks ahead, in order.

A stream's reader runs in a thread of its own and submits each chunk to this process's one tokenizing thread; the
consumer takes results strictly in submission order, so timing never changes what is produced, and the stage keeps
no state (a stream restarts it from the reader's position). One thread per process because concurrent
``encode_batch_fast`` calls fight over the cores; it also lays each chunk out (ids into one flat array) at once,
since ``Encoding`` objects are several times their ids' size. Until the consumer opens the lookahead, a chunk is
tokenized on demand by the asking thread, so streams starting together tokenize their first blocks side by side.
A document longer than ``LONG_DOCUMENT_CHARS`` is tokenized in pieces (:func:`long_ids`). The encoder is the run's
tokenizer backend (lightning_d9d.tokenization.backends); a fast one has one document in ``GUARD_EVERY`` re-encoded by
``tokenizers`` in the same thread. Trade-off: chunks tokenized ahead are lost when a stream stops, bounded by
``prefetch + 1`` per stream.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from lightning_d9d.core.epoch_iterator import close_at_exit
from lightning_d9d.streaming.sources.reader import TextChunk
from lightning_d9d.streaming.tokens import memory
from lightning_d9d.tokenization.backends import REFERENCE, BackendGuard, EncodedBatch, TokenizerBackend, backend_for

T = TypeVar("T")

_pool: tuple[int, ThreadPoolExecutor] | None = None
_TOKENIZING_THREAD = "lightning-d9d-tokenize"
_pool_lock = threading.Lock()


def encode_documents(backend: TokenizerBackend, texts: list[str]) -> EncodedBatch:
    """The documents' ids without the post-processor's special tokens (the streams prepend BOS themselves); a
    document over ``LONG_DOCUMENT_CHARS`` characters is tokenized in pieces.
    """
    limit = LONG_DOCUMENT_CHARS
    if not limit or all(len(text) <= limit for text in texts):
        return backend.encode(texts)
    short = backend.encode([text if len(text) <= limit else "" for text in texts])
    return EncodedBatch.of_arrays(
        [e.ids if len(text) <= limit else long_ids(backend, text, limit) for text, e in zip(texts, short)]
    )


# Longer documents are tokenized in pieces (streaming.memory); 0: every document in one call.
LONG_DOCUMENT_CHARS = memory.LONG_DOCUMENT_CHARS
# Characters either side of a candidate cut that are tokenized to prove the cut changes no token.
_CUT_WINDOW = 256


def long_ids(backend: TokenizerBackend, text: str, piece_chars: int) -> np.ndarray:
    """The ids of a document tokenized in pieces.

    A piece ends at the first single space at or after ``piece_chars`` where tokenizing around it whole and cut gives
    the same ids, so the ids are one call's for the usual pre-tokenizers; without such a space within another
    ``piece_chars``, it ends there (ids near that cut may differ from one call's, but are the same on every run and
    with every backend that gives the reference's ids).
    """
    parts, start = [], 0
    while start < len(text):
        stop = len(text) if len(text) - start <= piece_chars else _cut(backend, text, start + piece_chars, piece_chars)
        parts.append(backend.encode([text[start:stop]]).ids)
        start = stop
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _cut(backend: TokenizerBackend, text: str, at_least: int, piece_chars: int) -> int:
    """Where a piece holding ``text[:at_least]`` ends: the first clean space after, else ``piece_chars`` further."""
    hard = min(len(text), at_least + piece_chars)
    at = text.find(" ", at_least, hard)
    while at != -1:
        single = at + 1 < len(text) and not text[at - 1].isspace() and not text[at + 1].isspace()
        if single and _cuts_cleanly(backend, text, at):
            return at
        at = text.find(" ", at + 1, hard)
    return hard


def _cuts_cleanly(backend: TokenizerBackend, text: str, at: int) -> bool:
    first = max(0, at - _CUT_WINDOW)
    whole, left, right = backend.encode([text[first : at + _CUT_WINDOW], text[first:at], text[at : at + _CUT_WINDOW]])
    return len(whole) == len(left) + len(right) and np.array_equal(whole.ids, np.concatenate([left.ids, right.ids]))


def tokenizing_thread() -> ThreadPoolExecutor:
    """This process's one tokenizing thread (a forked child makes its own)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix=_TOKENIZING_THREAD))
        return _pool[1]


@dataclass
class TokenizedChunk:
    """A chunk of texts and their encodings: what ``tokenized`` yields when given no ``lay_out``."""

    chunk: TextChunk
    encodings: list


def tokenized(
    chunks: Iterator[TextChunk],
    tokenizer_json: str,
    prefetch: int = 4,
    name: str = "stream",
    lookahead: threading.Event | None = None,
    lay_out: Callable[[TextChunk, list], T] = TokenizedChunk,  # type: ignore[assignment]
    backend: str = REFERENCE,
    describe: Callable[[int, int], str] | None = None,
) -> InlineTokenizing[T] | PrefetchedTokenizing[T]:
    """``chunks``, tokenized (ahead, in threads, when ``prefetch > 0``) and laid out, in order.

    Args:
        chunks: the reader's chunks (iterated in a thread of its own when ``prefetch > 0``).
        tokenizer_json: the tokenizer, serialized.
        prefetch: chunks tokenized and waiting besides the one being tokenized (0: inline, no threads).
        name: names the reader thread.
        lookahead: until set, a chunk is tokenized only when asked for; ``None``: ahead from the start.
        lay_out: ``lay_out(chunk, encodings)`` is yielded for a chunk; it runs in the tokenizing thread, right after.
        backend: the tokenizer backend, resolved (not ``"auto"``); a fast one is guarded by ``tokenizers``.
        describe: ``describe(group, row)`` names a document in a guard's error (default: its group and row).

    Returns:
        an iterator with ``close()`` (stop reading, drop what was read ahead) and ``open_lookahead()``.

    Raises:
        whatever reading, tokenizing or laying out raised, in the consumer, at the chunk where it happened;
        ``TokenizerBackendMismatch`` where the guard found other ids than ``tokenizers``'.
    """
    encode = _Encode(tokenizer_json, backend, lay_out, describe)
    if prefetch <= 0:
        return InlineTokenizing(chunks, encode)
    return PrefetchedTokenizing(chunks, encode, prefetch, name, lookahead)


class _Encode:
    def __init__(
        self,
        tokenizer_json: str,
        backend: str,
        lay_out: Callable[[TextChunk, list], T],
        describe: Callable[[int, int], str] | None,
    ):
        self.backend, self.lay_out = backend_for(backend, tokenizer_json), lay_out
        self.guard = BackendGuard(backend, tokenizer_json)
        self.reference = backend_for(REFERENCE, tokenizer_json) if self.guard.active else None
        self.describe = describe or (lambda group, row: f"the document at row {row} of row group {group}")

    def __call__(self, chunk: TextChunk) -> T:
        if chunk.tokens is not None:  # replayed from the token cache: nothing to tokenize
            return self.lay_out(chunk, [])
        encodings = encode_documents(self.backend, chunk.texts)
        if self.reference is not None:
            self._guard(chunk, encodings)
        if chunk.record is not None:  # a recorded unit: its tokens go to the cache (whole once it is complete)
            chunk.record.add(chunk.record_part, chunk.rows, encodings, chunk.closes_unit)
        return self.lay_out(chunk, encodings)

    def _guard(self, chunk: TextChunk, encodings: EncodedBatch) -> None:
        picked = self.guard.picks(chunk.group, chunk.rows).tolist()
        if picked:
            reference = self.reference
            self.guard.check(
                [chunk.texts[i] for i in picked],
                [encodings[i].ids for i in picked],
                [self.describe(chunk.group, int(chunk.rows[i])) for i in picked],
                lambda texts: encode_documents(reference, texts),
            )


class InlineTokenizing(Generic[T]):
    """Mode ``prefetch=0``: each chunk is read and tokenized by the consumer when it asks for it; no threads."""

    def __init__(self, chunks: Iterator[TextChunk], encode: Callable[[TextChunk], T]):
        self.chunks, self.encode = chunks, encode

    def __iter__(self) -> InlineTokenizing[T]:
        return self

    def __next__(self) -> T:
        return self.encode(next(self.chunks))

    def open_lookahead(self) -> None:
        """Nothing to open: inline tokenizing never reads ahead."""

    def close(self) -> None:
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


# How long closing waits for the reader thread to finish the read it is in (a row group, or an object-storage
# read retrying an outage): bounded, so closing never hangs on a stalled store.
_READER_JOIN_SECONDS = 30.0


@dataclass(slots=True)
class _Done:
    """A chunk already laid out by the reader thread (replayed from the token cache)."""

    value: Any


class _ReadAhead:
    """The reader thread's side: it holds nothing of the consumer, so a dropped consumer is freed (and stops it)."""

    def __init__(self, encode: Callable[[TextChunk], Any], slots: threading.Semaphore, lookahead: threading.Event):
        self.encode, self.slots, self.lookahead = encode, slots, lookahead
        self.out: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.pool = tokenizing_thread()

    def run(self, chunks: Iterator[TextChunk]) -> None:
        try:
            for chunk in chunks:
                if not self._slot():
                    return
                on_demand = not self.lookahead.is_set()
                if chunk.tokens is not None:  # cached: laid out here, without queueing behind tokenizing
                    self.out.put(_Done(self.encode(chunk)))
                else:
                    self.out.put(chunk if on_demand else self.pool.submit(self.encode, chunk))
        except BaseException as error:  # handed to the consumer, which raises it
            self.out.put(error)

    def _slot(self) -> bool:
        while not self.stop.is_set():
            if self.slots.acquire(timeout=0.1):
                return not self.stop.is_set()  # close() releases a slot to wake it: then it stops here
        return False


class PrefetchedTokenizing(Generic[T]):
    """Mode ``prefetch > 0``: a reader thread reads chunks ahead and submits them to the tokenizing thread.

    A semaphore bounds chunks in flight (``prefetch`` waiting, one being tokenized); until the lookahead opens, a slot
    is released only when the consumer asks, and that chunk is tokenized by the asking thread.
    """

    def __init__(
        self,
        chunks: Iterator[TextChunk],
        encode: Callable[[TextChunk], T],
        prefetch: int,
        name: str,
        lookahead: threading.Event | None,
    ):
        self.encode, self.name, self.ahead = encode, name, prefetch + 1
        if lookahead is None:
            lookahead = threading.Event()
            lookahead.set()
        self.lookahead, self.on_demand = lookahead, not lookahead.is_set()
        self.slots = threading.Semaphore(1 if self.on_demand else self.ahead)  # on demand: the first at once
        self.asked, self.closed = 0, False
        # Bound here so that closing at interpreter exit needs no module global.
        self._future, self._wait, self._current_thread = Future, futures_wait, threading.current_thread
        self._tokenizing_thread = _TOKENIZING_THREAD
        self.read_ahead = _ReadAhead(encode, self.slots, lookahead)
        self.reader = threading.Thread(
            target=self.read_ahead.run, args=(chunks,), name=f"lightning-d9d-{name}-reader", daemon=True
        )
        self.reader.start()
        close_at_exit(self)

    def __iter__(self) -> PrefetchedTokenizing[T]:
        return self

    def open_lookahead(self) -> None:
        """Read and tokenize ahead from the next chunk asked for on."""
        self.lookahead.set()

    def __next__(self) -> T:
        if self.closed:
            raise StopIteration
        if self.on_demand and self.asked:
            if self.lookahead.is_set():
                self.on_demand = False
                self.slots.release(self.ahead)  # nothing is in flight on demand: now as far ahead as ever
            else:
                self.slots.release()  # this chunk, now that it is asked for
        self.asked += 1
        item = self._take()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if isinstance(item, _Done):
            result = item.value
        else:
            result = item.result() if isinstance(item, Future) else self.encode(item)
        if not self.on_demand:
            self.slots.release()
        return result

    def close(self) -> None:
        """Stop the reader thread and drop what was read ahead (futures not yet started are cancelled)."""
        self.closed = True
        self.read_ahead.stop.set()
        self.slots.release()  # a reader waiting for a slot wakes now, sees the stop and ends
        self._drop_read_ahead()
        # Wait for the reader to leave the read it is in: a thread still inside pyarrow's C++ when the process
        # exits aborts it ("terminate called without an active exception"). It stops at its next slot.
        if self.reader is not self._current_thread():
            self.reader.join(timeout=_READER_JOIN_SECONDS)
            self._drop_read_ahead()  # what it queued before it saw the stop

    def _drop_read_ahead(self) -> None:
        # Drained under the queue's own lock, not by get_nowait(): at interpreter exit the queue module's globals
        # may already be gone, and get_nowait() on an empty queue would then raise a TypeError instead of Empty.
        out = self.read_ahead.out
        with out.mutex:
            items = list(out.queue)
            out.queue.clear()
            out.not_full.notify_all()
        # A chunk being tokenized cannot be cancelled; waiting for it means nothing of this stream (its token cache
        # records included) is written after close() returns, so a next run meets the cache as this one left it.
        # (Not from the tokenizing thread itself: a collection running there would wait on its own work.)
        running = [item for item in items if isinstance(item, self._future) and not item.cancel()]
        if running and not self._current_thread().name.startswith(self._tokenizing_thread):
            self._wait(running, timeout=_READER_JOIN_SECONDS)

    def __del__(self) -> None:
        self.close()

    def _take(self) -> Any:
        out = self.read_ahead.out
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if not self.reader.is_alive() and out.empty():  # never wait on a reader that is gone
                    raise RuntimeError(f"{self.name}: its reader thread ended unexpectedly") from None
