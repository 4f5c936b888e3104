"""Properties of the order and the sharding, over random sizes (hypothesis), without a Trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_d9d import GlobalBatchOrder, SeededPermutation
from lightning_d9d.core.checks import microbatches_per_step
from lightning_d9d.mapstyle.loader import _IndexBatches
from lightning_d9d.mapstyle.shard import GlobalBatchSchedule, rank_microbatches, snake_owner


@given(size=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_permutation_is_a_bijection(size: int, seed: int) -> None:
    values = SeededPermutation(size, (seed, 0))(np.arange(size))
    assert sorted(values.tolist()) == list(range(size))


def test_permutation_of_a_billion_is_lazy_and_seeded() -> None:
    first = SeededPermutation(10**9, (3, 0))(np.arange(10_000))
    again = SeededPermutation(10**9, (3, 0))(np.arange(10_000))
    other_epoch = SeededPermutation(10**9, (3, 1))(np.arange(10_000))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other_epoch)
    assert len(np.unique(first)) == 10_000 and first.min() >= 0 and first.max() < 10**9
    # Shuffled, not a shifted range: positions far apart map far apart.
    assert np.abs(np.diff(first)).mean() > 10**7


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    microbatch = draw(st.integers(1, 4))
    world = draw(st.integers(1, 4))
    per_step = draw(st.integers(1, 3))
    global_batch = microbatch * world * per_step
    size = draw(st.integers(global_batch, global_batch * 12 + 7))
    buffer_batches = draw(st.one_of(st.none(), st.integers(1, 6)))
    return {
        "microbatch": microbatch,
        "world": world,
        "global_batch": global_batch,
        "size": size,
        "buffer": None
        if buffer_batches is None
        else buffer_batches * global_batch + draw(st.integers(0, global_batch - 1)),
        "seed": draw(st.integers(0, 1000)),
    }


def keys_of(size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 50, size)


def epoch_by_rank(layout: dict, epoch: int, world: int, microbatch: int) -> list[list[list[int]]]:
    keys = keys_of(layout["size"])
    order = GlobalBatchOrder(
        layout["size"], layout["global_batch"], layout["buffer"], lambda idx: keys[idx], layout["seed"]
    )
    per_step = microbatches_per_step(layout["global_batch"], world, microbatch)
    schedule = GlobalBatchSchedule(order, microbatch)
    return [list(_IndexBatches(schedule, epoch, 0, world, rank, per_step)) for rank in range(world)]


def step_sets(by_rank: list[list[list[int]]], world: int, microbatch: int, global_batch: int) -> list[list[int]]:
    per_step = global_batch // (world * microbatch)
    steps = len(by_rank[0]) // per_step
    return [
        sorted(i for rank in by_rank for mb in rank[s * per_step : (s + 1) * per_step] for i in mb)
        for s in range(steps)
    ]


def global_batches(by_rank: list[list[list[int]]], world: int, microbatch: int, global_batch: int) -> list[list[int]]:
    """Each step's global batch in order, rebuilt from the ranks' microbatches: microbatch i of a step is dealt in a
    snake (laps 0 1 .. w-1, then w-1 .. 0, ...), each rank keeping its share in order; written out here, not the
    library's dealer, so two layouts agree only if every sample has the same place in its step."""
    per_step = global_batch // (world * microbatch)
    out = []
    for s in range(len(by_rank[0]) // per_step):
        taken = [0] * world
        rows = []
        for i in range(global_batch // microbatch):
            lap, offset = divmod(i, world)
            owner = offset if lap % 2 == 0 else world - 1 - offset
            rows += by_rank[owner][s * per_step + taken[owner]]
            taken[owner] += 1
        assert taken == [per_step] * world
        out.append(rows)
    return out


@given(layout=layouts())
@settings(max_examples=120, deadline=None)
def test_each_epoch_is_exactly_once_and_equal_per_rank(layout: dict) -> None:
    world, microbatch, global_batch = layout["world"], layout["microbatch"], layout["global_batch"]
    steps = layout["size"] // global_batch
    for epoch in (0, 1):
        by_rank = epoch_by_rank(layout, epoch, world, microbatch)
        counts = {len(rank) for rank in by_rank}
        assert counts == {steps * global_batch // (world * microbatch)}, (
            "every rank runs the same number of microbatches"
        )
        assert all(len(mb) == microbatch for rank in by_rank for mb in rank)
        seen = [i for rank in by_rank for mb in rank for i in mb]
        assert len(seen) == steps * global_batch and len(set(seen)) == len(seen)
        assert set(seen) <= set(range(layout["size"]))


@given(layout=layouts(), other_world=st.integers(1, 4), other_microbatch=st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_global_batches_do_not_depend_on_world_size_or_microbatch_size(
    layout: dict, other_world: int, other_microbatch: int
) -> None:
    global_batch = layout["global_batch"]
    if global_batch % (other_world * other_microbatch):
        other_world, other_microbatch = 1, 1
    reference = step_sets(
        epoch_by_rank(layout, 2, layout["world"], layout["microbatch"]),
        layout["world"],
        layout["microbatch"],
        global_batch,
    )
    other = step_sets(
        epoch_by_rank(layout, 2, other_world, other_microbatch), other_world, other_microbatch, global_batch
    )
    assert reference == other
    ordered = global_batches(
        epoch_by_rank(layout, 2, layout["world"], layout["microbatch"]), layout["world"], layout["microbatch"],
        global_batch,
    )  # fmt: skip
    other_ordered = global_batches(
        epoch_by_rank(layout, 2, other_world, other_microbatch), other_world, other_microbatch, global_batch
    )
    assert len(ordered) == len(reference) and ordered == other_ordered


@given(layout=layouts())
@settings(max_examples=40, deadline=None)
def test_epochs_differ_and_reruns_match(layout: dict) -> None:
    world, microbatch = layout["world"], layout["microbatch"]
    first = epoch_by_rank(layout, 0, world, microbatch)
    assert first == epoch_by_rank(layout, 0, world, microbatch)
    second = epoch_by_rank(layout, 1, world, microbatch)
    if possible_orders(layout) >= 10**6:  # two epochs may only coincide by a one-in-a-million chance
        assert first != second


def possible_orders(layout: dict) -> int:
    """A lower bound on how many different epochs the layout allows (a tiny sorted layout has only a few: one
    window of two batches can only swap them)."""
    size, global_batch, buffer = layout["size"], layout["global_batch"], layout["buffer"]
    if buffer is None:
        return math.perm(size, min(size, 2 * global_batch))  # a seeded permutation's first two batches
    window = buffer // global_batch * global_batch
    if window >= size:
        return math.factorial(size // global_batch)  # one sorted window: only its batch order is random
    return math.comb(size, window) * math.factorial(window // global_batch)  # which samples share a window


def test_sorted_windows_hold_neighbours_and_batches_are_shuffled() -> None:
    keys = np.random.default_rng(0).permutation(4096)
    order = GlobalBatchOrder(4096, 64, 64 * 16, lambda idx: keys[idx], seed=1)
    batches = [order.global_batch(0, step) for step in range(order.steps_per_epoch)]
    for batch in batches:
        assert np.all(np.diff(keys[batch]) >= 0), "a global batch is a sorted run of its window"
    first_window_means = [keys[b].mean() for b in batches[:16]]
    assert first_window_means != sorted(first_window_means), "batches inside a window are visited in random order"
    # Each window covers 16 random samples' worth of keys: its batches partition one sorted window.
    window = np.sort(np.concatenate(batches[:16]))
    assert len(window) == 1024 and len(np.unique(window)) == 1024


def test_unshuffled_order_is_dataset_order_without_sorting() -> None:
    order = GlobalBatchOrder(100, 10, None, None, seed=5, shuffle=False)
    assert order.global_batch(3, 4).tolist() == list(range(40, 50))


def test_snake_dealing_balances_ascending_microbatches() -> None:
    owners = [snake_owner(i, 4) for i in range(8)]
    assert owners == [0, 1, 2, 3, 3, 2, 1, 0]
    sizes = np.arange(32).reshape(8, 4)  # microbatches of ascending lengths
    per_rank = [sum(mb.sum() for mb in rank_microbatches(sizes.reshape(-1), 4, r, 4)) for r in range(4)]
    assert max(per_rank) - min(per_rank) <= 16  # contiguous dealing would give a spread of 256


@pytest.mark.parametrize(
    ("global_batch", "world", "microbatch", "message"),
    [
        (10, 4, 1, "global_batch_size=10 is not divisible by data-parallel size × microbatch_size = 4 × 1 = 4"),
        (0, 1, 1, "global_batch_size must be a positive integer, got 0"),
        (8, 1, -2, "microbatch_size must be a positive integer, got -2"),
    ],
)
def test_bad_sizes_name_the_values(global_batch: int, world: int, microbatch: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        microbatches_per_step(global_batch, world, microbatch)
