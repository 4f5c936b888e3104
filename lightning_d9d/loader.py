"""Load and pack: turn this rank's share of the order into collated (and pinned) microbatches or packs.

Algorithm: at the first ``next()`` of an epoch the loader asks where to start (epoch, microbatch), builds a
lazy iterable of index lists — this rank's microbatches of the remaining global batches — and hands it to
torchdata's ``StatefulDataLoader`` as its ``batch_sampler``. Workers only fetch ``dataset[i]`` and collate;
the order is decided in the main process, so it cannot depend on ``num_workers``. Each microbatch handed out
advances the one position counter; with ``yield_packs`` the M microbatches of a step are handed out together.

Why a plain sized iterable and not the DataLoader itself: Lightning would otherwise (a) re-instantiate it
under DDP with its own distributed sampler and (b) save and restore the DataLoader's internal state, which
goes wrong in several measured ways (see the project README). A sized iterable without ``state_dict`` is left
alone; its length also stops Lightning's prefetcher from reading a batch ahead, so "handed out" equals
"consumed by training".

Trade-off: a new ``StatefulDataLoader`` (and worker pool) is started at each epoch or resume, which costs a
worker start-up per epoch, but makes resume cost independent of the position: no batch is replayed to skip.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_d9d.order import GlobalBatchOrder
from lightning_d9d.pin import pin_batch
from lightning_d9d.shard import rank_microbatches
from lightning_d9d.state import TrainPosition


class _IndexBatches:
    """This rank's microbatches (lists of sample indices) from a start point to the end of the epoch, lazily."""

    def __init__(
        self,
        order: GlobalBatchOrder,
        epoch: int,
        start_microbatch: int,
        world_size: int,
        rank: int,
        microbatch_size: int,
        microbatches_per_step: int,
    ):
        self._order, self._epoch, self._start = order, epoch, start_microbatch
        self._world_size, self._rank, self._microbatch_size = world_size, rank, microbatch_size
        self._per_step = microbatches_per_step

    def __len__(self) -> int:
        return max(0, self._order.steps_per_epoch * self._per_step - self._start)

    def __iter__(self) -> Iterator[list[int]]:
        first_step, skip = divmod(self._start, self._per_step)
        for step in range(first_step, self._order.steps_per_epoch):
            global_batch = self._order.global_batch(self._epoch, step)
            mine = rank_microbatches(global_batch, self._world_size, self._rank, self._microbatch_size)
            for microbatch in mine[skip:]:
                yield microbatch.tolist()
            skip = 0


