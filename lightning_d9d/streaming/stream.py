"""Stream: one resumable, endless stream of packed rows — reader → tokenizing prefetch → packing, with state.

Algorithm: a stream is three stages (as torchdata.nodes composes them, each owning its state and nesting its
source's):

1. reading (:mod:`~lightning_d9d.streaming.reader`): the stream's units, pass after pass, in chunks; its state
   is a :class:`~lightning_d9d.streaming.reader.ReadPosition`;
2. tokenizing (:mod:`~lightning_d9d.streaming.tokenize`): chunks tokenized ahead in threads, in order; no state;
3. packing (this module): documents (BOS first) laid out as numpy and packed into rows of ``seq_len + 1``
   tokens (:mod:`~lightning_d9d.streaming.packing`); its state (:class:`ConcatState` or :class:`BestFitState`)
   nests the reader's position where reading resumes.

The stream yields :class:`RowBlock` s of ``spec.rows_per_block`` rows with the :class:`StreamState` after each;
``get_state()`` is the last of them and ``reset(state)`` continues from one. A saved state is
``{"version", "packing": {"kind", "version", ..., "reader": {...}}, "counters": {...}, "blocks"}``
(:mod:`~lightning_d9d.streaming.state` validates it against the data when it is read back).
Packers take documents one at a time and a position never names a chunk boundary, so neither the rows nor any
state depend on how documents were batched for the tokenizer, or on timing. After a start or resume the
reader's chunks grow 1, 2, 3, 5, … documents and are read on demand until the first block is out, so the first
block waits for a few documents only. A fresh best-fit stream's buffer starts at ``buffer_start`` documents
(pieces) and grows by ``buffer_growth`` per row it packs (:class:`~lightning_d9d.streaming.packing.BufferGrowth`),
so its first row waits for a few documents instead of a whole buffer; the size is a function of the stream's rows
alone (never of time or of the process hosting it) and the growth is saved in the state, so rows stay the same on
any layout and after any resume.

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
import itertools
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from lightning_d9d.streaming.bestfit_restore import BufferedTexts, buffer_fetch
from lightning_d9d.streaming.packing import (
    FULL_BUFFER,
    BestFitPacker,
    BestFitSplitPacker,
    BufferGrowth,
    BufferState,
    ConcatPacker,
    PackerCounters,
)
from lightning_d9d.streaming.reader import ReadPosition, StreamUnits, TextChunk, TextReader
from lightning_d9d.streaming.source import RowGroupIndex, Units
from lightning_d9d.streaming.state import (
    InvalidDataState,
    check_column,
    field,
    int_table,
    integer,
    join,
    mapping,
    version,
)
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
        max_document_chars: longer documents are skipped and counted (``None``: no limit).
        buffer_start: best-fit's buffer size for a fresh stream's first row (it grows from there).
        buffer_growth: documents (pieces) best-fit's buffer grows by per row the stream packs, until it holds
            ``buffer_size``; 0: the full buffer from the first row. Saved in the state, so a resumed stream
            keeps the growth it started with.
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
    max_document_chars: int | None = None
    buffer_start: int = 8
    buffer_growth: int = 4

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
        too_long: documents over ``max_document_chars`` skipped before the position.
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
    too_long: int = 0
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
    def from_dict(cls, state: Any, path: str = "counters") -> StreamCounters:
        """Read saved counters.

        Raises:
            InvalidDataState: a counter missing, or not an integer >= 0.
        """
        state = mapping(state, path)
        if "too_long" not in state:  # saved before documents could be skipped for their length
            state = {**state, "too_long": 0}
        return cls(**{f.name: integer(state, f.name, path) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ConcatState:
    """Concat's state: the reader's position and tokens of the document there already emitted."""

    VERSION = 1
    kind = "concat"

    read: ReadPosition = dataclasses.field(default_factory=ReadPosition)
    offset: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": self.VERSION, "reader": self.read.to_dict(), "offset": self.offset}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], path: str) -> ConcatState:
        version(state, path, (cls.VERSION,))
        return cls(
            ReadPosition.from_dict(field(state, "reader", path), join(path, "reader")), integer(state, "offset", path)
        )

    def check(self, spec: StreamSpec, units: StreamUnits, path: str, reader: str = "reader") -> None:
        self.read.check(units, join(path, reader))


@dataclass(frozen=True)
class BestFitState:
    """Best-fit's state: the reader's position after the last document added, and the buffered documents.

    ``buffer`` holds one int64 row per buffered document (``bestfit``) or piece (``bestfit_split``), the packer's
    ``META_COLUMNS``; ``next_seq`` is the next insertion number; ``kind`` is the packing; ``growth`` how the
    buffer grows with the stream's rows (a state of version 1 had none: its buffer is full from the start).
    """

    VERSION = 2

    read: ReadPosition = dataclasses.field(default_factory=ReadPosition)
    buffer: np.ndarray | None = None
    next_seq: int = 0
    kind: str = "bestfit"
    growth: BufferGrowth = FULL_BUFFER

    def to_dict(self) -> dict[str, Any]:
        buffer = self.buffer
        columns = len(_META_COLUMNS[self.kind])
        return {
            "kind": self.kind,
            "version": self.VERSION,
            "reader": self.read.to_dict(),
            "buffer": np.zeros((0, columns), np.int64) if buffer is None else np.asarray(buffer, np.int64),
            "next_seq": self.next_seq,
            "buffer_start": self.growth.start,
            "buffer_growth": self.growth.per_row,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], path: str, kind: str) -> BestFitState:
        saved_version = 1  # state version 2 wrote the fields beside the stream's, without one
        if "version" in state:
            saved_version = version(state, path, (1, cls.VERSION))
        growth = FULL_BUFFER  # before version 2 the buffer was full from the first row
        if saved_version >= 2:
            start = integer(state, "buffer_start", path)
            growth = BufferGrowth(start, integer(state, "buffer_growth", path))
            if growth.per_row and not start:
                raise InvalidDataState(join(path, "buffer_start"), start, "a growing buffer must start at >= 1")
        read_key = "reader" if "reader" in state else "read"
        read = ReadPosition.from_dict(field(state, read_key, path), join(path, read_key))
        buffer = int_table(state, "buffer", path, len(_META_COLUMNS[kind]))
        return cls(read, buffer, integer(state, "next_seq", path), kind, growth)

    def check(self, spec: StreamSpec, units: StreamUnits, path: str, reader: str = "reader") -> None:
        """Raises :class:`InvalidDataState` unless every buffered row names a row of the data and fits the rows."""
        self.read.check(units, join(path, reader))
        buffer, where = self.buffer, join(path, "buffer")
        if buffer is None or not len(buffer):
            return
        check_column(buffer, 0, "seq", where, 0, self.next_seq)
        if len(np.unique(buffer[:, 0])) != len(buffer):
            raise InvalidDataState(f"{where}.seq", buffer[:, 0].tolist()[:20], "insertion numbers must be distinct")
        longest = spec.capacity + 1 if self.kind == "bestfit_split" else np.iinfo(np.int64).max
        check_column(buffer, 1, "length", where, 1, longest)
        check_column(buffer, 2, "key0 (row group)", where, 0, len(spec.index.num_rows))
        check_column(buffer, 3, "key1 (row)", where, 0, spec.index.num_rows[buffer[:, 2]])
        if self.kind == "bestfit_split":
            check_column(buffer, 4, "chunk", where, 0, np.iinfo(np.int64).max)
            check_column(buffer, 5, "final", where, 0, 2)
        check_column(buffer, buffer.shape[1] - 1, "hash", where, 0, 1 << 32)


PackingState = ConcatState | BestFitState
_META_COLUMNS = {
    "bestfit": BestFitPacker.META_COLUMNS,
    "bestfit_split": BestFitSplitPacker.META_COLUMNS,
}


@dataclass(frozen=True)
class StreamState:
    """A stream's state after a block: its packing stage's state (which nests the reader's) and its counters.

    Saved as ``{"version", "packing": {"kind", "version", ..., "reader": {...}}, "counters": {...}, "blocks"}``.

    Attributes:
        packing: the packing stage's state.
        counters: what the stream has done so far.
        blocks: blocks yielded.
    """

    VERSION = 3  # 2: the packing's and the reader's fields beside the counters, told apart by an "offset" key

    packing: PackingState = dataclasses.field(default_factory=ConcatState)
    counters: StreamCounters = dataclasses.field(default_factory=StreamCounters)
    blocks: int = 0
    # The version it was read from: errors name a field where that version kept it.
    read_from: int = dataclasses.field(default=VERSION, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, strings and int64 arrays (checkpoints stay loadable with ``torch.load(weights_only=True)``)."""
        return {
            "version": self.VERSION,
            "packing": self.packing.to_dict(),
            "counters": self.counters.to_dict(),
            "blocks": self.blocks,
        }

    @classmethod
    def from_dict(cls, state: Any, packing: str | None = None, path: str = "") -> StreamState:
        """Read a saved stream state (this version's, or state version 2's), checking each field's type.

        Args:
            state: what :meth:`to_dict` wrote (tensors already turned back into numpy).
            packing: the packing the stream runs (``None``: the state's own kind).
            path: where the state sits in the checkpoint's data state, for errors.

        Raises:
            InvalidDataState: a missing field, a wrong type or a negative value, an unknown version or kind, or a
                kind other than ``packing``.
        """
        state = mapping(state, path or "stream")
        if "packing" in state:
            version(state, path, (cls.VERSION,))
            where = join(path, "packing")
            saved = mapping(state["packing"], where)
            kind = field(saved, "kind", where)
            if kind not in PACKINGS:
                raise InvalidDataState(join(where, "kind"), kind, f"expected one of {list(PACKINGS)}")
        else:
            saved, where = state, path
            kind = _legacy_kind(state, path, packing)
        if packing is not None and kind != packing:
            raise InvalidDataState(join(where, "kind"), kind, f"this stream packs {packing!r}")
        if kind == "concat":
            if "packing" in state:
                packed: PackingState = ConcatState.from_dict(saved, where)
            else:
                read = ReadPosition.from_dict(field(saved, "read", where), join(where, "read"))
                packed = ConcatState(read, integer(saved, "offset", where))
        else:
            packed = BestFitState.from_dict(saved, where, kind)
        counters = StreamCounters.from_dict(field(state, "counters", path), join(path, "counters"))
        return cls(packed, counters, integer(state, "blocks", path), cls.VERSION if "packing" in state else 2)

    def check(self, spec: StreamSpec, stream: int, path: str = "") -> None:
        """Raises :class:`InvalidDataState` unless the state's positions lie inside the data stream ``stream``
        reads (and its buffered documents inside the data and the rows)."""
        if self.packing.kind != spec.packing:
            raise InvalidDataState(join(path, "packing.kind"), self.packing.kind, f"this stream packs {spec.packing!r}")
        if self.read_from == 2:  # its fields sat beside the stream's, the reader's under "read"
            self.packing.check(spec, spec.stream_units(stream), path, "read")
        else:
            self.packing.check(spec, spec.stream_units(stream), join(path, "packing"))


def _legacy_kind(state: Mapping[str, Any], path: str, packing: str | None) -> str:
    """The packing of a state version 2 stream state: concat had an ``offset``, best-fit a buffer."""
    if "offset" in state:
        return "concat"
    buffer = field(state, "buffer", path)
    if packing is not None:
        return packing
    columns = buffer.shape[1] if isinstance(buffer, np.ndarray) and buffer.ndim == 2 else None
    return "bestfit_split" if columns == len(BestFitSplitPacker.META_COLUMNS) else "bestfit"


@dataclass
class RowBlock:
    """Rows of ``seq_len + 1`` tokens; ``flags`` (``bestfit_split`` only) marks piece starts and non-targets;
    ``sources`` (a mixture only) the int64 index of each row's source."""

    tokens: np.ndarray
    flags: np.ndarray | None = None
    sources: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, start: int, stop: int) -> RowBlock:
        """Rows ``[start, stop)`` with their flags and sources."""
        flags = None if self.flags is None else self.flags[start:stop]
        sources = None if self.sources is None else self.sources[start:stop]
        return RowBlock(self.tokens[start:stop], flags, sources)

    @classmethod
    def empty(cls, capacity: int, split: bool) -> RowBlock:
        """A block of no rows (a mixture's source that gives a step none)."""
        return cls(np.empty((0, capacity), np.int32), np.empty((0, capacity), np.uint8) if split else None)


