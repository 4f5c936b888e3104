"""D9DDataModule: order → shard → load → pack → pin → transfer over a map-style dataset, exactly resumable.

A step is G samples in microbatches of m, or ``P`` microbatches within ``microbatch_tokens`` planned per epoch from
every sample's length. The schedule depends only on seed, data and settings, and the saved position is global
optimizer steps, so a resume continues on any data-parallel size, microbatch size or worker count.

Trade-off: every rank computes the schedule itself, and the fingerprint summarises the data rather than hashing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch.utils.data import Dataset

from lightning_d9d.core.checks import non_negative_int, positive_int
from lightning_d9d.core.resume import Fingerprint, StepLayout, TrainPosition
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.observability import DEFAULT_DATA_WAIT_WARNING
from lightning_d9d.mapstyle.loader import StepSchedule, TrainLoader, ValidationLoader
from lightning_d9d.mapstyle.order import GlobalBatchOrder
from lightning_d9d.mapstyle.plan import TokenBudget, TokenPlan
from lightning_d9d.mapstyle.shard import GlobalBatchSchedule
from lightning_d9d.mapstyle.steps import (
    DEFAULT_MICROBATCH_SIZE,
    OrderFingerprint,
    OrderSettings,
    SampleCountSteps,
    StepSizing,
    TokenBudgetSteps,
    TokenPlanFingerprint,
    step_sizing,
)
from lightning_d9d.parallel.topology import DataParallelSetting
from lightning_d9d.text.sft_schedule import LabelCountSchedule

DatasetOrFactory = Dataset | Callable[[], Dataset]
__all__ = ["DEFAULT_MICROBATCH_SIZE", "D9DDataModule", "OrderFingerprint", "TokenPlanFingerprint"]


class D9DDataModule(SteppedDataModule):
    """Sorted, sharded, packed map-style loading for ``Trainer.fit``, exactly resumable.

    Pass exactly one of ``global_batch_size`` (sample counts) and ``global_batch_tokens`` (token budgets).

    Args:
        train_dataset: a map-style dataset, or a zero-argument factory returning one.
        collate_fn: list of samples -> microbatch.
        global_batch_size: samples per optimizer step over all ranks (G).
        microbatch_size: samples per forward/backward on one rank (sample counts only).
        sort_buffer_size: sort samples by key within windows of this many; ``None``: no sorting.
        sort_key: ``None`` (``dataset.sort_key``), a callable ``(index) -> key`` or a column name; lengths for tokens.
        val_dataset: optional validation dataset (or factory), each sample evaluated once per run.
        seed: the order's seed.
        shuffle: ``False`` keeps dataset order.
        num_workers: ``StatefulDataLoader`` worker processes (does not change the order).
        pin_memory: ``None``: pin when the trainer's device is CUDA.
        yield_packs: each batch is the list of M microbatches of one step (manual optimization).
        on_order_mismatch: a checkpoint with another order fingerprint: ``"raise"`` or ``"restart_epoch"``.
        global_batch_tokens: tokens per optimizer step over all ranks; a multiple of ``microbatch_tokens``.
        microbatch_tokens: tokens of one microbatch (count × padded longest, or the sum if ``padding_free``).
        padding_free: plan for a ``collate_fn`` that concatenates a microbatch into one row.
        pad_to_multiple_of: the padded length's rounding; ``None``: the ``collate_fn``'s, else 1.
        data_parallel: which processes share data; ``None`` follows the strategy.
        verify_peers: the first N steps compare microbatches among each replica's processes (0: off).
        data_wait_warning: warn once per fit when waiting for data exceeds this share of step time.

    Raises:
        ValueError: inconsistent settings, or in ``setup`` a layout, dataset or sort key that does not fit them.
        InvalidLengthError: with token budgets, a length that is not a whole number >= 1.
    """

    def __init__(
        self,
        train_dataset: DatasetOrFactory,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        global_batch_size: PositiveInt | None = None,
        microbatch_size: PositiveInt | None = None,
        sort_buffer_size: PositiveInt | None = None,
        sort_key: str | Callable[[int], Any] | None = None,
        val_dataset: DatasetOrFactory | None = None,
        seed: NonNegativeInt = 0,
        shuffle: bool = True,
        num_workers: NonNegativeInt = 0,
        pin_memory: bool | None = None,
        yield_packs: bool = False,
        on_order_mismatch: OnOrderMismatch = "raise",
        global_batch_tokens: PositiveInt | None = None,
        microbatch_tokens: PositiveInt | None = None,
        padding_free: bool = False,
        pad_to_multiple_of: PositiveInt | None = None,
        data_parallel: DataParallelSetting = None,
        verify_peers: NonNegativeInt = 0,
        data_wait_warning: float | None = DEFAULT_DATA_WAIT_WARNING,
    ):
        super().__init__()
        self.data_parallel, self.verify_peers, self.data_wait_warning = data_parallel, verify_peers, data_wait_warning
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.steps: StepSizing = step_sizing(
            global_batch_size,
            microbatch_size,
            global_batch_tokens,
            microbatch_tokens,
            padding_free,
            pad_to_multiple_of,
            self.collate_fn,
        )
        self.padding_free = bool(padding_free)
        if sort_buffer_size is not None:
            sort_buffer_size = positive_int("sort_buffer_size", sort_buffer_size)
            self.steps.check_sort_buffer_size(sort_buffer_size)
        num_workers, seed = non_negative_int("num_workers", num_workers), non_negative_int("seed", seed)
        self.on_order_mismatch = on_order_mismatch
        self._train_source, self._val_source = train_dataset, val_dataset
        self.sort_buffer_size, self.sort_key = sort_buffer_size, sort_key
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.pin_memory, self.yield_packs = pin_memory, yield_packs

        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.schedule: StepSchedule | None = None
        self.fingerprint: Fingerprint | None = None
        # The single place where the data position lives; the loader advances it, state_dict reads it.
        self.position = TrainPosition()

    # ------------------------------------------------------------------ the step sizes
    @property
    def global_batch_size(self) -> int | None:  # type: ignore[override]
        """G, samples per step (sample counts; ``None`` with token budgets)."""
        return self.steps.global_batch_size if isinstance(self.steps, SampleCountSteps) else None

    @property
    def microbatch_size(self) -> int | None:  # type: ignore[override]
        """m, samples per microbatch (sample counts; ``None`` with token budgets)."""
        return self.steps.microbatch_size if isinstance(self.steps, SampleCountSteps) else None

    @property
    def budget(self) -> TokenBudget | None:
        """The token budget (``None`` with sample counts)."""
        return self.steps.budget if isinstance(self.steps, TokenBudgetSteps) else None

    @property
    def global_batch_tokens(self) -> int | None:
        return self.budget.global_batch_tokens if self.budget is not None else None

    @property
    def microbatch_tokens(self) -> int | None:
        return self.budget.microbatch_tokens if self.budget is not None else None

    @property
    def order(self) -> GlobalBatchOrder | None:
        """The sample-count order (needs ``setup``; ``None`` with token budgets)."""
        schedule = _unwrapped(self.schedule)
        return schedule.order if isinstance(schedule, GlobalBatchSchedule) else None

    @property
    def plan(self) -> TokenPlan | None:
        """The token-budget plan (needs ``setup``; ``None`` with sample counts)."""
        schedule = _unwrapped(self.schedule)
        return schedule if isinstance(schedule, TokenPlan) else None

    @property
    def reloads_train_loader_every_epoch(self) -> bool:  # type: ignore[override]
        return self.steps.epochs_differ

    def microbatches_for(self, dp_size: int) -> int:
        return self.steps.microbatches_per_step(dp_size)

    def describe_step(self) -> str:
        return self.steps.describe(self.dp_size)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (needs ``setup``): ``floor(N / G)``, or the current epoch's plan's steps."""
        return self.steps_in_epoch(self.position.epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (needs ``setup``); with token budgets epochs differ by a few steps."""
        return self._require_schedule().steps_in_epoch(epoch)

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Call the dataset factories once per node (download/process into their cache)."""
        for source in (self._train_source, self._val_source):
            if source is not None and _is_factory(source):
                source()

    def setup(self, stage: str | None = None) -> None:
        """Resolve the layout, build datasets and the schedule, attach the callback; the position starts at 0."""
        self.resolve_topology()
        if self.train_dataset is None:
            self.train_dataset = _materialise(self._train_source, "train_dataset")
            if self._val_source is not None:
                self.val_dataset = _materialise(self._val_source, "val_dataset")
        self.schedule, self.fingerprint = self.steps.schedule(self.train_dataset, self._order_settings)
        if self.val_dataset is not None:
            self.steps.prepare_validation(self.val_dataset, self._order_settings)
        per_step = self.microbatches_per_step  # validates divisibility by D·m (or D)
        if stage in (None, "fit"):
            self.start_fit(TrainPosition(layout=StepLayout.constant(per_step)))

    @property
    def _order_settings(self) -> OrderSettings:
        return OrderSettings(self.sort_buffer_size, self.sort_key, self.seed, self.shuffle)

    def train_dataloader(self) -> TrainLoader:
        """This replica's training loader: a sized iterable of microbatches (or packs), continuing the position."""
        return self.track_loader(self._train_loader(self.dp_size, self.dp_rank, self.position, self.start_point))

    def provenance(self, step: int, epoch: int = 0) -> list[list[int]]:
        """The dataset indices optimizer step ``step`` of ``epoch`` trains: its microbatches in global order (those of
        data-parallel rank 0, then rank 1, ... at one replica: the global batch), the same on every layout.

        Raises:
            ValueError: a step outside the epoch.
        """
        schedule = self._require_schedule()
        steps = schedule.steps_in_epoch(epoch)
        if not 0 <= step < steps:
            raise ValueError(f"step={step} is not a step of epoch {epoch}, which has {steps} (0..{steps - 1})")
        return [np.asarray(batch).tolist() for batch in schedule.rank_microbatches(epoch, step, 1, 0)]

    def train_dataloader_for_rank(self, dp_rank: int, dp_size: int, epoch: int = 0) -> TrainLoader:
        """What data-parallel rank ``dp_rank`` of ``dp_size`` would train in ``epoch``, with a position of its own."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        return self._train_loader(dp_size, dp_rank, TrainPosition(epoch=epoch), lambda: (epoch, 0))

    def _train_loader(
        self,
        dp_size: int,
        dp_rank: int,
        position: TrainPosition,
        start_point: Callable[[], tuple[int, int]],
    ) -> TrainLoader:
        return TrainLoader(
            self.train_dataset, self.collate_fn, self._require_schedule(), dp_size=dp_size, dp_rank=dp_rank,
            microbatches_per_step=self.microbatches_for(dp_size), position=position, start_point=start_point,
            num_workers=self.num_workers, pin_memory=self.resolve_pin_memory(), yield_packs=self.yield_packs,
        )  # fmt: skip

    def val_dataloader(self) -> ValidationLoader | list:
        if self.val_dataset is None:
            return []
        self._require_schedule()
        # Split among replicas, not processes: every sample once per replica set, peers identical.
        microbatches = self.steps.validation_microbatches(
            self.val_dataset, self._order_settings, self.dp_size, self.dp_rank
        )
        loader = ValidationLoader(
            self.val_dataset, self.collate_fn, microbatches, self.num_workers, self.resolve_pin_memory()
        )
        return self.track_loader(loader, "val")

    # ------------------------------------------------------------------ internals
    def _require_schedule(self) -> StepSchedule:
        if self.schedule is None:
            raise RuntimeError("call dm.setup('fit') before asking for batches or steps (Trainer.fit does it)")
        return self.schedule


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


def _unwrapped(schedule: Any) -> Any:
    """The schedule a fine-tuning ``LabelCountSchedule`` wraps (it only recounts trained targets), else itself."""
    return schedule.schedule if isinstance(schedule, LabelCountSchedule) else schedule
