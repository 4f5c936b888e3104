"""Step tensors: a step's packed rows turned into a microbatch's tensors, vectorised over all the step's rows at once.

``(rows, seq_len + 1)`` token ids become int64 ``input_ids`` and ``targets`` (one cast each, made in the copy that joins
the blocks the step's rows arrived in), ``position_ids`` (the flat offset less the last sequence start at or before it:
one ``np.repeat``) and the sequence bounds (the flat sequence starts, found once). A sequence starts at every row start
and at BOS (``concat``, and ``bestfit`` without context parallelism) or at a ``START`` flag (flagged rows); a
``NO_TARGET`` flag makes a target ``-100``. A run of rows (a microbatch) is then a view of the step's tensors plus its
slice of the bounds, since no sequence crosses a row. The microbatches of one size are built together on the first one's
request: one torch split per field (a torch view costs more than all the numpy work of a microbatch) and every run's
``cu_seqlens`` in one numpy pass; any other run of rows is cut on its own. Trade-off: the step's tensors live as long as
any of its microbatches (a step's worth of int64 memory), for a few numpy calls per step instead of per microbatch, and
no Python per row or per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.streaming.packing.rows import CP_PAD, NO_TARGET, START, RowBlock, joined_arrays

_ORIGINS: dict[int, np.ndarray] = {}  # flat offsets 0..n-1 by n (read-only), reused step after step


def _flat_offsets(size: int) -> np.ndarray:
    offsets = _ORIGINS.get(size)
    if offsets is None:
        if len(_ORIGINS) > 8:  # step sizes come from a handful of settings; never grow without bound
            _ORIGINS.clear()
        offsets = _ORIGINS[size] = np.arange(size, dtype=np.int64)
        offsets.flags.writeable = False
    return offsets


class MicrobatchTensors(NamedTuple):  # a tuple: made for every microbatch, it costs less than a dataclass
    """What a microbatch of rows trains on: ``PretrainingBatch``'s fields (``sources`` ``None`` for rows without)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    sources: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int


