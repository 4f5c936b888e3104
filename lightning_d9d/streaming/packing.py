"""Packing: how a stream turns tokenized documents into rows of ``seq_len + 1`` tokens — the part every packing
shares.

A packing is a strategy object (:class:`Packing`): ``concat`` (:mod:`~lightning_d9d.streaming.concat`),
``bestfit`` and ``bestfit_split`` (:mod:`~lightning_d9d.streaming.bestfit`). Each owns its state class (what
a resume needs besides the reader's position), its stage (documents in, blocks of rows out), its restore of a
saved buffer, the crop rule of its documents (``bestfit`` keeps a row-sized prefix) and the tensors of its rows.
What they share lives here:

* :class:`StreamCounters`: one mutable set of counters per stream, incremented by the reader's side of the
  stage (documents, skipped rows) and by the packer (tokens emitted, padding, crops, splits), copied into every
  state;
* :class:`BufferGrowth`: how a best-fit buffer grows to its size as a fresh stream starts (the one place its
  rule is checked);
* :class:`RowBlock` and :class:`PackingStage`: the rows a stage yields, and the bookkeeping of documents taken
  (counters and the reader's position after the last one);
* the tensors of a microbatch: positions restart at BOS (``concat``, ``bestfit``) or at the ``START`` flags a
  packer writes (``bestfit_split``, and ``bestfit`` laid out for context parallelism);
* the sequence bounds of a microbatch (:func:`sequence_bounds`): ``cu_seqlens`` and ``cu_seqlens_padded``.

Context parallelism (``context_parallel_size`` c > 1, :mod:`lightning_d9d.context_parallel`): a CP rank keeps
chunks of each sequence, so every sequence of a row must span a multiple of ``2·c`` positions. Best-fit packers
pad each piece to that (``CP_PAD`` flags: pad id, positions continuing, no target; the ``-100`` the map-style
path's :func:`~lightning_d9d.context_parallel.flatten_for_cp` writes), and the counters count that padding; a
concat row is one sequence (``seq_len`` is a multiple of ``2·c``), split as a whole.

Trade-off: counters are plain attributes bumped per document (a short document is a few dozen tokens, so
bookkeeping per document must be a few additions), at the price of one shared mutable object per stream.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from lightning_d9d.resume import InvalidDataState
from lightning_d9d.streaming.reader import ReadPosition, StreamUnits, TextChunk
from lightning_d9d.streaming.state import integer, mapping
from lightning_d9d.tokens import IGNORE_INDEX, cu_seqlens_of, restart_positions

if TYPE_CHECKING:
    from lightning_d9d.streaming.spec import StreamSpec

START = 1  # flag bit: this token starts a piece (or a padding run); positions restart here
NO_TARGET = 2  # flag bit: this token must not be the training target of the token before it
CP_PAD = 4  # flag bit: padding that rounds a piece up to a multiple of 2·cp (positions continue through it)


@dataclass(slots=True)
class StreamCounters:
    """What a stream has done, as of its position (the same on a resumed stream as on an uninterrupted one).

    Attributes:
        docs: documents taken by the packer (concat: begun; best-fit: added to its buffer).
        empty: null or empty texts skipped before the position.
        text_free_units: units skipped before the position because they hold no text.
        too_long: documents over ``max_document_chars`` skipped before the position.
        tokens: tokens of the documents taken, BOS included (``tokens`` ≥ ``emitted``: the rest is buffered,
            inside the current document, or cropped).
        emitted: document tokens in the rows yielded.
        padding: padding tokens in the rows yielded (``bestfit_split``'s gaps, and the CP padding).
        crops: documents cropped (``bestfit``).
        cropped: tokens dropped with their remainders (``bestfit``).
        split_docs: documents longer than a row, split into chunks (``bestfit_split``).
        chunks: pieces that came from split documents (``bestfit_split``).
        rows: rows yielded.
        cp_padding: of ``padding``, the tokens that round pieces up to a multiple of ``2·context_parallel_size``
            (best-fit with context parallelism).
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
    cp_padding: int = 0

    def copy(self) -> StreamCounters:
        return dataclasses.replace(self)

    def add(self, other: StreamCounters) -> None:
        """Add ``other``'s counts to these (sums over streams or sources)."""
        for name in _COUNTER_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTER_NAMES}

    @classmethod
    def from_dict(cls, state: Any, path: str = "counters") -> StreamCounters:
        """Read saved counters.

        Raises:
            InvalidDataState: a counter missing, or not an integer >= 0.
        """
        # States saved before context parallelism existed hold no CP padding.
        state = {"cp_padding": 0, **mapping(state, path)}
        return cls(**{name: integer(state, name, path) for name in _COUNTER_NAMES})


_COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(StreamCounters))


@dataclass(frozen=True)
class BufferGrowth:
    """How a best-fit buffer grows to its size as a stream starts: before each row it is topped up to
    ``min(buffer_size, start + rows_taken * per_row)`` items, so a fresh stream's first rows wait for ``start``
    documents instead of a whole buffer. The size depends only on the rows the stream has packed, never on time
    or on the process that hosts it, so rows stay a function of the data and settings.

    Attributes:
        start: the buffer's size for the first row.
        per_row: items the size grows by per row packed (0: no growth, the full size from the first row).

    Raises:
        ValueError: a negative field, or a growing buffer that starts empty.
    """

    start: int = 8
    per_row: int = 4

    def __post_init__(self) -> None:
        if self.start < 0 or self.per_row < 0 or (self.per_row and not self.start):
            raise ValueError(
                f"buffer growth start={self.start}, per_row={self.per_row}: both must be >= 0 (per_row 0: no "
                "growth) and a growing buffer must start at >= 1"
            )

    def size(self, buffer_size: int, rows_taken: int) -> int:
        """The buffer's size before a stream's row ``rows_taken`` (counting from 0)."""
        if not self.per_row:
            return buffer_size
        return min(buffer_size, self.start + rows_taken * self.per_row)


FULL_BUFFER = BufferGrowth(0, 0)  # no growth: the full buffer from the first row


@dataclass
class RowBlock:
    """Rows of ``seq_len + 1`` tokens; ``flags`` (``bestfit_split``, and ``bestfit`` under context parallelism)
    marks piece starts, non-targets and CP padding; ``sources`` the int64 index of each row's source."""

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
    def empty(cls, capacity: int, flagged: bool) -> RowBlock:
        """A block of no rows (a mixture's source that gives a step none)."""
        return cls(np.empty((0, capacity), np.int32), np.empty((0, capacity), np.uint8) if flagged else None)

    @classmethod
    def joined(cls, blocks: list[RowBlock]) -> RowBlock:
        """The blocks' rows one after the other."""
        flags = None if blocks[0].flags is None else np.concatenate([block.flags for block in blocks])
        sources = None if blocks[0].sources is None else np.concatenate([block.sources for block in blocks])
        return cls(np.concatenate([block.tokens for block in blocks]), flags, sources)


class PackingState(Protocol):
    """A packing's saved state: it nests the reader's position (``read``) and is tagged with its ``kind``."""

    kind: str
    read: ReadPosition
    buffer: np.ndarray  # saved rows of buffered pieces a resume rebuilds (none for concat)

    def to_dict(self) -> dict[str, Any]: ...

    def check(self, spec: StreamSpec, units: StreamUnits, path: str) -> None: ...


