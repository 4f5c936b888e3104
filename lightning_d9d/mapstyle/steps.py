"""Steps: how a map-style epoch is sized into optimizer steps — by sample counts or by token budgets.

``SampleCountSteps``: G samples per step in microbatches of m; ``TokenBudgetSteps``: P microbatches per step within
``microbatch_tokens``. Both give the loader's schedule and its fingerprint.

Trade-off: the sample-count fingerprint samples 64 sort keys rather than hashing all; token budgets hash every length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from lightning_d9d.core.checks import microbatches_per_step, positive_int, token_microbatches_per_step
from lightning_d9d.core.resume import Fingerprint
from lightning_d9d.mapstyle.loader import StepSchedule
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
    # Padding-free under context parallelism each sample costs its length rounded up to this (2 × CP size).
    document_multiple: int = 1


@dataclasses.dataclass(frozen=True)
class OrderSettings:
    """What decides the order besides the step sizes: length sorting, its keys, the seed, shuffling."""

    sort_buffer_size: int | None
    sort_key: Any
    seed: int
    shuffle: bool


class StepSizing(Protocol):
    """The interface of both strategies."""

    epochs_differ: bool

    def microbatches_per_step(self, dp_size: int) -> int: ...

    def describe(self, dp_size: int) -> str: ...

    def check_sort_buffer_size(self, sort_buffer_size: int) -> None: ...

    def schedule(self, dataset: Any, settings: OrderSettings) -> tuple[StepSchedule, Fingerprint]: ...

    def prepare_validation(self, dataset: Any, settings: OrderSettings) -> None: ...

    def validation_microbatches(
        self, dataset: Any, settings: OrderSettings, dp_size: int, dp_rank: int
    ) -> list[np.ndarray]: ...


class SampleCountSteps:
    """Steps of ``global_batch_size`` samples, microbatches of ``microbatch_size`` (G must be a multiple of m)."""

    epochs_differ = False

    def __init__(self, global_batch_size: int, microbatch_size: int):
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        microbatches_per_step(self.global_batch_size, 1, self.microbatch_size)  # G must be a multiple of m

    def microbatches_per_step(self, dp_size: int) -> int:
        return microbatches_per_step(self.global_batch_size, dp_size, self.microbatch_size)

    def describe(self, dp_size: int) -> str:
        return (
            f"global_batch_size={self.global_batch_size}, data-parallel size {dp_size} and microbatch_size="
            f"{self.microbatch_size} give {self.microbatches_per_step(dp_size)} microbatches per step"
        )

    def check_sort_buffer_size(self, sort_buffer_size: int) -> None:
        check_sort_buffer_size(sort_buffer_size, self.global_batch_size)

    def schedule(self, dataset: Any, settings: OrderSettings) -> tuple[GlobalBatchSchedule, OrderFingerprint]:
        """The epochs' global batches of ``dataset``, and their fingerprint."""
        num_samples = len(dataset)
        key_lookup = resolve_sort_keys(dataset, settings.sort_key) if settings.sort_buffer_size else None
        order = GlobalBatchOrder(
            num_samples, self.global_batch_size, settings.sort_buffer_size, key_lookup, settings.seed, settings.shuffle
        )
        fingerprint = OrderFingerprint(
            seed=settings.seed,
            num_samples=num_samples,
            global_batch_size=self.global_batch_size,
            sort_buffer_size=settings.sort_buffer_size,
            shuffle=settings.shuffle,
            sort_keys_digest=keys_digest(key_lookup, num_samples),
        )
        if key_lookup is not None:
            # Fail now, not mid-epoch, on keys that cannot be sorted: column keys were checked whole when
            # resolved; per-index keys (Python calls) are checked on a sample spread over the dataset.
            probe = np.unique(np.linspace(0, num_samples - 1, num=min(num_samples, 256)).astype(np.int64))
            argsort_keys(key_lookup(probe), np.zeros(len(probe)), probe)
        lengths = key_lookup or _optional_keys(dataset, settings.sort_key)
        return GlobalBatchSchedule(order, self.microbatch_size, lengths), fingerprint

    def prepare_validation(self, dataset: Any, settings: OrderSettings) -> None:
        """Nothing to read ahead."""

    def validation_microbatches(
        self, dataset: Any, settings: OrderSettings, dp_size: int, dp_rank: int
    ) -> list[np.ndarray]:
        """This replica's share of the set, sorted by a column key if one is named, cut into m's."""
        # A callable sort_key takes training indices, so only a column (or the dataset's own method) sorts here.
        key_lookup = resolve_sort_keys(dataset, settings.sort_key if isinstance(settings.sort_key, str) else None)
        indices = np.arange(len(dataset))
        if key_lookup is not None:
            indices = indices[argsort_keys(key_lookup(indices), indices)]
        return validation_microbatches(indices, dp_size, dp_rank, self.microbatch_size)


