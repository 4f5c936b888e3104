"""A PretrainingDataModule's mixture controller in the loop, a part it owns: per-source losses gathered, decisions
journaled.

Every training microbatch's per-token losses (``training_step`` returning ``{"loss", "token_losses"}``, or
``dm.report_token_losses``) are summed per source on the device, with the target mask and ``batch.sources``, without
a host sync; a step's sums join the window when the step ends. At each update step ``u`` (a multiple of the
controller's ``every``, decided once steps ``[0, u)`` have trained) the window and the latest validation sums go
through ONE all-reduce of a ``5·N`` float64 vector, the controller is called with the result (the same on every rank,
so every rank decides the same), and the decision is journaled (``streaming/plans/mixture_journal.py``) for data step
``u + MIXTURE_LAG``. The journal, the controller's state and the window are the part's state, nested under
``"mixture_control"`` in the DataModule's, so a resume replays every decision and continues the window.

Trade-off: the window a checkpoint saves is all-reduced at the save (one more small collective per checkpoint), so
any data-parallel layout resumes it.
"""

from __future__ import annotations

import atexit
import itertools
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.pretraining.plan import RunPlan
from lightning_d9d.mixtures import SourceStats, check_controller, check_stats, checked_weights, quantised
from lightning_d9d.streaming.plans.mixture_journal import MIXTURE_LAG, JournaledPlan, JournalEntry, MixtureJournal

_NEVER = 1 << 62  # the update interval of a journal replayed without a controller: no update is ever due
_FEEDS = itertools.count()


class MixtureWindow:
    """Per-source sums on the device, ``[N, 3]`` (loss sum, target tokens, rows): of the window, of the step being
    trained, and of the latest validation run. A row holds one source's tokens, so a microbatch adds per-row sums:
    a few tensor operations, no host sync."""

    def __init__(self, sources: int):
        self.n = sources
        self.window = torch.zeros(sources, 3, dtype=torch.float64)
        self.step = torch.zeros(sources, 3, dtype=torch.float64)
        self.validation = torch.zeros(sources, 3, dtype=torch.float64)

    def add(self, batch: Any, token_losses: torch.Tensor, into: str = "step", source: int | None = None) -> None:
        """Add a microbatch's per-token losses (``token_losses`` shaped like ``batch.targets``)."""
        targets = batch.targets
        if tuple(token_losses.shape) != tuple(targets.shape):
            raise ValueError(
                f"token_losses has shape {tuple(token_losses.shape)}, but batch.targets {tuple(targets.shape)}: give "
                "the per-token losses of the microbatch unreduced (e.g. F.cross_entropy(..., reduction='none') "
                "reshaped like batch.targets)"
            )
        device = token_losses.device
        sums = getattr(self, into)
        if sums.device != device:
            sums = sums.to(device)
            setattr(self, into, sums)
        mask = (targets != -100).to(device)
        losses = torch.where(mask, token_losses.detach(), 0)
        rows = len(targets)
        per_row = torch.stack([losses.sum(1, dtype=torch.float64), mask.sum(1, dtype=torch.float64),
                               torch.ones(rows, dtype=torch.float64, device=device)], 1)  # fmt: skip
        where = batch.sources.to(device) if source is None else torch.full((rows,), source, device=device)
        sums.index_add_(0, where, per_row)

    def end_step(self) -> None:
        self.window = self.window.to(self.step.device) + self.step
        self.step = torch.zeros_like(self.step)

    def drop_step(self) -> None:
        self.step = torch.zeros_like(self.step)

    def vector(self) -> torch.Tensor:
        """``[loss_sum × N, tokens × N, rows × N]`` of the window, ``[loss_sum × N, tokens × N]`` of validation."""
        window = self.window.to(self.validation.device)
        return torch.cat([window.T.reshape(-1), self.validation[:, :2].T.reshape(-1)])

    def load(self, values: torch.Tensor) -> None:
        """Restore what ``vector`` gave."""
        n = self.n
        self.window = values[: 3 * n].reshape(3, n).T.clone()
        self.validation = torch.zeros(n, 3, dtype=torch.float64)
        self.validation[:, :2] = values[3 * n :].reshape(2, n).T

    def reset_window(self) -> None:
        self.window = torch.zeros_like(self.window)


