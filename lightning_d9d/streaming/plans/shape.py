"""Shape: the global batch size and ``seq_len`` of every optimizer step, as phases fixed in advance.

Each setting is a number or phases ``[[from_step, value], ...]`` (the first from step 0, steps increasing); the
global batch size may also change by trained tokens (``{"from_tokens": n, "value": v}``, Megatron's ramp), resolved
to steps once, since the tokens before a step (``Σ G(t)·seq_len(t)``) depend only on the phases themselves. A
schedule is a pure function of the step, so every rank, every resume and every layout agree on the shape of any
step without talking. Trade-off: phases are fixed before training (a change is a deliberate resume under other
settings), in exchange for a shape that never depends on timing or on the layout.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_d9d.core.checks import plain_int


@dataclass(frozen=True)
class StepValues:
    """A positive integer for every step, piecewise constant: ``values[i]`` from ``starts[i]`` on."""

    starts: tuple[int, ...]
    values: tuple[int, ...]

    @classmethod
    def constant(cls, value: int) -> StepValues:
        return cls((0,), (value,))

    def at(self, step: int) -> int:
        return self.values[bisect.bisect_right(self.starts, step) - 1]

    @property
    def fixed(self) -> bool:
        return len(set(self.values)) == 1

    def segments(self, start: int, stop: float) -> Iterator[tuple[int, float, int]]:
        """``(first, end, value)`` of every constant stretch of ``[start, stop)`` (``end`` may be ``math.inf``)."""
        index = bisect.bisect_right(self.starts, start) - 1
        first = start
        while first < stop:
            end = self.starts[index + 1] if index + 1 < len(self.starts) else math.inf
            yield first, min(end, stop), self.values[index]
            first, index = end, index + 1

    def total(self, stop: int) -> int:
        """``Σ_{t < stop}`` of the values."""
        return sum(int(end - first) * value for first, end, value in self.segments(0, stop))

    def to_list(self) -> list[list[int]]:
        return [[start, value] for start, value in zip(self.starts, self.values)]

    @classmethod
    def from_list(cls, phases: Any, name: str = "phases") -> StepValues:
        """The inverse of :meth:`to_list` (``ValueError`` for anything else)."""
        return _step_values(name, phases, allow_tokens=False)


@dataclass(frozen=True)
class Shape:
    """One step's shape: ``global_batch_size`` rows of ``seq_len`` inputs (``capacity = seq_len + 1`` tokens)."""

    global_batch_size: int
    seq_len: int

    @property
    def capacity(self) -> int:
        return self.seq_len + 1


