"""Step tensors: a step's packed rows turned into a microbatch's tensors, vectorised over all the step's rows at once.

``(rows, seq_len + 1)`` token ids become int64 ``input_ids`` and ``targets`` (one cast each), ``position_ids`` (the
flat offset less the last sequence start at or before it: one ``np.repeat``) and the sequence bounds (the flat
sequence starts, found once). A sequence starts at every row start and at BOS (``concat``, and ``bestfit`` without
context parallelism) or at a ``START`` flag (flagged rows); a ``NO_TARGET`` flag makes a target ``-100``. A run of
rows (a microbatch) is then a view of the step's tensors plus its slice of the bounds, since no sequence crosses a
row. Trade-off: the step's tensors live as long as any of its microbatches (a step's worth of int64 memory), for
one pass of a few numpy calls per step instead of per microbatch, and no Python per row or per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lightning_d9d.streaming.packing import CP_PAD, NO_TARGET, START, RowBlock
from lightning_d9d.tokens import IGNORE_INDEX

_ORIGINS: dict[int, np.ndarray] = {}  # flat offsets 0..n-1 by n (read-only), reused step after step


def _flat_offsets(size: int) -> np.ndarray:
    offsets = _ORIGINS.get(size)
    if offsets is None:
        if len(_ORIGINS) > 8:  # step sizes come from a handful of settings; never grow without bound
            _ORIGINS.clear()
        offsets = _ORIGINS[size] = np.arange(size, dtype=np.int64)
        offsets.flags.writeable = False
    return offsets


@dataclass
class MicrobatchTensors:
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
        tokens, flags = rows.tokens, rows.flags
        count, capacity = tokens.shape
        width = self.width = capacity - 1
        inputs, targets = tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)
        if flags is None:
            starts = tokens[:, :-1] == bos_id
        else:
            np.putmask(targets, (flags[:, 1:] & NO_TARGET) != 0, IGNORE_INDEX)
            starts = (flags[:, :-1] & START) != 0
        starts[:, 0] = True
        at = np.flatnonzero(starts)
        size = count * width
        bounds = np.empty(len(at) + 1, np.int64)  # every sequence start, then the end
        bounds[:-1], bounds[-1] = at, size
        lengths = bounds[1:] - bounds[:-1]
        last_start = np.repeat(at, lengths)
        positions = np.subtract(_flat_offsets(size), last_start, out=last_start).reshape(count, width)
        self.input_ids, self.targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        self.position_ids = torch.from_numpy(positions)
        self.sources = None if rows.sources is None else torch.from_numpy(np.asarray(rows.sources, np.int64))
        # bounds[row_first[r]] is row r's first token: every row start is a sequence start.
        row_first = np.searchsorted(at, np.arange(0, size + 1, width))
        self.row_longest = np.maximum.reduceat(lengths, row_first[:-1]).tolist() if count else []
        self.row_first = row_first.tolist()
        self.padded = self.real = bounds  # real: the offsets less the CP padding before them
        self.whole_rows = context_parallel_size > 1 and flags is None  # concat under CP: a row is one sequence
        if context_parallel_size > 1 and flags is not None:
            pads_before = np.zeros(size + 1, np.int64)
            np.cumsum((flags[:, :-1] & CP_PAD) != 0, out=pads_before[1:])
            self.real = bounds - pads_before[bounds]

    def microbatch(self, start: int, stop: int) -> MicrobatchTensors:
        """Rows ``[start, stop)`` of the step: views of its tensors, and their own sequence bounds."""
        sources = None if self.sources is None else self.sources[start:stop]
        parts = self.input_ids[start:stop], self.targets[start:stop], self.position_ids[start:stop], sources
        if self.whole_rows:
            padded = torch.arange(0, (stop - start) * self.width + 1, self.width, dtype=torch.int32)
            return MicrobatchTensors(*parts, padded, padded.clone(), self.width if stop > start else 0)
        first, last = self.row_first[start], self.row_first[stop]
        padded = self.padded[first : last + 1]
        cu_padded = (padded - padded[0]).astype(np.int32)
        if self.real is self.padded:
            cu_seqlens = cu_padded.copy()
        else:
            real = self.real[first : last + 1]
            cu_seqlens = (real - real[0]).astype(np.int32)
        longest = max(self.row_longest[start:stop]) if stop > start else 0
        return MicrobatchTensors(*parts, torch.from_numpy(cu_seqlens), torch.from_numpy(cu_padded), longest)


class StepBlock(RowBlock):
    """A step's rows whose tensors are built once for all its microbatches: :meth:`rows` gives a
    :class:`StepSlice`, which :func:`microbatch_tensors` serves from the step's :class:`StepTensors`."""

    def __init__(self, block: RowBlock):
        super().__init__(block.tokens, block.flags, block.sources)
        self._built: tuple[tuple[int, int], StepTensors] | None = None

    def rows(self, start: int, stop: int) -> StepSlice:
        return StepSlice(self, start, stop)

    def tensors(self, bos_id: int, context_parallel_size: int) -> StepTensors:
        key = (bos_id, context_parallel_size)
        if self._built is None or self._built[0] != key:
            self._built = (key, StepTensors(self, bos_id, context_parallel_size))
        return self._built[1]


class StepSlice(RowBlock):
    """Rows ``[start, stop)`` of a :class:`StepBlock` (a microbatch), whose tensors are views of the step's."""

    def __init__(self, step: StepBlock, start: int, stop: int):
        flags = None if step.flags is None else step.flags[start:stop]
        sources = None if step.sources is None else step.sources[start:stop]
        super().__init__(step.tokens[start:stop], flags, sources)
        self.step, self.start, self.stop = step, start, stop


def microbatch_tensors(rows: RowBlock, bos_id: int, context_parallel_size: int) -> MicrobatchTensors:
    """The tensors of a microbatch's rows: a view of its step's (built on first use) for a :class:`StepSlice`."""
    if isinstance(rows, StepSlice):
        return rows.step.tensors(bos_id, context_parallel_size).microbatch(rows.start, rows.stop)
    return StepTensors(rows, bos_id, context_parallel_size).microbatch(0, len(rows))
