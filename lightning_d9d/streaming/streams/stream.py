"""Stream: one resumable, endless stream of packed rows of one source — reader → tokenizer → packing.

Three stages, as torchdata.nodes composes them, each owning its state and nesting its source's: reading (state: a
``ReadPosition``), tokenizing ahead in order (no state), packing (state nests the reader's position). Packers take
documents one at a time and a position never names a chunk boundary, so neither rows nor states depend on
tokenizer batching or timing. Trade-off: the state is small because a resume re-reads the buffered documents' row
groups and re-tokenizes each when it is picked, rather than saving their tokens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from lightning_d9d.streaming.packing.bestfit_restore import BufferedTexts
from lightning_d9d.streaming.packing.rows import PackingState, RowBlock, StreamCounters
from lightning_d9d.streaming.plans.spec import StreamSpec
from lightning_d9d.streaming.plans.state import field, integer, join, mapping
from lightning_d9d.streaming.sources.reader import StreamUnits, TextChunk, TextReader
from lightning_d9d.streaming.tokens.tokenize import tokenized
from lightning_d9d.tokenization.backends import EncodedBatch


@dataclass(frozen=True)
class StreamState:
    """A stream's state after a block: packing state (nesting the reader's), counters and blocks, as plain data."""

    packing: PackingState
    counters: StreamCounters = dataclasses.field(default_factory=StreamCounters)
    blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"packing": self.packing.to_dict(), "counters": self.counters.to_dict(), "blocks": self.blocks}

    @classmethod
    def from_dict(cls, state: Any, spec: StreamSpec, path: str = "") -> StreamState:
        """Read a saved stream state of ``spec``'s packing; :class:`InvalidDataState` for a bad or foreign field."""
        state = mapping(state, path or "stream")
        where = join(path, "packing")
        packing = spec.packing.state_from_dict(mapping(field(state, "packing", path), where), where)
        counters = StreamCounters.from_dict(field(state, "counters", path), join(path, "counters"))
        return cls(packing, counters, integer(state, "blocks", path))

    def check(self, spec: StreamSpec, stream: int, path: str = "") -> None:
        """Raises :class:`InvalidDataState` unless the state lies inside the data stream ``stream`` reads."""
        self.packing.check(spec, StreamUnits.of_spec(spec, stream), join(path, "packing"))


class TokenStream:
    """An endless stream of ``(RowBlock, StreamState)`` for stream ``stream`` of a source.

    Args:
        spec: the source's streams.
        stream: this stream's number among ``spec.num_streams``.
        state: a state yielded earlier by a stream with the same spec and number, to continue exactly after it.
        buffered_texts: the texts of ``state``'s best-fit buffer, already read; ``None``: the stream reads them.

    Raises:
        ValueError: a stream number outside ``[0, K)``; (when iterated) reading errors, no text in
            ``MAX_PASSES_WITHOUT_TEXT`` passes, or a restored document that changed.
        InvalidDataState: a state whose positions or buffered documents lie outside this stream's data.
    """

    def __init__(
        self,
        spec: StreamSpec,
        stream: int,
        state: StreamState | None = None,
        buffered_texts: BufferedTexts | None = None,
    ) -> None:
        if not 0 <= stream < spec.num_streams:
            raise ValueError(f"stream {stream} is not one of the {spec.num_streams} streams")
        self.spec, self.stream = spec, stream
        self.reset(state, buffered_texts)

    def reset(self, initial_state: StreamState | None = None, buffered_texts: BufferedTexts | None = None) -> None:
        """Continue from ``initial_state`` at the next ``blocks()`` (``None``: the start); raises as :meth:`check`."""
        if initial_state is None:
            initial_state = StreamState(self.spec.packing.fresh_state(self.spec))
        else:
            initial_state.check(self.spec, self.stream)
        self.state, self.buffered_texts = initial_state, buffered_texts

    def get_state(self) -> StreamState:
        """The state after the last block yielded (the initial state before any): where a new iteration starts."""
        return self.state

    def blocks(self, sizes: Iterator[tuple[int, int] | int]) -> Generator[tuple[RowBlock, StreamState], None, None]:
        """Blocks of ``next(sizes)`` = ``(rows, capacity)`` each (a number: rows of the spec's one row length), pulled
        just before each block; rows never depend on the grouping, and a new capacity carries the stream over to rows
        of that length, nothing dropped.
        """
        return self.shaped_blocks(_with_capacity(sizes, self.spec))

    def shaped_blocks(self, sizes: Iterator[tuple[int, int]]) -> Generator[tuple[RowBlock, StreamState], None, None]:
        """:meth:`blocks` of sizes that are all ``(rows, capacity)`` pairs."""
        spec, state = self.spec, self.state
        units = StreamUnits.of_spec(spec, self.stream)
        reader = TextReader(units, state.packing.read, spec.tokenizer_batch_size, spec.chunk_chars,
                            spec.max_document_chars, spec.cache, spec.excluded)  # fmt: skip
        cropped_to = spec.max_capacity if spec.packing.crops_to_row else None
        # Chunks on demand until the first block is out and asked past (a hosting process asks every stream's
        # first block before any second one), then prefetched.
        chunks = tokenized(
            iter(reader), spec.tokenizer_json, spec.prefetch, f"stream-{self.stream}", threading.Event(),
            lay_out=lambda chunk, encodings: LaidOut(chunk, encodings, spec.bos_id, cropped_to),
            backend=spec.tokenizer_backend, describe=lambda group, row: spec.index.describe_rows(group, row, row + 1),
        )  # fmt: skip
        texts, self.buffered_texts = self.buffered_texts, None  # held only until the buffer is restored
        counters = state.counters.copy()
        stage = spec.packing.stage(spec, units, state.packing, counters, texts)
        del texts
        blocks_done = state.blocks
        opened = False
        try:
            for block, packing in stage.blocks(chunks, sizes):
                counters.rows += len(block.tokens)
                blocks_done += 1
                self.state = StreamState(packing, counters.copy(), blocks_done)
                yield block, self.state
                if not opened:
                    chunks.open_lookahead()
                    opened = True
        finally:
            chunks.close()