def _optional_keys(dataset: Any, sort_key: Any) -> KeyLookup | None:
    """Sort keys read only as lengths for ``step_label_tokens``; ``None`` when there are none."""
    try:
        return resolve_sort_keys(dataset, sort_key)
    except (TypeError, ValueError):
        return None


class TokenBudgetSteps:
    """Steps of ``P`` microbatches within a token budget, planned per epoch from every sample's length."""

    epochs_differ = True

    def __init__(self, budget: TokenBudget):
        self.budget = budget
        self._lengths: tuple[Any, np.ndarray] | None = None  # (dataset, lengths): read once per dataset
        self._val_lengths: tuple[Any, np.ndarray] | None = None

    def microbatches_per_step(self, dp_size: int) -> int:
        return token_microbatches_per_step(self.budget.global_batch_tokens, self.budget.microbatch_tokens, dp_size)

    def describe(self, dp_size: int) -> str:
        return (
            f"global_batch_tokens={self.budget.global_batch_tokens}, microbatch_tokens="
            f"{self.budget.microbatch_tokens} and data-parallel size {dp_size} give "
            f"{self.microbatches_per_step(dp_size)} microbatches per step"
        )

    def check_sort_buffer_size(self, sort_buffer_size: int) -> None:
        """Any buffer packs: it is the number of samples packed together."""

    def schedule(self, dataset: Any, settings: OrderSettings) -> tuple[TokenPlan, TokenPlanFingerprint]:
        """The token plan of ``dataset``, and its fingerprint.

        Raises:
            ValueError: no lengths, a sample longer than ``microbatch_tokens``, data for less than one step.
        """
        if self._lengths is None or self._lengths[0] is not dataset:
            lookup = _length_lookup(dataset, settings.sort_key)
            if lookup is None:
                raise ValueError(
                    "token budgets need every sample's length: pass sort_key (a column of lengths such as "
                    "'token_counts', or a callable(index) returning the length) or give the dataset a "
                    "sort_key(index) method that returns it"
                )
            self._lengths = (dataset, read_lengths(lookup, len(dataset)))
        lengths, budget = self._lengths[1], self.budget
        plan = TokenPlan(lengths, budget, settings.sort_buffer_size, settings.seed, settings.shuffle)
        fingerprint = TokenPlanFingerprint(
            seed=settings.seed,
            num_samples=len(lengths),
            global_batch_tokens=budget.global_batch_tokens,
            microbatch_tokens=budget.microbatch_tokens,
            padding_free=budget.padding_free,
            pad_to_multiple_of=budget.pad_to_multiple_of,
            sort_buffer_size=settings.sort_buffer_size,
            shuffle=settings.shuffle,
            lengths_digest=lengths_digest(lengths),
            plan_version=PLAN_VERSION,
            document_multiple=budget.document_multiple,
        )
        return plan, fingerprint

    def prepare_validation(self, dataset: Any, settings: OrderSettings) -> None:
        """Read and check the validation lengths once, at set-up."""
        if self._val_lengths is not None and self._val_lengths[0] is dataset:
            return
        # A callable sort_key takes training indices, so validation lengths come from a column or the
        # validation dataset's own sort_key(index).
        lookup = _length_lookup(dataset, settings.sort_key if isinstance(settings.sort_key, str) else None)
        if lookup is None:
            raise ValueError(
                "token budgets pack validation microbatches by length too, but the validation dataset has no "
                "lengths: give it a sort_key(index) method returning the sample's length, or use a column "
                "sort_key that both datasets have"
            )
        lengths = read_lengths(lookup, len(dataset), "validation")
        check_lengths_fit(lengths, self.budget, "validation")
        self._val_lengths = (dataset, lengths)

    def validation_microbatches(
        self, dataset: Any, settings: OrderSettings, dp_size: int, dp_rank: int
    ) -> list[np.ndarray]:
        """This replica's share of the validation set packed by the budget."""
        self.prepare_validation(dataset, settings)
        packed = pack(self._val_lengths[1], self.budget)
        return np.split(packed.order, np.cumsum(packed.sizes)[:-1])[dp_rank::dp_size]


