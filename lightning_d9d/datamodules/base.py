"""SteppedDataModule: what every lightning_d9d DataModule shares — topology, the resume contract, devices, shutdown.

This layer (``lightning_d9d.datamodules``) is the only one that imports Lightning. Its base class owns:

* **topology**: the data-parallel size and rank (:mod:`lightning_d9d.topology`, resolved once per ``setup``
  from the trainer's strategy or the ``data_parallel`` setting; 1 and 0 without a trainer). Data is dealt by
  data-parallel rank, never by process, so tensor/context/pipeline-parallel peers get the same microbatches;
  ``M`` microbatches per replica per optimizer step (``M = G / (D·m)``; a subclass may size steps otherwise,
  e.g. ``P / D`` with token budgets); ``steps_in_epoch(epoch)`` may differ between epochs;
* **the resume contract** (:mod:`lightning_d9d.resume`): ``state_dict()`` is ``{"epoch", "step",
  "fingerprint"}`` plus what a subclass adds, the step counting only optimizer steps done (a microbatch in
  flight when the checkpoint is taken is not); ``load_state_dict`` validates the state (one error per bad
  field), compares fingerprints (one error format, naming every differing field), and stands the position at
  that step; one ``start_point``, free of side effects, decides where every epoch iteration begins;
* **pinning and transfer**: pin only where the trainer's device is CUDA; ``transfer_batch_to_device`` copies
  with ``non_blocking=True`` and keeps the batch type;
* **the data's speed** (:mod:`lightning_d9d.datamodules.observability`): ``data_wait_warning``, and the token
  count of each training microbatch on the host before its copy, which the callback logs;
* **shutdown**: the loaders it handed out are closed (worker processes stopped, there and then) when a new
  loader is made, at ``teardown`` and when training raises.

What the Trainer must be told or corrected (``accumulate_grad_batches``, a reload every epoch, its restored
counters, a checkpoint's loops that contradict the data state), and the opt-in peer check (``verify_peers``),
are done by
:class:`~lightning_d9d.datamodules.callback.DataModuleCallback`, attached in ``start_fit``.

Trade-off: the saved step reads Lightning's processed-batch counter (``fit_loop.epoch_loop.batch_progress``),
a loop internal; tests pin it down so an upgrade that changes it fails loudly.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Literal, Protocol, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_d9d.checks import microbatches_per_step, one_of
from lightning_d9d.datamodules.callback import DataModuleCallback
from lightning_d9d.datamodules.data_parallel import DataParallelMixin
from lightning_d9d.datamodules.observability import ObservedData
from lightning_d9d.device.transfer import move_batch_to_device
from lightning_d9d.resume import Fingerprint, InvalidDataState, SavedPosition, TrainPosition, mismatch_error

OnOrderMismatch = Literal["raise", "restart_epoch"]
ON_ORDER_MISMATCH = ("raise", "restart_epoch")


class ClosableLoader(Protocol):
    def close(self) -> None: ...


Loader = TypeVar("Loader", bound=ClosableLoader)


class SteppedDataModule(ObservedData, DataParallelMixin, pl.LightningDataModule):
    """Base of every lightning_d9d DataModule: topology, steps, the resume contract, counters, pinning, shutdown.

    Subclasses set ``global_batch_size`` and ``microbatch_size`` (or override ``microbatches_for`` and
    ``describe_step`` to size steps otherwise), ``pin_memory``, ``yield_packs``, ``on_order_mismatch``,
    ``data_parallel``, ``verify_peers`` and ``data_wait_warning``; ``setup`` starts with ``resolve_topology()``,
    sets ``fingerprint`` and calls ``start_fit()`` for the fit stage; they deal data by ``dp_rank`` of
    ``dp_size``; they define ``steps_per_epoch`` (and ``steps_in_epoch`` and ``reloads_train_loader_every_epoch``
    where epochs differ) and may add to the state with ``extra_state``/``restore_extra_state``.
    """

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

    @property
    def on_order_mismatch(self) -> OnOrderMismatch:
        """What ``load_state_dict`` does with a checkpoint of other data: ``"raise"`` or ``"restart_epoch"``."""
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
        """M at data-parallel size ``dp_size``: ``G / (D·m)`` unless a subclass sizes steps otherwise.

        Raises:
            ValueError: G not divisible by ``dp_size × m``.
        """
        return microbatches_per_step(self.global_batch_size, dp_size, self.microbatch_size)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch``; the same for every epoch unless a subclass says otherwise."""
        return self.steps_per_epoch

    @property
    def batches_per_step(self) -> int:
        """Batches the training loop receives per optimizer step: 1 with ``yield_packs``, else M."""
        return 1 if self.yield_packs else self.microbatches_per_step

    def describe_step(self) -> str:
        """How the settings give M, for messages (``global_batch_size=…, data-parallel size … give M …``)."""
        return (
            f"global_batch_size={self.global_batch_size}, data-parallel size {self.dp_size} and "
            f"microbatch_size={self.microbatch_size} give {self.microbatches_per_step} microbatches per step"
        )

    # ------------------------------------------------------------------ set-up under a Trainer
    def start_fit(self, position: TrainPosition) -> None:
        """Stand at the start of training with ``position``; under a Trainer, attach :class:`DataModuleCallback`.

        The callback sets the trainer's settings the data decides (``accumulate_grad_batches = M``), checks a
        restored data state against the checkpoint's loops and aligns Lightning's restored counters to it.
        """
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
            ValueError: a state from other data or settings (naming each differing field, with the checkpoint's
                value and this run's), unless ``on_order_mismatch="restart_epoch"``; a step beyond the epoch; a
                malformed state.
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
        self.position.start(saved.epoch, step, self.microbatches_per_step)

    def saved_position(self) -> tuple[int, int]:
        """(epoch, step) a checkpoint saves: the first optimizer step not yet done.

        The loader counts a microbatch when it hands it out, but under a Trainer a checkpoint can be taken while
        that microbatch is still in flight (an exception, Ctrl+C or any save before Lightning has processed
        it). If it is the last of its window, the step it belongs to has not been taken, so the saved step is
        counted from the microbatches Lightning has processed in this epoch, not from those handed out.
        Without a Trainer, what was handed out is what was trained.
        """
        position, trainer = self.position, self._trainer
        microbatches = position.microbatches
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and position.epoch == trainer.current_epoch:
            processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            microbatches = min(microbatches, processed * (self.microbatches_per_step if self.yield_packs else 1))
        return position.epoch, microbatches // position.microbatches_per_step

    def extra_state(self) -> dict[str, Any]:
        """What a subclass saves beside the position (plain values and tensors only)."""
        return {}

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore what ``extra_state`` saved; ``state`` is ``None`` when the epoch restarts with new data."""

    def start_point(self) -> tuple[int, int]:
        """(epoch, microbatch of this replica) where the next epoch iteration starts; read at its first ``next()``.

        Under a Trainer the epoch is the trainer's: the position continues where it stands in that epoch (a
        restored one included; a finished one stays finished), and any other epoch starts at 0. Without one (a
        notebook), the position continues, rolling into the next epoch once the last one is finished.
        """
        trainer, position = self._trainer, self.position
        epoch, microbatches = position.epoch, position.microbatches
        per_epoch = self.steps_in_epoch(epoch) * self.microbatches_per_step
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
        self.position.start(epoch, 0, self.microbatches_per_step)

    def restores_training_position(self) -> bool:
        """Whether a checkpoint's data state matters now: not under ``Trainer.validate/test/predict``.

        Those load the DataModule state too, but never use the training position, so a checkpoint from
        another data order must not stop them.
        """
        trainer = self._trainer
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    # ------------------------------------------------------------------ devices
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a (pinned) batch with ``non_blocking=True``, keeping its type; a pass-through on CPU."""
        self.count_host_batch(batch)  # a training batch's tokens, counted on the host before the copy
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

    # ------------------------------------------------------------------ shutdown
    def track_loader(self, loader: Loader, kind: str = "train") -> Loader:
        """Remember a loader handed out; the previous one of its kind is closed now, the rest at teardown/errors."""
        loaders: dict[str, weakref.ref] = getattr(self, "_loaders", {})
        previous = loaders.get(kind)
        if previous is not None and previous() is not None:
            previous().close()
        loaders[kind] = weakref.ref(loader)
        self._loaders = loaders
        return loader

    def close_loaders(self) -> None:
        """Stop every loader handed out (their worker processes exit now, not when garbage is collected)."""
        for ref in getattr(self, "_loaders", {}).values():
            loader = ref()
            if loader is not None:
                loader.close()
        self._loaders = {}

    def teardown(self, stage: str) -> None:
        self.close_loaders()

    def on_exception(self, exception: BaseException) -> None:
        self.close_loaders()
