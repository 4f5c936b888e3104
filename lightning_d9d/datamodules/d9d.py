"""D9DDataModule: order → shard → load → pack → pin → transfer over a map-style dataset, exactly resumable.

It builds the schedule of every epoch once per ``setup`` and hands each data-parallel rank a ``TrainLoader`` (a
sized iterable, so Lightning neither swaps in a distributed sampler nor saves the loader's own state), and carries
the data
position through the resume contract of :class:`SteppedDataModule` (Lightning stores it in every checkpoint
under the DataModule's class name). Two ways to size a step, two strategies of :mod:`lightning_d9d.mapstyle.steps`
behind one interface:

* **sample counts** (``global_batch_size``, ``microbatch_size``): every step is G samples, the order's global
  batch (:mod:`lightning_d9d.mapstyle.order`) cut into microbatches of m; ``floor(N / G)`` steps an epoch;
* **token budgets** (``global_batch_tokens``, ``microbatch_tokens``, ``padding_free``): every step is
  ``P = global_batch_tokens / microbatch_tokens`` microbatches over all ranks, each within
  ``microbatch_tokens``, planned per epoch from every sample's length (:mod:`lightning_d9d.mapstyle.plan`).
  Epochs then differ a little in their number of steps, and Lightning reads a train loader's length once per
  load: so the Trainer gets ``reload_dataloaders_every_n_epochs = 1``, and each epoch's loader reports
  that epoch's length (the trainer's ``current_epoch`` when it is built). ``estimated_stepping_batches`` is then
  the loading epoch's steps × ``max_epochs``, off by the few steps the epochs differ by.

Resume is exact because the position is global optimizer steps and the schedule is a pure function of the seed,
the data and the settings, never of the layout or workers: on resume the remaining batches of the epoch are
recomputed, on any data-parallel size (any tensor/context/pipeline-parallel layout around it), microbatch size
(sample counts) or worker count. Data is dealt by data-parallel rank (``data_parallel``,
:mod:`lightning_d9d.topology`): every process of a replica gets the same microbatches.

Trade-off: the schedule of an epoch is computed in the main process of every rank (cheap: a permutation, or one
pass over the lengths with token budgets) instead of being shared; and its fingerprint summarises the data
(:mod:`lightning_d9d.mapstyle.steps` says how) rather than hashing every sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch.utils.data import Dataset

from lightning_d9d.checks import non_negative_int, positive_int
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
from lightning_d9d.resume import Fingerprint, TrainPosition
from lightning_d9d.text.sft_schedule import LabelCountSchedule
from lightning_d9d.topology import DataParallelSetting

DatasetOrFactory = Dataset | Callable[[], Dataset]
__all__ = ["DEFAULT_MICROBATCH_SIZE", "D9DDataModule", "OrderFingerprint", "TokenPlanFingerprint"]


class D9DDataModule(SteppedDataModule):
    """Sorted, sharded, packed map-style loading for ``Trainer.fit``, exactly resumable.

    Pass exactly one of ``global_batch_size`` (sample counts, with ``microbatch_size``) and
    ``global_batch_tokens`` (token budgets, with ``microbatch_tokens``).

    Args:
        train_dataset: a map-style dataset, or a zero-argument factory called in ``prepare_data()`` (once per
            node, to download/process into a cache) and in ``setup()`` (every rank, loading that cache).
        collate_fn: list of samples -> microbatch (a tensor, dict, tuple or dataclass). A batch with a
            ``step_label_tokens`` field or key gets its step's predicted tokens over all ranks written into it.
        global_batch_size: samples per optimizer step, summed over all ranks and accumulation (G).
        microbatch_size: samples per forward/backward on one rank (m; default 4). Sample counts only.
        sort_buffer_size: ``None`` for no length sorting; else samples are sorted by key within windows of this
            many samples (rounded down to a multiple of G with sample counts). Larger pads less (README: padding
            vs buffer). With token budgets: samples packed together per window (``None``: packed in order).
        sort_key: ``None`` (use ``dataset.sort_key(index)`` if it exists), a callable ``(index) -> key``, or
            the name of a column of a Hugging Face dataset (each window's keys read with one Arrow ``take``).
            With token budgets the keys are the samples' lengths (whole numbers >= 1), read once at ``setup``;
            with sample counts numeric keys are also taken as lengths for ``step_label_tokens``.
        val_dataset: optional validation dataset (or factory); every sample is evaluated exactly once per run.
        seed: the order's seed. The order of epoch e is a pure function of seed, e, the data and the settings.
        shuffle: ``False`` keeps dataset order (epochs then repeat).
        num_workers: ``StatefulDataLoader`` worker processes (does not change the order).
        pin_memory: ``None`` pins exactly when the trainer's device is CUDA; ``True``/``False`` force it.
        yield_packs: each batch is the list of M microbatches of one optimizer step (for manual optimization).
        on_order_mismatch: what ``load_state_dict`` does when the checkpoint's order fingerprint (seed, dataset,
            sizes or budgets, buffer) differs from this DataModule's: ``"raise"`` (default) or
            ``"restart_epoch"`` (start the checkpoint's epoch over with the new order, with a warning).
        global_batch_tokens: tokens per optimizer step over all ranks and accumulation; a multiple of
            ``microbatch_tokens``. Token budgets only.
        microbatch_tokens: tokens of one microbatch: its sample count × its longest sample (rounded up to
            ``pad_to_multiple_of``) when padded, the sum of its lengths when ``padding_free``.
        padding_free: plan for a ``collate_fn`` that concatenates a microbatch's samples into one row (e.g.
            :class:`~lightning_d9d.text.collate.FlatteningCollator`). Token budgets only.
        pad_to_multiple_of: the padded length's rounding the plan counts (padded token budgets); ``None``: the
            ``collate_fn``'s own ``pad_to_multiple_of`` if it has one, else 1. A ``collate_fn`` with a
            ``context_parallel_size`` (``FlatteningCollator``) makes padding-free budgets count each sample
            rounded up to ``2 × context_parallel_size``.
        data_parallel: which processes share data: ``None`` (default) follows the strategy (DDP/FSDP: every
            process is a replica; ``ModelParallelStrategy``: its ``data_parallel`` dim); else dim names of the
            strategy's ``device_mesh``, a ``DeviceMesh`` or a ``DataParallelTopology`` (docs/model_parallelism.md).
            Replicas get disjoint data, the processes of one replica the same microbatches.
        verify_peers: the first N optimizer steps of each fit (and its first validation run) compare their
            microbatches among each replica's processes, one all-gather per step; a difference raises, naming
            the step and the processes (0: off).
        data_wait_warning: warn once per fit when training waits for data more than this fraction of its step
            time (0 to 1; ``None`` or 0: never); docs/observability.md.

    Raises:
        ValueError: non-positive sizes; both or neither of ``global_batch_size``/``global_batch_tokens``; a
            setting of the other mode; ``global_batch_tokens`` not a multiple of ``microbatch_tokens``; a buffer
            smaller than G; a padded collate with ``padding_free`` (or a flattening one without); an unknown
            ``on_order_mismatch``; a malformed ``data_parallel``; a ``data_wait_warning`` outside 0..1; a
            ``microbatch_tokens`` not a multiple of the collate's ``2 × context_parallel_size`` — at construction.
            A ``data_parallel`` that cannot be resolved (e.g. a mesh without the named dims), G (or P) not divisible by
            the data-parallel size (× m), a dataset shorter than one step, a missing or non-comparable sort key, a
            sample longer than ``microbatch_tokens`` (naming it), a conflicting ``accumulate_grad_batches`` or
            ``reload_dataloaders_every_n_epochs`` — in ``setup``.
        InvalidLengthError: (a ``ValueError`` and a ``TypeError``) with token budgets, a length that is not a
            whole number >= 1, or a sort-key column that is not numeric (naming the sample or column) — in
            ``setup``.
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
        """Token-budget epochs differ in length, and Lightning reads a train loader's length once per load."""
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
        """Call the dataset factories once per node so they can download/process into their cache."""
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
            self.start_fit(TrainPosition(microbatches_per_step=per_step))

    @property
    def _order_settings(self) -> OrderSettings:
        return OrderSettings(self.sort_buffer_size, self.sort_key, self.seed, self.shuffle)

    def train_dataloader(self) -> TrainLoader:
        """This replica's training loader: a sized iterable of microbatches (or packs), continuing the position."""
        return self.track_loader(self._train_loader(self.dp_size, self.dp_rank, self.position, self.start_point))

    def train_dataloader_for_rank(self, dp_rank: int, dp_size: int, epoch: int = 0) -> TrainLoader:
        """What data-parallel rank ``dp_rank`` of ``dp_size`` would train in ``epoch`` — for exploration and
        simulation (every process of that replica trains the same).

        It has its own position (from the epoch's start) and does not touch the DataModule's.

        Raises:
            ValueError: a rank outside ``[0, dp_size)`` or a step that does not divide among ``dp_size``
                replicas (G by ``dp_size × m``, or P by ``dp_size``).
        """
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