def _length_lookup(dataset: Any, sort_key: Any) -> KeyLookup | None:
    try:
        return resolve_sort_keys(dataset, sort_key)
    except TypeError as error:  # a column that is not numeric
        raise InvalidLengthError(f"token budgets read every sample's length from sort_key: {error}") from error


def step_sizing(
    global_batch_size: Any,
    microbatch_size: Any,
    global_batch_tokens: Any,
    microbatch_tokens: Any,
    padding_free: bool,
    pad_to_multiple_of: Any,
    collate_fn: Any,
) -> SampleCountSteps | TokenBudgetSteps:
    """The strategy the arguments ask for; ``pad_to_multiple_of=None`` takes the ``collate_fn``'s (else 1).

    Raises:
        ValueError: both or neither mode, bad sizes, or a collate that contradicts ``padding_free``.
    """
    for name, value in (("global_batch_size", global_batch_size), ("global_batch_tokens", global_batch_tokens)):
        if isinstance(value, (list, tuple, dict)):
            raise ValueError(
                f"{name}={value!r} has phases, but a map-style epoch is planned whole from one {name} (its order, "
                f"the samples of every step and the resume position depend on it): give one number; schedules of "
                "the batch size are PretrainingDataModule's (docs/schedules.md)"
            )
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
        _check_sample_count_settings(global_batch_size, microbatch_tokens, padding_free)
        return SampleCountSteps(
            global_batch_size, DEFAULT_MICROBATCH_SIZE if microbatch_size is None else microbatch_size
        )
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
    multiple = getattr(collate_fn, "pad_to_multiple_of", 1) if pad_to_multiple_of is None else pad_to_multiple_of
    multiple = positive_int("pad_to_multiple_of", multiple)
    _check_collate_matches(collate_fn, padding_free)
    budget = TokenBudget(
        int(global_batch_tokens),
        int(microbatch_tokens),
        bool(padding_free),
        1 if padding_free else multiple,
        int(getattr(collate_fn, "context_parallel_size", 1)),
    )
    return TokenBudgetSteps(budget)


def _check_sample_count_settings(global_batch_size: Any, microbatch_tokens: Any, padding_free: bool) -> None:
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


def _check_collate_matches(collate_fn: Any, padding_free: bool) -> None:
    flattens = getattr(collate_fn, "flattens", None)
    name = type(collate_fn).__name__
    if padding_free and flattens is False:
        raise ValueError(
            f"padding_free=True plans microbatches by the sum of their lengths, but {name} pads them (count × "
            "longest would exceed microbatch_tokens): use FlatteningCollator (or a collate_fn that flattens), or "
            "padding_free=False"
        )
    if not padding_free and flattens is True:
        raise ValueError(
            f"{name} concatenates microbatches, but padding_free=False plans them padded (count × longest), which "
            "wastes the budget: pass padding_free=True"
        )
