"""Tokenize: the tokenizer as the streams use it, and a prefetching stage that tokenizes chunks ahead, in order.

Algorithm: a stream's reader runs in a thread of its own and submits each chunk of texts to this process's one
tokenizing thread (``Tokenizer.encode_batch_fast`` releases the GIL; in the training process it uses every
core, in a DataLoader worker one); the stream's consumer takes the results strictly in submission order, so
timing never changes what is produced. The stage keeps no state: what it yields is decided by the reader's
position, so a stream restarts it from there.

Why one tokenizing thread per process, shared by every stream it hosts: concurrent ``encode_batch_fast`` calls
make the tokenizer's threads fight over the cores, and a process may host many streams. Why the tokenizing
thread also lays each chunk out (``lay_out``: the ids into one flat array) before the next call: the
``Encoding`` objects are several times the size of their ids, and a process hosting many streams holds several
chunks each in flight; laid out at once, they are read and freed while still in the cache, and what waits for
the consumer is a compact array.

Until the consumer opens the lookahead (after its first block), a chunk is read only when asked for and
tokenized by the asking thread: a process starting or resuming many streams at once then tokenizes exactly
what their first blocks need, side by side on every core, instead of serving one stream's read-ahead chunks
before another stream's first one.

Trade-off: a chunk read ahead and tokenized but not yet packed is work thrown away when a stream stops; each
stream's lookahead is bounded (``prefetch + 1`` chunks), so little is lost and memory stays bounded.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from tokenizers import Tokenizer

from lightning_d9d.streaming.reader import TextChunk
from lightning_d9d.tokenizer import tokenizer_from_json as load_tokenizer  # estimate, bestfit_restore use this name

T = TypeVar("T")

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list:
    """``encode_batch_fast`` without the post-processor's special tokens.

    The streams prepend BOS themselves; a template such as Llama's ``"<s> $A"`` would otherwise put a second
    BOS (or a BERT-style ``[SEP]``) in every document.
    """
    return tokenizer.encode_batch_fast(texts, add_special_tokens=False)


def tokenizing_thread() -> ThreadPoolExecutor:
    """This process's one tokenizing thread (a forked child makes its own)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-d9d-tokenize"))
        return _pool[1]


@dataclass
class TokenizedChunk:
    """A chunk of texts and their encodings (``encodings[i]`` is ``chunk.texts[i]``'s): what ``tokenized``
    yields when given no ``lay_out``."""

    chunk: TextChunk
    encodings: list


def tokenized(
    chunks: Iterator[TextChunk],
    tokenizer_json: str,
    prefetch: int = 4,
    name: str = "stream",
    lookahead: threading.Event | None = None,
    lay_out: Callable[[TextChunk, list], T] = TokenizedChunk,  # type: ignore[assignment]
) -> Generator[T, None, None]:
    """``chunks``, tokenized ahead in threads and laid out, in order.

    Args:
        chunks: the reader's chunks (iterated in a thread of its own when ``prefetch > 0``).
        tokenizer_json: the tokenizer, serialized.
        prefetch: chunks tokenized and waiting for the consumer, besides the one being tokenized (0: inline, no
            threads).
        name: names the reader thread.
        lookahead: until it is set, a chunk is read and tokenized only when the consumer asks for it (then up
            to ``prefetch + 1`` ahead). A process starting many streams sets it once their first blocks are out, so
            that its one tokenizer first serves what every stream needs for its first block, not the chunks
            some streams would read ahead.
        lay_out: ``lay_out(chunk, encodings)`` is what is yielded for a chunk; it runs in the thread that
            tokenized the chunk, right after, and the encodings are dropped once it returns.

    Raises:
        whatever reading, tokenizing or laying out raised, in the consumer, at the chunk where it happened.
    """
    tokenizer = load_tokenizer(tokenizer_json)

    def encode(chunk: TextChunk) -> T:
        return lay_out(chunk, encode_documents(tokenizer, chunk.texts))

    if prefetch <= 0:
        for chunk in chunks:
            yield encode(chunk)
        return
    # Chunks submitted and not yet taken: ``prefetch`` tokenized and waiting, and one being tokenized. The reader
    # takes a slot before it submits a chunk, so nothing is tokenized beyond them (and, on demand, nothing the
    # consumer has not asked for).
    ahead = prefetch + 1
    on_demand = lookahead is not None and not lookahead.is_set()
    slots = threading.Semaphore(1 if on_demand else ahead)  # on demand: the first chunk is asked for at once
    out: queue.Queue = queue.Queue()
    stop = threading.Event()
    pool = tokenizing_thread()

    def slot() -> bool:
        while not stop.is_set():
            if slots.acquire(timeout=0.1):
                return True
        return False

    def produce() -> None:
        try:
            for chunk in chunks:
                if not slot():
                    return
                # A chunk asked for before the lookahead opens is tokenized by the asking thread: the streams a
                # process starts at once then tokenize their first chunks side by side, on every core.
                out.put(chunk if lookahead is not None and not lookahead.is_set() else pool.submit(encode, chunk))
        except BaseException as error:  # handed to the consumer, which raises it
            out.put(error)

    reader = threading.Thread(target=produce, name=f"lightning-d9d-{name}-reader", daemon=True)
    reader.start()
    asked = 0
    try:
        while True:
            if on_demand and asked:
                if lookahead is not None and lookahead.is_set():
                    on_demand = False
                    slots.release(ahead)  # nothing is in flight on demand: now as far ahead as ever
                else:
                    slots.release()  # this chunk, now that it is asked for
            asked += 1
            try:
                item = out.get(timeout=1.0)
            except queue.Empty:
                if not reader.is_alive() and out.empty():  # never wait on a reader that is gone
                    raise RuntimeError(f"{name}: its reader thread ended unexpectedly") from None
                continue
            if isinstance(item, BaseException):
                raise item
            result = item.result() if isinstance(item, Future) else encode(item)
            if not on_demand:
                slots.release()
            yield result
    finally:
        stop.set()
        while True:  # drop what was read ahead; futures not yet started are cancelled
            try:
                item = out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Future):
                item.cancel()
