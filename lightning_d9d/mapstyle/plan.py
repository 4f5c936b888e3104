"""Plan: token-budget epochs — which samples form each microbatch of each optimizer step, from lengths alone.

A step is ``P = global_batch_tokens / microbatch_tokens`` microbatches, each within ``microbatch_tokens`` (padded:
samples × padded longest; padding-free: sum of lengths). The seeded epoch order is cut into windows of
``sort_buffer_size``; padded windows are sorted and cut greedily into runs, padding-free ones filled largest-fit-first,
and under-full tails carry into the next window. Steps are visited in a seeded order and dealt to ranks by
``snake_owner``. The plan depends only on (seed, epoch, lengths, budgets), never on the layout.

Trade-off: step counts vary a little between epochs, and every length is read once at set-up (O(N) memory).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from lightning_d9d.core.checks import positive_int, token_step_microbatches
from lightning_d9d.core.digest import digest
from lightning_d9d.mapstyle.order import KeyLookup, SeededPermutation
from lightning_d9d.mapstyle.shard import snake_owner
from lightning_d9d.parallel.context_parallel import cp_multiple

PLAN_VERSION = 1
"""Bump when the planning algorithm changes (part of the resume fingerprint)."""
# Lengths are read and the bijection evaluated this many samples at a time: bounded memory for any N.
_BLOCK = 1 << 18
# Padding-free microbatches filled below this share at the end of a window are completed in the next window.
_CARRY_BELOW = 0.99
# Without sorting, samples are packed next-fit in blocks of this many (the open microbatch carries over).
_UNSORTED_WINDOW = 1 << 16


class InvalidLengthError(ValueError, TypeError):
    """A sample's length is not a whole number >= 1."""


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """The budgets of a token-budget step and how a microbatch's tokens are counted against them.

    Args:
        global_batch_tokens: tokens of one optimizer step over all ranks.
        microbatch_tokens: tokens of one microbatch on one rank.
        padding_free: cost is the sum of lengths, else count × padded longest.
        pad_to_multiple_of: the padded length's rounding.
        context_parallel_size: CP ranks; lengths round up to ``2 × context_parallel_size``.

    Raises:
        ValueError: a non-positive value or budgets that do not divide.
    """

    global_batch_tokens: int
    microbatch_tokens: int
    padding_free: bool = False
    pad_to_multiple_of: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        token_step_microbatches(self.global_batch_tokens, self.microbatch_tokens)
        positive_int("pad_to_multiple_of", self.pad_to_multiple_of)
        multiple = cp_multiple(positive_int("context_parallel_size", self.context_parallel_size))
        name, value = (
            ("microbatch_tokens", self.microbatch_tokens)
            if self.padding_free
            else ("pad_to_multiple_of", self.pad_to_multiple_of)
        )
        if value % multiple:
            raise ValueError(
                f"{name}={value} is not a multiple of 2 × context_parallel_size = {multiple}: a "
                f"{'row' if self.padding_free else 'padded sequence'} must split into equal chunks over the "
                f"{self.context_parallel_size} context-parallel ranks; use a multiple of {multiple}"
            )

    @property
    def microbatches_per_step(self) -> int:
        """P: microbatches of one step over all ranks."""
        return self.global_batch_tokens // self.microbatch_tokens

    @property
    def document_multiple(self) -> int:
        """Padding-free: each sample's cost rounding (``2 × context_parallel_size`` under CP); else 1."""
        return cp_multiple(self.context_parallel_size) if self.padding_free else 1

    def padded_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """What each sample costs alone."""
        multiple = self.document_multiple if self.padding_free else self.pad_to_multiple_of
        if multiple == 1:
            return lengths
        return -(-lengths // multiple) * multiple

    def describe(self) -> str:
        mode = "padding-free (sum of lengths)" if self.padding_free else "padded (samples × padded longest)"
        if self.document_multiple > 1:
            mode = f"padding-free (sum of lengths, each rounded up to {self.document_multiple} for CP)"
        return (
            f"global_batch_tokens={self.global_batch_tokens}, microbatch_tokens={self.microbatch_tokens}, "
            f"{self.microbatches_per_step} microbatches per step, {mode}"
        )


# ---------------------------------------------------------------------------------------------- lengths
def read_lengths(lookup: KeyLookup, num_samples: int, what: str = "training") -> np.ndarray:
    """Every sample's length, read a block at a time.

    Args:
        lookup: vectorised ``indices -> lengths`` (the resolved ``sort_key``).
        what: names the dataset in errors.

    Raises:
        InvalidLengthError: a length that is not a whole number >= 1.
    """
    lengths: np.ndarray | None = None
    for start in range(0, num_samples, _BLOCK):
        indices = np.arange(start, min(start + _BLOCK, num_samples), dtype=np.int64)
        block = _whole_lengths(np.asarray(lookup(indices)), indices, what)
        if lengths is None:
            lengths = np.empty(num_samples, dtype=np.int32)
        if block.size and int(block.max()) > np.iinfo(lengths.dtype).max:
            lengths = lengths.astype(np.int64)
        lengths[start : start + len(block)] = block
    return lengths if lengths is not None else np.empty(0, dtype=np.int32)


def _whole_lengths(keys: np.ndarray, indices: np.ndarray, what: str) -> np.ndarray:
    hint = "token budgets count tokens: the sort key must be every sample's length (a whole number >= 1)"
    if keys.dtype == object or keys.dtype.kind not in "biuf" or keys.ndim != 1:
        position = next(
            (i for i, key in enumerate(keys.ravel()) if isinstance(key, bool) or not isinstance(key, (int, float))),
            0,
        )
        value = keys.ravel()[position] if keys.size else None
        raise InvalidLengthError(
            f"{what} sample {int(indices[position])} has length {value!r} ({type(value).__name__}); {hint}"
        )
    if keys.dtype.kind == "f":
        bad = ~np.isfinite(keys) | (keys != np.floor(keys))
        if bad.any():
            position = int(np.flatnonzero(bad)[0])
            raise InvalidLengthError(
                f"{what} sample {int(indices[position])} has length {keys[position].item()!r}; {hint}"
            )
    small = keys < 1
    if small.any():
        position = int(np.flatnonzero(small)[0])
        raise InvalidLengthError(f"{what} sample {int(indices[position])} has length {keys[position].item()!r}; {hint}")
    return keys.astype(np.int64)


def check_lengths_fit(lengths: np.ndarray, budget: TokenBudget, what: str = "training") -> None:
    """Raise ``ValueError`` unless every sample fits a microbatch on its own."""
    if not len(lengths) or int(budget.padded_lengths(np.int64(lengths.max()))) <= budget.microbatch_tokens:
        return  # the longest fits: no O(N) temporaries on the way that every run takes
    costs = budget.padded_lengths(lengths.astype(np.int64))
    too_long = costs > budget.microbatch_tokens
    first = int(np.flatnonzero(too_long)[0])
    longest = int(np.argmax(lengths))
    multiple = budget.document_multiple if budget.padding_free else budget.pad_to_multiple_of
    why = f" = 2 × context_parallel_size={budget.context_parallel_size}" if budget.document_multiple > 1 else ""
    rounded = (
        f" (padded to a multiple of {multiple}{why}: {int(costs[first])})" if costs[first] != lengths[first] else ""
    )
    raise ValueError(
        f"{what} sample {first} has {int(lengths[first])} tokens{rounded}, more than microbatch_tokens="
        f"{budget.microbatch_tokens}; {int(too_long.sum())} sample(s) do not fit a microbatch, the longest is "
        f"sample {longest} with {int(lengths[longest])} tokens. Use microbatch_tokens >= {int(costs.max())} "
        "(and a global_batch_tokens that is a multiple of it) or truncate the samples (TextDataModule: max_length)"
    )


def lengths_digest(lengths: np.ndarray) -> str:
    """The digest of every length: the plan depends on all of them, so the fingerprint does too."""
    return digest(np.ascontiguousarray(lengths, dtype="<i8" if lengths.dtype.itemsize > 4 else "<i4").tobytes())


# ---------------------------------------------------------------------------------------------- packers
@dataclasses.dataclass
class Packed:
    """Microbatches of some samples: ``order`` cut into ``sizes`` runs (int64, one entry per microbatch)."""

    order: np.ndarray
    sizes: np.ndarray
    tokens: np.ndarray
    costs: np.ndarray


def _runs(order: np.ndarray, lengths: np.ndarray, costs: np.ndarray, cuts: list[int], padded: bool) -> Packed:
    """Packed from cut points into ``order`` (lengths and costs given in that order)."""
    cut = np.asarray(cuts, dtype=np.int64)
    sizes = np.diff(cut)
    cumulative = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    tokens = cumulative[cut[1:]] - cumulative[cut[:-1]]
    if padded and len(sizes):
        run_costs = sizes * np.maximum.reduceat(costs, cut[:-1])
    elif costs is lengths:
        run_costs = tokens
    else:  # padding-free, each sample rounded up (context parallelism): the sum of the rounded lengths
        cumulative_costs = np.concatenate([[0], np.cumsum(costs, dtype=np.int64)])
        run_costs = cumulative_costs[cut[1:]] - cumulative_costs[cut[:-1]]
    return Packed(order, sizes, tokens, run_costs)


def pack_padded_sorted(lengths: np.ndarray, budget: TokenBudget) -> Packed:
    """Greedy runs of an ascending ``lengths``, each within ``count × padded max`` (one bisect per run)."""
    lengths = lengths.astype(np.int64)
    costs = budget.padded_lengths(lengths)
    limits = (np.arange(1, len(costs) + 1) - budget.microbatch_tokens // costs).tolist()
    cuts = [0]
    while cuts[-1] < len(costs):
        cuts.append(bisect.bisect_right(limits, cuts[-1], lo=cuts[-1]))
    return _runs(np.arange(len(costs), dtype=np.int64), lengths, costs, cuts, padded=True)


def pack_largest_fit(lengths: np.ndarray, budget: int) -> Packed:
    """Padding-free bins, each opened by the longest remaining sample and filled by the longest that fits."""
    lengths = lengths.astype(np.int64)
    by_length = np.argsort(lengths, kind="stable")
    ascending = lengths[by_length]
    first = np.concatenate([[0], np.flatnonzero(np.diff(ascending)) + 1])
    counts = np.diff(np.concatenate([first, [len(ascending)]]))
    present, left, next_of = ascending[first].tolist(), counts.tolist(), first.tolist()
    starts: list[int] = []
    takes: list[int] = []
    sizes: list[int] = []
    tokens: list[int] = []
    # Bound once: this loop runs a few times per microbatch, for every microbatch of the epoch.
    find, start, take = bisect.bisect_right, starts.append, takes.append
    while present:
        room, taken = budget, 0
        k = len(present) - 1  # every sample fits an empty microbatch: it opens with the longest
        while k >= 0:
            value, available = present[k], left[k]
            n = room // value
            start(next_of[k])
            if n >= available:
                n = available
                del present[k], left[k], next_of[k]
            else:
                next_of[k] += n
                left[k] = available - n
            take(n)
            room -= n * value
            taken += n
            k = find(present, room) - 1
        sizes.append(taken)
        tokens.append(budget - room)
    token_array = np.asarray(tokens, dtype=np.int64)
    return Packed(by_length[_concat_ranges(starts, takes)], np.asarray(sizes, dtype=np.int64), token_array, token_array)


def pack_next_fit(lengths: np.ndarray, budget: TokenBudget) -> Packed:
    """Samples in their given order, each microbatch taking the following samples while they fit."""
    lengths = lengths.astype(np.int64)
    costs = budget.padded_lengths(lengths)
    cumulative = np.concatenate([[0], np.cumsum(costs)])
    cuts = [0]
    limit = budget.microbatch_tokens
    while cuts[-1] < len(lengths):
        start = cuts[-1]
        if budget.padding_free:
            stop = bisect.bisect_right(cumulative, cumulative[start] + limit, lo=start + 1) - 1
        else:
            ahead = costs[start : start + limit // int(costs[start])]
            run = np.arange(1, len(ahead) + 1) * np.maximum.accumulate(ahead)
            stop = start + int(np.searchsorted(run, limit, side="right"))
        cuts.append(stop)
    return _runs(np.arange(len(lengths), dtype=np.int64), lengths, costs, cuts, padded=not budget.padding_free)


def pack(lengths: np.ndarray, budget: TokenBudget, sort: bool = True) -> Packed:
    """Microbatches of samples with these lengths under ``budget`` (the per-window packer)."""
    if not sort:
        return pack_next_fit(lengths, budget)
    if budget.padding_free:
        costs = budget.padded_lengths(lengths)
        packed = pack_largest_fit(costs, budget.microbatch_tokens)
        if costs is not lengths:  # rounded for context parallelism: the real tokens are fewer than the costs
            cumulative = np.concatenate([[0], np.cumsum(lengths[packed.order], dtype=np.int64)])
            bounds = np.concatenate([[0], np.cumsum(packed.sizes)])
            packed.tokens = cumulative[bounds[1:]] - cumulative[bounds[:-1]]
        return packed
    ascending = np.argsort(lengths, kind="stable")
    packed = pack_padded_sorted(lengths[ascending], budget)
    packed.order = ascending[packed.order]
    return packed


def _concat_ranges(starts: list[int], lengths: list[int]) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    start = np.asarray(starts, dtype=np.int64)
    length = np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(length) - length
    return np.repeat(start - offsets, length) + np.arange(int(length.sum()), dtype=np.int64)


def _carried(packed: Packed, budget: TokenBudget, limit: int, sort: bool) -> int:
    """How many trailing microbatches of a window to complete in the next window instead."""
    if not budget.padding_free or not sort:  # only the last run can be short for want of samples
        return 1 if len(packed.sizes) and packed.sizes[-1] <= limit else 0
    floor = _CARRY_BELOW * budget.microbatch_tokens
    count = samples = 0
    for size, tokens in zip(packed.sizes[::-1].tolist(), packed.costs[::-1].tolist()):
        if tokens >= floor or samples + size > limit:
            break
        count, samples = count + 1, samples + size
    return count


# ---------------------------------------------------------------------------------------------- the epoch
@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """One epoch's steps: step ``s`` is microbatches ``step_group[s]·P … +P`` of ``order``, cut at ``bounds``."""

    order: np.ndarray
    bounds: np.ndarray
    tokens: np.ndarray
    costs: np.ndarray
    step_group: np.ndarray
    step_label_tokens: np.ndarray
    microbatches_per_step: int
    dropped_samples: int
    packed_microbatches: int

    @property
    def steps(self) -> int:
        return len(self.step_group)

    def microbatch(self, step: int, k: int) -> np.ndarray:
        """Sample indices of microbatch ``k`` (of P) of step ``step``."""
        number = int(self.step_group[step]) * self.microbatches_per_step + k
        return self.order[self.bounds[number] : self.bounds[number + 1]]


def plan_epoch(
    lengths: np.ndarray,
    budget: TokenBudget,
    sort_buffer_size: int | None,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> EpochPlan:
    """The plan of one epoch; ``sort_buffer_size=None`` packs next-fit in dataset order."""
    num_samples = len(lengths)
    permutation = SeededPermutation(num_samples, (seed, epoch)) if shuffle else None
    order, size_array, token_array, cost_array = _pack_epoch(lengths, budget, sort_buffer_size, permutation)
    per_step = budget.microbatches_per_step
    steps = len(size_array) // per_step
    kept = steps * per_step
    bounds = np.concatenate([[0], np.cumsum(size_array[:kept])])
    trained = int(bounds[-1])
    labels_per_group = (token_array[:kept] - size_array[:kept]).reshape(steps, per_step).sum(axis=1)
    step_group = np.arange(steps)
    if shuffle:
        step_group = np.random.default_rng((seed, epoch, PLAN_VERSION)).permutation(steps)
    return EpochPlan(
        order=order[:trained],
        bounds=bounds,
        tokens=token_array[:kept],
        costs=cost_array[:kept],
        step_group=step_group,
        step_label_tokens=labels_per_group[step_group],
        microbatches_per_step=per_step,
        dropped_samples=num_samples - trained,
        packed_microbatches=len(size_array),
    )


def _windows(num_samples: int, permutation: SeededPermutation | None, window: int) -> Iterator[tuple[np.ndarray, bool]]:
    """The epoch's order in windows of ``window`` samples (bounded memory), each with whether it is the last."""
    block_size = max(1, _BLOCK // window) * window
    for start in range(0, num_samples, block_size):
        block_positions = np.arange(start, min(start + block_size, num_samples), dtype=np.int64)
        block = permutation(block_positions) if permutation is not None else block_positions
        for offset in range(0, len(block), window):
            yield block[offset : offset + window], start + offset + window >= num_samples


def _pack_epoch(
    lengths: np.ndarray, budget: TokenBudget, sort_buffer_size: int | None, permutation: SeededPermutation | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every window packed: the kept sample order and each microbatch's size, tokens and cost."""
    num_samples = len(lengths)
    window = sort_buffer_size or _UNSORTED_WINDOW
    sort = sort_buffer_size is not None
    # Filled in place (4 bytes a sample below 2³¹ samples): no list of pieces to concatenate, no second copy.
    order = np.empty(num_samples, dtype=np.int32 if num_samples < np.iinfo(np.int32).max else np.int64)
    written = 0
    sizes: list[np.ndarray] = []
    tokens: list[np.ndarray] = []
    costs: list[np.ndarray] = []
    carry = np.empty(0, dtype=np.int64)
    for items, last in _windows(num_samples, permutation, window):
        if len(carry):
            items = np.concatenate([carry, items])
        packed = pack(lengths[items], budget, sort=sort)
        keep = len(packed.sizes) - (0 if last else _carried(packed, budget, window, sort))
        kept_samples = int(packed.sizes[:keep].sum())
        ordered = items[packed.order]
        order[written : written + kept_samples] = ordered[:kept_samples]
        written += kept_samples
        carry = ordered[kept_samples:]
        sizes.append(packed.sizes[:keep])
        tokens.append(packed.tokens[:keep])
        costs.append(packed.costs[:keep])
    size_array, token_array, cost_array = (np.concatenate(parts) for parts in (sizes, tokens, costs))
    return order[:written], size_array, token_array, cost_array


class TokenPlan:
    """The training schedule of token-budget epochs; plans each epoch on first use and keeps the last two.

    Args:
        sort_buffer_size: samples packed together per window (``None``: next-fit in order).

    Raises:
        ValueError: a sample that does not fit a microbatch, or data too small for one step.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        budget: TokenBudget,
        sort_buffer_size: int | None,
        seed: int,
        shuffle: bool = True,
    ):
        check_lengths_fit(lengths, budget)
        self.lengths, self.budget = lengths, budget
        self.sort_buffer_size, self.seed, self.shuffle = sort_buffer_size, seed, shuffle
        self._cache: dict[int, EpochPlan] = {}
        first = self.epoch(0)
        if first.steps == 0:
            raise ValueError(
                f"the training dataset ({len(lengths)} samples, {int(lengths.sum())} tokens) packs into "
                f"{first.packed_microbatches} microbatches, fewer than one step's {budget.microbatches_per_step} "
                f"(global_batch_tokens={budget.global_batch_tokens} / microbatch_tokens={budget.microbatch_tokens});"
                " use a smaller global_batch_tokens or more data"
            )

    def epoch(self, epoch: int) -> EpochPlan:
        plan = self._cache.get(epoch)
        if plan is None:
            plan = plan_epoch(self.lengths, self.budget, self.sort_buffer_size, self.seed, epoch, self.shuffle)
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))  # the one planned longest ago
            self._cache[epoch] = plan
        return plan

    def steps_in_epoch(self, epoch: int) -> int:
        return self.epoch(epoch).steps

    def rank_microbatches(self, epoch: int, step: int, dp_size: int, dp_rank: int) -> list[np.ndarray]:
        """Data-parallel rank ``dp_rank``'s M microbatches of ``step`` (snake dealing)."""
        plan = self.epoch(epoch)
        return [
            plan.microbatch(step, k) for k in range(plan.microbatches_per_step) if snake_owner(k, dp_size) == dp_rank
        ]

    def step_label_tokens(self, epoch: int, step: int) -> int:
        return int(self.epoch(epoch).step_label_tokens[step])

    def describe(self, epoch: int = 0) -> dict[str, Any]:
        """Figures of one epoch's plan: steps, samples and tokens per step, fill of the budget."""
        plan = self.epoch(epoch)
        per_step = plan.microbatches_per_step
        samples = np.diff(plan.bounds).reshape(-1, per_step).sum(axis=1)
        tokens = plan.tokens.reshape(-1, per_step).sum(axis=1)
        return {
            "steps": plan.steps,
            "samples_per_step": (float(samples.mean()), int(samples.min()), int(samples.max())),
            "tokens_per_step": (float(tokens.mean()), int(tokens.min()), int(tokens.max())),
            "fill": float(plan.tokens.sum() / (len(plan.tokens) * self.budget.microbatch_tokens)),
            "budget_used": float(plan.costs.sum() / (len(plan.costs) * self.budget.microbatch_tokens)),
            "dropped_samples": plan.dropped_samples,
        }
