"""Stream: one resumable, endless stream of packed rows — reader → tokenizing prefetch → packing, with state.

Algorithm: a stream is three stages (as torchdata.nodes composes them, each owning its state and nesting its
source's):

1. reading (:mod:`~lightning_d9d.streaming.reader`): the stream's units, pass after pass, in chunks; its state
   is a :class:`~lightning_d9d.streaming.reader.ReadPosition`;
2. tokenizing (:mod:`~lightning_d9d.streaming.tokenize`): chunks tokenized ahead in threads, in order; no state;
3. packing (this module): documents (BOS first) laid out as numpy and packed into rows of ``seq_len + 1``
   tokens (:mod:`~lightning_d9d.streaming.packing`); its state (:class:`ConcatState` or :class:`BestFitState`)
   nests the reader's position where reading resumes.

The stream yields :class:`RowBlock` s of ``spec.rows_per_block`` rows with the :class:`StreamState` after each.
Packers take documents one at a time and a position never names a chunk boundary, so neither the rows nor any
state depend on how documents were batched for the tokenizer, or on timing. After a start or resume the
reader's chunks grow 1, 2, 3, 5, … documents and are read on demand until the first block is out, so the first
block waits for a few documents only.

Positions: inside a document (concat's next unemitted token, ``offset`` tokens into it) the position is that
document's row; between documents it is the row just after the last document taken, whose following empty
rows are not yet read (a chunk boundary can fall anywhere among them). On resume reading restarts there; the
tokens carried over are recomputed, not saved. Best-fit's buffer is saved as one integer row per buffered
document or piece and rebuilt by :mod:`~lightning_d9d.streaming.bestfit_restore`.

Trade-off: the state is small (tens of KiB for a 1000-document buffer) and restoring it costs re-reading the
buffered documents' row groups and re-tokenizing each document when it is picked; saving the tokens themselves
would cost MiBs per stream.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from lightning_d9d.streaming.bestfit_restore import BufferedTexts, restore_buffer
from lightning_d9d.streaming.packing import BestFitPacker, BestFitSplitPacker, ConcatPacker, SplitPackerCounters
from lightning_d9d.streaming.reader import ReadPosition, StreamUnits, TextChunk, TextReader
from lightning_d9d.streaming.source import RowGroupIndex, Units
from lightning_d9d.streaming.tokenize import tokenized

PACKINGS = ("bestfit", "bestfit_split", "concat")


@dataclass(frozen=True)
class StreamSpec:
    """Everything a stream needs, picklable so that it can travel to a DataLoader worker.

    Attributes:
        index: the row groups to read.
        units: the units dealt to streams (row groups, or parts of them).
        tokenizer_json: the tokenizer, serialized (``Tokenizer.to_str()``).
        bos_id: the BOS token id prepended to every document.
        seq_len: tokens per row of ``inputs`` (rows hold ``seq_len + 1`` tokens).
        rows_per_block: rows per block the stream yields (one optimizer step's share of this stream).
        packing: one of ``PACKINGS``.
        seed: seeds each pass's unit order.
        shuffle: reshuffle units every pass (``False``: rotated file order, for validation).
        num_streams: K, the streams the units are dealt to.
        tokenizer_batch_size: documents per tokenizer call, at most.
        buffer_size: best-fit's buffer (documents; pieces for ``bestfit_split``).
        prefetch: chunks read and tokenized ahead (0: inline, no threads).
        chunk_chars: a tokenizer call also ends before its text passes this many characters (0: no limit).
        pad_id: the token id at ``bestfit_split``'s padding positions.
    """

    index: RowGroupIndex
    units: Units
    tokenizer_json: str
    bos_id: int
    seq_len: int
    rows_per_block: int
    packing: str
    seed: int
    shuffle: bool
    num_streams: int
    tokenizer_batch_size: int = 128
    buffer_size: int = 1000
    prefetch: int = 4
    chunk_chars: int = 0
    pad_id: int = 0

    @property
    def capacity(self) -> int:
        return self.seq_len + 1

    def stream_units(self, stream: int) -> StreamUnits:
        return StreamUnits(self.index, self.units, stream, self.num_streams, self.seed, self.shuffle)


@dataclass(frozen=True)
class StreamCounters:
    """What a stream has done, as of its position (the same on a resumed stream as on an uninterrupted one).

    Attributes:
        docs: documents taken by the packer (concat: begun; best-fit: added to its buffer).
        empty: null or empty texts skipped before the position.
        text_free_units: units skipped before the position because they hold no text.
        tokens: tokens of the documents taken, BOS included (so ``tokens`` ≥ ``emitted``; the rest is still
            buffered, inside the current document, or cropped).
        emitted: document tokens in the rows yielded.
        padding: padding tokens in the rows yielded (``bestfit_split``).
        crops: documents cropped (``bestfit``).
        cropped: tokens dropped with their remainders (``bestfit``).
        split_docs: documents longer than a row, split into chunks (``bestfit_split``).
        chunks: pieces that came from split documents (``bestfit_split``).
        rows: rows yielded.
    """

    docs: int = 0
    empty: int = 0
    text_free_units: int = 0
    tokens: int = 0
    emitted: int = 0
    padding: int = 0
    crops: int = 0
    cropped: int = 0
    split_docs: int = 0
    chunks: int = 0
    rows: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StreamCounters:
        return cls(**{field.name: int(state.get(field.name, 0)) for field in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ConcatState:
    """Concat's state: the reader's position and tokens of the document there already emitted."""

    read: ReadPosition = dataclasses.field(default_factory=ReadPosition)
    offset: int = 0


@dataclass(frozen=True)
class BestFitState:
    """Best-fit's state: the reader's position after the last document added, and the buffered documents.

    ``buffer`` holds one int64 row per buffered document (``bestfit``) or piece (``bestfit_split``), the packer's
    ``META_COLUMNS``; ``next_seq`` is the next insertion number.
    """

    read: ReadPosition = dataclasses.field(default_factory=ReadPosition)
    buffer: np.ndarray | None = None
    next_seq: int = 0


@dataclass(frozen=True)
class StreamState:
    """A stream's state after a block: its packing stage's state (which nests the reader's) and its counters.

    Attributes:
        packing: the packing stage's state.
        counters: what the stream has done so far.
        blocks: blocks yielded.
    """

    packing: ConcatState | BestFitState = dataclasses.field(default_factory=ConcatState)
    counters: StreamCounters = dataclasses.field(default_factory=StreamCounters)
    blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain ints and an int64 array only (checkpoints stay loadable with ``torch.load(weights_only=True)``)."""
        out: dict[str, Any] = {"read": self.packing.read.to_dict(), "blocks": self.blocks}
        out["counters"] = self.counters.to_dict()
        if isinstance(self.packing, ConcatState):
            out["offset"] = self.packing.offset
        else:
            out["next_seq"] = self.packing.next_seq
            buffer = self.packing.buffer
            out["buffer"] = np.zeros((0, 0), np.int64) if buffer is None else np.asarray(buffer, np.int64)
        return out

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StreamState:
        read = ReadPosition.from_dict(state["read"])
        if "offset" in state:
            packing: ConcatState | BestFitState = ConcatState(read, int(state["offset"]))
        else:
            packing = BestFitState(read, np.asarray(state["buffer"], np.int64), int(state["next_seq"]))
        return cls(packing, StreamCounters.from_dict(state["counters"]), int(state["blocks"]))


@dataclass
class RowBlock:
    """Rows of ``seq_len + 1`` tokens; ``flags`` (``bestfit_split`` only) marks piece starts and non-targets."""

    tokens: np.ndarray
    flags: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class TokenStream:
    """An endless iterator of ``(RowBlock, StreamState)`` for one stream.

    Args:
        spec: the streams' configuration.
        stream: this stream's number among ``spec.num_streams``.
        state: a state yielded earlier by a stream with the same spec and number, to continue exactly after it.
        buffered_texts: the texts of ``state``'s best-fit buffer, already read
            (:func:`~lightning_d9d.streaming.bestfit_restore.read_buffered_texts`); ``None``: the stream reads them.

    Raises:
        ValueError: an unknown packing or a negative ``chunk_chars``; (when iterated) reading errors, a stream
            that finds no text in ``MAX_PASSES_WITHOUT_TEXT`` passes, a restored document that changed.
    """

    def __init__(
        self,
        spec: StreamSpec,
        stream: int,
        state: StreamState | None = None,
        buffered_texts: BufferedTexts | None = None,
    ) -> None:
        if spec.packing not in PACKINGS:
            raise ValueError(f"packing={spec.packing!r} is not one of {PACKINGS}")
        if spec.chunk_chars < 0:
            raise ValueError(f"chunk_chars={spec.chunk_chars} must be >= 0 (0: no limit)")
        if not 0 <= stream < spec.num_streams:
            raise ValueError(f"stream {stream} is not one of the {spec.num_streams} streams")
        self.spec, self.stream = spec, stream
        fresh = BestFitState() if spec.packing != "concat" else ConcatState()
        self.state = state if state is not None else StreamState(fresh)
        self.buffered_texts = buffered_texts

    def __iter__(self) -> Generator[tuple[RowBlock, StreamState], None, None]:
        spec, state = self.spec, self.state
        units = spec.stream_units(self.stream)
        reader = TextReader(units, state.packing.read, spec.tokenizer_batch_size, spec.chunk_chars)
        # Chunks on demand until the first block is out and asked past (a hosting process asks every stream's
        # first block before any second one), then prefetched.
        lookahead = threading.Event()
        cropped_to = spec.capacity if spec.packing == "bestfit" else None
        chunks = tokenized(
            iter(reader), spec.tokenizer_json, spec.prefetch, f"stream-{self.stream}", lookahead,
            lay_out=lambda chunk, encodings: _Laid(chunk, encodings, spec.bos_id, cropped_to),
        )  # fmt: skip
        texts, self.buffered_texts = self.buffered_texts, None  # held only until the buffer is restored
        packing_stage = _Concat(spec, units, state) if spec.packing == "concat" else _BestFit(spec, units, state, texts)
        del texts
        try:
            blocks = packing_stage.blocks(chunks)
            yield next(blocks)
            lookahead.set()
            yield from blocks
        finally:
            chunks.close()


class _Laid:
    """One tokenized chunk laid out for a packer: BOS-first documents as numpy, with their lengths."""

    __slots__ = ("chunk", "lengths", "payload", "starts")

    def __init__(self, chunk: TextChunk, encodings: list, bos_id: int, capacity: int | None):
        self.chunk = chunk
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
        else:  # best-fit with cropping keeps only each document's row-sized prefix
            ends = np.cumsum(np.minimum(self.lengths, capacity)).tolist()
            prefixes = chain.from_iterable(
                (head, e.ids if n <= capacity else e.ids[: capacity - 1])
                for e, n in zip(encodings, self.lengths.tolist())
            )
            flat = np.fromiter(chain.from_iterable(prefixes), np.int32, ends[-1] if ends else 0)
            self.payload = [flat[s:e] for s, e in zip([0, *ends[:-1]], ends)]


class _Stage:
    """What both packing stages share: where they stand and how the counters follow the documents taken.

    Documents taken are tallied in plain integers and folded into the frozen counters once per block: a short
    document is only a few dozen tokens, so per-document bookkeeping has to be a few additions.
    """

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: StreamState):
        self.spec, self.units = spec, units
        self.counters, self.blocks_done = state.counters, state.blocks
        self.taken = [0, 0, 0, 0]  # documents, tokens, empty rows, text-free units taken since the last fold

    def after(self, chunk: TextChunk, doc: int) -> ReadPosition:
        """The position just after document ``doc`` of ``chunk`` (its row + 1, normalised)."""
        position = chunk.position_of(doc)
        return self.units.normalise(ReadPosition(position.pass_index, position.slot, position.row + 1))

    def took_range(self, chunk: TextChunk, lengths: np.ndarray, first: int, stop: int) -> None:
        """Count documents ``[first, stop)`` of ``chunk`` as taken (and the rows and units skipped before them)."""
        taken = self.taken
        taken[0] += stop - first
        taken[1] += int(lengths[first:stop].sum())
        taken[2] += int(chunk.empty_before[first:stop].sum())
        taken[3] += int(chunk.units_before[first:stop].sum())

    def folded(self, **block: int) -> StreamCounters:
        """The counters with the documents taken since the last fold, and ``block``'s fields set."""
        c, (docs, tokens, empty, units) = self.counters, self.taken
        self.taken[:] = (0, 0, 0, 0)
        self.counters = dataclasses.replace(
            c, docs=c.docs + docs, tokens=c.tokens + tokens, empty=c.empty + empty,
            text_free_units=c.text_free_units + units, **block,
        )  # fmt: skip
        return self.counters


class _Concat(_Stage):
    """Concat: one token stream cut into rows; nothing wasted, rows usually start mid-document."""

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: StreamState):
        super().__init__(spec, units, state)
        assert isinstance(state.packing, ConcatState)
        self.start = state.packing

    def blocks(self, chunks: Iterator[_Laid]) -> Generator[tuple[RowBlock, StreamState], None, None]:
        spec, rows_per_block = self.spec, self.spec.rows_per_block
        packer = ConcatPacker(spec.capacity)
        skip, carried = self.start.offset, self.start.offset > 0  # resumed inside a document: already counted
        after_last = self.start.read  # the position after the last document begun (or where reading started)
        pending: list[list[Any]] = []  # [chunk, documents of it counted], oldest first, not yet all begun
        last_begun: tuple[TextChunk, int] | None = None  # (chunk, document) begun last, once after_last is stale
        while True:
            rows = packer.take(rows_per_block)
            while rows is None:
                laid = next(chunks)
                packer.add(laid.payload, laid.starts, laid, skip=skip)
                pending.append([laid, 0])
                skip = 0
                rows = packer.take(rows_per_block)
            laid, doc, offset = packer.position()
            begun = doc + (1 if offset > 0 else 0)
            # Count every document begun by now, each exactly once, in stream order.
            while pending:
                current, counted = pending[0]
                upto = begun if current is laid else len(current.lengths)
                if upto > counted:
                    first = counted
                    if carried:  # the document a resume started inside of was counted before the checkpoint
                        carried, first = False, first + 1
                    self.took_range(current.chunk, current.lengths, first, upto)
                    last_begun = (current.chunk, upto - 1)
                if current is not laid:
                    pending.pop(0)
                    continue
                pending[0][1] = upto
                break
            if offset > 0:
                read = laid.chunk.position_of(doc)
            else:
                if last_begun is not None:  # only the last document begun names the position, so only it is placed
                    after_last, last_begun = self.after(*last_begun), None
                read = after_last
            self.blocks_done += 1
            c = self.counters
            counters = self.folded(emitted=c.emitted + rows.size, rows=c.rows + len(rows))
            yield RowBlock(rows), StreamState(ConcatState(read, offset), counters, self.blocks_done)


