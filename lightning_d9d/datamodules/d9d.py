"""D9DDataModule: order → shard → load → pack → pin → transfer over a map-style dataset, exactly resumable.

It builds the order once per ``setup`` (:mod:`lightning_d9d.mapstyle.order`), hands each rank a ``TrainLoader``
(a sized iterable, so Lightning neither swaps in a distributed sampler nor saves the loader's own state), and
carries the data position through the resume contract of :class:`SteppedDataModule` (Lightning stores it in
every checkpoint under the DataModule's class name).

Resume is exact because the position is global optimizer steps and the order is a pure function of the seed:
on resume the remaining batches of the epoch are recomputed, on any world size, microbatch size or worker count.

Trade-off: the fingerprint samples 64 sort keys instead of hashing all of them, so two datasets of the same
length that differ only between the sampled keys are not told apart; hashing every key would cost O(N) at every
resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch.utils.data import Dataset

from lightning_d9d.checks import microbatches_per_step, non_negative_int, positive_int
from lightning_d9d.datamodules.base import ON_ORDER_MISMATCH, OnOrderMismatch, SteppedDataModule
from lightning_d9d.mapstyle.loader import TrainLoader, ValidationLoader
from lightning_d9d.mapstyle.order import (
    GlobalBatchOrder,
    argsort_keys,
    check_sort_buffer_size,
    keys_digest,
    resolve_sort_keys,
)
from lightning_d9d.mapstyle.shard import validation_microbatches
from lightning_d9d.resume import Fingerprint, TrainPosition

DatasetOrFactory = Dataset | Callable[[], Dataset]


@dataclasses.dataclass(frozen=True)
class OrderFingerprint(Fingerprint):
    """What defines the map-style training order."""

    seed: int
    num_samples: int
    global_batch_size: int
    sort_buffer_size: int | None
    shuffle: bool
    sort_keys_digest: str


class D9DDataModule(SteppedDataModule):
    """Sorted, sharded, packed map-style loading for ``Trainer.fit``, exactly resumable.

    Args:
        train_dataset: a map-style dataset, or a zero-argument factory called in ``prepare_data()`` (once per
            node, to download/process into a cache) and in ``setup()`` (every rank, loading that cache).
        collate_fn: list of samples -> microbatch (a tensor, dict, tuple or dataclass).
        global_batch_size: samples per optimizer step, summed over all ranks and accumulation (G).
        microbatch_size: samples per forward/backward on one rank (m).
        sort_buffer_size: ``None`` for no length sorting; else samples are sorted by key within windows of this
            many samples (rounded down to a multiple of G). Larger pads less (README: padding vs buffer).
        sort_key: ``None`` (use ``dataset.sort_key(index)`` if it exists), a callable ``(index) -> key``, or
            the name of a column of a Hugging Face dataset (each window's keys read with one Arrow ``take``).
        val_dataset: optional validation dataset (or factory); every sample is evaluated exactly once per run.
        seed: the order's seed. The order of epoch e is a pure function of seed, e, the data and G/buffer.
        shuffle: ``False`` keeps dataset order (epochs then repeat).
        num_workers: ``StatefulDataLoader`` worker processes (does not change the order).
        pin_memory: ``None`` pins exactly when the trainer's device is CUDA; ``True``/``False`` force it.
        yield_packs: each batch is the list of M microbatches of one optimizer step (for manual optimization).
        on_order_mismatch: what ``load_state_dict`` does when the checkpoint's order fingerprint (seed, dataset,
            G, buffer) differs from this DataModule's: ``"raise"`` (default) or ``"restart_epoch"`` (start the
            checkpoint's epoch over with the new order, with a warning).

    Raises:
        ValueError: non-positive sizes, a buffer smaller than G, an unknown ``on_order_mismatch`` — at
            construction; G not divisible by world size × microbatch size, a dataset shorter than one global
            batch, a missing or non-comparable sort key, a conflicting ``accumulate_grad_batches`` — in ``setup``.
    """

    def __init__(
        self,
        train_dataset: DatasetOrFactory,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        global_batch_size: PositiveInt = 256,
        microbatch_size: PositiveInt = 4,
        sort_buffer_size: PositiveInt | None = None,
        sort_key: str | Callable[[int], Any] | None = None,
        val_dataset: DatasetOrFactory | None = None,
        seed: NonNegativeInt = 0,
        shuffle: bool = True,
        num_workers: NonNegativeInt = 0,
        pin_memory: bool | None = None,
        yield_packs: bool = False,
        on_order_mismatch: OnOrderMismatch = "raise",
    ):
        super().__init__()
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        microbatches_per_step(self.global_batch_size, 1, self.microbatch_size)  # G must be a multiple of m
        if sort_buffer_size is not None:
            sort_buffer_size = positive_int("sort_buffer_size", sort_buffer_size)
            check_sort_buffer_size(sort_buffer_size, self.global_batch_size)
        num_workers, seed = non_negative_int("num_workers", num_workers), non_negative_int("seed", seed)
        if on_order_mismatch not in ON_ORDER_MISMATCH:
            raise ValueError(f"on_order_mismatch must be one of {list(ON_ORDER_MISMATCH)}, got {on_order_mismatch!r}")
        self._train_source, self._val_source = train_dataset, val_dataset
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.sort_buffer_size, self.sort_key = sort_buffer_size, sort_key
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.pin_memory, self.yield_packs, self.on_order_mismatch = pin_memory, yield_packs, on_order_mismatch

        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.order: GlobalBatchOrder | None = None
        self.fingerprint: OrderFingerprint | None = None
        # The single place where the data position lives; the loader advances it, state_dict reads it.
        self.position = TrainPosition()

    @property
    def steps_per_epoch(self) -> int:
        """floor(N / G) optimizer steps per epoch (needs ``setup``)."""
        return self._require_order().steps_per_epoch

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Call the dataset factories once per node so they can download/process into their cache."""
        for source in (self._train_source, self._val_source):
            if source is not None and _is_factory(source):
                source()

    def setup(self, stage: str | None = None) -> None:
        """Build datasets and the order; under a Trainer, set accumulation. Starts the position at 0."""
        if self.train_dataset is None:
            self.train_dataset = _materialise(self._train_source, "train_dataset")
            if self._val_source is not None:
                self.val_dataset = _materialise(self._val_source, "val_dataset")
        num_samples = len(self.train_dataset)
        key_lookup = resolve_sort_keys(self.train_dataset, self.sort_key) if self.sort_buffer_size else None
        self.order = GlobalBatchOrder(
            num_samples, self.global_batch_size, self.sort_buffer_size, key_lookup, self.seed, self.shuffle
        )
        self.fingerprint = OrderFingerprint(
            seed=self.seed,
            num_samples=num_samples,
            global_batch_size=self.global_batch_size,
            sort_buffer_size=self.sort_buffer_size,
            shuffle=self.shuffle,
            sort_keys_digest=keys_digest(key_lookup, num_samples),
        )
        if key_lookup is not None:
            # Fail now, not mid-epoch, on keys that cannot be sorted: column keys were checked whole when
            # resolved; per-index keys (Python calls) are checked on a sample spread over the dataset.
            probe = np.unique(np.linspace(0, num_samples - 1, num=min(num_samples, 256)).astype(np.int64))
            argsort_keys(key_lookup(probe), np.zeros(len(probe)), probe)
        per_step = self.microbatches_per_step  # validates divisibility by W·m
        if stage in (None, "fit"):
            self.start_fit(TrainPosition(microbatches_per_step=per_step))

    def train_dataloader(self) -> TrainLoader:
        """This rank's training loader: a sized iterable of microbatches (or packs), continuing the position."""
        return self.track_loader(self._train_loader(self.world_size, self.rank, self.position, self.start_point))

    def train_dataloader_for_rank(self, rank: int, world_size: int, epoch: int = 0) -> TrainLoader:
        """What rank ``rank`` of ``world_size`` would train in ``epoch`` — for exploration and simulation.

        It has its own position (from the epoch's start) and does not touch the DataModule's.

        Raises:
            ValueError: a rank outside ``[0, world_size)`` or a G not divisible by ``world_size × m``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        return self._train_loader(world_size, rank, TrainPosition(epoch=epoch), lambda: (epoch, 0))

    def _train_loader(
        self, world_size: int, rank: int, position: TrainPosition, start_point: Callable[[], tuple[int, int]]
    ) -> TrainLoader:
        return TrainLoader(
            self.train_dataset,
            self.collate_fn,
            self._require_order(),
            world_size=world_size,
            rank=rank,
            microbatch_size=self.microbatch_size,
            microbatches_per_step=microbatches_per_step(self.global_batch_size, world_size, self.microbatch_size),
            position=position,
            start_point=start_point,
            num_workers=self.num_workers,
            pin_memory=self.resolve_pin_memory(),
            yield_packs=self.yield_packs,
        )

    def val_dataloader(self) -> ValidationLoader | list:
        if self.val_dataset is None:
            return []
        key_lookup = resolve_sort_keys(self.val_dataset, self.sort_key if isinstance(self.sort_key, str) else None)
        indices = np.arange(len(self.val_dataset))
        if key_lookup is not None:
            indices = indices[argsort_keys(key_lookup(indices), indices)]
        microbatches = validation_microbatches(indices, self.world_size, self.rank, self.microbatch_size)
        return ValidationLoader(
            self.val_dataset, self.collate_fn, microbatches, self.num_workers, self.resolve_pin_memory()
        )

    # ------------------------------------------------------------------ internals
    def _require_order(self) -> GlobalBatchOrder:
        if self.order is None:
            raise RuntimeError("call dm.setup('fit') before asking for batches or steps (Trainer.fit does it)")
        return self.order


def _is_factory(source: Any) -> bool:
    return callable(source) and not hasattr(source, "__getitem__")


def _materialise(source: DatasetOrFactory, name: str) -> Dataset:
    dataset = source() if _is_factory(source) else source
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"{name} must be a map-style dataset (with __getitem__ and __len__) or a factory returning one; "
            f"got {type(dataset).__name__}"
        )
    return dataset
