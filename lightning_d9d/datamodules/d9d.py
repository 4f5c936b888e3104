"""D9DDataModule: order → shard → load → pack → pin → transfer over a map-style dataset, exactly resumable.

It builds the schedule of every epoch once per ``setup`` and hands each rank a ``TrainLoader`` (a sized iterable,
so Lightning neither swaps in a distributed sampler nor saves the loader's own state), and carries the data
position through the resume contract of :class:`SteppedDataModule` (Lightning stores it in every checkpoint
under the DataModule's class name). Two ways to size a step:

* **sample counts** (``global_batch_size``, ``microbatch_size``): every step is G samples, the order's global
  batch (:mod:`lightning_d9d.mapstyle.order`) cut into microbatches of m; ``floor(N / G)`` steps an epoch;
* **token budgets** (``global_batch_tokens``, ``microbatch_tokens``, ``padding_free``): every step is
  ``P = global_batch_tokens / microbatch_tokens`` microbatches over all ranks, each within
  ``microbatch_tokens``, planned per epoch from every sample's length (:mod:`lightning_d9d.mapstyle.plan`).
  Epochs then differ a little in their number of steps, and Lightning reads a train loader's length once per
  load: so the DataModule sets ``trainer.reload_dataloaders_every_n_epochs = 1``, and each epoch's loader reports
  that epoch's length (the trainer's ``current_epoch`` when it is built). ``estimated_stepping_batches`` is then
  the loading epoch's steps × ``max_epochs``, off by the few steps the epochs differ by.

Resume is exact because the position is global optimizer steps and the schedule is a pure function of the seed,
the data and the settings, never of world size or workers: on resume the remaining batches of the epoch are
recomputed, on any world size, microbatch size (sample counts) or worker count.

Trade-off: the sample-count fingerprint samples 64 sort keys instead of hashing all of them, so two datasets of
the same length that differ only between the sampled keys are not told apart; hashing every key would cost O(N)
at every resume. Token budgets read every length anyway, so their fingerprint hashes them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch.utils.data import Dataset

from lightning_d9d.checks import (
    microbatches_per_step,
    non_negative_int,
    positive_int,
    token_microbatches_per_step,
)
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.mapstyle.loader import StepSchedule, TrainLoader, ValidationLoader
from lightning_d9d.mapstyle.order import (
    GlobalBatchOrder,
    KeyLookup,
    argsort_keys,
    check_sort_buffer_size,
    keys_digest,
    resolve_sort_keys,
)
from lightning_d9d.mapstyle.plan import (
    PLAN_VERSION,
    InvalidLengthError,
    TokenBudget,
    TokenPlan,
    check_lengths_fit,
    lengths_digest,
    pack,
    read_lengths,
)
from lightning_d9d.mapstyle.shard import GlobalBatchSchedule, validation_microbatches
from lightning_d9d.resume import Fingerprint, TrainPosition
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator

DatasetOrFactory = Dataset | Callable[[], Dataset]
DEFAULT_MICROBATCH_SIZE = 4


@dataclasses.dataclass(frozen=True)
class OrderFingerprint(Fingerprint):
    """What defines the map-style training order (sample counts)."""

    seed: int
    num_samples: int
    global_batch_size: int
    sort_buffer_size: int | None
    shuffle: bool
    sort_keys_digest: str


@dataclasses.dataclass(frozen=True)
class TokenPlanFingerprint(Fingerprint):
    """What defines the token-budget plan: budgets, padding mode, buffer, seed and every sample's length."""

    seed: int
    num_samples: int
    global_batch_tokens: int
    microbatch_tokens: int
    padding_free: bool
    pad_to_multiple_of: int
    sort_buffer_size: int | None
    shuffle: bool
    lengths_digest: str
    plan_version: int


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
            ``collate_fn``'s own ``pad_to_multiple_of`` if it has one, else 1.

    Raises:
        ValueError: non-positive sizes; both or neither of ``global_batch_size``/``global_batch_tokens``; a
            setting of the other mode; ``global_batch_tokens`` not a multiple of ``microbatch_tokens``; a buffer
            smaller than G; a padded collate with ``padding_free`` (or a flattening one without); an unknown
            ``on_order_mismatch`` — at construction. G (or P) not divisible by the world size (× m), a dataset
            shorter than one step, a missing or non-comparable sort key, a sample longer than
            ``microbatch_tokens`` (naming it), a conflicting ``accumulate_grad_batches`` or
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
    ):
        super().__init__()
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.budget = _step_sizes(
            global_batch_size, microbatch_size, global_batch_tokens, microbatch_tokens, padding_free
        )
        if self.budget is None:
            self.global_batch_size = positive_int("global_batch_size", global_batch_size)
            self.microbatch_size = positive_int(
                "microbatch_size", DEFAULT_MICROBATCH_SIZE if microbatch_size is None else microbatch_size
            )
            microbatches_per_step(self.global_batch_size, 1, self.microbatch_size)  # G must be a multiple of m
        else:
            self.global_batch_size = self.microbatch_size = None
            self.global_batch_tokens, self.microbatch_tokens = self.budget.global_batch_tokens, microbatch_tokens
            multiple = pad_to_multiple_of
            if multiple is None:
                multiple = getattr(self.collate_fn, "pad_to_multiple_of", 1)
            multiple = positive_int("pad_to_multiple_of", multiple)
            self.budget = dataclasses.replace(self.budget, pad_to_multiple_of=1 if padding_free else multiple)
            _check_collate_matches(self.collate_fn, padding_free)
        self.padding_free = bool(padding_free)
        if sort_buffer_size is not None:
            sort_buffer_size = positive_int("sort_buffer_size", sort_buffer_size)
            if self.budget is None:
                check_sort_buffer_size(sort_buffer_size, self.global_batch_size)
        num_workers, seed = non_negative_int("num_workers", num_workers), non_negative_int("seed", seed)
        self._train_source, self._val_source = train_dataset, val_dataset
        self.sort_buffer_size, self.sort_key = sort_buffer_size, sort_key
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.pin_memory, self.yield_packs, self.on_order_mismatch = pin_memory, yield_packs, on_order_mismatch

        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.order: GlobalBatchOrder | None = None
        self.plan: TokenPlan | None = None
        self.schedule: StepSchedule | None = None
        self.fingerprint: OrderFingerprint | TokenPlanFingerprint | None = None
        self._lengths: tuple[Any, np.ndarray] | None = None  # (dataset, lengths): read once per dataset
        self._val_lengths: np.ndarray | None = None
        # The single place where the data position lives; the loader advances it, state_dict reads it.
        self.position = TrainPosition()

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (needs ``setup``): ``floor(N / G)``, or the current epoch's plan's steps."""
        if self.plan is not None:
            return self.plan.steps_in_epoch(self.position.epoch)
        return self._require_order().steps_per_epoch

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
        """Build datasets and the schedule; under a Trainer, set accumulation. Starts the position at 0."""
        if self.train_dataset is None:
            self.train_dataset = _materialise(self._train_source, "train_dataset")
            if self._val_source is not None:
                self.val_dataset = _materialise(self._val_source, "val_dataset")
        if self.budget is not None:
            self._setup_token_plan()
        else:
            self._setup_sample_order()
        per_step = self.microbatches_per_step  # validates divisibility by W·m (or W)
        if stage in (None, "fit"):
            self.start_fit(TrainPosition(microbatches_per_step=per_step))
            if self.plan is not None:
                self._reload_train_loader_every_epoch()

    def _setup_sample_order(self) -> None:
        num_samples = len(self.train_dataset)
        key_lookup = resolve_sort_keys(self.train_dataset, self.sort_key) if self.sort_buffer_size else None
        self.order = GlobalBatchOrder(
            num_samples, self.global_batch_size, self.sort_buffer_size, key_lookup, self.seed, self.shuffle
        )
        self.schedule = GlobalBatchSchedule(self.order, self.microbatch_size, key_lookup or self._optional_keys())
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

    def _optional_keys(self) -> KeyLookup | None:
        """Sort keys read only as lengths for ``step_label_tokens`` (no sorting): ``None`` when there are none."""
        try:
            return resolve_sort_keys(self.train_dataset, self.sort_key)
        except (TypeError, ValueError):
            return None

    def _setup_token_plan(self) -> None:
        budget = self.budget
        lengths = self._train_lengths()
        self.plan = TokenPlan(lengths, budget, self.sort_buffer_size, self.seed, self.shuffle)
        self.schedule = self.plan
        self.fingerprint = TokenPlanFingerprint(
            seed=self.seed,
            num_samples=len(lengths),
            global_batch_tokens=budget.global_batch_tokens,
            microbatch_tokens=budget.microbatch_tokens,
            padding_free=budget.padding_free,
            pad_to_multiple_of=budget.pad_to_multiple_of,
            sort_buffer_size=self.sort_buffer_size,
            shuffle=self.shuffle,
            lengths_digest=lengths_digest(lengths),
            plan_version=PLAN_VERSION,
        )
        if self.val_dataset is not None and self._val_lengths is None:
            # A callable sort_key takes training indices, so validation lengths come from a column or the
            # validation dataset's own sort_key(index).
            lookup = self._length_lookup(self.val_dataset, self.sort_key if isinstance(self.sort_key, str) else None)
            if lookup is None:
                raise ValueError(
                    "token budgets pack validation microbatches by length too, but the validation dataset has no "
                    "lengths: give it a sort_key(index) method returning the sample's length, or use a column "
                    "sort_key that both datasets have"
                )
            val_lengths = read_lengths(lookup, len(self.val_dataset), "validation")
            check_lengths_fit(val_lengths, budget, "validation")
            self._val_lengths = val_lengths

    def _train_lengths(self) -> np.ndarray:
        dataset = self.train_dataset
        if self._lengths is None or self._lengths[0] is not dataset:
            lookup = self._length_lookup(dataset, self.sort_key)
            if lookup is None:
                raise ValueError(
                    "token budgets need every sample's length: pass sort_key (a column of lengths such as "
                    "'token_counts', or a callable(index) returning the length) or give the dataset a "
                    "sort_key(index) method that returns it"
                )
            self._lengths = (dataset, read_lengths(lookup, len(dataset)))
        return self._lengths[1]

    @staticmethod
    def _length_lookup(dataset: Any, sort_key: Any) -> KeyLookup | None:
        try:
            return resolve_sort_keys(dataset, sort_key)
        except TypeError as error:  # a column that is not numeric
            raise InvalidLengthError(f"token budgets read every sample's length from sort_key: {error}") from error

    def _reload_train_loader_every_epoch(self) -> None:
        """Epochs of a token plan differ in length, and Lightning reads a loader's length once per load."""
        trainer = self._trainer
        if trainer is None:
            return
        every = trainer.reload_dataloaders_every_n_epochs
        if every not in (0, 1):
            raise ValueError(
                f"Trainer(reload_dataloaders_every_n_epochs={every}) would keep one epoch's train loader for "
                f"{every} epochs, but token-budget epochs differ in their number of steps; leave it at 0 "
                f"({type(self).__name__} sets it to 1) or set it to 1"
            )
        trainer.reload_dataloaders_every_n_epochs = 1

    def train_dataloader(self) -> TrainLoader:
        """This rank's training loader: a sized iterable of microbatches (or packs), continuing the position."""
        return self.track_loader(
            self._train_loader(self.world_size, self.rank, self.position, self.start_point, self._length_epoch)
        )

    def train_dataloader_for_rank(self, rank: int, world_size: int, epoch: int = 0) -> TrainLoader:
        """What rank ``rank`` of ``world_size`` would train in ``epoch`` — for exploration and simulation.

        It has its own position (from the epoch's start) and does not touch the DataModule's.

        Raises:
            ValueError: a rank outside ``[0, world_size)`` or a step that does not divide among ``world_size``
                ranks (G by ``world_size × m``, or P by ``world_size``).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        return self._train_loader(world_size, rank, TrainPosition(epoch=epoch), lambda: (epoch, 0), lambda: epoch)

    def _train_loader(
        self,
        world_size: int,
        rank: int,
        position: TrainPosition,
        start_point: Callable[[], tuple[int, int]],
        length_epoch: Callable[[], int],
    ) -> TrainLoader:
        if self.budget is not None:
            per_step = token_microbatches_per_step(self.global_batch_tokens, self.microbatch_tokens, world_size)
        else:
            per_step = microbatches_per_step(self.global_batch_size, world_size, self.microbatch_size)
        return TrainLoader(
            self.train_dataset,
            self.collate_fn,
            self._require_schedule(),
            world_size=world_size,
            rank=rank,
            microbatches_per_step=per_step,
            position=position,
            start_point=start_point,
            length_epoch=length_epoch,
            num_workers=self.num_workers,
            pin_memory=self.resolve_pin_memory(),
            yield_packs=self.yield_packs,
        )

    def _length_epoch(self) -> int:
        """The epoch the next iteration trains, whose length the loader reports (Lightning reads it at load)."""
        trainer = self._trainer
        if trainer is not None:
            return trainer.current_epoch
        position = self.position
        if position.microbatches >= self.steps_in_epoch(position.epoch) * self.microbatches_per_step:
            return position.epoch + 1
        return position.epoch

    def val_dataloader(self) -> ValidationLoader | list:
        if self.val_dataset is None:
            return []
        if self.budget is not None:
            self._require_schedule()
            packed = pack(self._val_lengths, self.budget)
            microbatches = np.split(packed.order, np.cumsum(packed.sizes)[:-1])[self.rank :: self.world_size]
        else:
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

    def _require_schedule(self) -> StepSchedule:
        if self.schedule is None:
            raise RuntimeError("call dm.setup('fit') before asking for batches or steps (Trainer.fit does it)")
        return self.schedule


def _step_sizes(
    global_batch_size: Any,
    microbatch_size: Any,
    global_batch_tokens: Any,
    microbatch_tokens: Any,
    padding_free: bool,
) -> TokenBudget | None:
    """The token budget, or ``None`` for sample counts; one clear error for every mixed or missing setting.

    Raises:
        ValueError: both or neither of ``global_batch_size``/``global_batch_tokens``, the other mode's
            settings, or budgets that are not positive or do not divide.
    """
    if global_batch_size is not None and global_batch_tokens is not None:
        raise ValueError(
            f"pass exactly one of global_batch_size (samples per optimizer step) and global_batch_tokens (tokens "
            f"per optimizer step); got both: global_batch_size={global_batch_size!r}, "
            f"global_batch_tokens={global_batch_tokens!r}"
        )
    if global_batch_size is None and global_batch_tokens is None:
        raise ValueError(
            "pass exactly one of global_batch_size (samples per optimizer step, with microbatch_size) and "
            "global_batch_tokens (tokens per optimizer step, with microbatch_tokens); got neither"
        )
    if global_batch_size is not None:
        if microbatch_tokens is not None:
            raise ValueError(
                f"microbatch_tokens={microbatch_tokens!r} goes with global_batch_tokens; with "
                f"global_batch_size={global_batch_size!r} a microbatch is microbatch_size samples (drop "
                "microbatch_tokens, or give global_batch_tokens instead of global_batch_size)"
            )
        if padding_free:
            raise ValueError(
                "padding_free=True needs token budgets (global_batch_tokens and microbatch_tokens instead of "
                f"global_batch_size={global_batch_size!r}): a flattened microbatch is sized in tokens"
            )
        return None
    if microbatch_tokens is None:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens!r} needs microbatch_tokens (the tokens of one microbatch, "
            "a divisor of global_batch_tokens)"
        )
    if microbatch_size is not None:
        raise ValueError(
            f"microbatch_size={microbatch_size!r} counts samples, but global_batch_tokens={global_batch_tokens!r} "
            "sizes steps in tokens: microbatch_tokens sizes the microbatch (drop microbatch_size)"
        )
    positive_int("global_batch_tokens", global_batch_tokens)
    positive_int("microbatch_tokens", microbatch_tokens)
    return TokenBudget(int(global_batch_tokens), int(microbatch_tokens), bool(padding_free))


def _check_collate_matches(collate_fn: Any, padding_free: bool) -> None:
    """Raises ValueError when the package's own collators contradict the padding mode the plan counts."""
    if padding_free and isinstance(collate_fn, CausalLMCollator):
        raise ValueError(
            "padding_free=True plans microbatches by the sum of their lengths, but CausalLMCollator pads them "
            "(count × longest would exceed microbatch_tokens): use FlatteningCollator, or padding_free=False"
        )
    if not padding_free and isinstance(collate_fn, FlatteningCollator):
        raise ValueError(
            "FlatteningCollator concatenates microbatches, but padding_free=False plans them padded (count × "
            "longest), which wastes the budget: pass padding_free=True"
        )


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
