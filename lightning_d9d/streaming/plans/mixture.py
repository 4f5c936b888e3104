"""Mixture planning: how many rows of each source every optimizer step takes, exactly, as a function of the step.

Pure arithmetic. Source ``i`` is owed ``G · Σ_{t<s} w_i(t)`` rows after steps ``[0, s)`` (exact ``Fraction``s of the
weights' decimal spelling); each step's ``G`` rows go one at a time, earliest deadline first (Tijdeman's rule), which
keeps every source within a row of its target under constant shares (a largest-deficit greedy, as Megatron's blend,
can fall further behind). The rows are dealt statelessly to the ``K`` streams, so the plan depends on the schedule,
``G`` and ``K`` only; deficits recur within a phase, so ``cumulative_rows`` skips whole periods. Trade-off: planning
the global batch makes totals exact to a row per batch (per stream: to ``K`` rows), but a stream's share of a source
varies by a row from step to step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import Any

from lightning_d9d.streaming.plans.shape import StepValues

_MAX_PERIOD_SEARCH = 100_000


def as_step_values(rows: int | StepValues) -> StepValues:
    """``rows`` as a per-step value (a number is the same every step)."""
    return rows if isinstance(rows, StepValues) else StepValues.constant(rows)


@dataclass(frozen=True)
class MixturePhase:
    """The shares from ``from_step`` on (until the next phase), normalised to sum to 1, in source order."""

    from_step: int
    shares: tuple[Fraction, ...]


class MixtureSchedule:
    """Validated per-source shares of the rows of every step, piecewise constant in the step.

    Args:
        sources: the source names, in their order (ties go to the earlier source).
        weights: ``None`` (equal shares), ``{name: weight}``, or phases ``(from_step, {name: weight})`` (also as a list
            or ``{"from_step": n, "weights": {...}}``), the first from step 0; normalised per phase, unnamed sources 0.

    Raises:
        ValueError: bad or duplicate source names, an unknown name or invalid weight in ``weights``, a phase of all
            zeros, malformed or misordered phases, or a source with weight 0 in every phase.
    """

    def __init__(self, sources: Sequence[str], weights: Any = None):
        self.sources = _check_sources(sources)
        if weights is None:
            weights = dict.fromkeys(self.sources, 1)
        if isinstance(weights, Mapping) and "from_step" not in weights:
            phases = [(0, weights)]
        elif isinstance(weights, Sequence) and not isinstance(weights, str):
            phases = [_phase_parts(phase, number) for number, phase in enumerate(weights)]
        else:
            raise ValueError(
                f"weights={weights!r} is not valid: give a mapping {{source: weight}} or a list of phases "
                "[from_step, {source: weight}] (or {from_step: ..., weights: {...}}), the first from step 0"
            )
        if not phases:
            raise ValueError("weights=[] has no phase: give at least one phase, from step 0")
        self.phases = tuple(self._phase(from_step, mapping) for from_step, mapping in phases)
        self._check_steps()
        never = [name for i, name in enumerate(self.sources) if all(p.shares[i] == 0 for p in self.phases)]
        if never:
            raise ValueError(
                f"sources {never} have weight 0 in every phase, so they would never be read: give them a "
                "weight > 0 in some phase or remove them from train_files"
            )

    def _phase(self, from_step: Any, mapping: Mapping[str, Any]) -> MixturePhase:
        unknown = [name for name in mapping if name not in self.sources]
        if unknown:
            raise ValueError(
                f"weights name unknown sources {unknown} (phase from step {from_step!r}); the sources are "
                f"{list(self.sources)}"
            )
        raw = [_weight(name, mapping.get(name, 0), from_step) for name in self.sources]
        total = sum(raw)
        if total == 0:
            raise ValueError(
                f"the weights of the phase from step {from_step!r} are all 0 ({dict(mapping)!r}): at least one "
                f"of {list(self.sources)} needs a weight > 0"
            )
        return MixturePhase(from_step, tuple(w / total for w in raw))

    def _check_steps(self) -> None:
        steps = [phase.from_step for phase in self.phases]
        for step in steps:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"a phase's from_step must be an integer >= 0, got {step!r} (phases from {steps})")
        if steps[0] != 0:
            raise ValueError(f"the first phase must start at step 0, got from_step={steps[0]} (phases from {steps})")
        for before, after in itertools.pairwise(steps):
            if after <= before:
                raise ValueError(
                    f"phases must start at strictly increasing steps: from_step={after} follows from_step={before} "
                    f"(phases from {steps})"
                )

    def shares_at(self, step: int) -> tuple[Fraction, ...]:
        """The normalised shares of ``step``, in source order."""
        return self.phases[self.phase_index(step)].shares

    def phase_index(self, step: int) -> int:
        """The index of the phase ``step`` belongs to."""
        index = 0
        for number, phase in enumerate(self.phases):
            if phase.from_step <= step:
                index = number
        return index

    def target_rows(self, step: int, rows_per_step: int | StepValues) -> tuple[Fraction, ...]:
        """``Σ_{t<step} G(t) · w_i(t)`` per source: the exact rows each source is owed after steps ``[0, step)``."""
        rows = as_step_values(rows_per_step)
        totals = [Fraction(0)] * len(self.sources)
        for first, end, size in rows.segments(0, step):
            for number, phase in enumerate(self.phases):
                phase_end = self.phases[number + 1].from_step if number + 1 < len(self.phases) else math.inf
                steps = max(0, min(end, phase_end) - max(first, phase.from_step))
                if steps:
                    totals = [total + size * int(steps) * share for total, share in zip(totals, phase.shares)]
        return tuple(totals)

    def describe(self) -> list[str]:
        """One line per phase: its steps and each source's share in percent (for ``inspect``)."""
        lines = []
        for number, phase in enumerate(self.phases):
            end = self.phases[number + 1].from_step if number + 1 < len(self.phases) else None
            span = f"steps {phase.from_step}-{end - 1}" if end is not None else f"steps {phase.from_step}-"
            lines.append(f"{span}: {_format_shares(self.sources, phase.shares)}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (exact shares as ``"num/den"`` strings) for checkpoints; ``from_dict`` inverts it."""
        return {
            "sources": list(self.sources),
            "phases": [[p.from_step, {n: str(s) for n, s in zip(self.sources, p.shares)}] for p in self.phases],
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> MixtureSchedule:
        phases = [[step, {n: Fraction(s) for n, s in shares.items()}] for step, shares in state["phases"]]
        return cls(state["sources"], phases)

    def first_difference(self, other: MixtureSchedule) -> int | None:
        """The first step whose shares differ between the two schedules (by source name), or ``None``."""
        steps = sorted({p.from_step for p in self.phases} | {p.from_step for p in other.phases})
        for step in steps:
            if self.named_shares(step) != other.named_shares(step):
                return step
        return None

    def named_shares(self, step: int) -> dict[str, Fraction]:
        """``{name: share}`` of ``step``, sources with share 0 left out (so adding a zero source is no change)."""
        return {n: s for n, s in zip(self.sources, self.shares_at(step)) if s}

    def change_message(self, new: MixtureSchedule, step: int) -> str | None:
        """Why resuming at ``step`` with ``new`` (this schedule being the checkpoint's) is a change, or ``None``."""
        first = self.first_difference(new)
        if first is None:
            return None
        return (
            f"the mixture differs from the checkpoint's from step {first} (resuming at step {step}): checkpoint "
            f"{_format_shares_by_name(self.named_shares(first))}, now "
            f"{_format_shares_by_name(new.named_shares(first))}; "
            "restore the checkpoint's weights, or pass on_mixture_change='continue' to continue every source "
            "from where it stopped under the new shares"
        )


class MixturePlan:
    """The rows per source of every step of a :class:`MixtureSchedule`.

    Args:
        schedule: the shares per step.
        rows_per_step: G, rows of one optimizer step over all ranks: a number, or one per step (``StepValues``).
        start_step: the first step this plan covers (a resume under changed shares or shapes: targets count from
            there).
        start_rows: rows of each source taken before ``start_step`` (default: none).

    Raises:
        ValueError: ``rows_per_step`` < 1, ``start_step`` < 0, or ``start_rows`` not one count >= 0 per source.
    """

    def __init__(
        self,
        schedule: MixtureSchedule,
        rows_per_step: int | StepValues,
        start_step: int = 0,
        start_rows: Sequence[int] | None = None,
    ):
        if not isinstance(rows_per_step, StepValues) and (not isinstance(rows_per_step, int) or rows_per_step < 1):
            raise ValueError(f"rows_per_step must be a positive integer, got {rows_per_step!r}")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0, got {start_step!r}")
        count = len(schedule.sources)
        start_rows = tuple(start_rows) if start_rows is not None else (0,) * count
        if len(start_rows) != count or any(r < 0 for r in start_rows) or (not start_step and any(start_rows)):
            raise ValueError(f"start_rows={list(start_rows)} must be {count} counts >= 0 (all 0 at start_step 0)")
        self.schedule, self.rows_per_step = schedule, as_step_values(rows_per_step)
        self.start_step, self.start_rows = start_step, start_rows
        self._base = schedule.target_rows(start_step, self.rows_per_step)
        # Rows at the start and at phase starts reached, plus the latest step asked for: where a query resumes
        # iterating from (a few entries, however many steps a run asks for).
        self._known: dict[int, tuple[int, ...]] = {start_step: start_rows}
        self._latest: tuple[int, tuple[int, ...]] = (start_step, start_rows)
        self._boundaries = sorted({p.from_step for p in schedule.phases} | set(self.rows_per_step.starts))

    def rows_at(self, step: int) -> int:
        """G of ``step``."""
        return self.rows_per_step.at(step)

    def target_rows(self, step: int) -> tuple[Fraction, ...]:
        """Exact rows each source is owed after steps ``[0, step)`` (``step >= start_step``)."""
        now = self.schedule.target_rows(step, self.rows_per_step)
        return tuple(r + t - b for r, t, b in zip(self.start_rows, now, self._base))

    def rows_of_step(self, step: int) -> tuple[int, ...]:
        """Rows each source gives step ``step`` (non-negative, summing to G of the step)."""
        before = self.cumulative_rows(step)
        return tuple(after - b for after, b in zip(self.cumulative_rows(step + 1), before))

    def cumulative_rows(self, step: int) -> tuple[int, ...]:
        """Rows each source took in ``[start_step, step)`` plus ``start_rows``; ValueError before ``start_step``."""
        if step < self.start_step:
            raise ValueError(f"step={step} is before this plan's start_step={self.start_step}")
        known = max(s for s in self._known if s <= step)
        rows = self._known[known]
        if known < self._latest[0] <= step:
            known, rows = self._latest
        while known < step:
            later = [b for b in self._boundaries if b > known]
            end = later[0] if later else math.inf
            stop = int(min(step, end))
            rows = self._run_phase(known, stop, rows)
            known = stop
            if known == end:
                self._known[known] = rows
        self._latest = (step, rows)
        return rows

    def _run_phase(self, start: int, stop: int, rows: tuple[int, ...]) -> tuple[int, ...]:
        """Rows after steps ``[start, stop)`` of one stretch of constant shares and G, given ``rows`` at ``start``;
        periods skipped.
        """
        shares, size = self.schedule.shares_at(start), self.rows_at(start)
        seen: dict[tuple[Fraction, ...], tuple[int, tuple[int, ...]]] = {}
        step = start
        while step < stop:
            targets = self.target_rows(step)
            deficits = tuple(t - r for t, r in zip(targets, rows))
            if deficits in seen and step - start <= _MAX_PERIOD_SEARCH:
                first, first_rows = seen[deficits]
                period = step - first
                # Same deficits, same future: every period adds the same rows (the targets' gain over it).
                per_period = tuple(r - f for r, f in zip(rows, first_rows))
                periods = (stop - step) // period
                rows = tuple(r + periods * p for r, p in zip(rows, per_period))
                step += periods * period
                seen.clear()
                continue
            if step - start <= _MAX_PERIOD_SEARCH:
                seen[deficits] = (step, rows)
            quota = _planned_quota(rows, targets, shares, size)
            rows = tuple(r + q for r, q in zip(rows, quota))
            step += 1
        return rows

    def expected_passes(self, rows_per_pass_by_source: Mapping[str, float], total_steps: int) -> dict[str, float]:
        """Passes over each source after ``total_steps`` steps (from step 0, ``start_rows`` included).

        Raises:
            ValueError: a source without a positive ``rows_per_pass_by_source`` entry.
        """
        passes = {}
        for name, target in zip(self.schedule.sources, self.target_rows(total_steps)):
            rows = rows_per_pass_by_source.get(name)
            if not isinstance(rows, Real) or not rows > 0:
                raise ValueError(f"rows per pass of source {name!r} must be a number > 0, got {rows!r}")
            passes[name] = float(target) / float(rows)
        return passes

    def stream_rows_of_step(self, step: int, num_streams: int) -> list[tuple[int, ...]]:
        """Rows each stream takes from each source in ``step``: ``K`` tuples, each summing to ``G / K``.

        Raises:
            ValueError: ``num_streams`` does not divide ``rows_per_step``.
        """
        size = self.rows_at(step)
        if not isinstance(num_streams, int) or num_streams < 1 or size % num_streams:
            raise ValueError(
                f"num_streams={num_streams!r} must be a positive divisor of the {size} rows of step {step}"
            )
        return deal_rows(self.rows_of_step(step), step, num_streams)

    def quotas_from(self, step: int) -> Iterator[tuple[int, ...]]:
        """``rows_of_step`` of ``step``, ``step + 1``, … one after another, in constant memory (a stream's plan)."""
        if len(self.schedule.sources) == 1:  # one source takes every row: no targets to weigh
            while True:
                yield (self.rows_at(step),)
                step += 1
        rows = self.cumulative_rows(step)
        while True:
            quota = _planned_quota(rows, self.target_rows(step), self.schedule.shares_at(step), self.rows_at(step))
            yield quota
            rows = tuple(r + q for r, q in zip(rows, quota))
            step += 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (for checkpoints): the schedule, ``start_step`` and ``start_rows`` by source name."""
        return {
            "schedule": self.schedule.to_dict(),
            "rows_per_step": self.rows_per_step.to_list(),
            "start_step": self.start_step,
            "start_rows": dict(zip(self.schedule.sources, self.start_rows)),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> MixturePlan:
        schedule = MixtureSchedule.from_dict(state["schedule"])
        rows = [int(state["start_rows"][name]) for name in schedule.sources]
        return cls(schedule, StepValues.from_list(state["rows_per_step"], "rows_per_step"), int(state["start_step"]),
                   rows)  # fmt: skip


def deal_rows(quota: Sequence[int], step: int, num_streams: int) -> list[tuple[int, ...]]:
    """Deal one step's rows per source: slot ``j``, in source order, goes to stream ``(j + step) mod K``."""
    counts = [[0] * len(quota) for _ in range(num_streams)]
    slot = 0
    for source, rows in enumerate(quota):
        whole, extra = divmod(rows, num_streams)
        first = (slot + step) % num_streams
        for stream in range(num_streams):
            counts[stream][source] += whole + ((stream - first) % num_streams < extra)
        slot += rows
    return [tuple(row) for row in counts]


def _planned_quota(
    rows: Sequence[int], targets: Sequence[Fraction], shares: Sequence[Fraction], rows_per_step: int
) -> tuple[int, ...]:
    """Earliest deadline first, kept within a row where whole rows allow."""
    quota = _step_quota(rows, targets, shares, rows_per_step)
    return _kept_within_one_row(rows, quota, targets, shares, rows_per_step)


def _kept_within_one_row(
    rows: Sequence[int],
    quota: Sequence[int],
    targets: Sequence[Fraction],
    shares: Sequence[Fraction],
    rows_per_step: int,
) -> tuple[int, ...]:
    """``quota``, or, where it leaves a source a row or more from its target after a phase change, a monotone quota
    that does not, if one exists.
    """
    after = [t + rows_per_step * share for t, share in zip(targets, shares)]
    taken = [r + q for r, q in zip(rows, quota)]
    if all(abs(t - a) < 1 for t, a in zip(taken, after)):
        return tuple(quota)
    low = [r if share == 0 else max(r, math.floor(a)) for r, a, share in zip(rows, after, shares)]
    high = [r if share == 0 else max(r, math.ceil(a)) for r, a, share in zip(rows, after, shares)]
    total = sum(rows) + rows_per_step
    if not sum(low) <= total <= sum(high):
        return tuple(quota)
    chosen = list(low)
    for _ in range(total - sum(low)):
        best = min((i for i in range(len(chosen)) if chosen[i] < high[i]), key=lambda i: (chosen[i] - after[i], i))
        chosen[best] += 1
    return tuple(c - r for c, r in zip(chosen, rows))


def _step_quota(
    rows: Sequence[int], targets: Sequence[Fraction], shares: Sequence[Fraction], rows_per_step: int
) -> tuple[int, ...]:
    """Tijdeman's rule: each row goes to the eligible source (deficit at least ``δ``) whose deficit reaches ``1 − δ``
    soonest, ties to the earlier source; integers scaled by a common denominator keep it exact and fast.
    """
    count = len(rows)
    active = [i for i, share in enumerate(shares) if share > 0]
    deficits = [t - r for t, r in zip(targets, rows)]
    scale = math.lcm(*(x.denominator for x in (*deficits, *shares)), max(1, 2 * count - 2))
    owed = [int(d * scale) for d in deficits]
    gain = [int(share * scale) for share in shares]
    eligible_at = scale // max(1, 2 * count - 2) if count > 1 else 0
    due_at = scale - eligible_at
    quota = [0] * count
    for _ in range(rows_per_step):
        for i in active:
            owed[i] += gain[i]
        eligible = [i for i in active if owed[i] >= eligible_at]
        if not eligible:  # only where frozen sources hold the deficit: serve the active one furthest behind
            eligible = [min(active, key=lambda i: (-owed[i], i))]
        best = min(eligible, key=lambda i: (max(0, -((owed[i] - due_at) // gain[i])), i))
        owed[best] -= scale
        quota[best] += 1
    return tuple(quota)


def _check_sources(sources: Sequence[str]) -> tuple[str, ...]:
    names = tuple(sources) if not isinstance(sources, str) else (sources,)
    if not names:
        raise ValueError("a mixture needs at least one source, got none")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"source names must be non-empty strings, got {name!r} (sources {list(names)})")
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"source names must be unique, got {duplicated} more than once")
    return names


def _phase_parts(phase: Any, number: int) -> tuple[Any, Mapping[str, Any]]:
    """``(from_step, mapping)`` of one phase given as a pair or as ``{"from_step": .., "weights": ..}``."""
    if isinstance(phase, Mapping) and set(phase) == {"from_step", "weights"}:
        from_step, mapping = phase["from_step"], phase["weights"]
    elif isinstance(phase, Sequence) and not isinstance(phase, str) and len(phase) == 2:
        from_step, mapping = phase
    else:
        from_step, mapping = None, None
    if not isinstance(mapping, Mapping):
        raise ValueError(
            f"phase {number} of weights is {phase!r}: a phase is [from_step, {{source: weight}}] or "
            "{from_step: ..., weights: {source: weight}}"
        )
    return from_step, mapping


def _weight(name: str, value: Any, from_step: Any) -> Fraction:
    """A weight as an exact Fraction of its decimal spelling (``0.1`` is ``1/10``, not the float's binary value)."""
    where = f"weights[{name!r}] (phase from step {from_step!r})"
    if isinstance(value, bool) or not isinstance(value, (Real, Fraction)):
        raise ValueError(f"{where} = {value!r} is not a number: weights are numbers >= 0")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} = {value!r} is not valid: weights are finite numbers >= 0")
    exact = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    if exact < 0:
        raise ValueError(f"{where} = {value!r} is negative: weights are numbers >= 0")
    return exact


def _format_shares(sources: Sequence[str], shares: Sequence[Fraction]) -> str:
    return ", ".join(f"{name} {float(share) * 100:.4g}%" for name, share in zip(sources, shares))


def _format_shares_by_name(shares: Mapping[str, Fraction]) -> str:
    return "{" + _format_shares(list(shares), list(shares.values())) + "}"