class TokenStream:
    """An endless iterator of ``(RowBlock, StreamState)`` for one stream.

    Args:
        spec: the streams' configuration.
        stream: this stream's number among ``spec.num_streams``.
        state: a state yielded earlier by a stream with the same spec and number, to continue exactly after it.
        buffered_texts: the texts of ``state``'s best-fit buffer, already read
            (:func:`~lightning_d9d.streaming.bestfit_restore.read_buffered_texts`); ``None``: the stream reads them.

    Raises:
        ValueError: an unknown packing, a negative ``chunk_chars`` or buffer growth; (when iterated) reading
            errors, a stream that finds no text in ``MAX_PASSES_WITHOUT_TEXT`` passes, a restored document that
            changed.
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
        if spec.buffer_growth < 0 or (spec.buffer_growth and spec.buffer_start < 1):
            raise ValueError(
                f"buffer_start={spec.buffer_start}, buffer_growth={spec.buffer_growth}: the growth must be >= 0 "
                "(0: no growth) and a growing buffer must start at >= 1"
            )
        if not 0 <= stream < spec.num_streams:
            raise ValueError(f"stream {stream} is not one of the {spec.num_streams} streams")
        self.spec, self.stream = spec, stream
        self.reset(state, buffered_texts)

    def reset(self, initial_state: StreamState | None = None, buffered_texts: BufferedTexts | None = None) -> None:
        """Continue from ``initial_state`` at the next iteration (``None``: from the stream's beginning).

        Raises:
            InvalidDataState: the state's positions or buffered documents lie outside this stream's data.
        """
        if initial_state is None:
            spec = self.spec
            growth = BufferGrowth(spec.buffer_start, spec.buffer_growth) if spec.buffer_growth else FULL_BUFFER
            fresh = ConcatState() if spec.packing == "concat" else BestFitState(kind=spec.packing, growth=growth)
            initial_state = StreamState(fresh)
        else:
            initial_state.check(self.spec, self.stream)
        self.state, self.buffered_texts = initial_state, buffered_texts

    def get_state(self) -> StreamState:
        """The state after the last block yielded (the initial state before any): where a new iteration starts."""
        return self.state

    def __iter__(self) -> Generator[tuple[RowBlock, StreamState], None, None]:
        return self.blocks(itertools.repeat(self.spec.rows_per_block))

    def blocks(self, sizes: Iterator[int]) -> Generator[tuple[RowBlock, StreamState], None, None]:
        """Blocks of ``next(sizes)`` rows each (0 allowed: an empty block, the state unchanged but ``blocks``).

        ``sizes`` is pulled when the next block is asked for, so a caller may decide each size just before.
        The rows are the same however they are grouped into blocks (packers pack one row after another).
        """
        spec, state = self.spec, self.state
        units = spec.stream_units(self.stream)
        reader = TextReader(
            units, state.packing.read, spec.tokenizer_batch_size, spec.chunk_chars, spec.max_document_chars
        )
        # Chunks on demand until the first block is out and asked past (a hosting process asks every stream's
        # first block before any second one), then prefetched.
        cropped_to = spec.capacity if spec.packing == "bestfit" else None
        chunks = tokenized(
            iter(reader), spec.tokenizer_json, spec.prefetch, f"stream-{self.stream}", threading.Event(),
            lay_out=lambda chunk, encodings: _Laid(chunk, encodings, spec.bos_id, cropped_to),
        )  # fmt: skip
        texts, self.buffered_texts = self.buffered_texts, None  # held only until the buffer is restored
        packing_stage = _Concat(spec, units, state) if spec.packing == "concat" else _BestFit(spec, units, state, texts)
        del texts
        try:
            blocks = packing_stage.blocks(chunks, sizes)
            block, self.state = next(blocks)
            yield block, self.state
            chunks.open_lookahead()
            for block, self.state in blocks:
                yield block, self.state
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


@dataclass(slots=True)
class _Taken:
    """Documents taken since the counters were last folded, and the rows and units skipped before them."""

    docs: int = 0
    tokens: int = 0
    empty: int = 0
    text_free_units: int = 0
    too_long: int = 0


class _Stage:
    """What both packing stages share: where they stand and how the counters follow the documents taken.

    Documents taken are tallied in plain integers and folded into the frozen counters once per block: a short
    document is only a few dozen tokens, so per-document bookkeeping has to be a few additions.
    """

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: StreamState):
        self.spec, self.units = spec, units
        self.reset(state)

    def reset(self, initial_state: StreamState) -> None:
        """Start (at the next ``blocks()``) from ``initial_state``."""
        self.state = initial_state
        self.counters, self.blocks_done = initial_state.counters, initial_state.blocks
        self.taken = _Taken()

    def get_state(self) -> StreamState:
        """The state after the last block (the initial state before any)."""
        return self.state

    def packer_counters(self) -> PackerCounters:
        """The stream's counters, as the packer keeps them (set back on a packer that resumes)."""
        c = self.counters
        return PackerCounters(c.docs, c.split_docs, c.chunks, c.emitted, c.padding, c.crops, c.cropped)

    def after(self, chunk: TextChunk, doc: int) -> ReadPosition:
        """The position just after document ``doc`` of ``chunk`` (its row + 1, normalised)."""
        position = chunk.position_of(doc)
        return self.units.normalise(ReadPosition(position.pass_index, position.slot, position.row + 1))

    def took_range(self, chunk: TextChunk, lengths: np.ndarray, first: int, stop: int) -> None:
        """Count documents ``[first, stop)`` of ``chunk`` as taken (and the rows and units skipped before them)."""
        taken = self.taken
        taken.docs += stop - first
        taken.tokens += int(lengths[first:stop].sum())
        taken.empty += int(chunk.empty_before[first:stop].sum())
        taken.text_free_units += int(chunk.units_before[first:stop].sum())
        if chunk.long_before:
            taken.too_long += sum(n for doc, n in chunk.long_before.items() if first <= doc < stop)

    def emitted(self, block: RowBlock, packing: PackingState, packer: PackerCounters) -> tuple[RowBlock, StreamState]:
        """``block`` with the state after it: the documents taken folded into the counters, the packer's set."""
        c, taken = self.counters, self.taken
        self.counters = StreamCounters(
            docs=c.docs + taken.docs, empty=c.empty + taken.empty, text_free_units=c.text_free_units
            + taken.text_free_units, too_long=c.too_long + taken.too_long, tokens=c.tokens + taken.tokens,
            emitted=packer.tokens_emitted, padding=packer.padding, crops=packer.crops, cropped=packer.tokens_cropped,
            split_docs=packer.split_docs, chunks=packer.chunks, rows=c.rows + len(block),
        )  # fmt: skip
        # In place: refill() holds it.
        taken.docs = taken.tokens = taken.empty = taken.text_free_units = taken.too_long = 0
        self.blocks_done += 1
        self.state = StreamState(packing, self.counters, self.blocks_done)
        return block, self.state


@dataclass(slots=True)
class _Begun:
    """A chunk added to the concat packer, and how many of its documents were counted as begun."""

    laid: _Laid
    counted: int = 0


class _Concat(_Stage):
    """Concat: one token stream cut into rows; nothing wasted, rows usually start mid-document."""

    def blocks(
        self, chunks: Iterator[_Laid], sizes: Iterator[int]
    ) -> Generator[tuple[RowBlock, StreamState], None, None]:
        spec, start = self.spec, self.state.packing
        assert isinstance(start, ConcatState)
        packer = ConcatPacker(spec.capacity)
        packer.counters = self.packer_counters()
        skip = start.offset
        self.carried = start.offset > 0  # resumed inside a document: it was counted before the checkpoint
        after_last = start.read  # the position after the last document begun (or where reading started)
        pending: list[_Begun] = []  # chunks not yet all begun, oldest first
        last_begun: tuple[TextChunk, int] | None = None  # (chunk, document) begun last, once after_last is stale
        while True:
            rows_per_block = next(sizes)
            if rows_per_block == 0:  # nothing taken: the position stays
                yield self.emitted(RowBlock.empty(spec.capacity, False), self.state.packing, packer.counters)
                continue
            rows = packer.take(rows_per_block)
            while rows is None:
                laid = next(chunks)
                if skip and skip >= laid.lengths[0]:
                    raise InvalidDataState(
                        "packing.offset", skip, f"the document there holds {int(laid.lengths[0])} tokens"
                    )
                packer.add(laid.payload, laid.starts, laid, skip=skip)
                pending.append(_Begun(laid))
                skip = 0
                rows = packer.take(rows_per_block)
            laid, doc, offset = packer.position()
            counted_last = self._count_begun(pending, laid, doc + (1 if offset > 0 else 0))
            if counted_last is not None:
                last_begun = counted_last
            if offset > 0:
                read = laid.chunk.position_of(doc)
            else:
                if last_begun is not None:  # only the last document begun names the position, so only it is placed
                    after_last, last_begun = self.after(*last_begun), None
                read = after_last
            yield self.emitted(RowBlock(rows), ConcatState(read, offset), packer.counters)

    def _count_begun(self, pending: list[_Begun], laid: _Laid, begun: int) -> tuple[TextChunk, int] | None:
        """Count every document begun by now (``begun`` of ``laid``'s), each once, in stream order; the last one."""
        last = None
        while pending:
            current = pending[0]
            upto = begun if current.laid is laid else len(current.laid.lengths)
            if upto > current.counted:
                first = current.counted + (1 if self.carried else 0)
                self.carried = False
                self.took_range(current.laid.chunk, current.laid.lengths, first, upto)
                last = (current.laid.chunk, upto - 1)
            if current.laid is not laid:
                pending.pop(0)
                continue
            current.counted = upto
            break
        return last


@dataclass(slots=True)
class _Cursor:
    """The chunk whose documents best-fit is adding to its buffer, and its next document; the chunk's columns as
    Python lists, converted once per chunk rather than per document."""

    laid: Any = None
    next_doc: int = 0
    payload: Any = None
    lengths: list[int] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)
    group: int = 0
    starts: list[int] = dataclasses.field(default_factory=list)
    empty_before: list[int] = dataclasses.field(default_factory=list)
    units_before: list[int] = dataclasses.field(default_factory=list)
    long_before: dict[int, int] = dataclasses.field(default_factory=dict)

    def load(self, laid: _Laid) -> None:
        chunk, self.laid = laid.chunk, laid
        self.next_doc, self.payload, self.group = 0, laid.payload, chunk.group
        self.lengths, self.rows, self.starts = laid.lengths.tolist(), chunk.rows.tolist(), laid.starts.tolist()
        self.empty_before, self.units_before = chunk.empty_before.tolist(), chunk.units_before.tolist()
        self.long_before = chunk.long_before