class ShapeSchedule:
    """The global batch size and ``seq_len`` of every step.

    Args:
        global_batch_size: rows per step over all ranks: a number, ``[[from_step, G], ...]``, or phases by trained
            tokens ``[{"from_tokens": n, "value": G}, ...]`` (the first from 0; a phase starts at the first step
            before which at least ``n`` row positions, ``Σ G·seq_len``, were trained).
        seq_len: inputs per row: a number or ``[[from_step, L], ...]``.

    Raises:
        ValueError: a value that is not a positive integer, or phases that are malformed, unordered or do not start
            at step 0 (naming the phase and what is valid).
    """

    def __init__(self, global_batch_size: Any, seq_len: Any):
        self.seq_lens = _step_values("seq_len", seq_len, allow_tokens=False)
        self.global_batch_sizes = _resolved_batch_sizes(global_batch_size, self.seq_lens)

    def at(self, step: int) -> Shape:
        return Shape(self.global_batch_sizes.at(step), self.seq_lens.at(step))

    def global_batch_size_at(self, step: int) -> int:
        return self.global_batch_sizes.at(step)

    def seq_len_at(self, step: int) -> int:
        return self.seq_lens.at(step)

    @property
    def fixed(self) -> bool:
        """Whether every step has the same shape."""
        return self.global_batch_sizes.fixed and self.seq_lens.fixed

    @property
    def boundaries(self) -> list[int]:
        """The steps where the shape may change (0 included), ascending."""
        return sorted(set(self.global_batch_sizes.starts) | set(self.seq_lens.starts))

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens.values)

    def phases(self) -> list[tuple[int, float, Shape]]:
        """``(first step, end, shape)`` of every stretch of one shape (``end`` of the last is ``math.inf``)."""
        starts = self.boundaries
        ends = [*starts[1:], math.inf]
        return [(first, end, self.at(first)) for first, end in zip(starts, ends)]

    def tokens_before(self, step: int) -> int:
        """Row positions (``Σ G·seq_len``) of the steps before ``step``."""
        total = 0
        for first, end, shape in self.phases():
            if first >= step:
                break
            total += int(min(end, step) - first) * shape.global_batch_size * shape.seq_len
        return total

    def check_divisible(self, name: str, divisor: int, divisor_text: str, why: str, advice: str = "") -> None:
        """``ValueError`` naming the first phase whose ``name`` is not a multiple of ``divisor`` (``divisor_text`` says
        what it is), ``why`` it must be, and ``advice`` (default: a multiple to use).
        """
        values = self.global_batch_sizes if name == "global_batch_size" else self.seq_lens
        for start, value in zip(values.starts, values.values):
            if value % divisor:
                where = f" (the phase from step {start})" if len(values.starts) > 1 else ""
                advice = advice or f"use a multiple of {divisor}, e.g. {-(-value // divisor) * divisor}"
                raise ValueError(f"{name}={value}{where} is not a multiple of {divisor_text}: {why}; {advice}")

    def describe(self) -> list[str]:
        """One line per phase: its steps and shape (for ``inspect``)."""
        lines = []
        for first, end, shape in self.phases():
            steps = f"steps {first}-{end - 1}" if end != math.inf else f"steps {first}-"
            lines.append(f"{steps}: global_batch_size {shape.global_batch_size}, seq_len {shape.seq_len}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The schedule by steps (token thresholds resolved), for checkpoints."""
        return {"global_batch_size": self.global_batch_sizes.to_list(), "seq_len": self.seq_lens.to_list()}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ShapeSchedule:
        return cls(state["global_batch_size"], state["seq_len"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShapeSchedule) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __repr__(self) -> str:
        return f"ShapeSchedule({self.to_dict()})"

    def first_difference(self, other: ShapeSchedule) -> int | None:
        """The first step whose shape differs between the two schedules, or ``None``."""
        for step in sorted(set(self.boundaries) | set(other.boundaries)):
            if self.at(step) != other.at(step):
                return step
        return None


def _phases_of(name: str, spelling: Any) -> list[tuple[str, Any, Any]]:
    """``(kind, threshold, value)`` of each phase of one setting (``kind``: ``"from_step"`` or ``"from_tokens"``)."""
    if isinstance(spelling, bool):
        raise ValueError(
            f"{name}={spelling!r} is not valid: give a positive integer or phases [[from_step, value], ...]"
        )
    if isinstance(plain_int(spelling), int):
        if spelling < 1:
            raise ValueError(f"{name} must be a positive integer (or phases [[from_step, value], ...]), got {spelling}")
        return [("from_step", 0, spelling)]
    if not isinstance(spelling, Sequence) or isinstance(spelling, (str, bytes)) or not spelling:
        raise ValueError(
            f"{name}={spelling!r} is not valid: give a positive integer or phases [[from_step, value], ...], the "
            "first from step 0"
        )
    phases = []
    for number, phase in enumerate(spelling):
        if (
            isinstance(phase, Mapping)
            and len(phase) == 2
            and "value" in phase
            and set(phase) & {"from_step", "from_tokens"}
        ):
            kind = "from_step" if "from_step" in phase else "from_tokens"
            phases.append((kind, phase[kind], phase["value"]))
        elif isinstance(phase, Sequence) and not isinstance(phase, (str, bytes)) and len(phase) == 2:
            phases.append(("from_step", phase[0], phase[1]))
        else:
            raise ValueError(
                f"phase {number} of {name} is {phase!r}: a phase is [from_step, value], {{from_step: n, value: v}}"
                + (" or {from_tokens: n, value: v}" if name == "global_batch_size" else "")
            )
    return phases


def _step_values(name: str, spelling: Any, allow_tokens: bool) -> StepValues:
    phases = _phases_of(name, spelling)
    kinds = {kind for kind, _, _ in phases}
    if "from_tokens" in kinds and not allow_tokens:
        raise ValueError(f"{name} phases are by step ([from_step, value]); only global_batch_size may use from_tokens")
    starts = [threshold for _, threshold, _ in phases]
    for number, (kind, threshold, value) in enumerate(phases):
        value = plain_int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} phase {number} ({kind} {threshold!r}): the value {value!r} must be a positive "
                             "integer")  # fmt: skip
        threshold = plain_int(threshold)
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"{name} phase {number}: {kind}={threshold!r} must be an integer >= 0 (phases from "
                             f"{starts})")  # fmt: skip
    if len(kinds) > 1:
        raise ValueError(f"{name} phases mix from_step and from_tokens ({starts}): give every phase the same kind")
    if plain_int(starts[0]) != 0:
        raise ValueError(f"{name}: the first phase must start at 0, got {starts[0]} (phases from {starts})")
    for before, after in itertools.pairwise(starts):
        if after <= before:
            raise ValueError(f"{name} phases must start at strictly increasing {phases[0][0]}: {after} follows "
                             f"{before} (phases from {starts})")  # fmt: skip
    return StepValues(tuple(int(s) for s in starts), tuple(int(plain_int(v)) for _, _, v in phases))


def _resolved_batch_sizes(spelling: Any, seq_lens: StepValues) -> StepValues:
    """The global batch sizes by step; phases by tokens start at the first step with enough tokens before it."""
    phases = _phases_of("global_batch_size", spelling)
    if not phases or phases[0][0] == "from_step":
        return _step_values("global_batch_size", spelling, allow_tokens=True)
    by_tokens = _step_values("global_batch_size", spelling, allow_tokens=True)
    starts, tokens, step = [0], 0, 0
    for index, threshold in enumerate(by_tokens.starts[1:]):
        size = by_tokens.values[index]
        while tokens < threshold:
            # Within a stretch of one seq_len every step adds size·seq_len positions: jump to the threshold.
            _, end, seq_len = next(seq_lens.segments(step, math.inf))
            per_step = size * seq_len
            steps = -(-(threshold - tokens) // per_step)
            if step + steps > end:
                steps = int(end - step)
            step, tokens = step + steps, tokens + steps * per_step
        if step <= starts[-1]:
            raise ValueError(
                f"global_batch_size phases from_tokens {list(by_tokens.starts)}: the phase from {threshold} tokens "
                f"would start at step {step}, where the phase before it starts; spread the thresholds further apart"
            )
        starts.append(step)
    return StepValues(tuple(starts), by_tokens.values)