class Packing(Protocol):
    """A packing strategy: its name, crop rule, state, stage, restore and tensors (see the module docstring)."""

    name: str
    crops_to_row: bool  # documents are laid out as a row-sized prefix only (the rest can never be emitted)
    flagged: bool  # rows carry START / NO_TARGET flags without context parallelism (best-fit's always do with it)

    def fresh_state(self, spec: StreamSpec) -> PackingState: ...

    def state_from_dict(self, state: Mapping[str, Any], path: str) -> PackingState: ...

    def stage(
        self, spec: StreamSpec, units: StreamUnits, state: PackingState, counters: StreamCounters, texts: Any
    ) -> PackingStage: ...

    def tensors(self, rows: RowBlock, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class PackingStage:
    """What every packing stage shares: the stream's counters and the reader's position after a document.

    A stage's ``blocks(chunks, sizes)`` yields ``(RowBlock, packing state)`` for each size pulled from
    ``sizes`` (0 allowed: an empty block, the state unchanged).
    """

    def __init__(self, spec: StreamSpec, units: StreamUnits, counters: StreamCounters):
        self.spec, self.units, self.counters = spec, units, counters

    def blocks(self, chunks: Iterator[Any], sizes: Iterator[int]) -> Generator[tuple[RowBlock, Any], None, None]:
        raise NotImplementedError

    def after(self, chunk: TextChunk, doc: int) -> ReadPosition:
        """The position just after document ``doc`` of ``chunk`` (its row + 1, normalised)."""
        position = chunk.position_of(doc)
        return self.units.normalise(ReadPosition(position.pass_index, position.slot, position.row + 1))

    def took_range(self, chunk: TextChunk, lengths: np.ndarray, first: int, stop: int) -> None:
        """Count documents ``[first, stop)`` of ``chunk`` as taken (and the rows and units skipped before them)."""
        counters = self.counters
        counters.docs += stop - first
        counters.tokens += int(lengths[first:stop].sum())
        counters.empty += int(chunk.empty_before[first:stop].sum())
        counters.text_free_units += int(chunk.units_before[first:stop].sum())
        if chunk.long_before:
            counters.too_long += sum(n for doc, n in chunk.long_before.items() if first <= doc < stop)


def bos_tensors(rows: np.ndarray, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, targets, position_ids)`` int64 tensors of packed rows whose documents start at BOS.

    Args:
        rows: ``(rows, seq_len + 1)`` token ids.
        bos_id: the BOS token id (positions restart there, and at every row start).

    Returns:
        ``rows[:, :-1]``, ``rows[:, 1:]`` (the next token) and the positions, each ``(rows, seq_len)``.
    """
    inputs = rows[:, :-1]
    positions = torch.from_numpy(restart_positions(inputs == bos_id))
    return torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64)), positions


def flagged_tensors(tokens: np.ndarray, flags: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, targets, position_ids)`` int64 tensors of rows with ``START`` / ``NO_TARGET`` flags.

    Targets are ``IGNORE_INDEX`` (-100) wherever the target token has ``NO_TARGET``; positions restart at column
    0 and at every ``START`` (a padding run counts from 0 too).

    Raises:
        ValueError: ``tokens`` and ``flags`` differ in shape, or are not 2-D with at least 2 columns.
    """
    if tokens.shape != flags.shape or tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"tokens {tokens.shape} and flags {flags.shape} must be the same (rows, seq_len + 1) shape, seq_len >= 1"
        )
    targets = tokens[:, 1:].astype(np.int64)
    targets[(flags[:, 1:] & NO_TARGET) != 0] = IGNORE_INDEX
    positions = torch.from_numpy(restart_positions((flags[:, :-1] & START) != 0))
    return torch.from_numpy(tokens[:, :-1].astype(np.int64)), torch.from_numpy(targets), positions


def sequence_bounds(
    rows: RowBlock, positions: torch.Tensor, context_parallel_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(cu_seqlens, cu_seqlens_padded, max_seqlen)`` of a microbatch's rows (int32 offsets in the flattened
    microbatch, 0 first and its size last: flash-attention's varlen and TransformerEngine's THD conventions).

    A sequence starts wherever ``positions`` is 0 (each row start, document, chunk or padding run). Without CP
    both tensors hold those offsets. With CP, best-fit's (flagged) rows: ``cu_seqlens_padded`` holds them (each
    sequence with its CP padding, a multiple of ``2·c``) and ``cu_seqlens`` the cumulative real lengths (the
    ``CP_PAD`` positions left out), as :func:`lightning_d9d.context_parallel.pad_documents_for_cp` gives; concat's
    rows are one sequence each. ``max_seqlen``: the longest padded sequence.

    Args:
        rows: the microbatch's rows (their flags say where CP padding is).
        positions: ``(rows, seq_len)`` positions, restarting at 0 at every sequence.
        context_parallel_size: the CP size the rows were packed for.
    """
    if context_parallel_size == 1:
        cu_seqlens, longest = cu_seqlens_of(positions)
        return cu_seqlens, cu_seqlens.clone(), longest
    if rows.flags is None:  # concat: the whole row is the CP sequence
        width = positions.shape[1]
        bounds = torch.arange(0, positions.numel() + 1, width, dtype=torch.int32)
        return bounds, bounds.clone(), width if len(positions) else 0
    padded, longest = cu_seqlens_of(positions)
    pads = ((rows.flags[:, :-1] & CP_PAD) != 0).reshape(-1)
    pads_before = np.concatenate([np.zeros(1, np.int64), np.cumsum(pads, dtype=np.int64)])
    # The real tokens before a sequence's start are its offset less the CP padding before it.
    offsets = padded.numpy().astype(np.int64)
    return torch.from_numpy((offsets - pads_before[offsets]).astype(np.int32)), padded, longest


def prefix_hash(tokens: np.ndarray) -> int:
    """A 32-bit checksum of a token prefix, used to verify a prefix rebuilt on resume."""
    return zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int32))  # crc32 reads the buffer itself, no copy


def read_kind(state: Mapping[str, Any], path: str, expected: str) -> None:
    """Check a saved packing state's ``kind`` tag.

    Raises:
        InvalidDataState: the state is another packing's.
    """
    kind = state.get("kind")
    if kind != expected:
        raise InvalidDataState(f"{path}.kind" if path else "kind", kind, f"this stream packs {expected!r}")
