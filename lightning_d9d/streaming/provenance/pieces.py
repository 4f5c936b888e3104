"""Provenance: which pieces of which documents every row of a global step holds, by replaying streams.

A stream replayed from a state saved at training step ``t`` gives exactly the blocks it gave in training (rows
are a function of the data, the settings and the state), and with ``record_pieces`` every block also lists its
pieces: row, column, length, and the document (row group, row) and token offset each comes from. Global row ``g``
of step ``s`` is row ``g - k·R`` of stream ``k``'s block, ``R = G(s) / K``, in the order every rank concatenates
its streams. Trade-off: a query packs the steps between the saved state and the step asked (cheap with a filled
token cache), where a per-step record of pieces would cost megabytes per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.streams.mixture_stream import MixtureState, MixtureStream, StepRows

PIECE_COLUMNS = ("row", "column", "length", "group", "document_row", "offset", "source")
"""The integers that describe a piece of a block's row (``group``: the global row group, ``offset``: the piece's
first token in its BOS-prefixed document)."""


@dataclass(frozen=True)
class Piece:
    """One piece of one row of a global step: ``length`` tokens at ``column`` of row ``batch_row`` (rank-independent:
    the rows of every rank, in rank order), holding tokens ``[start, stop)`` of a document (token 0 is its BOS),
    named by source, file, row group in that file and row in that row group."""

    step: int
    batch_row: int
    column: int
    length: int
    source: str
    file: str
    row_group: int
    document_row: int
    start: int
    stop: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def recording(spec: MixtureSpec) -> MixtureSpec:
    """``spec`` with every source recording the pieces of its rows (no row changes)."""
    sources = tuple(dataclasses.replace(source, record_pieces=True) for source in spec.sources)
    return dataclasses.replace(spec, sources=sources)


def replay(
    spec_at: Callable[[int], MixtureSpec],
    stream: int,
    state: MixtureState | None,
    first: int,
    steps: Iterable[int],
    restarts: Iterable[int] = (),
    step_rows: StepRows | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """``(training step, pieces)`` of stream ``stream``'s blocks for ``steps``, replayed from ``state`` saved at
    training step ``first`` (``None``: the stream's start, ``first`` 0) under ``spec_at(step)`` (recording pieces).
    At each of ``restarts`` (a resume that changed the stream's settings, as an exclusion does) the stream starts
    again from its state there under ``spec_at`` of that step, as training did. ``step_rows`` may be shared."""
    wanted = sorted(set(steps))
    if not wanted:
        return
    if wanted[0] < first:
        raise ValueError(f"steps from {wanted[0]} cannot be replayed from a state at step {first}")
    cuts = [step for step in sorted(set(restarts)) if first < step <= wanted[-1]]
    step = first
    for stop in [*cuts, wanted[-1] + 1]:
        blocks = iter(MixtureStream(spec_at(step), stream, state, step_rows=step_rows))
        try:
            while step < stop:
                block, state = next(blocks)
                if step in wanted:
                    yield step, block.pieces
                step += 1
        finally:
            blocks.close()


def pieces_of_step(
    spec: MixtureSpec,
    step: int,
    block_pieces: Mapping[int, np.ndarray],
    rows_per_stream: int,
    file_of: Callable[[int, int], tuple[str, int]],
) -> list[Piece]:
    """The step's pieces in global row order, from each stream's block pieces."""
    out = []
    for stream in sorted(block_pieces):
        table = block_pieces[stream]
        for row, column, length, group, document_row, offset, source in table.tolist():
            file, in_file = file_of(source, group)
            out.append(Piece(step, stream * rows_per_stream + row, column, length, spec.names[source], file,
                             in_file, document_row, offset, offset + length))  # fmt: skip
    out.sort(key=lambda piece: (piece.batch_row, piece.column))
    return out


def file_namer(spec: MixtureSpec) -> Callable[[int, int], tuple[str, int]]:
    """``(source, global row group) -> (file as resolved, row group in that file)``."""

    def name(source: int, group: int) -> tuple[str, int]:
        index = spec.sources[source].index
        return redact(index.files[int(index.file_of[group])]), int(index.group_in_file[group])

    return name
