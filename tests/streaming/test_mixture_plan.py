"""The mixture plan: exact per-step shares, cumulative rows without iterating, stream split, schedule errors."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule

NAMES = ["prose", "code", "math", "web", "books"]
WEIGHTS = st.sampled_from([0, 0, 1, 2, 3, 0.5, 0.3, 0.01, 0.001, 3.7, 10, 7])


@st.composite
def schedules(draw, max_phases: int = 3):
    """(schedule, rows_per_step): 1-5 sources, 1-3 phases with random weights, some sources zeroed."""
    names = NAMES[: draw(st.integers(1, len(NAMES)))]
    starts = sorted(draw(st.sets(st.integers(1, 40), max_size=max_phases - 1)))
    phases = []
    for start in [0, *starts]:
        weights = {name: draw(WEIGHTS) for name in names}
        if not any(weights.values()):
            weights[draw(st.sampled_from(names))] = draw(st.sampled_from([1, 0.2, 5]))
        phases.append([start, weights])
    for name in names:  # every source must be read in some phase
        if all(phase[1][name] == 0 for phase in phases):
            phases[-1][1][name] = 1
    rows_per_step = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
    return MixtureSchedule(names, phases), rows_per_step


def iterate(plan: MixturePlan, steps: int) -> list[tuple[int, ...]]:
    """Rows per source after each of ``steps`` steps, summing ``rows_of_step`` one step at a time."""
    rows = [0] * len(plan.schedule.sources)
    after = []
    for step in range(steps):
        rows = [r + q for r, q in zip(rows, plan.rows_of_step(step))]
        after.append(tuple(rows))
    return after


@settings(max_examples=60, deadline=None, derandomize=True)
@given(schedules())
def test_every_step_sums_to_its_rows_and_stays_within_one_row_of_the_target(case):
    """Within one row, plus what paused sources hold: a source paused while behind keeps its deficit, which the
    active sources must carry (when whole rows cannot share it, one of them is a row ahead)."""
    schedule, rows_per_step = case
    plan = MixturePlan(schedule, rows_per_step)
    for step, after in enumerate(iterate(plan, 60)):
        quota = plan.rows_of_step(step)
        assert sum(quota) == rows_per_step and min(quota) >= 0
        shares = schedule.shares_at(step)
        assert [q for q, share in zip(quota, shares) if share == 0] == [0] * shares.count(0)
        targets = schedule.target_rows(step + 1, rows_per_step)
        paused = sum(abs(r - t) for r, t, share in zip(after, targets, shares) if share == 0)
        assert max(abs(rows - target) for rows, target in zip(after, targets)) < 1 + paused, (step, after, targets)


def test_a_deficit_left_by_paused_sources_is_carried_by_one_row_at_most():
    """The case where no whole-row split keeps every source within one row: the paused sources are 1.07 rows
    behind together, so the active ones must be 1.07 ahead, and whole rows put one of them just over a row ahead.
    Nothing worse: every other source stays within one row."""
    phases = [
        [0, {"a": 0, "b": 3.7, "c": 3.7, "d": 3.7, "e": 1}],
        [16, {"a": 0, "b": 7, "c": 10, "d": 0, "e": 0}],
        [31, {"a": 1, "b": 10, "c": 1, "d": 0, "e": 3.7}],
    ]
    schedule = MixtureSchedule(list("abcde"), phases)
    plan = MixturePlan(schedule, 5)
    after, targets = plan.cumulative_rows(24), schedule.target_rows(24, 5)
    deviations = [r - t for r, t in zip(after, targets)]
    assert 1 < max(deviations) < 1 + sum(-d for d, share in zip(deviations, schedule.shares_at(23)) if share == 0)
    assert sorted(abs(d) for d in deviations)[-2] < 1


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 400))
def test_cumulative_rows_equals_the_iterated_rule(case, step):
    schedule, rows_per_step = case
    iterated = iterate(MixturePlan(schedule, rows_per_step), step)
    # A fresh plan answers the one query, skipping whole periods of every phase.
    assert MixturePlan(schedule, rows_per_step).cumulative_rows(step) == (
        iterated[-1] if iterated else (0,) * len(schedule.sources)
    )


def test_constant_shares_stay_within_tijdemans_bound():
    """With one phase every deficit stays within 1 − 1/(2N − 2), where a largest-deficit greedy exceeds 1 row."""
    schedule = MixtureSchedule(list("abcde"), {"a": 0.3, "b": 0.01, "c": 0.3, "d": 0.001, "e": 0.001})
    plan = MixturePlan(schedule, 3)
    worst = max(
        abs(rows - target)
        for step, after in enumerate(iterate(plan, 400))
        for rows, target in zip(after, schedule.target_rows(step + 1, 3))
    )
    assert worst <= 1 - Fraction(1, 8)


def test_a_zeroed_source_gets_nothing_and_comes_back_where_it_stopped():
    schedule = MixtureSchedule(["prose", "code"], [[0, {"prose": 3, "code": 1}], [10, {"prose": 1}], [20, {"code": 1}]])
    plan = MixturePlan(schedule, 8)
    assert [plan.rows_of_step(s) for s in (0, 9)] == [(6, 2), (6, 2)]
    assert all(plan.rows_of_step(s) == (8, 0) for s in range(10, 20))
    assert all(plan.rows_of_step(s) == (0, 8) for s in range(20, 30))
    assert plan.cumulative_rows(20) == (140, 20) and plan.cumulative_rows(30) == (140, 100)


def test_ten_million_steps_are_computed_without_iterating_them():
    schedule = MixtureSchedule(
        ["a", "b", "c"], [[0, {"a": 0.7, "b": 0.2, "c": 0.1}], [5_000_000, {"a": 0.123, "b": 1}]]
    )
    plan = MixturePlan(schedule, 64)
    rows = plan.cumulative_rows(10_000_000)
    targets = schedule.target_rows(10_000_000, 64)
    assert sum(rows) == 640_000_000
    assert all(abs(r - t) < 1 for r, t in zip(rows, targets))
    # the next step continues from there, as the iterated rule would
    assert tuple(r + q for r, q in zip(rows, plan.rows_of_step(10_000_000))) == plan.cumulative_rows(10_000_001)


@settings(max_examples=30, deadline=None)
@given(schedules(), st.sampled_from([1, 2, 4, 8]), st.integers(0, 50))
def test_streams_split_each_step_exactly(case, streams, step):
    schedule, rows_per_step = case
    rows_per_step *= 8  # a multiple of every K drawn
    plan = MixturePlan(schedule, rows_per_step)
    split = plan.stream_rows_of_step(step, streams)
    assert [sum(row) for row in split] == [rows_per_step // streams] * streams
    assert tuple(map(sum, zip(*split))) == plan.rows_of_step(step)


def test_a_source_rotates_over_the_streams():
    plan = MixturePlan(MixtureSchedule(["a", "b"], {"a": 5, "b": 3}), 8)
    per_stream = [0] * 4
    for step in range(40):
        for stream, row in enumerate(plan.stream_rows_of_step(step, 4)):
            per_stream[stream] += row[0]
    assert per_stream == [50, 50, 50, 50]


def test_a_plan_continued_under_new_shares_starts_from_the_rows_taken():
    plan = MixturePlan(MixtureSchedule(["a", "b"], {"a": 1, "b": 1}), 4, start_step=10, start_rows=(30, 10))
    assert plan.cumulative_rows(10) == (30, 10)
    assert plan.cumulative_rows(20) == (50, 30)
    with pytest.raises(ValueError, match=r"start_rows=\[30, -1\] must be 2 counts >= 0"):
        MixturePlan(MixtureSchedule(["a", "b"], {"a": 1, "b": 1}), 4, start_step=10, start_rows=(30, -1))
    with pytest.raises(ValueError, match="step=3 is before this plan's start_step=10"):
        plan.cumulative_rows(3)


def test_expected_passes_and_describe():
    schedule = MixtureSchedule(["prose", "code"], [{"from_step": 0, "weights": {"prose": 1, "code": 1}},
                                                   {"from_step": 50, "weights": {"prose": 1, "code": 3}}])  # fmt: skip
    plan = MixturePlan(schedule, 8)
    assert plan.expected_passes({"prose": 100, "code": 400}, 100) == {"prose": 3.0, "code": 1.25}
    assert schedule.describe() == ["steps 0-49: prose 50%, code 50%", "steps 50-: prose 25%, code 75%"]
    with pytest.raises(ValueError, match="rows per pass of source 'code' must be a number > 0, got None"):
        plan.expected_passes({"prose": 100}, 100)


def test_schedules_compare_by_shares_and_round_trip():
    old = MixtureSchedule(["prose", "code"], {"prose": 0.7, "code": 0.3})
    assert old.change_message(MixtureSchedule(["prose", "code"], {"prose": 7, "code": 3}), 5) is None
    assert old.change_message(MixtureSchedule.from_dict(old.to_dict()), 5) is None
    widened = MixtureSchedule(["prose", "code", "math"], [[0, {"prose": 7, "code": 3}], [100, {"math": 1}]])
    assert old.first_difference(widened) == 100
    message = old.change_message(MixtureSchedule(["prose", "code"], {"prose": 0.5, "code": 0.5}), 5)
    assert "from step 0" in message and "checkpoint {prose 70%, code 30%}" in message
    assert "now {prose 50%, code 50%}" in message and "on_mixture_change='continue'" in message


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"prose": 1, "cod": 1}, r"unknown sources \['cod'\].*the sources are \['prose', 'code'\]"),
        ({"prose": -1, "code": 1}, r"weights\['prose'\].* = -1 is negative"),
        ({"prose": math.nan, "code": 1}, r"weights\['prose'\].* = nan is not valid: weights are finite"),
        ({"prose": math.inf, "code": 1}, r"= inf is not valid"),
        ({"prose": "1", "code": 1}, r"weights\['prose'\].* = '1' is not a number"),
        ({"prose": True, "code": 1}, r"= True is not a number"),
        ({"prose": 0, "code": 0}, r"phase from step 0 are all 0.*needs a weight > 0"),
        ([[1, {"prose": 1, "code": 1}]], r"first phase must start at step 0, got from_step=1"),
        ([[0, {"prose": 1, "code": 1}], [0, {"code": 1}]], r"strictly increasing.*from_step=0 follows from_step=0"),
        ([[0, {"prose": 1, "code": 1}], [9, {"code": 1}], [5, {"prose": 1}]], r"from_step=5 follows from_step=9"),
        ([[0, {"prose": 1, "code": 1}], [-3, {"code": 1}]], r"from_step must be an integer >= 0, got -3"),
        ([[0, {"prose": 1, "code": 1}], [2.5, {"code": 1}]], r"from_step must be an integer >= 0, got 2.5"),
        ([[0, {"prose": 1}, 5]], r"phase 0 of weights is .*a phase is \[from_step"),
        ([], r"weights=\[\] has no phase"),
        ("prose", r"weights='prose' is not valid"),
        ({"prose": 1}, r"sources \['code'\] have weight 0 in every phase"),
    ],
)
def test_bad_weights_name_the_value_and_what_is_valid(weights, message):
    with pytest.raises(ValueError, match=message):
        MixtureSchedule(["prose", "code"], weights)


def test_bad_sources_and_sizes():
    with pytest.raises(ValueError, match="at least one source"):
        MixtureSchedule([], None)
    with pytest.raises(ValueError, match=r"unique, got \['a'\] more than once"):
        MixtureSchedule(["a", "a"], None)
    with pytest.raises(ValueError, match="non-empty strings, got ''"):
        MixtureSchedule(["a", ""], None)
    with pytest.raises(ValueError, match="rows_per_step must be a positive integer, got 0"):
        MixturePlan(MixtureSchedule(["a"]), 0)
    with pytest.raises(ValueError, match="num_streams=3 must be a positive divisor of the 8 rows of step 0"):
        MixturePlan(MixtureSchedule(["a"]), 8).stream_rows_of_step(0, 3)