class TrainLoader:
    """The training loader: a sized iterable of microbatches (or packs of M microbatches) for one rank.

    Args:
        dataset: map-style dataset (``dataset[i]`` returns one sample).
        collate_fn: list of samples -> microbatch.
        order: the epoch order (shared by all ranks).
        world_size, rank: data-parallel topology.
        microbatch_size: samples per microbatch (m).
        microbatches_per_step: M = G / (W·m).
        position: the shared position counter this loader advances.
        start_point: called at the first ``next()`` of an epoch; returns ``(epoch, microbatch)`` to start at.
        num_workers: DataLoader workers.
        pin_memory: pin each batch (only where an accelerator exists).
        yield_packs: hand out a list of M microbatches per optimizer step instead of single microbatches.
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any],
        order: GlobalBatchOrder,
        world_size: int,
        rank: int,
        microbatch_size: int,
        microbatches_per_step: int,
        position: TrainPosition,
        start_point: Callable[[], tuple[int, int]],
        num_workers: int = 0,
        pin_memory: bool = False,
        yield_packs: bool = False,
    ):
        self.dataset, self.collate_fn, self.order = dataset, collate_fn, order
        self.world_size, self.rank, self.microbatch_size = world_size, rank, microbatch_size
        self.microbatches_per_step = microbatches_per_step
        self.position, self.start_point = position, start_point
        self.num_workers, self.pin_memory, self.yield_packs = num_workers, pin_memory, yield_packs

    def __len__(self) -> int:
        # Always the full epoch: Lightning adds its own restored batch count to what it fetches after a resume.
        steps = self.order.steps_per_epoch
        return steps if self.yield_packs else steps * self.microbatches_per_step

    def __iter__(self) -> Iterator[Any]:
        # Lazy: iter() may run before the resume state is loaded (Lightning probes iterability early).
        return LazyIterator(self._epoch_batches)

    def _epoch_batches(self) -> Iterator[Any]:
        epoch, start = self.start_point()
        self.position.start(epoch, 0, self.microbatches_per_step)
        self.position.microbatches = start
        if self.yield_packs and start % self.microbatches_per_step:
            raise ValueError(f"cannot start packs mid-step (microbatch {start} with M={self.microbatches_per_step})")
        index_batches = _IndexBatches(
            self.order, epoch, start, self.world_size, self.rank, self.microbatch_size, self.microbatches_per_step
        )
        if len(index_batches) == 0:
            return
        loader = make_loader(self.dataset, index_batches, self.collate_fn, self.num_workers, self.pin_memory)
        pack: list[Any] = []
        for microbatch in loader:
            if not self.yield_packs:
                self.position.microbatches += 1
                yield microbatch
                continue
            pack.append(microbatch)
            if len(pack) == self.microbatches_per_step:
                self.position.microbatches += len(pack)
                yield pack
                pack = []


class ValidationLoader:
    """Sized iterable over this rank's validation microbatches (exactly-once across ranks, no padding)."""

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any],
        microbatches: list[np.ndarray],
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.microbatches = [microbatch.tolist() for microbatch in microbatches]
        self.num_workers, self.pin_memory = num_workers, pin_memory

    def __len__(self) -> int:
        return len(self.microbatches)

    def __iter__(self) -> Iterator[Any]:
        if not self.microbatches:
            return iter(())
        return iter(make_loader(self.dataset, self.microbatches, self.collate_fn, self.num_workers, self.pin_memory))


class PinnableBatch:
    """Carries any batch through torch's pin-memory thread: torch pins objects that have ``pin_memory()``.

    torch's own pinning skips dataclasses; wrapping lets the loader's background pin thread (used with
    workers) run our ``pin_batch`` tree walk instead of the training loop's thread.
    """

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch

    def pin_memory(self, device: Any = None) -> PinnableBatch:
        return PinnableBatch(pin_batch(self.batch))


class _CollateForPinning:
    """``collate_fn`` whose result is wrapped in ``PinnableBatch`` (a class, so workers can pickle it)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> PinnableBatch:
        return PinnableBatch(self.collate_fn(samples))


def make_loader(
    dataset: Dataset, index_batches: Any, collate_fn: Callable, num_workers: int, pin_memory: bool = False
) -> Iterator[Any]:
    """Batches from torchdata's ``StatefulDataLoader`` driven by precomputed index batches, pinned if asked.

    The loader's own ``state_dict`` is never used: the position lives in ``TrainPosition``.
    """
    with warnings.catch_warnings():
        # torchdata 0.11 calls the deprecated torch.set_vital on every construction; the warning is noise.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        loader = StatefulDataLoader(
            dataset,
            batch_sampler=index_batches,
            collate_fn=_CollateForPinning(collate_fn) if pin_memory else collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            # Its snapshots feed only its own state_dict, which we never use; turning them off saves work.
            snapshot_every_n_steps=None if num_workers else 1,
        )
    return (wrapped.batch for wrapped in loader) if pin_memory else iter(loader)


class LazyIterator:
    """Defers creating the epoch's batch generator to the first ``next()``.

    ``iter()`` may run before the resume state is loaded (Lightning probes iterability early); the position is
    read only when the first batch is really asked for.
    """

    def __init__(self, factory: Callable[[], Iterator[Any]]):
        self._factory: Callable[[], Iterator[Any]] | None = factory
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> LazyIterator:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            assert self._factory is not None
            self._batches, self._factory = self._factory(), None
        return next(self._batches)
