"""Mixture stream: one of the K streams of a corpus, each step's rows taken from its sources' streams.

Stream ``k`` is N *sub-streams*, sub-stream ``i`` being source ``i``'s stream ``k``; at step ``s`` it takes the
rows the :class:`MixturePlan` deals it from each (possibly none), in source order, each row tagged with its source.
So a stream gives ``R = G / K`` rows per step whatever the shares, and everything after it is the same for one
source or many. Its state holds every sub-stream's state by source name, so a resume under other shares continues
every source, and a source added later starts fresh. Trade-off: each sub-stream keeps its own best-fit buffer
(memory grows with N), but a source's rows never depend on the other sources or on the shares.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing.bestfit_restore import UnitTokens, read_buffered_texts
from lightning_d9d.streaming.packing.rows import RowBlock, StreamCounters
from lightning_d9d.streaming.plans.edits import is_skipped
from lightning_d9d.streaming.plans.mixture import MixturePlan, deal_rows
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.plans.state import field as state_field
from lightning_d9d.streaming.plans.state import integer, join, mapping
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream, saved_buffers


@dataclass(frozen=True)
class MixtureState:
    """A corpus stream's state after a step: the steps it has given and each source's stream state.

    Attributes:
        step: global steps taken (the plan's step of the next block).
        sources: each source's sub-stream state, by name (a source missing here starts from its beginning).
    """

    step: int = 0
    sources: Mapping[str, StreamState] = field(default_factory=dict)

    @property
    def counters(self) -> StreamCounters:
        totals = StreamCounters()
        for state in self.sources.values():
            totals.add(state.counters)
        return totals

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sources": {name: state.to_dict() for name, state in self.sources.items()}}

    @classmethod
    def from_dict(cls, state: Any, spec: MixtureSpec, path: str = "") -> MixtureState:
        """Read a saved state of one of ``spec``'s streams.

        Raises:
            InvalidDataState: a missing or mistyped field, or a source this run lacks.
        """
        state = mapping(state, path or "stream")
        where = join(path, "sources")
        saved = mapping(state_field(state, "sources", path), where)
        sources = {}
        for name, value in saved.items():
            if name not in spec.names:
                raise InvalidDataState(join(where, str(name)), "<a stream state>", f"this run's sources are "
                                       f"{list(spec.names)}")  # fmt: skip
            sources[name] = StreamState.from_dict(value, spec.sources[spec.names.index(name)], join(where, name))
        return cls(integer(state, "step", path), sources)

    def check(self, spec: MixtureSpec, stream: int, path: str = "") -> None:
        """Raises :class:`InvalidDataState` unless every source's state lies inside that source's data."""
        for name, state in self.sources.items():
            state.check(spec.sources[spec.names.index(name)], stream, join(join(path, "sources"), name))


class MixtureStream:
    """An endless iterator of ``(RowBlock, MixtureState)`` for stream ``stream`` of a corpus.

    Args:
        spec: the corpus.
        stream: this stream's number among K.
        state: a state yielded earlier by this stream (``None``: from step 0).
        buffered_texts: per source, its buffered documents' texts already read (or ``None``).
        step_rows: the plan's rows per stream, shared by the streams of a process (``None``: its own).

    Raises:
        InvalidDataState: a state whose positions lie outside this stream's data.
    """

    def __init__(
        self,
        spec: MixtureSpec,
        stream: int,
        state: MixtureState | None = None,
        buffered_texts: Mapping[str, Any] | None = None,
        step_rows: StepRows | None = None,
    ):
        self.spec, self.stream = spec, stream
        self.step_rows = step_rows if step_rows is not None else StepRows(spec.plan, spec.num_streams)
        self.state = state if state is not None else MixtureState()
        if state is not None:
            state.check(spec, stream)
        self.buffered_texts = dict(buffered_texts or {})

    def __iter__(self) -> Generator[tuple[RowBlock, MixtureState], None, None]:
        spec, k, step, names = self.spec, self.stream, self.state.step, self.spec.names
        # This step's (rows, capacity) per source: each sub-stream pulls its own entry (a C-level iterator, no
        # generator frame per pull), set just before the sub-streams are asked.
        sizes: list[tuple[int, int]] = [(0, 0)] * len(names)
        subs = []
        for i, name in enumerate(names):
            texts = self.buffered_texts.pop(name, None)
            stream = TokenStream(spec.sources[i], k, self.state.sources.get(name), texts)
            subs.append(stream.shaped_blocks(map(sizes.__getitem__, itertools.repeat(i))))
        skips, step_rows = spec.skipped, self.step_rows
        sources = np.arange(len(names), dtype=np.int64)
        capacity, capacity_until = 0, step  # the row length, the same up to step capacity_until
        single, first = len(subs) == 1, True
        try:
            while True:
                skipped = bool(skips) and is_skipped(step, skips)  # a data step consumed untrained: rows dropped
                asked = step_rows.of(step)[k]
                if step >= capacity_until:
                    capacity, capacity_until = spec.capacity_span(step)
                if single:  # one source: its block is the stream's
                    sizes[0] = (asked[0], capacity)
                    parts = [next(subs[0])]
                    states = {names[0]: parts[0][1]}
                else:
                    for i, rows in enumerate(asked):
                        sizes[i] = (rows, capacity)
                    if first:
                        # The sources' first blocks at once: each waits on its first reads (and a restored buffer's
                        # documents), which overlap across sources but would add up one source after another.
                        with ThreadPoolExecutor(len(subs), thread_name_prefix="lightning-d9d-source") as pool:
                            parts = list(pool.map(next, subs))
                        first = False
                    else:
                        parts = [next(sub) for sub in subs]
                    states = {name: state for name, (_, state) in zip(names, parts)}
                step += 1
                self.state = MixtureState(step, states)
                if skipped:
                    continue
                yield _joined(parts, np.repeat(sources, asked)), self.state
        finally:
            for sub in subs:
                sub.close()


def _joined(parts: list[tuple[RowBlock, Any]], sources: np.ndarray) -> RowBlock:
    """The sources' blocks of a step as one, each row tagged with its source (and each piece, where recorded)."""
    if len(parts) == 1:
        part = parts[0][0]
        block = RowBlock(part.tokens, part.flags, sources)
        if part.pieces is None:
            return block
    else:
        block = RowBlock.joined([part for part, _ in parts])
        block.sources = sources
        if all(part.pieces is None for part, _ in parts):
            return block
    for i, (part, _) in enumerate(parts):  # provenance: each piece names its source
        if part.pieces is not None:
            part.pieces[:, 6] = i
    block.pieces = RowBlock.joined_pieces([part for part, _ in parts])
    return block


class StepRows:
    """The plan's rows per stream and source of each step, computed once for a process's lockstep streams (the
    latest ``keep`` steps are kept: streams in lockstep ask a few; a replay of one stream after another asks all)."""

    def __init__(self, plan: MixturePlan, num_streams: int, keep: int = 4):
        self.plan, self.num_streams, self.keep = plan, num_streams, keep
        self._lock = threading.Lock()  # first blocks are asked for from several threads at once
        self._dealt: dict[int, list[tuple[int, ...]]] = {}
        self._quotas: Iterator[tuple[int, ...]] | None = None
        self._next = -1
        self._last: tuple[int, list[tuple[int, ...]]] = (-1, [])

    def of(self, step: int) -> list[tuple[int, ...]]:
        last = self._last  # one read: the K streams of a step ask in turn, and another thread may replace it
        if last[0] == step:
            return last[1]
        with self._lock:
            dealt = self._dealt.get(step)
            if dealt is None:
                if self._quotas is None or self._next != step:
                    self._quotas = self.plan.quotas_from(step)
                dealt = deal_rows(next(self._quotas), step, self.num_streams)
                self._next = step + 1
                if len(self._dealt) >= self.keep:
                    self._dealt = {s: d for s, d in self._dealt.items() if s > step - self.keep}
                self._dealt[step] = dealt
            self._last = (step, dealt)
            return dealt


def mixture_streams(spec: MixtureSpec, hosted: list[int], states: Mapping[int, MixtureState]) -> list[MixtureStream]:
    """The streams one process hosts, continuing from ``states``: their buffered texts read once for all, or (with a
    token cache) their buffered units' tokens loaded once for all, each when a piece of it is first picked."""
    texts: dict[int, dict[str, Any]] = {sid: {} for sid in hosted}
    if len(states) > 1:
        for i, name in enumerate(spec.names):
            if spec.sources[i].cache is not None:
                shared_units = UnitTokens(spec.sources[i])
                for sid in hosted:
                    texts[sid][name] = shared_units
                continue
            owners = [sid for sid, state in states.items() if name in state.sources]
            buffers = saved_buffers([states[sid].sources[name] for sid in owners])
            if buffers:
                shared = read_buffered_texts(spec.sources[i], buffers)
                for sid in owners:
                    texts[sid][name] = shared
    shared_rows = StepRows(spec.plan, spec.num_streams)
    return [MixtureStream(spec, sid, states.get(sid), texts[sid], shared_rows) for sid in hosted]
