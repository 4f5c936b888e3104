"""Mixture stream: one of the K streams of a weighted mixture, each step's rows taken from N per-source streams.

Algorithm: for a mixture of N sources, stream ``k`` of ``K`` is N *sub-streams*, sub-stream ``i`` being source
``i``'s stream ``k`` (:class:`~lightning_d9d.streaming.stream.TokenStream` over source ``i``'s units dealt to K
streams, exactly as a single corpus's are): a pure function of the source, the stream number and the data.
At global step ``s`` the :class:`~lightning_d9d.streaming.mixture.MixturePlan` gives the step's rows per
source; they are dealt to the K streams (``deal_rows``), and stream ``k`` takes its ``r_{k,i}(s)`` rows from
sub-stream ``i`` (possibly none), laid out in source order. So a stream still gives ``R = G / K`` rows per step
and every stage after it (ranks, workers, microbatches) is that of a single corpus; every row holds tokens of
one source, and the step's rows per source are the plan's, whatever the layout.

State: :class:`MixtureState` ``{"kind": "mixture", "version", "step", "sources": {name: stream state}}``: the
steps taken and every sub-stream's own state, by source name, so a resume under other shares continues every
source where it stopped, and a source added later starts fresh.

Trade-off: each sub-stream keeps its own best-fit buffer (``bestfit_buffer_size`` per source and stream), so
memory and the documents tokenized before the first step grow with N; in exchange a source's rows never
depend on the other sources or on the shares (only on how many rows it has given).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lightning_d9d.streaming.bestfit_restore import read_buffered_texts
from lightning_d9d.streaming.mixture import MixturePlan, deal_rows
from lightning_d9d.streaming.state import InvalidDataState, field, integer, join, mapping, version
from lightning_d9d.streaming.stream import BestFitState, RowBlock, StreamCounters, StreamSpec, StreamState, TokenStream


@dataclass(frozen=True)
class MixtureSpec:
    """Everything a mixture's streams need, picklable for DataLoader workers.

    Attributes:
        names: the source names, in order (a row's source index refers to it).
        sources: each source's stream spec (same K, seq_len, packing, tokenizer; own files and text column).
        plan: the rows per source of every step.
        prefetch: chunks each source of a stream reads ahead.
        chunk_chars: a tokenizer call also ends before this many characters (0: the sources' own setting).
    """

    names: tuple[str, ...]
    sources: tuple[StreamSpec, ...]
    plan: MixturePlan
    prefetch: int = 4
    chunk_chars: int = 0

    @property
    def num_streams(self) -> int:
        return self.sources[0].num_streams

    @property
    def rows_per_block(self) -> int:
        return self.plan.rows_per_step // self.num_streams

    @property
    def packing(self) -> str:
        return self.sources[0].packing

    @property
    def bos_id(self) -> int:
        return self.sources[0].bos_id

    @property
    def capacity(self) -> int:
        return self.sources[0].capacity

    def source_spec(self, i: int) -> StreamSpec:
        """Source ``i``'s spec with this process's read-ahead and chunking."""
        spec = self.sources[i]
        # Each source reads ahead as a whole stream would: sources taking turns must not starve the tokenizer.
        return replace(spec, prefetch=self.prefetch, chunk_chars=self.chunk_chars or spec.chunk_chars)


@dataclass(frozen=True)
class MixtureState:
    """A mixture stream's state after a step: the steps it has given and each source's stream state.

    Attributes:
        step: global steps taken (the plan's step of the next block).
        sources: each source's sub-stream state, by name (a source missing here starts from its beginning).
    """

    VERSION = 1
    kind = "mixture"

    step: int = 0
    sources: Mapping[str, StreamState] = dataclasses.field(default_factory=dict)

    @property
    def blocks(self) -> int:
        return self.step

    @property
    def counters(self) -> StreamCounters:
        """The sources' counters summed."""
        totals = StreamCounters().to_dict()
        for state in self.sources.values():
            for key, value in state.counters.to_dict().items():
                totals[key] += value
        return StreamCounters(**totals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": self.VERSION,
            "step": self.step,
            "sources": {name: state.to_dict() for name, state in self.sources.items()},
        }

    @classmethod
    def from_dict(cls, state: Any, packing: str, path: str = "") -> MixtureState:
        """Read a saved mixture stream state, checking each field's type.

        Raises:
            InvalidDataState: a missing or mistyped field, an unknown version, a state that is not a mixture's.
        """
        state = mapping(state, path or "stream")
        kind = field(state, "kind", path)
        if kind != cls.kind:
            raise InvalidDataState(join(path, "kind"), kind, "this run reads a mixture of sources: expected 'mixture'")
        version(state, path, (cls.VERSION,))
        saved = mapping(field(state, "sources", path), join(path, "sources"))
        sources = {
            str(name): StreamState.from_dict(value, packing, join(join(path, "sources"), str(name)))
            for name, value in saved.items()
        }
        return cls(integer(state, "step", path), sources)

    def check(self, spec: MixtureSpec, stream: int, path: str = "") -> None:
        """Raises :class:`InvalidDataState` unless every source's state lies inside that source's data.

        A source of the state that this run lacks is an error (a source cannot be removed on resume).
        """
        for name, state in self.sources.items():
            where = join(join(path, "sources"), name)
            if name not in spec.names:
                raise InvalidDataState(where, "<a stream state>", f"this run's sources are {list(spec.names)}")
            state.check(spec.sources[spec.names.index(name)], stream, where)


class MixtureStream:
    """An endless iterator of ``(RowBlock, MixtureState)`` for stream ``stream`` of a mixture.

    Args:
        spec: the mixture.
        stream: this stream's number among K.
        state: a state yielded earlier by this stream (``None``: from step 0).
        buffered_texts: per source, its buffered documents' texts already read (or ``None``).
        step_rows: the plan's rows per stream, shared by the streams of a process (``None``: its own).
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
        spec, k, step = self.spec, self.stream, self.state.step
        asked = [0] * len(spec.names)  # this step's rows per source, read by each sub-stream when asked
        subs = []
        for i, name in enumerate(spec.names):
            texts = self.buffered_texts.pop(name, None)
            stream = TokenStream(spec.source_spec(i), k, self.state.sources.get(name), texts)
            subs.append(stream.blocks(_asked(asked, i)))
        sources = np.arange(len(spec.names), dtype=np.int64)
        split = spec.packing == "bestfit_split"
        try:
            first = True
            while True:
                asked[:] = self.step_rows.of(step)[k]
                if first and len(subs) > 1:
                    # The sources' first blocks at once: each waits on its first reads (and a restored buffer's
                    # documents), which overlap across sources but would add up one source after another.
                    with ThreadPoolExecutor(len(subs), thread_name_prefix="lightning-d9d-source") as pool:
                        parts = list(pool.map(next, subs))
                else:
                    parts = [next(sub) for sub in subs]
                first = False
                tokens = np.concatenate([block.tokens for block, _ in parts])
                flags = np.concatenate([block.flags for block, _ in parts]) if split else None
                step += 1
                self.state = MixtureState(step, {name: state for name, (_, state) in zip(spec.names, parts)})
                yield RowBlock(tokens, flags, np.repeat(sources, asked)), self.state
        finally:
            for sub in subs:
                sub.close()


class StepRows:
    """The plan's rows per stream and source of each step, computed once per step for all the streams of a
    process (they move in lockstep), a few recent steps kept."""

    def __init__(self, plan: MixturePlan, num_streams: int):
        self.plan, self.num_streams = plan, num_streams
        self._lock = threading.Lock()  # first blocks are asked for from several threads at once
        self._dealt: dict[int, list[tuple[int, ...]]] = {}
        self._quotas: Iterator[tuple[int, ...]] | None = None
        self._next = -1

    def of(self, step: int) -> list[tuple[int, ...]]:
        """``plan.stream_rows_of_step(step, K)``."""
        with self._lock:
            dealt = self._dealt.get(step)
            if dealt is None:
                if self._quotas is None or self._next != step:
                    self._quotas = self.plan.quotas_from(step)
                dealt = deal_rows(next(self._quotas), step, self.num_streams)
                self._next = step + 1
                self._dealt = {s: d for s, d in self._dealt.items() if s > step - 4}
                self._dealt[step] = dealt
            return dealt


def _asked(asked: list[int], source: int) -> Iterator[int]:
    while True:
        yield asked[source]


def mixture_streams(spec: MixtureSpec, hosted: list[int], states: Mapping[int, Any]) -> list[MixtureStream]:
    """The mixture streams one process hosts, continuing from ``states``; each source's buffered documents of
    all of them read once (a row group shared by several streams' buffers is read one time)."""
    texts: dict[int, dict[str, Any]] = {sid: {} for sid in hosted}
    if len(states) > 1:
        for i, name in enumerate(spec.names):
            buffers = {
                sid: state.sources[name].packing.buffer
                for sid, state in states.items()
                if name in state.sources and isinstance(state.sources[name].packing, BestFitState)
            }
            saved = [b for b in buffers.values() if b is not None and len(b)]
            if saved:
                shared = read_buffered_texts(spec.source_spec(i), saved)
                for sid in buffers:
                    texts[sid][name] = shared
    shared = StepRows(spec.plan, spec.num_streams)
    return [MixtureStream(spec, sid, states.get(sid), texts[sid], shared) for sid in hosted]
