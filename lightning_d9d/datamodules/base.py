"""SteppedDataModule: what every lightning_d9d DataModule shares — topology, the resume contract, devices, shutdown.

Data is dealt by data-parallel rank, never by process. ``state_dict()`` is ``{"epoch", "step", "fingerprint"}``
(optimizer steps done) plus a subclass's extra state; ``load_state_dict`` validates it, and one side-effect-free
``start_point`` decides where every epoch iteration begins. Loaders are closed when replaced, at teardown and on error.
The base composes three parts rather than inheriting them: ``parallelism`` (which processes share data,
``data_parallel.py``), ``observation`` (what the data observer reads, ``observability.py``) and ``handed`` (the
loaders handed out, ``parts.py``); its public names (``data_parallel``, ``verify_peers``, ``data_wait_warning``,
``close_loaders``, ...) are theirs, read through.

Trade-off: the saved step reads Lightning's processed-batch counter, a loop internal pinned down by tests.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_d9d.core.checks import microbatches_per_step, one_of
from lightning_d9d.core.resume import (
    Fingerprint,
    InvalidDataState,
    SavedPosition,
    StepLayout,
    TrainPosition,
    mismatch_error,
)
from lightning_d9d.datamodules.callback import DataModuleCallback
from lightning_d9d.datamodules.data_parallel import DataParallel
from lightning_d9d.datamodules.observability import DataObservation
from lightning_d9d.datamodules.parts import HandedLoaders, PartAttribute, SettablePartAttribute
from lightning_d9d.device.pin import resolve_pin_memory
from lightning_d9d.device.transfer import move_batch_to_device
from lightning_d9d.parallel.topology import DataParallelTopology

OnOrderMismatch = Literal["raise", "restart_epoch"]
ON_ORDER_MISMATCH = ("raise", "restart_epoch")


class SteppedDataModule(pl.LightningDataModule):
    """Base of every lightning_d9d DataModule; subclasses size steps, set ``fingerprint`` and call ``start_fit``."""

    global_batch_size: int | None
    microbatch_size: int | None
    pin_memory: bool | None = None
    yield_packs: bool = False
    reloads_train_loader_every_epoch: bool = False  # epochs differ in length: a new train loader every epoch
    _on_order_mismatch: OnOrderMismatch = "raise"
    fingerprint: Fingerprint | None = None
    position: TrainPosition
    steps_per_epoch: int  # optimizer steps per epoch; a subclass's attribute or property
    restored: tuple[int, int] | None = None  # (epoch, step) loaded from a checkpoint in this fit
    loaded: tuple[SavedPosition, bool] | None = None  # the saved position, and whether its data is this run's

    def __init__(self) -> None:
        super().__init__()
        self.parallelism = DataParallel()
        self.observation = DataObservation()
        self.handed = HandedLoaders()

    # ------------------------------------------------------------------ the parts' settings, as users name them
    data_parallel = SettablePartAttribute("parallelism", "setting")  # which processes share data
    verify_peers = SettablePartAttribute("parallelism")  # steps whose microbatches peers compare (0: off)
    data_wait_warning = SettablePartAttribute("observation")  # warn when data waits exceed this share
    take_host_counts = PartAttribute("observation", "take")  # the counts of the microbatch last moved, once

    def resolve_topology(self) -> DataParallelTopology:
        """Resolve the data-parallel layout and confirm it across processes (under a Trainer, a collective).

        Raises:
            ValueError: a layout that cannot be resolved or that processes disagree on.
        """
        return self.parallelism.resolve(self._trainer)

    @property
    def topology(self) -> DataParallelTopology:
        """The data-parallel layout (resolved at ``setup``, or now if asked before; no collective here)."""
        return self.parallelism.topology(self._trainer)

    dp_size = PartAttribute("topology")  # the data-parallel size: replicas the data is dealt among (1 alone)
    dp_rank = PartAttribute("topology")  # this process's data-parallel rank (shared with its model-parallel peers)

    @property
    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def count_host_batch(self, batch: Any) -> None:
        """Count a training microbatch on the host, before it is moved (``transfer_batch_to_device`` calls it)."""
        self.observation.count(batch, self._trainer is not None and self._trainer.training)

    def step_metrics(self, rows_by_source: collections.Counter[int]) -> dict[str, float]:
        """What the DataModule logs beside the timing, per optimizer step; nothing unless a subclass says."""
        return {}

    @property
    def on_order_mismatch(self) -> OnOrderMismatch:
        return self._on_order_mismatch

    @on_order_mismatch.setter
    def on_order_mismatch(self, value: OnOrderMismatch) -> None:
        self._on_order_mismatch = one_of("on_order_mismatch", value, ON_ORDER_MISMATCH)

    # ------------------------------------------------------------------ steps
    @property
    def microbatches_per_step(self) -> int:
        """M: microbatches one data-parallel replica runs per optimizer step."""
        return self.microbatches_for(self.dp_size)

    def microbatches_for(self, dp_size: int) -> int:
        """M at data-parallel size ``dp_size``: ``G / (D·m)`` unless a subclass sizes steps otherwise."""
        return microbatches_per_step(self.global_batch_size, dp_size, self.microbatch_size)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch``; the same for every epoch unless a subclass says otherwise."""
        return self.steps_per_epoch

    @property
    def batches_per_step(self) -> int:
        """Batches the training loop receives per optimizer step: 1 with ``yield_packs``, else M."""
        return 1 if self.yield_packs else self.microbatches_per_step

    def step_layout(self, epoch: int) -> StepLayout:
        """This replica's microbatches of each step of ``epoch`` (M every step unless a subclass says otherwise)."""
        return StepLayout.constant(self.microbatches_per_step)

    @property
    def step_sizes_vary(self) -> bool:
        """Whether the microbatches per step change during the run (then Lightning is told M step by step)."""
        return False

    def batch_in_step(self, epoch: int, index: int) -> tuple[int, int, int]:
        """``(step, position in it, batches of it)`` of the training loop's batch ``index`` (from 0) of ``epoch``."""
        if self.yield_packs:
            return index, 0, 1
        layout = self.step_layout(epoch)
        step = layout.step_of(index)
        return step, index - layout.before(step), layout.at(step)

    def batches_in_global_step(self, step: int) -> int:
        """Batches the training loop receives in global optimizer step ``step`` (the same every step unless a
        subclass's steps change size)."""
        return self.batches_per_step

    def batches_before(self, epoch: int, step: int) -> int:
        """Batches the training loop receives in ``epoch`` before its ``step``."""
        return step if self.yield_packs else self.step_layout(epoch).before(step)

    def describe_step(self) -> str:
        """How the settings give M, for messages."""
        return (
            f"global_batch_size={self.global_batch_size}, data-parallel size {self.dp_size} and "
            f"microbatch_size={self.microbatch_size} give {self.microbatches_per_step} microbatches per step"
        )

    # ------------------------------------------------------------------ set-up under a Trainer
    def start_fit(self, position: TrainPosition) -> None:
        """Stand at the start of training; under a Trainer, attach :class:`DataModuleCallback`."""
        self.position, self.restored, self.loaded = position, None, None
        trainer = self._trainer
        if trainer is not None:
            DataModuleCallback.attach(trainer, self)

    # ------------------------------------------------------------------ the resume contract
    def state_dict(self) -> dict[str, Any]:
        """The data position ``{"epoch", "step", "fingerprint", ...}``, the same on every rank."""
        if self.fingerprint is None:
            return {}
        epoch, step = self.saved_position()
        return {
            "epoch": epoch,
            "step": step,
            "fingerprint": self.fingerprint.to_dict(),
            **self.extra_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; the next epoch iteration continues exactly where the checkpoint was taken.

        Raises:
            ValueError: a malformed state, a step beyond the epoch, or (unless ``restart_epoch``) other data.
        """
        if not self.restores_training_position():
            return
        saved = SavedPosition.read(state_dict)
        fingerprint = self.fingerprint
        if fingerprint is None:
            raise RuntimeError(f"call {type(self).__name__}.setup('fit') before load_state_dict")
        step = saved.step
        differences = fingerprint.mismatches(saved.fingerprint)
        if differences:
            differences = self.other_differences(state_dict) + differences
            if self.on_order_mismatch == "raise":
                advice = fingerprint.mismatch_advice(saved.fingerprint)
                raise mismatch_error(type(self).__name__, differences, saved.epoch, advice)
            warnings.warn(
                f"the checkpoint's data does not match this {type(self).__name__} ({'; '.join(differences)}); "
                f"restarting epoch {saved.epoch} from its first step with this run's data",
                stacklevel=2,
            )
            step = 0
        if step > self.steps_in_epoch(saved.epoch):
            raise InvalidDataState(
                "step", step, f"at most this run's {self.steps_in_epoch(saved.epoch)} steps in epoch {saved.epoch}"
            )
        try:
            self.restore_extra_state(state_dict if not differences else None, saved.epoch, step)
        except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as error:
            raise InvalidDataState(
                f"{type(self).__name__}'s own part",
                {k: v for k, v in state_dict.items() if k not in saved.KEYS},
                f"what its state_dict() writes ({type(error).__name__}: {error})",
            ) from error
        self.restored = (saved.epoch, step)
        self.loaded = (saved, not differences)
        self.position.start(saved.epoch, step, self.step_layout(saved.epoch))

    def saved_position(self) -> tuple[int, int]:
        """(epoch, step) a checkpoint saves: the first optimizer step Lightning has not finished processing."""
        position, trainer = self.position, self._trainer
        microbatches = position.microbatches
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and position.epoch == trainer.current_epoch:
            processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            microbatches = min(microbatches, position.layout.before(processed) if self.yield_packs else processed)
        return position.epoch, position.layout.step_of(microbatches)

    def extra_state(self) -> dict[str, Any]:
        """What a subclass saves beside the position (plain values and tensors only)."""
        return {}

    def other_differences(self, state_dict: dict[str, Any]) -> list[str]:
        """Settings of ``state_dict`` a subclass checks on its own (and a resume may change), that differ: named
        beside the fingerprint's differences when those refuse the checkpoint anyway.
        """
        return []

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore what ``extra_state`` saved; ``state`` is ``None`` when the epoch restarts with new data."""

    def start_point(self) -> tuple[int, int]:
        """(epoch, microbatch of this replica) where the next epoch iteration starts; read at its first ``next()``."""
        trainer, position = self._trainer, self.position
        epoch, microbatches = position.epoch, position.microbatches
        per_epoch = self.step_layout(epoch).before(self.steps_in_epoch(epoch))
        if trainer is not None:
            if epoch == trainer.current_epoch and microbatches <= per_epoch:
                return epoch, microbatches
            return trainer.current_epoch, 0
        if microbatches >= per_epoch:
            return epoch + 1, 0
        return epoch, microbatches

    def restart_epoch(self, epoch: int) -> None:
        """Stand at the first step of ``epoch`` as if restored there (a resume that starts the epoch over)."""
        self.restored = (epoch, 0)
        self.position.start(epoch, 0, self.step_layout(epoch))

    def restores_training_position(self) -> bool:
        """Whether a checkpoint's data state matters now: not under ``validate/test/predict``, which never use it."""
        trainer = self._trainer
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    def check_run(self, total_steps: int | None) -> None:
        """Refuse settings that contradict the run's length (``total_steps`` optimizer steps, where known)."""

    def complete_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """Fill in what a training batch can only know from every rank (a collective), as each batch starts."""

    # ------------------------------------------------------------------ devices
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a (pinned) batch with ``non_blocking=True``, keeping its type; a pass-through on CPU."""
        self.count_host_batch(batch)  # a training batch's tokens, counted on the host before the copy
        return move_batch_to_device(batch, device)

    def resolve_pin_memory(self) -> bool:
        """``pin_memory`` if set, else pin exactly when the trainer's device (or, alone, the machine) has CUDA
        (``ValueError`` for ``pin_memory=True`` without CUDA)."""
        trainer = self._trainer
        return resolve_pin_memory(self.pin_memory, None if trainer is None else trainer.strategy.root_device)

    # ------------------------------------------------------------------ shutdown
    track_loader = PartAttribute("handed", "track")  # remember a loader, closing the previous one of its kind
    close_loaders = PartAttribute("handed", "close")  # stop every loader handed out (their workers exit now)

    def teardown(self, stage: str) -> None:
        self.close_loaders()

    def on_exception(self, exception: BaseException) -> None:
        self.close_loaders()
