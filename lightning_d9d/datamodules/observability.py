"""The pipeline's speed, visible: per optimizer step, how long training waited for data and how many tokens it got.

A step's wait is the sum of the host-clock gaps between ``on_train_batch_end`` and the next
``on_train_batch_start``, validation cut out; figures are logged under ``data/`` and a warning fires once per fit
when the wait exceeds ``data_wait_warning``. Tokens are counted on the host copy, never syncing CUDA. A DataModule
owns a ``DataObservation`` (the setting and the host counts) that its ``DataObserver`` reads.

Trade-off: values are this process's own (no collective), and the host may run ahead of the device.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_d9d.core.batches import count_tokens, row_sources

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_d9d.datamodules.base import SteppedDataModule

# Steps a fit runs before its wait is judged: the first pays for worker start-up and the first fetches (the
# fetcher's lookahead included), and the next ones for the workers' own prefetch filling up.
WARMUP_STEPS = 3
# Steps the wait is judged over: enough that one slow fetch (a new file, a storage hiccup) does not warn alone.
WINDOW_STEPS = 10
# A wait under this per microbatch is not warned about whatever its share: Lightning's own per-batch bookkeeping
# (metrics, loggers, hooks) takes a few milliseconds in the same gap, a large share only of toy-sized steps.
MIN_WARNED_WAIT_S = 0.01
DEFAULT_DATA_WAIT_WARNING = 0.2


class DataWaitWarning(UserWarning):
    """The training loop waited for data more than ``data_wait_warning`` of its step time."""


def check_data_wait_warning(value: Any) -> float | None:
    """``value`` as a fraction of the step time (0 to 1); ``None`` where the warning is off (``None`` or 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(
            f"data_wait_warning must be a fraction of the step time from 0 to 1 (0 or None: no warning), got {value!r}"
        )
    return float(value) or None


class DataObservation:
    """The part of a DataModule its :class:`DataObserver` reads: the warning setting and the host counts of the
    microbatch last moved. It saves nothing in a checkpoint (the figures are per fit).

    Args:
        data_wait_warning: warn once per fit when waiting for data exceeds this fraction of step time.

    Raises:
        ValueError: ``data_wait_warning`` that is no fraction from 0 to 1.
    """

    def __init__(self, data_wait_warning: float | None = DEFAULT_DATA_WAIT_WARNING):
        self._data_wait_warning = check_data_wait_warning(data_wait_warning)
        self.counting = False  # set by the observer while a fit with a logger runs: only then is a batch counted
        self._host_counts: BatchCounts | None = None

    @property
    def data_wait_warning(self) -> float | None:
        return self._data_wait_warning

    @data_wait_warning.setter
    def data_wait_warning(self, value: float | None) -> None:
        self._data_wait_warning = check_data_wait_warning(value)

    def count(self, batch: Any, training: bool) -> None:
        """Count a training microbatch on the host, before it is moved (its device copy would need a sync)."""
        if self.counting and training:
            self._host_counts = BatchCounts.of(batch)

    def take(self) -> BatchCounts | None:
        """The counts of the microbatch last moved, once (then ``None`` until another is moved)."""
        counts, self._host_counts = self._host_counts, None
        return counts

    def stop(self) -> None:
        """Count nothing more (the fit ended) and forget what was counted."""
        self.counting, self._host_counts = False, None


@dataclass
class BatchCounts:
    """One microbatch's real tokens (``None``: not countable) and rows per source."""

    tokens: int | None
    sources: collections.Counter[int]

    @classmethod
    def of(cls, batch: Any) -> BatchCounts:
        counts = count_tokens(batch)
        return cls(None if counts is None else counts[0], collections.Counter(row_sources(batch)))


class StepTimer:
    """Wait and wall time per optimizer step, from the callback's hook times."""

    def __init__(self) -> None:
        self._mark: float | None = None  # the end of the last microbatch (or the epoch's start)
        self._step_start = 0.0
        self._wait = 0.0
        self._paused_at: float | None = None

    def epoch_start(self, now: float) -> None:
        self._mark = self._step_start = now
        self._wait = 0.0

    def batch_start(self, now: float) -> None:
        if self._mark is not None:
            self._wait += now - self._mark

    def batch_end(self, now: float) -> None:
        self._mark = now

    def step_end(self, now: float) -> tuple[float, float]:
        """(wait, step time) in seconds of the step that ended ``now``; the next step starts now."""
        figures = (self._wait, now - self._step_start)
        self._step_start, self._wait = now, 0.0
        return figures

    def pause(self, now: float) -> None:
        self._paused_at = now

    def resume(self, now: float) -> None:
        """Cut the time since ``pause`` out of the current gap and step (a validation run inside the epoch)."""
        if self._paused_at is None or self._mark is None:
            return
        paused, self._paused_at = now - self._paused_at, None
        self._mark += paused
        self._step_start += paused


class DataObserver:
    """Times one DataModule's training steps, logs their data figures and warns when the loop waits for data."""

    def __init__(self, datamodule: SteppedDataModule):
        self._datamodule = datamodule
        self._timer = StepTimer()
        self._logging = False
        self._microbatches, self._tokens, self._sources = 0, 0, collections.Counter()
        self._countable = True
        self._steps, self._warned, self._epoch_steps = 0, False, 0
        # (wait, elapsed, microbatches) of the latest steps
        self._window: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=WINDOW_STEPS)

    def fit_start(self, trainer: pl.Trainer) -> None:
        self._logging = bool(trainer.loggers)
        self._datamodule.observation.counting = self._logging
        self._steps, self._warned = 0, False
        self._window.clear()

    def fit_end(self) -> None:
        self._datamodule.observation.stop()

    def epoch_start(self) -> None:
        self._timer.epoch_start(time.perf_counter())
        self._start_step()
        self._epoch_steps = 0

    def batch_start(self, batch: Any) -> None:
        self._timer.batch_start(time.perf_counter())
        if not self._logging:
            return
        counts = self._datamodule.take_host_counts()
        if counts is None:  # the LightningModule moved the batch itself: count it where it is
            counts = BatchCounts.of(batch)
        if counts.tokens is None:
            self._countable = False
        else:
            self._tokens += counts.tokens
        self._sources.update(counts.sources)

    def batch_end(self, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        self._microbatches += 1
        trainer = pl_module.trainer
        index = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        _, at, count = self._datamodule.batch_in_step(trainer.current_epoch, index)
        if at == count - 1:
            wait, elapsed = self._timer.step_end(now)
            if self._logging:
                shape = self._shape_metrics(trainer.global_step - 1, count)  # the step that just ended
                pl_module.log_dict(self._metrics(wait, elapsed) | shape, on_step=True, on_epoch=False)
            self._epoch_steps += 1
            if self._epoch_steps > 1:  # an epoch's first step waits for a new iterator (workers start again)
                self._judge(wait, elapsed, trainer.global_step, self._microbatches)
            self._start_step()
        # The gap starts after this bookkeeping: logging these figures is not a wait for data.
        self._timer.batch_end(time.perf_counter())

    def validation_start(self, trainer: pl.Trainer) -> None:
        if not trainer.sanity_checking:
            self._timer.pause(time.perf_counter())

    def validation_end(self, trainer: pl.Trainer) -> None:
        if not trainer.sanity_checking:
            self._timer.resume(time.perf_counter())

    def _start_step(self) -> None:
        self._microbatches, self._tokens, self._countable = 0, 0, True
        self._sources = collections.Counter()

    def _metrics(self, wait: float, elapsed: float) -> dict[str, float]:
        metrics = {"data/wait_ms": 1000.0 * wait, "data/step_ms": 1000.0 * elapsed}
        if self._countable:
            metrics["data/tokens"] = float(self._tokens)
            metrics["data/tokens_per_s"] = self._tokens / elapsed if elapsed > 0 else 0.0
        metrics.update(self._datamodule.step_metrics(self._sources))
        return metrics

    def _shape_metrics(self, step: int, microbatches: int) -> dict[str, float]:
        """The step's shape: this rank's microbatches (Lightning's accumulation), and where the DataModule knows
        them, the global batch size (rows over every rank) and ``seq_len`` of that optimizer step."""
        datamodule = self._datamodule
        metrics = {"data/accumulation": float(microbatches)}
        global_batch_size = getattr(datamodule, "global_batch_size_at", None)
        if global_batch_size is not None:
            metrics["data/global_batch_size"] = float(global_batch_size(step))
        elif isinstance(getattr(datamodule, "global_batch_size", None), int):  # samples; None under token budgets
            metrics["data/global_batch_size"] = float(datamodule.global_batch_size)
        seq_len = getattr(datamodule, "seq_len_at", None)
        if seq_len is not None:
            metrics["data/seq_len"] = float(seq_len(step))
        return metrics

    def _judge(self, wait: float, elapsed: float, global_step: int, microbatches: int) -> None:
        """Warn once per fit when the last ``WINDOW_STEPS`` steps after the warm-up waited too long."""
        self._steps += 1
        threshold = self._datamodule.data_wait_warning
        if self._warned or not threshold or self._steps <= WARMUP_STEPS:
            return
        self._window.append((wait, elapsed, microbatches))
        if len(self._window) < WINDOW_STEPS:
            return
        total, waited = sum(step for _, step, _ in self._window), sum(waited for waited, _, _ in self._window)
        fraction = waited / total if total > 0 else 0.0
        if fraction <= threshold or waited < MIN_WARNED_WAIT_S * sum(m for _, _, m in self._window):
            return
        self._warned = True
        workers = getattr(self._datamodule, "num_workers", None)
        rank_zero_warn(
            f"the training loop waited for data {fraction:.0%} of its step time over the {WINDOW_STEPS} optimizer "
            f"steps before step {global_step} (more than data_wait_warning={threshold:g}): the data does not keep "
            f"up with training. Give it more workers (num_workers={workers}) or cheaper samples, or pass "
            "data_wait_warning=None to silence this; data/wait_ms in the logs shows the wait of every step "
            "(docs/observability.md)",
            category=DataWaitWarning,
        )


class GlobalStepLoss:
    """The exact loss of each optimizer step: the token-weighted mean over every microbatch of every process.

    Each process adds its microbatches' summed token losses and target counts; at the step's end one all-reduce of
    the two sums over the whole world gives ``sum of losses / sum of targets``, the mean a single process would
    compute over the whole global batch. A ratio of sums is right under any layout: context-parallel ranks add
    their slices, and peers that compute the same loss (tensor parallelism) add to both sums alike. A logged mean
    of microbatch means (``sync_dist=True``) is not: it weights a microbatch of few targets as much as a full one.

    Use it in a ``LightningModule``::

        self.step_loss = GlobalStepLoss()                       # in __init__
        self.step_loss.add(loss_sum, target_count)              # in training_step, per microbatch
        def on_before_optimizer_step(self, optimizer):          # once per step, on every process
            self.log("train/global_loss", self.step_loss.compute(self), rank_zero_only=True)

    Trade-off: one collective of two numbers per optimizer step (not per microbatch).
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None

    def add(self, loss_sum: torch.Tensor, targets: torch.Tensor | int) -> None:
        """Add a microbatch: the sum of its token losses and the number of targets summed.

        Args:
            loss_sum: summed (not averaged) token losses; detached here.
            targets: how many targets ``loss_sum`` sums over.
        """
        pair = torch.stack([loss_sum.detach().double(), torch.as_tensor(targets, device=loss_sum.device).double()])
        self._sums = pair if self._sums is None else self._sums + pair

    @property
    def pending(self) -> bool:
        """Whether a microbatch was added since the last ``compute``."""
        return self._sums is not None

    def compute(self, module: pl.LightningModule) -> torch.Tensor:
        """The step's loss over every process (a collective: call it on every process), and start a new step.

        Raises:
            RuntimeError: no microbatch was added since the last call.
        """
        if self._sums is None:
            raise RuntimeError("GlobalStepLoss.compute: no microbatch was added since the last step (call add())")
        sums, self._sums = self._sums, None
        if module.trainer.world_size > 1:
            sums = module.trainer.strategy.reduce(sums, reduce_op="sum")
        return (sums[0] / sums[1].clamp(min=1)).float()
