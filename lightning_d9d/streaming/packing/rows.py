"""Packing: what every packing (``concat``, ``bestfit``, ``bestfit_split``) shares in turning documents into rows.

Counters, buffer growth, row blocks, the microbatch tensors (positions restart at BOS or at ``START`` flags) and
sequence bounds. Under context parallelism (c > 1) every sequence of a row spans a multiple of ``2·c`` positions.
Trade-off: counters are plain attributes bumped per document (a short document's bookkeeping must be a few
additions), at the price of one shared mutable object per stream.
"""

from __future__ import annotations

import dataclasses
import operator
import zlib
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.core.tokens import IGNORE_INDEX, cu_seqlens_of, restart_positions
from lightning_d9d.streaming.plans.state import integer, mapping
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits, TextChunk

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec

START = 1  # flag bit: this token starts a piece (or a padding run); positions restart here
NO_TARGET = 2  # flag bit: this token must not be the training target of the token before it
CP_PAD = 4  # flag bit: padding that rounds a piece up to a multiple of 2·cp (positions continue through it)


@dataclass(slots=True)
class StreamCounters:
    """What a stream has done, as of its position (the same on a resumed stream as on an uninterrupted one).

    Attributes:
        docs: documents taken by the packer (concat: begun; best-fit: added to its buffer).
        empty, text_free_units, too_long: null or empty texts, text-free units, and documents over
            ``max_document_chars`` skipped before the position.
        tokens: tokens of the documents taken, BOS included (≥ ``emitted``: the rest is buffered or cropped).
        emitted, padding, rows: document tokens, padding tokens and rows yielded.
        crops, cropped: documents cropped and tokens dropped with them (``bestfit``).
        split_docs, chunks: documents split and the pieces they gave (``bestfit_split``).
        cp_padding: of ``padding``, the tokens rounding pieces up to a multiple of ``2·context_parallel_size``.
        excluded: documents passed over (or dropped from a restored buffer) as ``exclude_documents`` asks.
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
    excluded: int = 0

    def copy(self) -> StreamCounters:
        return StreamCounters(*_COUNTER_VALUES(self))  # positional: dataclasses.replace costs several times more

    def add(self, other: StreamCounters) -> None:
        for name in _COUNTER_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTER_NAMES}

    @classmethod
    def from_dict(cls, state: Any, path: str = "counters") -> StreamCounters:
        """Read saved counters; :class:`InvalidDataState` for one missing or not an integer >= 0."""
        state = mapping(state, path)
        return cls(**{name: integer(state, name, path) for name in _COUNTER_NAMES})


_COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(StreamCounters))
_COUNTER_VALUES = operator.attrgetter(*_COUNTER_NAMES)


@dataclass
class RowBlock:
    """Rows of ``seq_len + 1`` tokens; ``flags`` (``bestfit_split``, and ``bestfit`` under context parallelism)
    marks piece starts, non-targets and CP padding; ``sources`` the int64 index of each row's source; ``pieces``,
    where provenance is recorded, one int64 row per piece (``streaming.provenance.PIECE_COLUMNS``)."""

    tokens: np.ndarray
    flags: np.ndarray | None = None
    sources: np.ndarray | None = None
    pieces: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        """Tokens per row (``seq_len + 1``)."""
        return self.tokens.shape[1]

    @property
    def token_parts(self) -> list[np.ndarray]:
        """The rows' tokens as the arrays that hold them, in order (one here; a step keeps its streams' blocks)."""
        return [self.tokens]

    def target_count(self) -> int:
        """The positions of these rows that have a target (all but those whose next token is ``NO_TARGET``)."""
        positions = len(self) * (self.capacity - 1)
        if self.flags is None:
            return positions
        return positions - int(np.count_nonzero(self.flags[:, 1:] & NO_TARGET))

    def rows(self, start: int, stop: int) -> RowBlock:
        flags = None if self.flags is None else self.flags[start:stop]
        sources = None if self.sources is None else self.sources[start:stop]
        return RowBlock(self.tokens[start:stop], flags, sources)

    @classmethod
    def empty(cls, capacity: int, flagged: bool) -> RowBlock:
        """A block of no rows (a mixture's source that gives a step none)."""
        return cls(np.empty((0, capacity), np.int32), np.empty((0, capacity), np.uint8) if flagged else None)

    @staticmethod
    def joined_pieces(blocks: list[RowBlock]) -> np.ndarray | None:
        """The blocks' pieces, their rows counted on from block to block (``None`` where not recorded)."""
        if all(block.pieces is None for block in blocks):
            return None
        tables, first = [np.zeros((0, 7), np.int64)], 0
        for block in blocks:
            if block.pieces is not None:
                table = block.pieces.copy()
                table[:, 0] += first
                tables.append(table)
            first += len(block)
        return np.concatenate(tables)

    @classmethod
    def joined(cls, blocks: list[RowBlock]) -> RowBlock:
        return cls(joined_arrays([block.tokens for block in blocks]), *cls.joined_marks(blocks))

    @staticmethod
    def joined_marks(blocks: list[RowBlock]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The blocks' ``(flags, sources)``, each ``None`` where the blocks have none."""
        flags = None if blocks[0].flags is None else joined_arrays([block.flags for block in blocks])
        sources = None if blocks[0].sources is None else joined_arrays([block.sources for block in blocks])
        return flags, sources


def joined_arrays(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays end to end; a single one is shared as it is (a block's arrays are never written after it is made)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class PackingState(Protocol):
    """A packing's saved state: it nests the reader's position (``read``) and is tagged with its ``kind``."""

    kind: str
    read: ReadPosition
    buffer: np.ndarray  # saved rows of buffered pieces a resume rebuilds (none for concat)

    def to_dict(self) -> dict[str, Any]: ...

    def check(self, spec: StreamSpec, units: StreamUnits, path: str) -> None: ...


class Packing(Protocol):
    """A packing strategy: its name, crop rule, state, stage, restore and tensors."""

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
    """What every packing stage shares; ``blocks(chunks, sizes)`` yields ``(RowBlock, state)`` per size pulled."""

    def __init__(self, spec: StreamSpec, units: StreamUnits, counters: StreamCounters):
        self.spec, self.units, self.counters = spec, units, counters

    def blocks(self, chunks: Iterator[Any], sizes: Iterator[int]) -> Generator[tuple[RowBlock, Any], None, None]:
        raise NotImplementedError

    def after(self, chunk: TextChunk, doc: int) -> ReadPosition:
        """The position just after document ``doc`` of ``chunk`` (its row + 1, normalised)."""
        position = chunk.position_of(doc)
        return self.units.normalise(ReadPosition(position.pass_index, position.slot, position.row + 1))

    def took_range(self, sums: DocumentSums, first: int, stop: int) -> None:
        """Count documents ``[first, stop)`` of ``sums``' chunk as taken (and the rows and units skipped before)."""
        counters, chunk = self.counters, sums.chunk
        counters.docs += stop - first
        counters.tokens += sums.tokens[stop] - sums.tokens[first]
        counters.empty += sums.empty[stop] - sums.empty[first]
        counters.text_free_units += sums.units[stop] - sums.units[first]
        if chunk.long_before:
            counters.too_long += sum(n for doc, n in chunk.long_before.items() if first <= doc < stop)
        if chunk.excluded_before:
            counters.excluded += sum(n for doc, n in chunk.excluded_before.items() if first <= doc < stop)


class DocumentSums:
    """A chunk's per-document counts as prefix sums (Python ints), so that counting a range of its documents costs a
    few subtractions whatever its length: ``tokens`` (``lengths``: BOS included), ``empty`` and ``units`` (skipped
    before each document); entry ``i`` sums documents ``[0, i)``."""

    __slots__ = ("chunk", "empty", "tokens", "units")

    def __init__(self, chunk: TextChunk, lengths: np.ndarray):
        self.chunk = chunk
        self.tokens, self.empty, self.units = (_prefix_sums(values) for values in (lengths, chunk.empty_before,
                                                                                    chunk.units_before))  # fmt: skip


def _prefix_sums(values: np.ndarray) -> list[int]:
    sums = np.zeros(len(values) + 1, np.int64)
    np.cumsum(values, out=sums[1:])
    return sums.tolist()


def bos_tensors(rows: np.ndarray, bos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, targets, position_ids)`` int64 ``(rows, seq_len)`` tensors of packed ``(rows, seq_len + 1)``
    token ids whose documents start at ``bos_id`` (positions restart there and at every row start).
    """
    inputs = rows[:, :-1]
    positions = torch.from_numpy(restart_positions(inputs == bos_id))
    return torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64)), positions


def flagged_tensors(tokens: np.ndarray, flags: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, targets, position_ids)`` of rows with ``START`` / ``NO_TARGET`` flags (ValueError: bad shapes)."""
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
    """``(cu_seqlens, cu_seqlens_padded, max_seqlen)`` of a microbatch (int32 offsets into the flattened microbatch,
    flash-attention's varlen convention). A sequence starts where ``positions`` is 0; with CP, ``cu_seqlens`` leaves
    out the ``CP_PAD`` positions that ``cu_seqlens_padded`` counts (as ``pad_documents_for_cp``); without, they agree.

    Args:
        rows: the microbatch's rows (their flags say where CP padding is).
        positions: ``(rows, seq_len)`` positions.
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


def kept_rows(table: np.ndarray, keep: np.ndarray, added: np.ndarray) -> np.ndarray:
    """``table``'s rows where ``keep`` is set, then ``added``'s rows (2-D tables of one dtype and width).

    Each row is selected as one fixed-size item, which numpy copies several times faster than the rows of a 2-D
    array under a boolean mask (a best-fit buffer is rebuilt this way for every block).
    """
    width = table.shape[1]
    row = np.dtype((np.void, width * table.itemsize))
    table, added = np.ascontiguousarray(table), np.ascontiguousarray(added, table.dtype)
    joined = np.concatenate([table.view(row).reshape(-1)[keep], added.view(row).reshape(-1)])
    return joined.view(table.dtype).reshape(-1, width)


def prefix_hash(tokens: np.ndarray) -> int:
    """A 32-bit checksum of a token prefix (its int32 bytes), to verify a prefix rebuilt on resume."""
    if tokens.dtype != np.int32 or not tokens.flags.c_contiguous:  # else crc32 reads the buffer as it is
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    return zlib.crc32(tokens)


def read_kind(state: Mapping[str, Any], path: str, expected: str) -> None:
    """Raises :class:`InvalidDataState` where a saved packing state's ``kind`` tag is not ``expected``."""
    kind = state.get("kind")
    if kind != expected:
        raise InvalidDataState(f"{path}.kind" if path else "kind", kind, f"this stream packs {expected!r}")