class _BestFit(_Stage):
    """Best-fit (every row starts at BOS, cropping) and best-fit-split (split long documents, pad the rest)."""

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: StreamState, texts: BufferedTexts | None):
        super().__init__(spec, units, state)
        assert isinstance(state.packing, BestFitState)
        self.start, self.texts = state.packing, texts

    def blocks(self, chunks: Iterator[_Laid]) -> Generator[tuple[RowBlock, StreamState], None, None]:
        spec, counters = self.spec, self.counters
        split = spec.packing == "bestfit_split"
        packer: BestFitPacker | BestFitSplitPacker
        if split:
            packer = BestFitSplitPacker(spec.capacity, spec.pad_id, spec.buffer_size)
            packer.counters = SplitPackerCounters(
                counters.docs, counters.split_docs, counters.chunks, counters.emitted, counters.padding
            )
        else:
            packer = BestFitPacker(spec.capacity, spec.buffer_size)
            packer.crops, packer.tokens_cropped = counters.crops, counters.cropped
        if self.start.buffer is not None and len(self.start.buffer):
            restore_buffer(spec, packer, self.start.buffer, self.start.next_seq, self.texts)
            self.texts = None
        packer.next_seq = self.start.next_seq
        read = self.start.read
        cursor: list[Any] = [None, 0]  # the chunk being added to the buffer, and its next document
        # That chunk's documents as Python lists (converted once per chunk, not per document): payload, lengths,
        # rows, group, starts, empty rows and text-free units before each.
        lists: list[Any] = [None, [], [], 0, [], [], []]
        taken = self.taken

        def refill() -> None:
            """Add the next document (one per call, so the buffer never depends on chunk sizes)."""
            laid, doc = cursor
            while laid is None or doc >= len(lists[1]):
                laid, doc = next(chunks), 0
                chunk = laid.chunk
                lists[:] = (
                    laid.payload, laid.lengths.tolist(), chunk.rows.tolist(), chunk.group, laid.starts.tolist(),
                    chunk.empty_before.tolist(), chunk.units_before.tolist(),
                )  # fmt: skip
            length = lists[1][doc]
            if split:
                start = lists[4][doc]
                packer.add(lists[0][start : start + length], (lists[3], lists[2][doc]))
            else:
                packer.add(lists[0][doc], length, (lists[3], lists[2][doc]))
            taken[0] += 1
            taken[1] += length
            taken[2] += lists[5][doc]
            taken[3] += lists[6][doc]
            cursor[0], cursor[1] = laid, doc + 1

        take: Callable[..., Any] = packer.take
        while True:
            result = take(spec.rows_per_block, refill)
            if taken[0]:  # only the last document added names the position, so only it is placed
                read = self.after(cursor[0].chunk, cursor[1] - 1)
            self.blocks_done += 1
            c = self.counters
            if split:
                tokens, flags = result
                p = packer.counters
                counters = self.folded(
                    emitted=p.tokens_emitted, padding=p.padding, split_docs=p.split_docs, chunks=p.chunks,
                    rows=c.rows + len(tokens),
                )  # fmt: skip
                block = RowBlock(tokens, flags)
            else:
                counters = self.folded(
                    emitted=c.emitted + result.size, crops=packer.crops, cropped=packer.tokens_cropped,
                    rows=c.rows + len(result),
                )  # fmt: skip
                block = RowBlock(result)
            state = BestFitState(read, packer.snapshot(), packer.next_seq)
            yield block, StreamState(state, counters, self.blocks_done)