class MixtureControl:
    """A PretrainingDataModule's mixture controller in the loop, a part it owns: the journal, the window of
    statistics, the decisions. Its state, nested under ``"mixture_control"``, is the journal, the controller's own
    state and the window (all-reduced at the save).

    Args:
        controller: the mixture controller (``None``: none; a journal saved by a run with one is still replayed).
        plan: the run plan, whose training spec the journal's decisions are wrapped around.
        trainer: the DataModule's trainer now (``None`` without one).
        peers: the processes of one data-parallel replica (their sums are counted once).
    """

    def __init__(self, controller: Any, plan: RunPlan, trainer: Callable[[], Any], peers: Callable[[], int]) -> None:
        self.controller, self.plan, self._trainer, self._peers = controller, plan, trainer, peers
        self.journal: MixtureJournal | None = None
        self.window: MixtureWindow | None = None
        self.reported = False  # the microbatch's losses came through report_token_losses
        self._feed_dir: str | None = None
        self._said_no_losses = False

    # ------------------------------------------------------------------ public
    @property
    def journal_entries(self) -> list[dict[str, Any]]:
        """Every update of the mixture controller so far, in order: ``update_step``, ``effective_step`` (training
        step the shares start at), ``data_step``, ``shares`` (``{source: "num/den"}``, ``None`` where kept),
        ``start_rows`` and ``inputs`` (the statistics the controller got and what it returned)."""
        journal = self.journal
        return [] if journal is None else [entry.to_dict(journal.names) for entry in journal.entries]

    def current_shares(self, position: Any, step: int | None = None) -> dict[str, float]:
        """The shares in force at global step ``step`` (``None``: the next step ``position`` trains), the journal's
        included."""
        spec = self.plan.require()
        if step is None:
            step = position.epoch * (self.plan.steps_per_epoch or 0) + position.step
        shares = spec.plan.shares_at(self.plan.data_step(step)) if isinstance(spec.plan, JournaledPlan) else (
            spec.plan.schedule.shares_at(self.plan.data_step(step))
        )  # fmt: skip
        return {name: float(share) for name, share in zip(spec.names, shares)}

    def report_token_losses(self, batch: Any, token_losses: torch.Tensor) -> None:
        """Count a training microbatch's per-token losses for the mixture controller (instead of returning them as
        ``token_losses`` from ``training_step``).

        Raises:
            ValueError: ``token_losses`` not shaped like ``batch.targets``.
        """
        if self.window is not None:
            self.window.add(batch, token_losses)
            self.reported = True

    def update(self, step: int) -> JournalEntry | None:
        """Close the statistics of the steps before ``step`` and, at an update step not yet decided, call the
        controller and journal its decision (the Trainer's hooks call it after each optimizer step, on every rank;
        outside ``Trainer.fit`` no update is made and the shares in force stay).

        Raises:
            ValueError: a NaN or infinite loss, or bad weights from the controller, naming the update step.
        """
        journal, window, controller = self.journal, self.window, self.controller
        if journal is None or window is None or controller is None:
            return None
        window.end_step()
        if step % controller.every or step <= journal.decided_through:
            return None
        return self._decide(step)

    # ------------------------------------------------------------------ setup, decisions
    def start(self, datamodule: Any) -> None:
        """At ``setup("fit")``: a fresh journal and window, the plan wrapped to follow the journal, and under
        ``Trainer.fit`` the callback that feeds ``datamodule``'s controller."""
        controller = self.controller
        if controller is None:
            return
        spec = self.plan.require()
        self.journal = MixtureJournal(spec.names, feed=self._feed_path())
        self.window = MixtureWindow(len(spec.names))
        self.reported = False
        self._wrap_plan(controller.every)
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            MixtureControlCallback.attach(trainer, datamodule)
        else:  # read without training (inspect, a loop of your own): no update is made, the shares in force stay
            self.journal.settle_through(_NEVER)

    def _wrap_plan(self, every: int, ignore_through: int = -1) -> None:
        spec = self.plan.require()
        base = spec.plan.base if isinstance(spec.plan, JournaledPlan) else spec.plan
        plan = JournaledPlan(base, self.journal, every, spec.skipped, ignore_through)
        self.plan.spec = spec.with_plan(plan)

    def _feed_path(self) -> str:
        if self._feed_dir is None:
            self._feed_dir = tempfile.mkdtemp(prefix="lightning-d9d-mixture-")
            weakref.finalize(self, shutil.rmtree, self._feed_dir, True)
            atexit.register(shutil.rmtree, self._feed_dir, True)
        return f"{self._feed_dir}/journal-{next(_FEEDS)}.jsonl"

    def _decide(self, step: int) -> JournalEntry:
        journal, window, controller = self.journal, self.window, self.controller
        spec = self.plan.require()
        names, n = spec.names, len(spec.names)
        values = self._reduced(window.vector()).tolist()
        shares = spec.plan.shares_at(self.plan.data_step(step - 1))
        stats = {}
        for i, name in enumerate(names):
            val_sum, val_tokens = values[3 * n + i], values[4 * n + i]
            stats[name] = SourceStats(values[i], round(values[n + i]), round(values[2 * n + i]),
                                      float(shares[i]), val_sum / val_tokens if val_tokens > 0 else None)  # fmt: skip
        check_stats(step, stats)
        if not any(stat.tokens for stat in stats.values()) and not self._said_no_losses:
            self._said_no_losses = True
            rank_zero_warn(
                f"the mixture controller got no token losses for the steps before step {step}: return "
                "{'loss': ..., 'token_losses': <per-token losses shaped like batch.targets>} from training_step, or "
                "call dm.report_token_losses(batch, token_losses)"
            )
        answer = controller.update(step, stats)
        effective = step + MIXTURE_LAG
        data_step = self.plan.data_step(effective)
        inputs: dict[str, Any] = {"stats": {name: stat.to_dict() for name, stat in stats.items()}}
        if answer is None:
            entry = JournalEntry(step, effective, data_step, None, None, inputs)
        else:
            exact = checked_weights(step, answer, names, controller)
            inputs["returned"] = {name: float(w) for name, w in zip(names, exact)}
            # At least one row a step for every source kept: a source that gets none is never observed again.
            floor = Fraction(1, min(spec.plan.rows_per_step.values))
            new = quantised(exact, floor)
            entry = JournalEntry(step, effective, data_step, new, spec.plan.cumulative_rows(data_step), inputs)
        journal.add(entry)
        window.reset_window()
        _log_update(self._trainer(), entry, stats)
        return entry

    def _reduced(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector`` summed over every process (one collective), counted once per data-parallel replica."""
        trainer = self._trainer()
        if trainer is None or trainer.world_size <= 1:
            return vector.cpu()
        total = trainer.strategy.reduce(vector.to(trainer.strategy.root_device), reduce_op="sum")
        return total.cpu() / self._peers()

    # ------------------------------------------------------------------ validation
    def add_validation(self, batch: Any, outputs: Any, name: str | None) -> None:
        """Count a validation microbatch of the validation source ``name`` (one that trains: its losses join the
        statistics the controller gets)."""
        window = self.window
        if window is None:
            return
        names = self.plan.require().names
        if name not in names:
            return
        source = names.index(name)
        losses = outputs.get("token_losses") if isinstance(outputs, Mapping) else None
        if losses is None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if not isinstance(loss, torch.Tensor):
                return
            losses = (batch.targets != -100).to(loss.device) * loss.detach().reshape(())  # the mean on every target
        window.add(batch, losses, into="validation", source=source)

    # ------------------------------------------------------------------ the resume contract
    def state_dict(self, global_step: int) -> dict[str, Any] | None:
        """The journal, the controller's state and the window at the save of global step ``global_step`` (``None``
        without a journal). A save at an update step holds its decision, whatever the order of the hooks; the
        window is all-reduced (a collective: on every process), so any layout resumes it."""
        journal, window, controller = self.journal, self.window, self.controller
        if journal is None:
            return None
        if controller is not None and global_step % controller.every == 0 and global_step > journal.decided_through:
            self._decide(global_step)
        vector = self._reduced(window.vector())
        return {
            "journal": journal.to_dict(),
            "controller": controller.state_dict() if controller is not None else None,
            "controller_class": type(controller).__name__ if controller is not None else None,
            "window": [float(v) for v in vector.tolist()],
        }

    def load_state_dict(self, saved: Mapping[str, Any] | None, global_step: int, saved_mixture: Any) -> None:
        """Replay a saved journal (or start one at ``global_step`` for a controller new at this resume) and continue
        the window; ``saved_mixture``: the checkpoint's base plan, to tell a plan replaced at this resume.

        Raises:
            InvalidDataState: a malformed journal or window.
        """
        controller = self.controller
        if saved is None and controller is None:
            return
        spec = self.plan.require()
        names = spec.names
        if saved is None:  # a controller from this resume on
            self.journal = MixtureJournal(names, decided_through=global_step, feed=self._feed_path())
            self.window = self.window or MixtureWindow(len(names))
            self._wrap_plan(controller.every)
            return
        try:
            journal = MixtureJournal.from_dict(saved["journal"], names, feed=self._feed_path())
            window = MixtureWindow(len(names))
            values = torch.tensor([float(v) for v in saved["window"]], dtype=torch.float64)
            if len(values) != 5 * len(names):
                raise ValueError(f"{len(values)} values for {len(names)} sources")
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidDataState("mixture_control", saved, f"the journal a checkpoint saves ({error})") from error
        if _global_rank(self._trainer()) == 0:  # the all-reduced sums, counted once
            window.load(values)
        journal.settle_through(global_step)
        self.journal, self.window, self.reported = journal, window, False
        same_kind = controller is not None and saved.get("controller_class") == type(controller).__name__
        if same_kind and saved.get("controller") is not None:
            controller.load_state_dict(saved["controller"])
        # A base plan replaced at this resume (on_mixture_change="continue") supersedes the decisions not yet in force.
        base = spec.plan.base if isinstance(spec.plan, JournaledPlan) else spec.plan
        replaced = base.start_step > 0 and base.start_step == self.plan.data_step(global_step)
        replaced = replaced and saved_mixture is not None and saved_mixture != base.to_dict()
        self._wrap_plan(controller.every if controller is not None else _NEVER, global_step if replaced else -1)

    # ------------------------------------------------------------------ reports
    def with_weights(self, stats: dict[str, dict[str, float]], position: Any) -> dict[str, dict[str, float]]:
        """``stats`` (``Reports.source_stats``) with ``weight``: each source's share in force at the next step."""
        try:
            shares = self.current_shares(position)
        except (RuntimeError, ValueError):
            return stats
        for name, share in shares.items():
            stats[name]["weight"] = share
        return stats

    def report(self, lines: list[str], position: Any) -> list[str]:
        """``inspect``'s mixture ``lines`` and the journal's line."""
        journal = self.journal
        if not lines or journal is None:
            return lines
        changes = journal.changes()
        now = ", ".join(f"{n} {100 * s:.4g}%" for n, s in self.current_shares(position).items())
        lines.append(
            f"  controller journal: {len(journal.entries)} updates, {len(changes)} changes of shares; shares in force "
            f"now: {now}" + (f" (from step {changes[-1].effective_step})" if changes else "")
        )
        return lines