class LaidOut:
    """One tokenized chunk laid out for a packer: BOS-first documents as numpy, with their lengths.

    Args:
        chunk: the reader's chunk.
        encodings: its documents' encodings (anything with ``ids`` and ``len``).
        bos_id: the BOS id each document starts with.
        capacity: keep only each document's first ``capacity`` tokens (a packing that crops); ``None``: all.
    """

    __slots__ = ("chunk", "lengths", "payload", "starts")

    def __init__(self, chunk: TextChunk, encodings: list, bos_id: int, capacity: int | None):
        self.chunk = chunk
        if chunk.tokens is not None:
            self._lay_out_tokens(chunk.tokens, bos_id, capacity)
            return
        if isinstance(encodings, EncodedBatch):  # flat ids already: laid out like cached ones, no loop over tokens
            self._lay_out_tokens((encodings.ids, encodings.counts), bos_id, capacity)
            return
        self.lengths = np.fromiter(map(len, encodings), np.int64, len(encodings)) + 1  # len() builds no list
        self.starts = np.concatenate([[0], np.cumsum(self.lengths[:-1])]) if len(encodings) else self.lengths
        head = (bos_id,)
        # Each document's ids list is built, copied into one flat array and freed in turn, so the Python ints in
        # flight stay one document's worth instead of the chunk's.
        if capacity is None:
            self.payload: Any = np.fromiter(
                chain.from_iterable(chain.from_iterable((head, e.ids) for e in encodings)),
                np.int32,
                int(self.lengths.sum()),
            )
        else:  # a cropping packing keeps only each document's row-sized prefix
            ends = np.cumsum(np.minimum(self.lengths, capacity)).tolist()
            prefixes = chain.from_iterable(
                (head, e.ids if n <= capacity else e.ids[: capacity - 1])
                for e, n in zip(encodings, self.lengths.tolist())
            )
            flat = np.fromiter(chain.from_iterable(prefixes), np.int32, ends[-1] if ends else 0)
            self.payload = [flat[s:e] for s, e in zip([0, *ends[:-1]], ends)]

    def _lay_out_tokens(self, tokens: tuple[np.ndarray, np.ndarray], bos_id: int, capacity: int | None) -> None:
        """The same layout from cached ids, without a Python loop over tokens."""
        ids, counts = tokens
        self.lengths = counts + 1
        self.starts = np.concatenate([[0], np.cumsum(self.lengths[:-1])]) if len(counts) else self.lengths
        flat = bos_first(ids, counts, self.starts, bos_id)
        if capacity is None:
            self.payload = flat
        else:
            ends = self.starts + np.minimum(self.lengths, capacity)
            self.payload = [flat[s:e] for s, e in zip(self.starts.tolist(), ends.tolist())]


def bos_first(ids: np.ndarray, counts: np.ndarray, starts: np.ndarray, bos_id: int) -> np.ndarray:
    """Documents' ids (``counts`` each, concatenated) as int32 with ``bos_id`` before each, document ``i`` at
    ``starts[i]``.

    Few long documents are copied one slice each (one pass, the int32 cast made in the copy); many short ones in one
    vectorised insert, whose cost does not grow with their number.
    """
    if len(counts) * _SLICED_DOCUMENT_TOKENS > len(ids):
        return np.insert(ids.astype(np.int32), starts - np.arange(len(starts)), bos_id)
    flat = np.empty(len(ids) + len(counts), np.int32)
    flat[starts] = bos_id
    at = 0
    for first, stop in zip((starts + 1).tolist(), (starts + 1 + counts).tolist()):
        after = at + stop - first
        flat[first:stop] = ids[at:after]
        at = after
    return flat


# Average document length (tokens) from which the per-document copy lays a chunk out faster than one insert.
_SLICED_DOCUMENT_TOKENS = 2048


def _with_capacity(sizes: Iterator[tuple[int, int] | int], spec: StreamSpec) -> Iterator[tuple[int, int]]:
    for size in sizes:
        yield size if isinstance(size, tuple) else (size, spec.capacity)


def saved_buffers(states: Mapping[Any, StreamState] | list[StreamState]) -> list[np.ndarray]:
    """The non-empty best-fit buffers among ``states``."""
    values = states.values() if isinstance(states, Mapping) else states
    return [state.packing.buffer for state in values if len(state.packing.buffer)]
