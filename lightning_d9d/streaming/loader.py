"""Token loader: one rank's token streams, interleaved into microbatches, with the position that resumes them.

Algorithm: a rank owns ``max(1, num_workers)`` streams (``token_stream.TokenStream``), one per DataLoader worker
(or one in-process stream for ``num_workers=0``). torch's DataLoader hands out an ``IterableDataset``'s items
strictly round-robin over workers, so microbatch ``n`` of the rank (counted since training began) always comes
from stream ``n % streams``; on resume the workers are *rotated* so that the stream whose turn it is sits in
worker 0. Each microbatch arrives with its stream's state after it; the loader keeps the latest state of every
stream and, at every optimizer-step boundary, commits a copy: that committed copy is what a checkpoint saves.

Why commit only at step boundaries: Lightning does not checkpoint accumulated gradients, so a resume must start
at the first microbatch of an optimizer step; Lightning's own batch counters are aligned to the same point.

Workers: each DataLoader worker tokenizes on one core (its tokenizer's own thread pool is switched off), so
``num_workers`` is the number of cores a rank tokenizes on; ``num_workers=0`` runs the one stream in this
process, where ``encode_batch_fast`` uses every core. A worker's calls also end at ``WORKER_CHUNK_CHARS``
characters of text, so its rows come steadily rather than in bursts of a whole batch. A worker sends each
microbatch as its compact int32 rows (``seq_len + 1`` tokens each) pickled through its pipe; this process
expands them into ``inputs``/``targets``/``position_ids`` (``token_packing.microbatch_tensors``). Three int64
tensors per microbatch crossing as shared-memory files cost the workers about a quarter of their throughput
(measured, 2 workers on 2 cores).

Trade-off: the worker processes live as long as the loader's iterator (across epochs, because a stream never
restarts at an epoch boundary); a resume or a new ``fit`` restarts them from the committed states, which costs
one re-read and re-tokenization of the chunk in flight (and best-fit's buffer prefixes) per stream.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_d9d.epoch_iterator import EpochIterator, collect_before_fork, shutdown_workers
from lightning_d9d.resume import TrainPosition
from lightning_d9d.streaming.packing import microbatch_tensors
from lightning_d9d.streaming.source import stream_id
from lightning_d9d.streaming.stream import StreamSpec, TokenStream

StreamStates = dict[int, dict[str, Any]]

# A worker's tokenizer calls hold at most this much text (about 75K tokens of English or code, ~0.1 s on one
# core): 128 long documents can be 4 MB, which made a worker's rows come in ~1.5 s bursts and held ~70 MB of
# Encodings per call in flight; a call's size buys no speed on one core. Rows never depend on it.
WORKER_CHUNK_CHARS = 1 << 18


@dataclass
class StreamPosition(TrainPosition):
    """Where one rank's streams are: the single place the data position lives.

    Attributes:
        states: the latest state of each of this rank's streams (by global stream number).
        committed: ``(epoch, step, states)`` at the last optimizer-step boundary (what checkpoints save).
        generation: bumped whenever the position is replaced (resume), which invalidates running streams.
    """

    states: StreamStates = field(default_factory=dict)
    committed: tuple[int, int, StreamStates] = (0, 0, {})
    generation: int = 0

    def restart(self, epoch: int, step: int, states: StreamStates, microbatches_per_step: int) -> None:
        """Jump to ``step`` of ``epoch`` with the given stream states (a resume)."""
        self.start(epoch, step, microbatches_per_step)
        self.states = dict(states)
        self.committed = (epoch, step, dict(states))
        self.generation += 1


class _WorkerStreams(IterableDataset):
    """The dataset each DataLoader worker iterates: its (rotated) stream, from its saved state."""

    def __init__(self, spec: StreamSpec, rank: int, num_workers: int, states: StreamStates, rotation: int):
        self.spec, self.rank, self.num_workers = spec, rank, num_workers
        self.states, self.rotation = states, rotation

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:
            # The workers are the parallelism: each tokenizes on one core. (tokenizers switches its pool off in a
            # forked child anyway once the parent has used it; when the parent has not, every worker would start
            # a pool as wide as the machine and they would oversubscribe the cores.) Only this process is set.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        local = (worker + self.rotation) % max(1, self.num_workers)
        sid = stream_id(self.rank, local, self.num_workers)
        for rows, state in TokenStream(self.spec, sid, self.states.get(sid)):
            yield rows, sid, state


def _as_is(item: Any) -> Any:
    """The workers' collate function: hand the item over unchanged (numpy rows, plain state)."""
    return item


