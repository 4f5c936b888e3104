"""Load and pack: turn a data-parallel rank's share of the order into collated (and pinned) microbatches or packs.

At an epoch's first ``next()`` the loader asks where to start and drives a ``StatefulDataLoader`` with a lazy
``batch_sampler`` of this rank's remaining microbatches; workers only fetch and collate, so the order never depends
on ``num_workers``. It is a sized iterable, not a DataLoader, so Lightning neither swaps its sampler nor saves it.

Trade-off: a new worker pool per epoch or resume costs a start-up, but no batch is ever replayed to skip.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_d9d.core.epoch_iterator import (
    EpochIterator,
    OneIterationAtATime,
    ResumedByDataModule,
    forking_workers,
    shutdown_workers,
)
from lightning_d9d.core.resume import TrainPosition
from lightning_d9d.device.pin import pin_batch

STEP_LABEL_TOKENS = "step_label_tokens"
"""The batch field (or key) the loader fills with its step's predicted tokens over all ranks."""


class StepSchedule(Protocol):
    """What the training loader reads: steps per epoch, a rank's microbatches of a step, its label count."""

    def steps_in_epoch(self, epoch: int) -> int: ...

    def rank_microbatches(self, epoch: int, step: int, dp_size: int, dp_rank: int) -> list[np.ndarray]: ...

    def step_label_tokens(self, epoch: int, step: int) -> int | None: ...


class DataLoadingError(RuntimeError):
    """A sample or ``collate_fn`` raised; the message names the microbatch's samples and where it sits."""


class MicrobatchIndices(list):
    """A microbatch's sample indices, with where it sits in training (``"epoch 0, step 3, dp rank 1"``)."""

    def __init__(self, indices: Any, where: str = ""):
        super().__init__(indices)
        self.where = where

    def __reduce__(self) -> tuple:
        return MicrobatchIndices, (list(self), self.where)


class _IndexBatches:
    """A data-parallel rank's microbatches (lists of sample indices) from a start point to the epoch's end, lazily."""

    def __init__(
        self,
        schedule: StepSchedule,
        epoch: int,
        start_microbatch: int,
        dp_size: int,
        dp_rank: int,
        microbatches_per_step: int,
    ):
        self._schedule, self._epoch, self._start = schedule, epoch, start_microbatch
        self._dp_size, self._dp_rank, self._per_step = dp_size, dp_rank, microbatches_per_step

    def __len__(self) -> int:
        return max(0, self._schedule.steps_in_epoch(self._epoch) * self._per_step - self._start)

    def __iter__(self) -> Iterator[MicrobatchIndices]:
        first_step, skip = divmod(self._start, self._per_step)
        for step in range(first_step, self._schedule.steps_in_epoch(self._epoch)):
            mine = self._schedule.rank_microbatches(self._epoch, step, self._dp_size, self._dp_rank)
            where = f"epoch {self._epoch}, step {step}, dp rank {self._dp_rank}"
            for microbatch in mine[skip:]:
                yield MicrobatchIndices(microbatch.tolist(), where)
            skip = 0


def carries_step_label_tokens(batch: Any) -> bool:
    """Whether ``batch`` has a ``step_label_tokens`` field or key (only such batches are told the count)."""
    if isinstance(batch, dict):
        return STEP_LABEL_TOKENS in batch
    return dataclasses.is_dataclass(batch) and not isinstance(batch, type) and hasattr(batch, STEP_LABEL_TOKENS)


def attach_step_label_tokens(batch: Any, value: int | None) -> Any:
    if value is None:
        return batch
    if isinstance(batch, dict):
        batch[STEP_LABEL_TOKENS] = value
        return batch
    try:
        setattr(batch, STEP_LABEL_TOKENS, value)
    except dataclasses.FrozenInstanceError:
        return dataclasses.replace(batch, **{STEP_LABEL_TOKENS: value})
    return batch


