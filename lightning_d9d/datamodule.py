"""D9DDataModule: order → shard → load → pack → pin → transfer, wired into Lightning, with exact resume.

This is the only stage that imports Lightning. It builds the order once per ``setup``, hands each rank a
``TrainLoader`` (a sized iterable, so Lightning neither swaps in a distributed sampler nor saves the
loader's own state), sets ``trainer.accumulate_grad_batches`` to the microbatches per step, and carries the
data position through ``state_dict``/``load_state_dict`` (Lightning stores it in every checkpoint under the
DataModule's class name).

Resume is exact because the position is global optimizer steps and the order is a pure function of the seed:
on resume the remaining batches of the epoch are recomputed. Lightning's own restored batch counters are
re-aligned to that position in ``on_train_start`` (they are counted in the old run's microbatches, which is
wrong after a mid-window checkpoint or a change of world size or microbatch size).

Trade-off: aligning Lightning's counters touches its loop internals
(``fit_loop.epoch_loop.batch_progress``); a test pins this down so an upgrade that changes them fails loudly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch.utils.data import Dataset

from lightning_d9d.loader import TrainLoader, ValidationLoader
from lightning_d9d.order import (
    GlobalBatchOrder,
    argsort_keys,
    check_sort_buffer_size,
    keys_digest,
    resolve_sort_keys,
)
from lightning_d9d.shard import microbatches_per_step, validation_microbatches
from lightning_d9d.state import OrderFingerprint, TrainPosition, check_state
from lightning_d9d.transfer import move_batch_to_device
from lightning_d9d.validation import non_negative_int, positive_int

DatasetOrFactory = Dataset | Callable[[], Dataset]


class SteppedDataModule(pl.LightningDataModule):
    """What every lightning_d9d DataModule shares: topology, accumulation, pinning, transfer, counter alignment.

    Subclasses set ``global_batch_size``, ``microbatch_size``, ``pin_memory`` and ``yield_packs``, call
    ``configure_trainer()`` from ``setup("fit")``, and set ``restored`` to the ``(epoch, step)`` loaded from a
    checkpoint; ``on_train_start`` then aligns Lightning's restored batch counters to that step.
    """

    global_batch_size: int
    microbatch_size: int
    pin_memory: bool | None = None
    yield_packs: bool = False
    restored: tuple[int, int] | None = None  # (epoch, step) loaded from a checkpoint, not yet started

    @property
    def world_size(self) -> int:
        trainer = self._trainer
        return trainer.world_size if trainer is not None else 1

    @property
    def rank(self) -> int:
        trainer = self._trainer
        return trainer.global_rank if trainer is not None else 0

    @property
    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    @property
    def microbatches_per_step(self) -> int:
        """M = G / (W·m): microbatches one rank runs per optimizer step."""
        return microbatches_per_step(self.global_batch_size, self.world_size, self.microbatch_size)

    def configure_trainer(self) -> None:
        """Set ``accumulate_grad_batches = M`` (automatic optimization) and register the counter alignment.

        Raises:
            ValueError: the user set ``accumulate_grad_batches`` to a value other than 1 and M.
        """
        trainer = self._trainer
        if trainer is None:
            return
        per_step = self.microbatches_per_step
        module = getattr(trainer, "lightning_module", None)
        if module is not None and module.automatic_optimization:
            # A pack is a whole optimizer step already; otherwise Lightning accumulates the M microbatches.
            expected = 1 if self.yield_packs else per_step
            if trainer.accumulate_grad_batches not in (1, expected):
                what = (
                    "yield_packs=True hands out one whole optimizer step per batch"
                    if self.yield_packs
                    else f"global_batch_size={self.global_batch_size}, world_size={self.world_size} and "
                    f"microbatch_size={self.microbatch_size} give {per_step} microbatches per step"
                )
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) disagrees with the data: "
                    f"{what}; leave it at 1 ({type(self).__name__} sets it) or set it to {expected}"
                )
            trainer.accumulate_grad_batches = expected
        # Lightning warns that a mid-epoch checkpoint is unreliable unless the *loader* is stateful; ours is
        # exact through the DataModule's state instead, so the warning would only mislead.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        if not any(isinstance(callback, _AlignRestoredProgress) for callback in trainer.callbacks):
            trainer.callbacks.append(_AlignRestoredProgress(self))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a (pinned) batch with ``non_blocking=True``, keeping its type; a pass-through on CPU."""
        return move_batch_to_device(batch, device)

    def resolve_pin_memory(self) -> bool:
        """``pin_memory`` if set, else pin exactly when the trainer's device (or, alone, the machine) has CUDA.

        Raises:
            ValueError: ``pin_memory=True`` where torch sees no CUDA device (pinning would fail in the loader).
        """
        if self.pin_memory is not None:
            if self.pin_memory and not torch.cuda.is_available():
                raise ValueError(
                    "pin_memory=True needs a CUDA device, but torch.cuda.is_available() is False; "
                    "use pin_memory=None (pin exactly when training on CUDA) or False"
                )
            return bool(self.pin_memory)
        trainer = self._trainer
        if trainer is not None:
            return trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    def restores_training_position(self) -> bool:
        """Whether a checkpoint's data state matters now: not under ``Trainer.validate/test/predict``.

        Those load the DataModule state too, but never use the training position, so a checkpoint from
        another data order must not stop them.
        """
        trainer = self._trainer
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    def align_lightning_progress(self, trainer: pl.Trainer) -> None:
        """Set Lightning's restored in-epoch batch counters to the restored data position.

        Lightning restores them in the old run's microbatches, including a partial accumulation window; it
        would end the epoch early or misalign accumulation windows if they were left as they are.
        """
        if self.restored is None or self.restored[0] != trainer.current_epoch:
            return
        batches_per_step = 1 if self.yield_packs else self.microbatches_per_step
        batches = self.restored[1] * batches_per_step
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.batch_progress.current
        current.ready = current.started = current.processed = batches
        # When Lightning saw the checkpoint as taken at on_train_batch_end, its reset() adds one completed batch.
        current.completed = batches - 1 if epoch_loop.restarted_on_train_batch_end else batches


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
        on_order_mismatch: Literal["raise", "restart_epoch"] = "raise",
    ):
        super().__init__()
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        if self.global_batch_size % self.microbatch_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by microbatch_size={microbatch_size}"
            )
        if sort_buffer_size is not None:
            sort_buffer_size = positive_int("sort_buffer_size", sort_buffer_size)
            check_sort_buffer_size(sort_buffer_size, self.global_batch_size)
        num_workers, seed = non_negative_int("num_workers", num_workers), non_negative_int("seed", seed)
        if on_order_mismatch not in ("raise", "restart_epoch"):
            raise ValueError(f"on_order_mismatch must be 'raise' or 'restart_epoch', got {on_order_mismatch!r}")
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
        self.restored = None

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
            self.position = TrainPosition(microbatches_per_step=per_step)
            self.restored = None
            self.configure_trainer()

    def train_dataloader(self) -> TrainLoader:
        """This rank's training loader: a sized iterable of microbatches (or packs), continuing the position."""
        return self._train_loader(self.world_size, self.rank, self.position, self._start_point)

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

    def state_dict(self) -> dict[str, Any]:
        """The data position: ``{"epoch", "step", "fingerprint"}`` — a few integers, the same on every rank."""
        if self.fingerprint is None:
            return {}
        return self.position.to_state(self.fingerprint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; the next epoch iteration continues exactly where the checkpoint was taken.

        Raises:
            ValueError: a state from a different order (seed, dataset, G, buffer), unless
                ``on_order_mismatch="restart_epoch"``; a malformed state.
        """
        if not self.restores_training_position():
            return
        epoch, step, saved_fingerprint = check_state(state_dict)
        fingerprint = self._require_fingerprint()
        differences = fingerprint.mismatches(saved_fingerprint)
        if differences:
            if self.on_order_mismatch == "raise":
                raise ValueError(
                    "the checkpoint's data order does not match this D9DDataModule ("
                    + "; ".join(differences)
                    + "). Resume with the same settings, or pass on_order_mismatch='restart_epoch' to start "
                    f"epoch {epoch} over with the new order"
                )
            warnings.warn(
                f"data order changed ({'; '.join(differences)}); restarting epoch {epoch} from its first step",
                stacklevel=2,
            )
            step = 0
        if step > fingerprint.num_samples // fingerprint.global_batch_size:
            raise ValueError(f"checkpoint step {step} is beyond the epoch's {self.steps_per_epoch} steps")
        self.restored = (epoch, step)
        self.position.start(epoch, step, self.microbatches_per_step)

    # ------------------------------------------------------------------ internals
    def _start_point(self) -> tuple[int, int]:
        """(epoch, microbatch) at which the next epoch iteration starts; called at its first ``next()``."""
        trainer, position = self._trainer, self.position
        per_step = self.microbatches_per_step
        if trainer is not None:
            epoch = trainer.current_epoch
            restored, self.restored = self.restored, None
            if restored is not None and restored[0] == epoch:
                return epoch, restored[1] * per_step
            if position.epoch == epoch and restored is None:
                return epoch, position.microbatches  # continuing the same epoch in this process
            return epoch, 0
        self.restored = None
        if position.microbatches >= self.steps_per_epoch * per_step:
            return position.epoch + 1, 0  # the last epoch was finished: roll into the next one
        return position.epoch, position.microbatches

    def _require_order(self) -> GlobalBatchOrder:
        if self.order is None:
            raise RuntimeError("call dm.setup('fit') before asking for batches or steps (Trainer.fit does it)")
        return self.order

    def _require_fingerprint(self) -> OrderFingerprint:
        self._require_order()
        assert self.fingerprint is not None
        return self.fingerprint


class _AlignRestoredProgress(pl.Callback):
    """Runs after Lightning restored its loops and before the first batch: aligns them to the data position."""

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._datamodule.align_lightning_progress(trainer)


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