def rank_stream_iterator(spec: StreamSpec, rank: int, num_workers: int, states: StreamStates) -> Iterator[tuple]:
    """Endless ``(rows, stream, state)`` for one rank, continuing from ``states`` (rows: int32 numpy).

    Args:
        spec: the streams' configuration (``spec.num_streams`` must be ``world_size * max(1, num_workers)``).
        rank: this rank.
        num_workers: DataLoader worker processes (0: the one stream runs in this process, with its reader
            thread). Workers cap each tokenizer call at ``WORKER_CHUNK_CHARS`` unless ``spec.chunk_chars`` is set.
        states: saved stream states by global stream number (missing: start from the beginning).
    """
    streams = max(1, num_workers)
    if num_workers > 0 and not spec.chunk_chars:
        spec = replace(spec, chunk_chars=WORKER_CHUNK_CHARS)
    consumed = sum(
        int(states[stream_id(rank, w, num_workers)]["batches"])
        for w in range(streams)
        if stream_id(rank, w, num_workers) in states
    )
    dataset = _WorkerStreams(spec, rank, num_workers, states, rotation=consumed % streams)
    if num_workers == 0:
        return iter(dataset)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        # collate_fn=_as_is: the default would turn the numpy rows into tensors in the worker, and each tensor
        # then crosses to this process as a shared-memory file; a pickled 33 KB array through the worker's pipe
        # is cheaper (measured, 2 workers, long documents: ~500K -> ~680K tokens per worker CPU-second).
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=4, collate_fn=_as_is)
    collect_before_fork()
    return iter(loader)


class TokenTrainLoader:
    """A sized iterable of microbatches for one rank; one epoch is ``len(self)`` microbatches.

    Args:
        spec: the streams' configuration.
        rank: this rank.
        num_workers: DataLoader worker processes.
        microbatches_per_epoch: ``steps_per_epoch * microbatches_per_step``.
        microbatches_per_step: M; states are committed every M microbatches.
        position: the shared position this loader advances.
        start_point: called at the first ``next()`` of an epoch, returns ``(epoch, microbatch)`` to start at
            (the streams continue from ``position.states`` either way).
        make_batch: turns ``(inputs, targets, position_ids)`` into the batch handed to training (and pins it).
    """

    def __init__(
        self,
        spec: StreamSpec,
        rank: int,
        num_workers: int,
        microbatches_per_epoch: int,
        microbatches_per_step: int,
        position: StreamPosition,
        start_point: Callable[[], tuple[int, int]],
        make_batch: Callable[..., Any],
    ):
        self.spec, self.rank, self.num_workers = spec, rank, num_workers
        self.microbatches_per_epoch, self.microbatches_per_step = microbatches_per_epoch, microbatches_per_step
        self.position, self.start_point, self.make_batch = position, start_point, make_batch
        self._running: tuple[int, Iterator[tuple]] | None = None  # (generation, stream iterator)

    def __len__(self) -> int:
        # The full epoch even after a mid-epoch resume: Lightning adds its restored count to what it fetches.
        return self.microbatches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """Empty: the position is the DataModule's state, which Lightning saves in the same checkpoint.

        Having ``state_dict``/``load_state_dict`` tells Lightning that this loader resumes exactly, so it does
        not warn that a mid-epoch checkpoint cannot be resumed.
        """
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load here: the DataModule restored the position (see ``state_dict``)."""

    def __iter__(self) -> Iterator[Any]:
        return EpochIterator(self._epoch_batches)

    def close(self) -> None:
        """Stop the streams (and their worker processes, now)."""
        running, self._running = self._running, None
        if running is not None:
            shutdown_workers(running[1])

    def _epoch_batches(self) -> Iterator[Any]:
        epoch, start = self.start_point()
        position, per_step = self.position, self.microbatches_per_step
        position.epoch, position.microbatches = epoch, start
        if self._running is None or self._running[0] != position.generation:
            self._running = (
                position.generation,
                rank_stream_iterator(self.spec, self.rank, self.num_workers, position.states),
            )
        streams = self._running[1]
        while position.microbatches < self.microbatches_per_epoch:
            rows, sid, state = next(streams)
            position.states[sid] = state
            position.microbatches += 1
            if position.microbatches % per_step == 0:
                position.committed = (epoch, position.microbatches // per_step, dict(position.states))
            yield self.make_batch(*microbatch_tensors(rows, self.spec.bos_id))


class TokenValidationLoader:
    """A sized iterable of ``num_microbatches`` validation microbatches, the same ones on every run."""

    def __init__(
        self, spec: StreamSpec, rank: int, num_workers: int, num_microbatches: int, make_batch: Callable[..., Any]
    ):
        self.spec, self.rank, self.num_workers = spec, rank, num_workers
        self.num_microbatches, self.make_batch = num_microbatches, make_batch

    def __len__(self) -> int:
        return self.num_microbatches

    def __iter__(self) -> Iterator[Any]:
        return EpochIterator(self._batches)

    def close(self) -> None:
        """Nothing outlives an iteration here: each validation pass stops its workers when it ends or is freed."""

    def _batches(self) -> Iterator[Any]:
        streams = rank_stream_iterator(self.spec, self.rank, self.num_workers, {})
        try:
            for _ in range(self.num_microbatches):
                rows, _sid, _state = next(streams)
                yield self.make_batch(*microbatch_tensors(rows, self.spec.bos_id))
        finally:
            shutdown_workers(streams)