class TrainLoader(OneIterationAtATime, ResumedByDataModule):
    """The training loader: a sized iterable of microbatches (or packs of M) for one data-parallel replica.

    Args:
        schedule: the steps of every epoch (shared by all ranks).
        microbatches_per_step: M (this rank's microbatches per step).
        position: the shared position counter this loader advances.
        start_point: side-effect-free ``() -> (epoch, microbatch)`` where the next epoch iteration starts.
        yield_packs: hand out a list of M microbatches per optimizer step.
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any],
        schedule: StepSchedule,
        dp_size: int,
        dp_rank: int,
        microbatches_per_step: int,
        position: TrainPosition,
        start_point: Callable[[], tuple[int, int]],
        num_workers: int = 0,
        pin_memory: bool = False,
        yield_packs: bool = False,
    ):
        self.dataset, self.collate_fn, self.schedule = dataset, collate_fn, schedule
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.microbatches_per_step = microbatches_per_step
        self.position, self.start_point = position, start_point
        self.num_workers, self.pin_memory, self.yield_packs = num_workers, pin_memory, yield_packs

    def __len__(self) -> int:
        # Always the full epoch: Lightning adds its own restored batch count to what it fetches after a resume.
        steps = self.schedule.steps_in_epoch(self.start_point()[0])
        return steps if self.yield_packs else steps * self.microbatches_per_step

    def __iter__(self) -> EpochIterator:
        # Lazy: iter() may run before the resume state is loaded (Lightning probes iterability early).
        return self.start_iteration(self._epoch_batches)

    def _epoch_batches(self) -> Generator[Any, None, None]:
        epoch, start = self.start_point()
        self.position.start(epoch, 0, self.microbatches_per_step)
        self.position.microbatches = start
        if self.yield_packs and start % self.microbatches_per_step:
            raise ValueError(f"cannot start packs mid-step (microbatch {start} with M={self.microbatches_per_step})")
        index_batches = _IndexBatches(
            self.schedule, epoch, start, self.dp_size, self.dp_rank, self.microbatches_per_step
        )
        expected = len(index_batches)
        if expected == 0:
            return
        loader = make_loader(self.dataset, index_batches, self.collate_fn, self.num_workers, self.pin_memory)
        pack: list[Any] = []
        received = 0
        label_tokens: tuple[int, int | None] = (-1, None)  # (step, its count): asked once per step
        try:
            for microbatch in loader:
                if carries_step_label_tokens(microbatch):
                    step = (start + received) // self.microbatches_per_step
                    if label_tokens[0] != step:
                        label_tokens = (step, self.schedule.step_label_tokens(epoch, step))
                    microbatch = attach_step_label_tokens(microbatch, label_tokens[1])
                received += 1
                if not self.yield_packs:
                    self.position.microbatches += 1
                    yield microbatch
                    continue
                pack.append(microbatch)
                if len(pack) == self.microbatches_per_step:
                    self.position.microbatches += len(pack)
                    yield pack
                    pack = []
        finally:
            stop(loader)
        if received < expected:
            raise RuntimeError(
                f"epoch {epoch} on data-parallel rank {self.dp_rank} ended after {received} of its {expected} "
                "microbatches: the DataLoader stopped early (a StopIteration raised by the dataset, a sampler or "
                "collate_fn ends a DataLoader quietly); no samples may go missing, so this is an error"
            )


class ValidationLoader(OneIterationAtATime):
    """Sized iterable over a data-parallel rank's validation microbatches (exactly once over replicas, unpadded)."""

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any],
        microbatches: list[np.ndarray],
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.microbatches = [
            MicrobatchIndices(microbatch.tolist(), f"validation microbatch {number}")
            for number, microbatch in enumerate(microbatches)
        ]
        self.num_workers, self.pin_memory = num_workers, pin_memory

    def __len__(self) -> int:
        return len(self.microbatches)

    def __iter__(self) -> Iterator[Any]:
        if not self.microbatches:
            return iter(())
        return self.start_iteration(self._batches)

    def _batches(self) -> Generator[Any, None, None]:
        loader = make_loader(self.dataset, self.microbatches, self.collate_fn, self.num_workers, self.pin_memory)
        received = 0
        try:
            for batch in loader:
                received += 1
                yield batch
        finally:
            stop(loader)
        if received < len(self.microbatches):
            raise RuntimeError(
                f"validation ended after {received} of its {len(self.microbatches)} microbatches: the DataLoader "
                "stopped early (a StopIteration raised by the dataset or collate_fn ends a DataLoader quietly)"
            )


class PinnableBatch:
    """Carries any batch through torch's pin-memory thread, which skips dataclasses, so ``pin_batch`` runs there."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch

    def pin_memory(self, device: Any = None) -> PinnableBatch:
        return PinnableBatch(pin_batch(self.batch))


class _Samples(list):
    indices: Any = None


class FetchWithContext(Dataset):
    """The dataset as the DataLoader sees it (batched ``__getitems__`` kept): a failing sample names its place."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> _Samples:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = _Samples()
        if getitems is not None:
            try:
                samples.extend(getitems(list(indices)))
            except BaseException as error:
                raise DataLoadingError(f"reading {_place(indices)} failed: {type(error).__name__}: {error}") from error
        else:
            dataset, append, index = self.dataset, samples.append, None
            try:
                for index in indices:
                    append(dataset[index])
            except BaseException as error:
                raise DataLoadingError(
                    f"dataset[{index}] of {_place(indices)} failed: {type(error).__name__}: {error}"
                ) from error
        samples.indices = indices
        return samples


def _place(indices: Any) -> str:
    where = getattr(indices, "where", "")
    return f"microbatch {list(indices)}" + (f" ({where})" if where else "")


class CollateWithContext:
    """``collate_fn`` that names the microbatch's samples and place when it raises (a class, so workers pickle it)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], pin: bool = False):
        self.collate_fn, self.pin = collate_fn, pin

    def __call__(self, samples: list[Any]) -> Any:
        try:
            batch = self.collate_fn(samples)
        except BaseException as error:
            indices = getattr(samples, "indices", None)
            place = _place(indices) if indices is not None else "a microbatch"
            raise DataLoadingError(f"collate_fn failed on {place}: {type(error).__name__}: {error}") from error
        return PinnableBatch(batch) if self.pin else batch


class _Unpinned:
    """Iterates a pinning DataLoader, unwrapping its ``PinnableBatch`` es; keeps the iterator to stop its workers."""

    def __init__(self, batches: Iterator[Any]):
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self.batches).batch


def make_loader(
    dataset: Dataset, index_batches: Any, collate_fn: Callable, num_workers: int, pin_memory: bool = False
) -> Iterator[Any]:
    """Batches from torchdata's ``StatefulDataLoader`` over precomputed index batches; ``stop`` ends its workers."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls the deprecated torch.set_vital on every construction; the warning is noise.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        loader = StatefulDataLoader(
            FetchWithContext(dataset),
            batch_sampler=index_batches,
            collate_fn=CollateWithContext(collate_fn, pin=pin_memory),
            num_workers=num_workers,
            pin_memory=pin_memory,
            # Its snapshots feed only its own state_dict, which we never use; turning them off saves work.
            snapshot_every_n_steps=None if num_workers else 1,
        )
    with forking_workers():
        batches = iter(loader)
    return _Unpinned(batches) if pin_memory else batches


def stop(batches: Iterator[Any]) -> None:
    shutdown_workers(batches.batches if isinstance(batches, _Unpinned) else batches)
