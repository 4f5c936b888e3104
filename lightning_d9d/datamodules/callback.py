"""DataModuleCallback: what a lightning_d9d DataModule needs from the Trainer, in the Trainer's own hooks.

It sets ``accumulate_grad_batches = M`` (and per-epoch reloads where epochs differ), checks a restored data state
against the checkpoint's loops, aligns Lightning's in-epoch counters to the data position, runs the peer check and
times the data; attaching it makes Lightning's progress bar count optimizer steps. The DataModule itself never
edits the Trainer.

Trade-off: aligning counters touches Lightning's loop internals, which tests pin down.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.observability import DataObserver
from lightning_d9d.datamodules.progress_bar import count_optimizer_steps
from lightning_d9d.parallel.peer_check import (
    NothingToCompareWarning,
    batch_digest,
    checked_summary,
    nothing_to_compare,
    steps_checked,
    verify_peer_step,
)

if TYPE_CHECKING:
    from lightning_d9d.datamodules.base import SteppedDataModule


class DataModuleCallback(pl.Callback):
    """Keeps the Trainer's settings and restored counters in agreement with one DataModule's data position."""

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule
        self._checkpoint_keys: list[str] | None = None
        self._peers = _PeerCheck(datamodule)
        self._observer = DataObserver(datamodule)

    @classmethod
    def attach(cls, trainer: pl.Trainer, datamodule: SteppedDataModule) -> None:
        """Add the callback of ``datamodule`` to ``trainer`` (replacing one left by another DataModule), and make
        Lightning's progress bar count optimizer steps."""
        callbacks = [c for c in trainer.callbacks if not isinstance(c, cls) or c._datamodule is datamodule]
        if not any(isinstance(c, cls) for c in callbacks):
            callbacks.append(cls(datamodule))
        trainer.callbacks[:] = callbacks
        count_optimizer_steps(trainer)

    # ------------------------------------------------------------------ trainer settings
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._set_accumulation(trainer, pl_module)
        if self._datamodule.reloads_train_loader_every_epoch:
            self._reload_train_loader_every_epoch(trainer)
        self._warn_val_check_in_microbatches(trainer)

    def _warn_val_check_in_microbatches(self, trainer: pl.Trainer) -> None:
        """One warning when an integer ``val_check_interval`` counts microbatches rather than optimizer steps.

        Lightning counts it in training batches, which are microbatches here, while ``max_steps``, checkpoints and
        the logs count optimizer steps; converting it would change what a Trainer argument means (and has no exact
        value where steps change size), so the warning says what it counts, with the numbers.
        """
        interval, datamodule = trainer.val_check_interval, self._datamodule
        if not isinstance(interval, int) or isinstance(interval, bool):
            return  # a float is a fraction of the epoch, the same in batches as in steps
        if not datamodule.step_sizes_vary and trainer.accumulate_grad_batches == 1:
            return
        if datamodule.step_sizes_vary:
            every = "a number of optimizer steps that changes with the step's microbatches"
            advice = "count the microbatches of the steps you want between validations"
        else:
            every = f"{interval / trainer.accumulate_grad_batches:g} optimizer steps"
            advice = f"val_check_interval={interval * trainer.accumulate_grad_batches} validates every {interval} steps"
        rank_zero_warn(
            f"Trainer(val_check_interval={interval}) counts training batches, which are microbatches here "
            f"({datamodule.describe_step()}): validation runs every {interval} microbatches, {every}; {advice}",
            category=UserWarning,
        )

    def _set_accumulation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``accumulate_grad_batches = M`` (1 with packs); ``ValueError`` if the user set another value than 1 and M.
        Where M changes from step to step, Lightning is told each step's M as it starts (:class:`StepSizes`).
        """
        datamodule = self._datamodule
        if not pl_module.automatic_optimization:
            return
        if datamodule.step_sizes_vary:
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) disagrees with the data: "
                    f"the microbatches per step change during the run ({datamodule.describe_step()}); leave it at 1 "
                    f"({type(datamodule).__name__} sets it step by step)"
                )
            StepSizes(datamodule).install(trainer)
            return
        expected = datamodule.batches_per_step
        if trainer.accumulate_grad_batches not in (1, expected):
            what = (
                "yield_packs=True hands out one whole optimizer step per batch"
                if datamodule.yield_packs
                else datamodule.describe_step()
            )
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) disagrees with the data: "
                f"{what}; leave it at 1 ({type(datamodule).__name__} sets it) or set it to {expected}"
            )
        trainer.accumulate_grad_batches = expected

    def _reload_train_loader_every_epoch(self, trainer: pl.Trainer) -> None:
        """Reload every epoch (epochs differ in length); ``ValueError`` if the user set a reload period above 1."""
        every = trainer.reload_dataloaders_every_n_epochs
        if every not in (0, 1):
            raise ValueError(
                f"Trainer(reload_dataloaders_every_n_epochs={every}) would keep one epoch's train loader for "
                f"{every} epochs, but token-budget epochs differ in their number of steps; leave it at 0 "
                f"({type(self._datamodule).__name__} sets it to 1) or set it to 1"
            )
        trainer.reload_dataloaders_every_n_epochs = 1

    # ------------------------------------------------------------------ the checkpoint's loops
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._checkpoint_keys = sorted(str(key) for key in checkpoint)
        self.check_against_loops(checkpoint, pl_module.automatic_optimization)

    def check_against_loops(self, checkpoint: dict[str, Any], automatic_optimization: bool) -> None:
        """Raise ``ValueError`` when a restored data position disagrees with the checkpoint's loops."""
        datamodule = self._datamodule
        loaded, epoch = datamodule.loaded, checkpoint.get("epoch")
        if loaded is None or not isinstance(epoch, int):
            return
        saved, same_data = loaded
        # Another run's data (restart_epoch) may have had other epoch lengths: only its epoch is checked.
        finished = not same_data or saved.step == datamodule.steps_in_epoch(saved.epoch)
        if saved.epoch != epoch and not (saved.epoch == epoch - 1 and finished):
            raise InvalidDataState(
                "epoch",
                saved.epoch,
                f"the checkpoint's loops are in epoch {epoch}, so the data must be in epoch "
                f"{epoch} (or have finished epoch {epoch - 1})",
            )
        done = _steps_done_in_epoch(checkpoint, automatic_optimization, datamodule.yield_packs)
        if same_data and saved.epoch == epoch and done is not None and saved.step != done:
            raise InvalidDataState(
                "step",
                saved.step,
                f"the checkpoint's loops completed {done} optimizer steps of epoch {epoch} "
                f"(global step {checkpoint.get('global_step')}), so the data's step must be {done}",
            )

    # ------------------------------------------------------------------ Lightning's restored counters
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._datamodule.check_run(_total_steps(trainer, self._datamodule))
        self.align_lightning_progress(trainer)
        self._peers.start()
        self._observer.fit_start(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._peers.end()
        self._observer.fit_end()

    # ------------------------------------------------------------------ the peer check and the data's speed
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._observer.epoch_start()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        self._observer.batch_start(batch)  # first: the wait ends here, not after the digest
        self._datamodule.complete_batch(trainer, batch)
        self._peers.collect(trainer, batch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self._peers.verify_if_step_ends()
        self._observer.batch_end(pl_module)  # last: the peers' all-gather is not a wait for data

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._observer.validation_start(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._observer.validation_end(trainer)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._peers.collect_validation(trainer, batch)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._peers.verify_validation(trainer)

    def align_lightning_progress(self, trainer: pl.Trainer) -> None:
        """Set Lightning's restored in-epoch batch counters to the data position (``ValueError`` without a state)."""
        datamodule = self._datamodule
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.batch_progress.current
        missing = datamodule.restored is None and trainer.ckpt_path is not None
        if missing and 0 < current.ready < trainer.num_training_batches:
            self._on_missing_state(trainer)
        restored = datamodule.restored
        if restored is None:
            return
        epoch, step = restored
        if epoch == trainer.current_epoch:
            batches = datamodule.batches_before(epoch, step)
        elif epoch + 1 == trainer.current_epoch and step == datamodule.steps_in_epoch(epoch):
            # A checkpoint from the last batch of an epoch: Lightning moved on to the next epoch but kept the counters
            # of the finished one, in the saving run's microbatches. Its own reset clears them only when they reach
            # this run's epoch length, which another layout (or another M in the next epoch) need not: the next
            # epoch would start mid-way, its windows cut in the wrong places. It starts at its first batch.
            batches = 0
            epoch_loop.scheduler_progress.reset_on_run()
            epoch_loop.automatic_optimization.optim_progress.reset_on_run()
            epoch_loop.val_loop.batch_progress.total.reset()
        else:
            return
        current.ready = current.started = current.processed = batches
        # When Lightning saw the checkpoint as taken at on_train_batch_end, its reset() adds one completed batch.
        current.completed = batches - 1 if epoch_loop.restarted_on_train_batch_end else batches

    def _on_missing_state(self, trainer: pl.Trainer) -> None:
        datamodule = self._datamodule
        name = type(datamodule).__qualname__
        epoch = trainer.current_epoch
        keys = self._checkpoint_keys
        held = f"it holds the keys {keys}" if keys is not None else "its keys were not seen"
        if datamodule.on_order_mismatch == "restart_epoch":
            warnings.warn(
                f"checkpoint {trainer.ckpt_path!r} has no {name!r} data state ({held}); restarting epoch {epoch} "
                "from its first step (on_order_mismatch='restart_epoch')",
                stacklevel=2,
            )
            datamodule.restart_epoch(epoch)
            return
        raise ValueError(
            f"checkpoint {trainer.ckpt_path!r} resumes epoch {epoch} mid-way, but it holds no data state for this "
            f"DataModule: Lightning stores it under the class name {name!r}, and {held}. Without it the data "
            "would start the epoch again while the trainer continues it (samples trained twice or never). Resume "
            f"from a checkpoint saved with {name} (if it was saved under another class name, copy that entry: "
            f"ckpt[{name!r}] = ckpt.pop('<that name>')), or pass on_order_mismatch='restart_epoch' to start "
            f"epoch {epoch} over"
        )


class _PeerCheck:
    """Digests of the first ``verify_peers`` steps, compared among each replica's processes; one line says what
    passed, a warning that nothing could be compared."""

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule
        self._checked, self._step, self._digests, self._first, self._batches = 0, 0, [], 0, 0
        self._validation: list[str] | None = []  # None once a validation run was checked

    def start(self) -> None:
        self._checked, self._step, self._digests = 0, 0, []
        datamodule = self._datamodule
        if datamodule.verify_peers:
            topology = datamodule.topology
            warning = nothing_to_compare(datamodule.verify_peers, topology.dp_size, topology.world_size)
            if warning is not None:
                rank_zero_warn(warning, category=NothingToCompareWarning)

    def collect(self, trainer: pl.Trainer, batch: Any) -> None:
        if trainer.world_size == 1 or self._checked >= self._datamodule.verify_peers:
            return
        if not self._digests:
            self._step = trainer.global_step
            index = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
            self._batches = self._datamodule.batch_in_step(trainer.current_epoch, index)[2]
            if not self._checked:
                self._first = self._step
        self._digests.append(batch_digest(batch))

    def verify_if_step_ends(self) -> None:
        if self._digests and len(self._digests) == self._batches:
            step, digests = self._step, self._digests
            self._digests, self._checked = [], self._checked + 1
            verify_peer_step(step, digests, self._datamodule.dp_rank)
            if self._checked == self._datamodule.verify_peers:
                self._say(steps_checked(self._first, step))

    def end(self) -> None:
        """A fit shorter than ``verify_peers`` steps: say what was checked."""
        if 0 < self._checked < self._datamodule.verify_peers:
            self._say(steps_checked(self._first, self._step))

    def collect_validation(self, trainer: pl.Trainer, batch: Any) -> None:
        if trainer.world_size > 1 and self._datamodule.verify_peers and self._validation is not None:
            self._validation.append(batch_digest(batch))

    def verify_validation(self, trainer: pl.Trainer) -> None:
        if trainer.world_size == 1 or not self._datamodule.verify_peers or self._validation is None:
            return
        digests, self._validation = self._validation, None
        verify_peer_step(f"{trainer.global_step} (validation)", digests, self._datamodule.dp_rank)
        self._say(f"the validation run at step {trainer.global_step}")

    def _say(self, what: str) -> None:
        topology = self._datamodule.topology
        if topology.model_parallel:  # else nothing was compared (warned at the start)
            rank_zero_info(checked_summary(what, topology.dp_size, topology.world_size))


def _total_steps(trainer: pl.Trainer, datamodule: SteppedDataModule) -> int | None:
    """The optimizer steps the fit ends after, where known (``max_steps``, else ``max_epochs`` epochs)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        return sum(datamodule.steps_in_epoch(epoch) for epoch in range(trainer.max_epochs))
    return None


def _steps_done_in_epoch(checkpoint: dict[str, Any], automatic_optimization: bool, packs: bool) -> int | None:
    """Optimizer steps the checkpoint's loops completed in its epoch; ``None`` where they do not say."""
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


class StepSizes:
    """Lightning told, step by step, how many microbatches each optimizer step has, where that changes.

    Lightning decides a step's end by ``batch_progress.current.ready % accumulate_grad_batches`` and zeroes gradients
    at ``batch_idx % accumulate_grad_batches == 0``: both assume windows of one size aligned to the epoch's start. With
    global batch sizes in phases the windows change size, so the epoch loop's ``_accumulated_batches_reached`` and the
    automatic optimisation's ``_make_zero_grad_fn`` are answered from the DataModule's step layout, and
    ``accumulate_grad_batches`` (by which Lightning divides each microbatch's loss) is set to the step's M before each
    of its microbatches. These are Lightning internals: ``tests/datamodules/test_shape_schedule_trainer.py`` pins them.
    """

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule

    def install(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        optimization = epoch_loop.automatic_optimization
        progress = epoch_loop.batch_progress.current

        def place(index: int) -> tuple[int, int, int]:
            position = self._datamodule.batch_in_step(trainer.current_epoch, index)
            trainer.accumulate_grad_batches = position[2]
            return position

        def step_ends() -> bool:
            if progress.ready == 0:  # nothing handed out in this epoch yet: no window is open
                return True
            _, at, count = place(progress.ready - 1)
            return at == count - 1

        def zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
            if optimization._skip_backward or place(batch_idx)[1] != 0:
                return None

            def zero_grad() -> None:
                optimization._on_before_zero_grad(optimizer)
                optimization._optimizer_zero_grad(batch_idx, optimizer)

            return zero_grad

        epoch_loop._accumulated_batches_reached = step_ends
        optimization._make_zero_grad_fn = zero_grad_fn