class _BestFit(_Stage):
    """Best-fit (every row starts at BOS, cropping) and best-fit-split (split long documents, pad the rest)."""

    def __init__(self, spec: StreamSpec, units: StreamUnits, state: StreamState, texts: BufferedTexts | None):
        super().__init__(spec, units, state)
        self.texts = texts

    def blocks(
        self, chunks: Iterator[_Laid], sizes: Iterator[int]
    ) -> Generator[tuple[RowBlock, StreamState], None, None]:
        spec, start = self.spec, self.state.packing
        assert isinstance(start, BestFitState)
        split = spec.packing == "bestfit_split"
        packer = self._packer(start)
        cursor = _Cursor()
        refill = self._refiller(packer, chunks, cursor)
        read, take = start.read, packer.take
        while True:
            rows_per_block = next(sizes)
            if rows_per_block == 0:  # nothing taken: the buffer and the position stay
                yield self.emitted(RowBlock.empty(spec.capacity, split), self.state.packing, packer.counters)
                continue
            result = take(rows_per_block, refill)
            if self.taken.docs:  # only the last document added names the position, so only it is placed
                read = self.after(cursor.laid.chunk, cursor.next_doc - 1)
            block = RowBlock(*result) if split else RowBlock(result)
            packed = packer.get_state()
            state = BestFitState(read, packed.rows, packed.next_seq, spec.packing, start.growth)
            yield self.emitted(block, state, packed.counters)

    def _packer(self, start: BestFitState) -> BestFitPacker | BestFitSplitPacker:
        """A packer of the stream's kind, with the counters and buffer of ``start``."""
        spec = self.spec
        packer: BestFitPacker | BestFitSplitPacker
        if spec.packing == "bestfit_split":
            packer = BestFitSplitPacker(spec.capacity, spec.pad_id, spec.buffer_size, start.growth)
        else:
            packer = BestFitPacker(spec.capacity, spec.buffer_size, start.growth)
        packer.rows_taken = self.counters.rows  # the buffer's size follows the rows packed
        buffer = start.buffer if start.buffer is not None else np.zeros((0, len(packer.META_COLUMNS)), np.int64)
        fetch = buffer_fetch(spec, buffer, self.texts) if len(buffer) else None
        self.texts = None
        packer.reset(BufferState(buffer, start.next_seq, self.packer_counters()), fetch)
        return packer

    def _refiller(
        self, packer: BestFitPacker | BestFitSplitPacker, chunks: Iterator[_Laid], cursor: _Cursor
    ) -> Callable[[], None]:
        """``refill()``: add the next document (one per call, so the buffer never depends on chunk sizes)."""
        split, taken = self.spec.packing == "bestfit_split", self.taken
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
            taken.docs += 1
            taken.tokens += length
            taken.empty += cursor.empty_before[doc]
            taken.text_free_units += cursor.units_before[doc]
            if cursor.long_before:
                taken.too_long += cursor.long_before.get(doc, 0)
            cursor.next_doc = doc + 1

        return refill