class StepTensors:
    """The tensors of all of a step's rows, built at once; :meth:`microbatch` cuts any run of rows out of them.

    Args:
        rows: the step's rows (``flags`` where the packing flags them).
        bos_id: where rows without flags start a sequence.
        context_parallel_size: the CP size the rows were packed for (c > 1: ``cu_seqlens`` leaves out ``CP_PAD``
            positions, which ``cu_seqlens_padded`` counts; rows without flags are one sequence each).
    """

    def __init__(self, rows: RowBlock, bos_id: int, context_parallel_size: int = 1):
        parts, flags, count, capacity = rows.token_parts, rows.flags, len(rows), rows.capacity
        width = self.width = capacity - 1
        self.count = count
        inputs, targets = _columns(parts, slice(None, -1)), _columns(parts, slice(1, None))
        size = count * width
        row_starts = np.arange(0, size + 1, width)
        pads = None  # CP padding's input offsets, where they count
        if flags is None:
            starts = inputs == bos_id
            starts[:, 0] = True
            bounds = np.append(np.flatnonzero(starts), size)  # every sequence start, then the end
        else:  # flags are sparse: their offsets once, then each bit among them
            flagged = np.flatnonzero(flags != 0)
            bits = flags.reshape(-1)[flagged]
            no_target = flagged[(bits & NO_TARGET) != 0]
            no_target = no_target[no_target % capacity != 0]  # a row's first token is no one's target
            targets.reshape(-1)[no_target - no_target // capacity - 1] = IGNORE_INDEX  # the token before's
            marked = flagged[(bits & START) != 0]
            # As input offsets (one token fewer per row before), a row's last token lands on the next row's start.
            bounds = np.union1d(row_starts, marked - marked // capacity)
            if context_parallel_size > 1:
                pads = flagged[(bits & CP_PAD) != 0]
                pads = pads[pads % capacity != width]  # a row's last token is no input
                pads -= pads // capacity
        at = bounds[:-1]
        last_start = np.repeat(at, bounds[1:] - bounds[:-1])
        positions = np.subtract(_flat_offsets(size), last_start, out=last_start).reshape(count, width)
        self.input_ids, self.targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        self.position_ids = torch.from_numpy(positions)
        self.sources = None if rows.sources is None else torch.from_numpy(np.asarray(rows.sources, np.int64))
        if context_parallel_size > 1 and flags is None:  # concat under CP: a row is one sequence
            self.padded, self.row_first = row_starts, np.arange(count + 1)
        else:  # bounds[row_first[r]] is row r's first token: every row start is a sequence start
            self.padded, self.row_first = bounds, np.searchsorted(bounds, row_starts)
        # real: the offsets less the CP padding before them
        self.real = self.padded if pads is None else bounds - np.searchsorted(pads, bounds)
        self.lengths = self.padded[1:] - self.padded[:-1]
        self._runs: dict[int, list[MicrobatchTensors]] = {}

    def microbatch(self, start: int, stop: int) -> MicrobatchTensors:
        """Rows ``[start, stop)`` of the step: views of its tensors, and their own sequence bounds."""
        stop = min(stop, self.count)
        size = stop - start
        if size > 0 and start % size == 0:
            runs = self._runs.get(size)
            if runs is None:
                runs = self._runs[size] = self._every_run(size)
            return runs[start // size]
        first, last = self.row_first[start], self.row_first[stop]
        cu_padded = _from_zero(self.padded[first : last + 1])
        cu_seqlens = cu_padded.copy() if self.real is self.padded else _from_zero(self.real[first : last + 1])
        longest = int(self.lengths[first:last].max()) if last > first else 0
        fields = self.input_ids, self.targets, self.position_ids, self.sources
        rows = [_rows(tensor, start, stop) for tensor in fields]
        return MicrobatchTensors(*rows, torch.from_numpy(cu_seqlens), torch.from_numpy(cu_padded), longest)

    def _every_run(self, size: int) -> list[MicrobatchTensors]:
        """Every run of ``size`` rows from row 0 (the last one shorter where ``size`` does not divide the rows), built
        together: one torch view per tensor and run, and all runs' ``cu_seqlens`` in one pass."""
        count = self.count
        first = self.row_first[[*range(0, count, size), count]]  # each run's first sequence, then the end
        counts = first[1:] - first[:-1] + 1  # bounds per run: its sequence starts and its end
        repeats = np.ones(len(self.padded), np.intp)
        repeats[first[1:-1]] = 2  # a bound between runs ends one and starts the next
        both = np.stack((self.real, self.padded))
        cu = torch.from_numpy((both.repeat(repeats, axis=1) - both[:, first[:-1].repeat(counts)]).astype(np.int32))
        split = counts.tolist()
        cu_seqlens, cu_padded = cu[0].split(split), cu[1].split(split)
        longest = np.maximum.reduceat(self.lengths, first[:-1]).tolist()
        if count % size:
            tensors = [tensor.split(size) for tensor in (self.input_ids, self.targets, self.position_ids)]
        else:  # unbinding costs less per view than splitting
            tensors = [tensor.view(-1, size, self.width).unbind() for tensor in (self.input_ids, self.targets,
                                                                                    self.position_ids)]  # fmt: skip
        tensors.append([None] * len(split) if self.sources is None else self.sources.split(size))
        return list(map(MicrobatchTensors._make, zip(*tensors, cu_seqlens, cu_padded, longest)))


def _columns(parts: list[np.ndarray], columns: slice) -> np.ndarray:
    """``columns`` of every row of the parts, as one int64 array: the cast made in the one copy that joins them."""
    if len(parts) == 1:
        return parts[0][:, columns].astype(np.int64)
    return np.concatenate([part[:, columns] for part in parts], dtype=np.int64)


def _from_zero(bounds: np.ndarray) -> np.ndarray:
    return (bounds - bounds[0]).astype(np.int32)


def _rows(tensor: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[start:stop]


class StepBlock(RowBlock):
    """A step's rows, kept as the blocks they arrived in (its streams', or its workers'), whose tensors are built once
    for all its microbatches: :meth:`rows` gives a :class:`StepSlice`, which :func:`microbatch_tensors` serves from
    the step's :class:`StepTensors`. The tensors are cut from the blocks directly (the int64 cast is the copy that
    joins them); ``tokens`` are joined only when read.
    """

    def __init__(self, *blocks: RowBlock):  # no RowBlock.__init__: tokens is a property
        self._parts = [block.tokens for block in blocks]
        self.flags, self.sources = RowBlock.joined_marks(list(blocks))
        self.pieces = None
        self.count = sum(len(part) for part in self._parts)
        self._tokens: np.ndarray | None = None
        self._built: tuple[tuple[int, int], StepTensors] | None = None

    @property
    def tokens(self) -> np.ndarray:  # type: ignore[override]
        if self._tokens is None:
            self._tokens = joined_arrays(self._parts)
        return self._tokens

    @property
    def token_parts(self) -> list[np.ndarray]:
        return self._parts

    def __len__(self) -> int:
        return self.count

    @property
    def capacity(self) -> int:
        return self._parts[0].shape[1]

    def rows(self, start: int, stop: int) -> StepSlice:
        return StepSlice(self, start, stop)

    def tensors(self, bos_id: int, context_parallel_size: int) -> StepTensors:
        key = (bos_id, context_parallel_size)
        if self._built is None or self._built[0] != key:
            self._built = (key, StepTensors(self, bos_id, context_parallel_size))
        return self._built[1]


class StepSlice(RowBlock):
    """Rows ``[start, stop)`` of a :class:`StepBlock` (a microbatch), whose tensors are views of the step's; its
    arrays are cut from the step's only when read (the tensors never need them)."""

    def __init__(self, step: StepBlock, start: int, stop: int):  # no RowBlock.__init__: its fields are properties
        self.step, self.start, self.stop = step, start, stop

    def __len__(self) -> int:
        return max(0, min(self.stop, len(self.step)) - self.start)

    @property
    def capacity(self) -> int:
        return self.step.capacity

    @property
    def tokens(self) -> np.ndarray:  # type: ignore[override]
        return self.step.tokens[self.start : self.stop]

    @property
    def flags(self) -> np.ndarray | None:  # type: ignore[override]
        return None if self.step.flags is None else self.step.flags[self.start : self.stop]

    @property
    def sources(self) -> np.ndarray | None:  # type: ignore[override]
        return None if self.step.sources is None else self.step.sources[self.start : self.stop]

    @property
    def pieces(self) -> None:  # type: ignore[override]
        return None


def microbatch_tensors(rows: RowBlock, bos_id: int, context_parallel_size: int) -> MicrobatchTensors:
    """The tensors of a microbatch's rows: a view of its step's (built on first use) for a :class:`StepSlice`."""
    if isinstance(rows, StepSlice):
        return rows.step.tensors(bos_id, context_parallel_size).microbatch(rows.start, rows.stop)
    return StepTensors(rows, bos_id, context_parallel_size).microbatch(0, len(rows))
