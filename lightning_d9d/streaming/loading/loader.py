"""Loader: one rank's share of K topology-independent streams, assembled into the same global steps on any layout.

Global step ``s`` is rows ``[s·R, (s+1)·R)`` of every stream, ``R = G / K``, so a step's rows never depend on the
world size, workers or microbatch size, and the streams' states at a step boundary resume on any layout. Rank ``r``
owns a contiguous block of streams; each worker hosts some and yields one item per step, which DataLoader's
round-robin lets this process reorder into the step's microbatches. Handing out a step's last microbatch commits
the states a checkpoint saves. Workers fork unless a file is read over the network: then a forkserver, since a
forked child can inherit pyarrow's S3 client locks mid-request and hang (the training script must then guard its
top-level code with ``if __name__ == "__main__":``). Trade-off: a larger K lets more ranks and workers share the
streams, at the cost of K best-fit buffers and K streams to start on every resume.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_d9d.core.child_processes import exit_with_process
from lightning_d9d.core.epoch_iterator import (
    EpochIterator,
    OneIterationAtATime,
    ResumedByDataModule,
    close_at_exit,
    forking_workers,
    shutdown_workers,
)
from lightning_d9d.core.resume import StepLayout, TrainPosition
from lightning_d9d.streaming.loading.step_tensors import StepBlock
from lightning_d9d.streaming.packing.bestfit_stage import BestFitState
from lightning_d9d.streaming.packing.buffer_rows import BufferRows, received
from lightning_d9d.streaming.packing.rows import RowBlock
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.streams.mixture_stream import MixtureState, mixture_streams
from lightning_d9d.streaming.streams.stream import StreamState
from lightning_d9d.streaming.tokens.memory import IN_PROCESS_CHUNK_CHARS, WORKER_CHUNK_CHARS

StreamStates = dict[int, MixtureState]

# Chunks each stream reads and tokenizes ahead; a process hosting many streams keeps fewer per stream.
_PREFETCH_PER_PROCESS = 8


# URL schemes whose files a fresh process could not see (they live in this process's memory) or that need no
# network client: forked workers read them.
_FORKABLE_SCHEMES = frozenset({"file", "local", "memory"})


def worker_start_method(files: Iterable[str]) -> str | None:
    """``"forkserver"`` when any file is read through a network client (not fork-safe), else ``None`` (fork)."""
    for path in files:
        if "://" in path and path.split("://", 1)[0].lower() not in _FORKABLE_SCHEMES:
            return "forkserver"
    return None


def _forkserver_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading this module (and Lightning when in use)."""
    context = multiprocessing.get_context("forkserver")
    preload = list(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    wanted = [name for name in (__name__, "lightning") if name in sys.modules and name not in preload]
    if wanted:
        context.set_forkserver_preload([*preload, *wanted])  # no effect once the server runs
    return context


def rank_streams(num_streams: int, world_size: int, rank: int) -> list[int]:
    """The streams rank ``rank`` of ``world_size`` owns: a contiguous block of ``num_streams / world_size``."""
    per_rank = num_streams // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def check_layout(num_streams: int, dp_size: int, num_workers: int) -> None:
    """Raises ValueError unless the data-parallel size divides K and ``num_workers`` divides K / dp_size."""
    if num_streams % dp_size:
        valid = [w for w in range(1, num_streams + 1) if num_streams % w == 0]
        raise ValueError(
            f"num_streams={num_streams} streams cannot be shared by data-parallel size dp_size={dp_size}: every "
            f"data-parallel replica owns num_streams / dp_size whole streams; with num_streams={num_streams} the "
            f"data-parallel size can be {valid}, or choose num_streams as a multiple of {dp_size} "
            f"(e.g. {dp_size * max(1, num_workers) * 2})"
        )
    per_rank = num_streams // dp_size
    if num_workers and per_rank % num_workers:
        valid = [n for n in range(1, per_rank + 1) if per_rank % n == 0]
        raise ValueError(
            f"num_workers={num_workers} workers cannot share the {per_rank} streams of each data-parallel replica "
            f"(num_streams={num_streams}, dp_size={dp_size}): every worker hosts the same number of streams; use "
            f"num_workers in {[0, *valid]}, or num_streams a multiple of {dp_size * num_workers}"
        )


@dataclass
class StreamPosition(TrainPosition):
    """Where one rank's streams are: the single place the data position lives, changed only by its methods.

    Attributes:
        states: the latest state of each stream this rank owns (by stream number).
        committed: ``(epoch, step, states)`` at the last optimizer-step boundary (what checkpoints save).
        previous: ``committed`` of the boundary before, saved while a step's last microbatch is still in flight.
        generation: bumped whenever the position is replaced (resume), which invalidates running streams.
    """

    states: StreamStates = field(default_factory=dict)
    committed: tuple[int, int, StreamStates] = (0, 0, {})
    previous: tuple[int, int, StreamStates] = (0, 0, {})
    generation: int = 0
    on_commit: Callable[[int, int, StreamStates], None] | None = field(default=None, compare=False, repr=False)

    def commit(self, epoch: int, step: int) -> None:
        """Record the streams' states at the boundary before ``step`` just reached, keeping the one before (and tell
        ``on_commit``)."""
        self.previous, self.committed = self.committed, (epoch, step, dict(self.states))
        if self.on_commit is not None:
            self.on_commit(epoch, step, self.committed[2])

    def committed_states(self, step: int) -> StreamStates:
        """The streams' states at the start of ``step``: the last boundary or the one before (else RuntimeError)."""
        if step == self.step:
            return self.committed[2]
        if step == self.step - 1:
            return self.previous[2]
        raise RuntimeError(f"no committed stream states for step {step} at step {self.step} of epoch {self.epoch}")

    def restart(self, epoch: int, step: int, states: StreamStates, layout: StepLayout) -> None:
        """Jump to ``step`` of ``epoch`` with the given stream states (a resume)."""
        self.start(epoch, step, layout)
        self.states = dict(states)
        self.committed = self.previous = (epoch, step, dict(states))
        self.generation += 1

    def begin_epoch(self, epoch: int, microbatch: int, layout: StepLayout) -> None:
        """Stand at ``microbatch`` of ``epoch`` of ``layout`` (the streams continue from ``states`` either way)."""
        self.epoch, self.microbatches, self.layout = epoch, microbatch, layout

    def enter_step(self, states: StreamStates) -> None:
        """A step's blocks arrived: ``states`` are their streams' states after it."""
        self.states.update(states)

    def next_microbatch(self) -> tuple[int, int]:
        """``(step, index in it)`` of the next microbatch to hand out."""
        step = self.layout.step_of(self.microbatches)
        return step, self.microbatches - self.layout.before(step)

    def hand_out(self, step: int, index: int, count: int) -> None:
        """Count one microbatch handed out: ``index`` of the ``count`` of ``step``, the next one
        (:meth:`next_microbatch`). A step's last commits the states."""
        self.microbatches += 1
        if index == count - 1:
            self.commit(self.epoch, step + 1)


class _HostedStreams(IterableDataset):
    """What one process hosts of a rank's streams: per step, a list of one block per hosted stream."""

    def __init__(
        self,
        spec: MixtureSpec,
        streams: list[int],
        num_workers: int,
        states: StreamStates,
        chunk_chars: int,
        environment: dict[str, str] | None = None,
    ):
        self.spec, self.streams, self.num_workers, self.states = spec, streams, num_workers, states
        self.chunk_chars = chunk_chars
        self.environment = environment  # set for workers that do not inherit this process's environment
        self.requester = os.getpid()  # the process whose end ends such workers

    def __iter__(self) -> Iterator[list[tuple[int, RowBlock, MixtureState]]]:
        info = get_worker_info()
        hosted = self.streams
        if info is not None:
            if self.environment is not None:  # a forkserver's child: not the training process's
                _take_environment(self.environment)
                exit_with_process(self.requester)
            # The workers are the parallelism: each tokenizes on one core (when the parent has not tokenized
            # before forking, every worker would otherwise start a pool as wide as the machine). Only this
            # process is set.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")  # the same for the fast backend's pool
            hosted = self.streams[info.id :: self.num_workers]
        deltas = WireFormat() if info is not None else None  # what crosses to the training process, compactly
        spec = self.spec.with_reading(max(1, _PREFETCH_PER_PROCESS // len(hosted)), self.chunk_chars)
        states = {sid: self.states[sid] for sid in hosted if sid in self.states}
        iterators: list[Iterator] = [iter(stream) for stream in mixture_streams(spec, hosted, states)]
        try:
            # Every stream's first block at once: a started or resumed stream waits on its first chunks (and a
            # restored best-fit buffer on tokenizing the documents it picks), which overlap across streams but
            # would add up one stream after another.
            if len(hosted) > 1:
                with ThreadPoolExecutor(len(hosted), thread_name_prefix="lightning-d9d-start") as pool:
                    firsts = list(pool.map(next, iterators))
                items = [(sid, block, state) for sid, (block, state) in zip(hosted, firsts)]
                yield items if deltas is None else deltas.encode(items)
            while True:
                items = [(sid, *next(blocks)) for sid, blocks in zip(hosted, iterators)]
                yield items if deltas is None else deltas.encode(items)
        finally:
            for blocks in iterators:
                blocks.close()


class WireFormat:
    """A worker's items of a step as they cross to the training process, compactly (``encode`` in the worker,
    ``decode`` here): its streams' rows as one block (ids as uint16 where they fit, flags as positions), each
    stream's rows a view of it again on arrival, and a best-fit buffer's rows as their change since the last step
    (:meth:`BufferRows.change_from`), chained here the same way, so neither side builds a buffer's table per step.
    """

    def __init__(self) -> None:
        self.sent: dict[tuple[int, str], BufferRows] = {}

    def encode(self, items: list[tuple]) -> tuple:
        block = RowBlock.joined([block for _, block, _ in items])
        states = [self._map(sid, state, self._change) for sid, _, state in items]
        return [sid for sid, _, _ in items], [len(block) for _, block, _ in items], _packed_block(block), states

    def decode(self, message: tuple) -> list[tuple]:
        sids, counts, packed, states = message
        block, stop = _unpacked_block(packed), 0
        items = []
        for sid, count, state in zip(sids, counts, states):
            start, stop = stop, stop + count
            items.append((sid, block.rows(start, stop), self._map(sid, state, self._received)))
        return items

    def _map(self, sid: int, state: MixtureState, change: Callable[[tuple[int, str], Any], Any]) -> MixtureState:
        sources = {}
        for name, sub in state.sources.items():
            packing = sub.packing
            if isinstance(packing, BestFitState):  # made directly: dataclasses.replace costs more than the rest
                packing = BestFitState(packing.kind, packing.read, change((sid, name), packing.rows),
                                       packing.next_seq, packing.growth)  # fmt: skip
                sub = StreamState(packing, sub.counters, sub.blocks)
            sources[name] = sub
        return MixtureState(state.step, sources)

    def _change(self, key: tuple[int, str], rows: BufferRows) -> _Wire:
        change = rows.change_from(self.sent.get(key))
        self.sent[key] = rows
        return _Wire(change)

    def _received(self, key: tuple[int, str], wire: _Wire) -> BufferRows:
        rows = self.sent[key] = received(self.sent.get(key), wire.change)
        return rows


class _Wire:
    """A best-fit buffer's rows on the wire: the change a :class:`WireFormat` sends for them."""

    __slots__ = ("change",)

    def __init__(self, change: Any):
        self.change = change


def _packed_block(block: RowBlock) -> tuple:
    tokens = block.tokens
    if tokens.size and int(tokens.max()) < 1 << 16:
        tokens = tokens.astype(np.uint16)
    flags = None
    if block.flags is not None:
        at = np.flatnonzero(block.flags != 0)  # numpy finds a bool array's nonzeros much faster than uint8's
        flags = (block.flags.shape, at.astype(np.uint32), block.flags.reshape(-1)[at])
    return tokens, flags, block.sources


def _unpacked_block(packed: tuple) -> RowBlock:
    tokens, sparse, sources = packed
    flags = None
    if sparse is not None:
        shape, at, values = sparse
        flags = np.zeros(shape, np.uint8)
        flags.reshape(-1)[at] = values
    return RowBlock(tokens, flags, sources)


def _take_environment(environment: dict[str, str]) -> None:
    """Make this process's environment ``environment`` (what a forked worker would have inherited)."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    os.environ.update(environment)


def _as_is(item: Any) -> Any:
    """The workers' collate function: hand the item over unchanged (numpy rows, a plain state)."""
    return item


class _InStreamOrder:
    """``(stream, block, state)`` one at a time, in the rank's stream order, from per-process lists of each step."""

    def __init__(self, lists: Iterator[list[tuple]], streams: list[int], processes: int, deltas: Any = None):
        self.lists, self.processes, self.deltas = lists, processes, deltas
        self.order = {sid: i for i, sid in enumerate(streams)}
        self.pending: list[tuple] = []

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        if not self.pending:
            step = []
            for _ in range(self.processes):
                message = next(self.lists)
                step += message if self.deltas is None else self.deltas.decode(message)
            step.sort(key=lambda item: self.order[item[0]], reverse=True)  # popped from the end
            self.pending = step
        return self.pending.pop()

    def _shutdown_workers(self) -> None:
        """Stop the workers now, or close the in-process streams (their reader threads stop with them)."""
        shutdown_workers(self.lists)
        close = getattr(self.lists, "close", None)
        if close is not None:
            close()


def rank_blocks(spec: MixtureSpec, streams: list[int], num_workers: int, states: StreamStates) -> Iterator[tuple]:
    """Endless ``(stream, block, state)`` of a rank's streams, step after step, continuing from ``states``.

    Args:
        spec: the streams' configuration.
        streams: the rank's streams (``rank_streams``).
        num_workers: DataLoader worker processes (0: the streams run in this process).
        states: saved stream states by stream number (missing: from the beginning).
    """
    chunk_chars = WORKER_CHUNK_CHARS if num_workers > 0 else IN_PROCESS_CHUNK_CHARS
    start_method = worker_start_method(spec.files) if num_workers > 0 else None
    environment = dict(os.environ) if start_method is not None else None
    dataset = _HostedStreams(spec, streams, num_workers, states, chunk_chars, environment)
    if num_workers == 0:
        return _InStreamOrder(iter(dataset), streams, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        # collate_fn=_as_is: the default would turn the numpy rows into tensors in the worker, and each tensor
        # would then cross to this process as a shared-memory file; a pickled array through the pipe is cheaper.
        context = _forkserver_context() if start_method == "forkserver" else None
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=2, collate_fn=_as_is,
                            multiprocessing_context=context)  # fmt: skip
    with forking_workers():
        lists = iter(loader)
    return _InStreamOrder(lists, streams, num_workers, WireFormat())


def steps_of(blocks: Iterator[tuple], streams: int) -> Iterator[tuple[RowBlock, StreamStates]]:
    """The rank's rows of each step (its streams' blocks, in arrival order) and the streams' states after it."""
    while True:
        parts, states = [], {}
        for _ in range(streams):
            sid, block, state = next(blocks)
            parts.append(block)
            states[sid] = state
        yield StepBlock(*parts), states


@dataclass
class _Running:
    """A training loader's running streams, started for ``generation`` of the position, and the steps from them."""

    generation: int
    blocks: Iterator[tuple]
    steps: Iterator[tuple[RowBlock, StreamStates]]


class TokenTrainLoader(ResumedByDataModule):
    """A sized iterable of microbatches for one rank; one epoch is ``len(self)`` microbatches.

    Args:
        spec: the streams' configuration.
        streams: the streams this rank owns.
        num_workers: DataLoader worker processes.
        microbatch_size: rows per microbatch (m).
        epoch_layout: ``epoch -> (its StepLayout, its steps)``: this rank's microbatches of each step of an epoch.
        position: the shared position this loader advances (states are committed at every step's last microbatch).
        start_point: called at an epoch's first ``next()``, returns ``(epoch, microbatch)`` to start at.
        make_batch: ``(microbatch rows, targets of the rank's whole step) -> batch`` handed to training (pinned).
    """

    def __init__(
        self,
        spec: MixtureSpec,
        streams: list[int],
        num_workers: int,
        microbatch_size: int,
        epoch_layout: Callable[[int], tuple[StepLayout, int]],
        position: StreamPosition,
        start_point: Callable[[], tuple[int, int]],
        make_batch: Callable[[RowBlock, int | None], Any],
    ):
        self.spec, self.streams, self.num_workers = spec, streams, num_workers
        self.microbatch_size, self.epoch_layout = microbatch_size, epoch_layout
        self.position, self.start_point, self.make_batch = position, start_point, make_batch
        self._running: _Running | None = None  # the streams running for the position's generation
        # the step being handed out: its rows, the streams' states after it, and its rows' targets
        self._step: tuple[RowBlock, StreamStates, int] | None = None
        close_at_exit(self)  # its streams outlive each epoch's iterator

    def __len__(self) -> int:
        # The full epoch even after a mid-epoch resume: Lightning adds its restored count to what it fetches.
        layout, steps = self.epoch_layout(self.start_point()[0])
        return layout.before(steps)

    def __iter__(self) -> Iterator[Any]:
        return EpochIterator(self._epoch_batches)

    def close(self) -> None:
        """Stop the streams (and their worker processes, now)."""
        running, self._running = self._running, None
        if running is not None:
            shutdown_workers(running.blocks)

    def _epoch_batches(self) -> Generator[Any, None, None]:
        epoch, start = self.start_point()
        layout, steps_in_epoch = self.epoch_layout(epoch)
        position, m = self.position, self.microbatch_size
        position.begin_epoch(epoch, start, layout)
        if self._running is None or self._running.generation != position.generation:
            self.close()
            blocks = rank_blocks(self.spec, self.streams, self.num_workers, position.states)
            self._running = _Running(position.generation, blocks, steps_of(blocks, len(self.streams)))
            self._step = None
        steps, end = self._running.steps, layout.before(steps_in_epoch)
        while position.microbatches < end:
            step, index = position.next_microbatch()
            if self._step is None or index == 0:
                # A loop broken off mid-step continues in the step it left (its rows are kept until it ends).
                rows, states = next(steps)
                self._step = (rows, states, rows.target_count())
                position.enter_step(states)
            rows, _, targets = self._step
            count, first = layout.at(step), position.microbatches - index
            # The rest of the step, as long as nothing else moves the position meanwhile.
            for j in range(index, count):
                if position.microbatches != first + j:
                    break
                position.hand_out(step, j, count)
                yield self.make_batch(rows.rows(j * m, (j + 1) * m), targets)


class TokenValidationLoader(OneIterationAtATime):
    """A sized iterable of ``num_microbatches`` validation microbatches, the same ones on every run."""

    def __init__(
        self,
        spec: MixtureSpec,
        streams: list[int],
        num_workers: int,
        microbatch_size: int,
        num_microbatches: int,
        make_batch: Callable[[RowBlock, int | None], Any],
    ):
        self.spec, self.streams, self.num_workers = spec, streams, num_workers
        self.microbatch_size, self.num_microbatches, self.make_batch = microbatch_size, num_microbatches, make_batch

    def __len__(self) -> int:
        return self.num_microbatches

    def __iter__(self) -> Iterator[Any]:
        return self.start_iteration(self._batches)

    def _batches(self) -> Generator[Any, None, None]:
        blocks = rank_blocks(self.spec, self.streams, self.num_workers, {})
        m, done = self.microbatch_size, 0
        try:
            for rows, _states in steps_of(blocks, len(self.streams)):
                for first in range(0, len(rows.tokens), m):
                    if done == self.num_microbatches:
                        return
                    yield self.make_batch(rows.rows(first, first + m), None)
                    done += 1
        finally:
            shutdown_workers(blocks)
