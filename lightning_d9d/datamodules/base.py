"""SteppedDataModule: what every lightning_d9d DataModule shares with Lightning — steps, resume, devices, shutdown.

This layer (``lightning_d9d.datamodules``) is the only one that imports Lightning. Its base class owns:

* **steps**: ``M = G / (W·m)`` microbatches per rank per optimizer step (``M = P / W`` with token budgets,
  ``P = global_batch_tokens / microbatch_tokens``), set as ``trainer.accumulate_grad_batches`` (an explicit,
  different value is an error); ``steps_in_epoch(epoch)`` may differ between epochs (token budgets pack each
  epoch's samples into its own number of steps);
* **the resume contract** (:mod:`lightning_d9d.resume`): ``state_dict()`` is ``{"epoch", "step",
  "fingerprint"}`` plus what a subclass adds; ``load_state_dict`` compares fingerprints (one error format,
  naming every differing field), checks the step, and stands the position at that step; one ``start_point``
  decides where every epoch iteration begins;
* **Lightning's restored counters**: Lightning restores its in-epoch batch counters in the old run's
  microbatches, which is wrong after a mid-window checkpoint or a change of world size or microbatch size;
  they are re-aligned to the data position in ``on_train_start``. A mid-epoch resume whose checkpoint gave this
  DataModule no state (a checkpoint of a plain DataLoader, or one saved under another class name) would train
  a wrong partial epoch, so it is an error there, naming the checkpoint's keys;
* **pinning and transfer**: pin only where the trainer's device is CUDA; ``transfer_batch_to_device`` copies
  with ``non_blocking=True`` and keeps the batch type;
* **shutdown**: the loaders it handed out are closed (worker processes stopped, there and then) when a new
  loader is made, at ``teardown`` and when training raises.

Trade-off: aligning Lightning's counters touches its loop internals
(``fit_loop.epoch_loop.batch_progress``); tests pin this down so an upgrade that changes them fails loudly.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Literal, Protocol, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_d9d.checks import microbatches_per_step, one_of, token_microbatches_per_step
from lightning_d9d.device.transfer import move_batch_to_device
from lightning_d9d.resume import Fingerprint, SavedPosition, TrainPosition, invalid_state, mismatch_error

OnOrderMismatch = Literal["raise", "restart_epoch"]
ON_ORDER_MISMATCH = ("raise", "restart_epoch")


class ClosableLoader(Protocol):
    def close(self) -> None: ...


Loader = TypeVar("Loader", bound=ClosableLoader)


class SteppedDataModule(pl.LightningDataModule):
    """Base of every lightning_d9d DataModule: steps, the resume contract, counters, pinning, shutdown.

    Subclasses set ``global_batch_size`` and ``microbatch_size`` (or ``global_batch_tokens`` and
    ``microbatch_tokens``), ``pin_memory``, ``yield_packs`` and ``on_order_mismatch``; in ``setup`` they set
    ``fingerprint`` and call ``start_fit()`` for the fit stage; they define ``steps_per_epoch`` (and
    ``steps_in_epoch`` where epochs differ) and may add to the state with ``extra_state``/``restore_extra_state``.
    """

    global_batch_size: int | None
    microbatch_size: int | None
    global_batch_tokens: int | None = None  # token budgets: set instead of global_batch_size/microbatch_size
    microbatch_tokens: int | None = None
    pin_memory: bool | None = None
    yield_packs: bool = False
    _on_order_mismatch: OnOrderMismatch = "raise"
    fingerprint: Fingerprint | None = None
    position: TrainPosition
    steps_per_epoch: int  # optimizer steps per epoch; a subclass's attribute or property
    restored: tuple[int, int] | None = None  # (epoch, step) loaded from a checkpoint, not yet started

    @property
    def on_order_mismatch(self) -> OnOrderMismatch:
        """What ``load_state_dict`` does with a checkpoint of other data: ``"raise"`` or ``"restart_epoch"``."""
        return self._on_order_mismatch

    @on_order_mismatch.setter
    def on_order_mismatch(self, value: OnOrderMismatch) -> None:
        self._on_order_mismatch = one_of("on_order_mismatch", value, ON_ORDER_MISMATCH)

    # ------------------------------------------------------------------ topology
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
        """M = G / (W·m), or P / W with token budgets: microbatches one rank runs per optimizer step."""
        if self.global_batch_tokens is not None:
            return token_microbatches_per_step(self.global_batch_tokens, self.microbatch_tokens, self.world_size)
        return microbatches_per_step(self.global_batch_size, self.world_size, self.microbatch_size)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch``; the same for every epoch unless a subclass says otherwise."""
        return self.steps_per_epoch

    @property
    def batches_per_step(self) -> int:
        """Batches the training loop receives per optimizer step: 1 with ``yield_packs``, else M."""
        return 1 if self.yield_packs else self.microbatches_per_step

    # ------------------------------------------------------------------ set-up under a Trainer
    def start_fit(self, position: TrainPosition) -> None:
        """Stand at the start of training with ``position``; under a Trainer, configure it.

        Sets ``accumulate_grad_batches = M`` (automatic optimization) and registers the callback that aligns
        Lightning's restored counters and checks that a mid-epoch resume gave this DataModule its state.

        Raises:
            ValueError: the user set ``accumulate_grad_batches`` to a value other than 1 and M.
        """
        self.position, self.restored = position, None
        trainer = self._trainer
        if trainer is None:
            return
        per_step = self.microbatches_per_step
        module = getattr(trainer, "lightning_module", None)
        if module is not None and module.automatic_optimization:
            expected = self.batches_per_step
            if trainer.accumulate_grad_batches not in (1, expected):
                what = (
                    "yield_packs=True hands out one whole optimizer step per batch"
                    if self.yield_packs
                    else f"global_batch_tokens={self.global_batch_tokens}, microbatch_tokens={self.microbatch_tokens} "
                    f"and world_size={self.world_size} give {per_step} microbatches per step"
                    if self.global_batch_tokens is not None
                    else f"global_batch_size={self.global_batch_size}, world_size={self.world_size} and "
                    f"microbatch_size={self.microbatch_size} give {per_step} microbatches per step"
                )
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) disagrees with the data: "
                    f"{what}; leave it at 1 ({type(self).__name__} sets it) or set it to {expected}"
                )
            trainer.accumulate_grad_batches = expected
        if not any(isinstance(callback, _DataPositionCallback) for callback in trainer.callbacks):
            trainer.callbacks.append(_DataPositionCallback(self))

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
                raise mismatch_error(type(self).__name__, differences, saved.epoch)
            warnings.warn(
                f"the checkpoint's data does not match this {type(self).__name__} ({'; '.join(differences)}); "
                f"restarting epoch {saved.epoch} from its first step with this run's data",
                stacklevel=2,
            )
            step = 0
        if step > self.steps_in_epoch(saved.epoch):
            raise invalid_state(
                "step", step, f"at most this run's {self.steps_in_epoch(saved.epoch)} steps in epoch {saved.epoch}"
            )
        try:
            self.restore_extra_state(state_dict if not differences else None, saved.epoch, step)
        except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as error:
            raise invalid_state(
                f"{type(self).__name__}'s own part",
                {k: v for k, v in state_dict.items() if k not in saved.KEYS},
                f"what its state_dict() writes ({type(error).__name__}: {error})",
            ) from error
        self.restored = (saved.epoch, step)
        self._loaded = (saved, not differences)
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
        """(epoch, microbatch of this rank) where the next epoch iteration starts; read at its first ``next()``.

        Under a Trainer the epoch is the trainer's: a restored position of that epoch continues, this process's
        own position continues a partly consumed epoch, and anything else starts the epoch at 0. Without one
        (a notebook), the position continues, rolling into the next epoch once the last one is finished.
        """
        trainer, position = self._trainer, self.position
        per_step = self.microbatches_per_step
        restored, self.restored = self.restored, None
        if trainer is not None:
            epoch = trainer.current_epoch
            if restored is not None and restored[0] == epoch:
                return epoch, restored[1] * per_step
            per_epoch = self.steps_in_epoch(epoch) * per_step
            if restored is None and position.epoch == epoch and position.microbatches < per_epoch:
                return epoch, position.microbatches
            return epoch, 0
        if position.microbatches >= self.steps_in_epoch(position.epoch) * per_step:
            return position.epoch + 1, 0
        return position.epoch, position.microbatches

    def restores_training_position(self) -> bool:
        """Whether a checkpoint's data state matters now: not under ``Trainer.validate/test/predict``.

        Those load the DataModule state too, but never use the training position, so a checkpoint from
        another data order must not stop them.
        """
        trainer = self._trainer
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    # ------------------------------------------------------------------ Lightning's restored counters
    def check_against_loops(self, checkpoint: dict[str, Any], automatic_optimization: bool) -> None:
        """Check the restored data position against the checkpoint's own loop state (its epoch and steps).

        A data state saved with a checkpoint agrees with it: the data is in the checkpoint's epoch with as many
        steps done as Lightning's optimizer completed in that epoch (batches, with ``yield_packs``), or it
        finished the epoch before (a checkpoint between epochs). A state that disagrees would train other data
        than the trainer believes, so it is refused.

        Raises:
            ValueError: ``epoch`` or ``step`` contradicts the checkpoint's loops, naming both.
        """
        loaded, self._loaded = getattr(self, "_loaded", None), None
        epoch = checkpoint.get("epoch")
        if loaded is None or not isinstance(epoch, int):
            return
        saved, same_data = loaded
        # Another run's data (restart_epoch) may have had other epoch lengths: only its epoch is checked.
        finished = not same_data or saved.step == self.steps_in_epoch(saved.epoch)
        if saved.epoch != epoch and not (saved.epoch == epoch - 1 and finished):
            raise invalid_state(
                "epoch",
                saved.epoch,
                f"the checkpoint's loops are in epoch {epoch}, so the data must be in epoch "
                f"{epoch} (or have finished epoch {epoch - 1})",
            )
        done = _steps_done_in_epoch(checkpoint, automatic_optimization, self.yield_packs)
        if same_data and saved.epoch == epoch and done is not None and saved.step != done:
            raise invalid_state(
                "step",
                saved.step,
                f"the checkpoint's loops completed {done} optimizer steps of epoch {epoch} "
                f"(global step {checkpoint.get('global_step')}), so the data's step must be {done}",
            )

    def align_lightning_progress(self, trainer: pl.Trainer, checkpoint_keys: list[str] | None) -> None:
        """Set Lightning's restored in-epoch batch counters to the restored data position.

        Lightning restores them in the old run's microbatches, including a partial accumulation window; left as
        they are, it would end the epoch early or misalign accumulation windows.

        Raises:
            ValueError: Lightning resumes mid-epoch but the checkpoint gave this DataModule no state.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.batch_progress.current
        if self.restored is None and trainer.ckpt_path is not None and 0 < current.ready < trainer.num_training_batches:
            self._on_missing_state(trainer, checkpoint_keys)
        if self.restored is None or self.restored[0] != trainer.current_epoch:
            return
        batches = self.restored[1] * self.batches_per_step
        current.ready = current.started = current.processed = batches
        # When Lightning saw the checkpoint as taken at on_train_batch_end, its reset() adds one completed batch.
        current.completed = batches - 1 if epoch_loop.restarted_on_train_batch_end else batches

    def _on_missing_state(self, trainer: pl.Trainer, checkpoint_keys: list[str] | None) -> None:
        name = type(self).__qualname__
        epoch = trainer.current_epoch
        keys = f"it holds the keys {checkpoint_keys}" if checkpoint_keys is not None else "its keys were not seen"
        if self.on_order_mismatch == "restart_epoch":
            warnings.warn(
                f"checkpoint {trainer.ckpt_path!r} has no {name!r} data state ({keys}); restarting epoch {epoch} "
                "from its first step (on_order_mismatch='restart_epoch')",
                stacklevel=2,
            )
            self.restored = (epoch, 0)
            self.position.start(epoch, 0, self.microbatches_per_step)
            return
        raise ValueError(
            f"checkpoint {trainer.ckpt_path!r} resumes epoch {epoch} mid-way, but it holds no data state for this "
            f"DataModule: Lightning stores it under the class name {name!r}, and {keys}. Without it the data "
            "would start the epoch again while the trainer continues it (samples trained twice or never). Resume "
            f"from a checkpoint saved with {name} (if it was saved under another class name, copy that entry: "
            f"ckpt[{name!r}] = ckpt.pop('<that name>')), or pass on_order_mismatch='restart_epoch' to start "
            f"epoch {epoch} over"
        )

    # ------------------------------------------------------------------ devices
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


class _DataPositionCallback(pl.Callback):
    """Sees the checkpoint's keys when it is loaded, and aligns Lightning's counters before the first batch."""

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule
        self._checkpoint_keys: list[str] | None = None

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # Runs after the DataModule's load_state_dict, on the whole checkpoint.
        self._checkpoint_keys = sorted(str(key) for key in checkpoint)
        self._datamodule.check_against_loops(checkpoint, pl_module.automatic_optimization)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._datamodule.align_lightning_progress(trainer, self._checkpoint_keys)


def _steps_done_in_epoch(checkpoint: dict[str, Any], automatic_optimization: bool, packs: bool) -> int | None:
    """Optimizer steps the checkpoint's loops completed in its epoch; ``None`` where they do not say.

    Automatic optimization counts them; with packs (manual optimization, one step per batch) they are the
    processed batches. Other manual optimization may step any number of times per batch.
    """
    try:
        loop = checkpoint["loops"]["fit_loop"]
        if automatic_optimization:
            done = loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"]
            return int(done["completed"])
        if packs:
            return int(loop["epoch_loop.batch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return None
    return None