def _log_update(trainer: Any, entry: JournalEntry, stats: Mapping[str, SourceStats]) -> None:
    """Log an update's shares, mean losses and validation losses per source (rank 0, where a logger is)."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    if module is None or trainer.logger is None:
        return
    metrics = {}
    shares = entry.shares
    for i, (name, stat) in enumerate(stats.items()):
        metrics[f"mixture/weight/{name}"] = float(shares[i]) if shares is not None else stat.weight
        if stat.mean_loss is not None:
            metrics[f"mixture/loss/{name}"] = stat.mean_loss
        if stat.val_loss is not None:
            metrics[f"mixture/val_loss/{name}"] = stat.val_loss
    module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)


def _global_rank(trainer: Any) -> int:
    return 0 if trainer is None else int(trainer.global_rank)


class MixtureControlCallback(pl.Callback):
    """Feeds a DataModule's mixture controller from the Trainer's hooks (placed before any checkpoint callback, so a
    checkpoint at an update step holds its decision)."""

    def __init__(self, datamodule: Any):
        self._datamodule = datamodule
        self._step = 0  # the global step as the last microbatch began

    @classmethod
    def attach(cls, trainer: pl.Trainer, datamodule: Any) -> None:
        callbacks = [c for c in trainer.callbacks if not isinstance(c, cls)]
        first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
        callbacks.insert(first_checkpoint, cls(datamodule))
        trainer.callbacks[:] = callbacks

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        control = self._datamodule.mixture_control
        if control.window is None:
            return
        losses = outputs.get("token_losses") if isinstance(outputs, Mapping) else None
        if losses is not None and not control.reported:
            control.window.add(batch, losses)
        control.reported = False
        if trainer.global_step != self._step:  # an optimizer step ended with this microbatch
            self._step = trainer.global_step
            control.update(trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._datamodule.mixture_control.window
        if window is not None:
            window.drop_step()  # a step broken off by a resume is trained again from its start

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._datamodule.mixture_control.window
        if window is not None and not trainer.sanity_checking:
            window.validation = torch.zeros_like(window.validation)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        if not trainer.sanity_checking:
            names = self._datamodule.val_source_names
            name = names[dataloader_idx] if dataloader_idx < len(names) else None
            self._datamodule.mixture_control.add_validation(batch, outputs, name)


def check_mixture_controller(controller: Any, mixture: bool) -> Any:
    """``controller`` checked (``None`` passes); a controller needs a mixture of named sources.

    Raises:
        ValueError: not a controller, or a controller without ``train_files={name: files}``.
    """
    if controller is None:
        return None
    check_controller(controller)
    if not mixture:
        raise ValueError(
            f"mixture_controller={type(controller).__name__}(...) needs a mixture: give train_files as a mapping "
            "{name: files} of sources"
        )
    return controller
