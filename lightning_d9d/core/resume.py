"""Resume: where training is in the data, and a fingerprint of what decides the data, for every DataModule.

Data is a pure function of settings and data, so the global position ``(epoch, step)`` in optimizer steps is all a
map-style resume needs: the rest is recomputed on any layout. ``step`` rounds down to whole steps, so a checkpoint
inside an accumulation window replays that step. A :class:`Fingerprint` mismatch names every differing field.

Trade-off: fingerprints summarise large inputs (sampled keys, parquet footers) instead of hashing every byte.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Base of every fingerprint: a frozen dataclass of plain values, one field per thing that decides the data."""

    def to_dict(self) -> dict[str, Any]:
        """The compared fields, as plain values (tuples as lists)."""
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self) if field.compare}

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """``field: checkpoint X, this run Y`` for every field that differs from a saved fingerprint."""
        differences = []
        for name, now in self.to_dict().items():
            then = _plain(saved.get(name, MISSING))
            if now != then:
                differences.append(self.describe_difference(name, then, now))
        return differences

    def describe_difference(self, name: str, then: Any, now: Any) -> str:
        return f"{name}: checkpoint {then!r}, this run {now!r}"

    def mismatch_advice(self, saved: dict[str, Any]) -> str | None:
        """Advice a subclass knows better for the differences from ``saved``; ``None``: the usual."""
        return None


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def mismatch_error(owner: str, differences: list[str], epoch: int, advice: str | None = None) -> ValueError:
    """The one error for a checkpoint whose data does not match this run's, naming every differing field."""
    advice = advice or (
        f"Resume with the same settings, or pass on_order_mismatch='restart_epoch' to start epoch {epoch} over "
        "with this run's data"
    )
    return ValueError(f"the checkpoint's data does not match this {owner} ({'; '.join(differences)}). {advice}")


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How many microbatches each optimizer step of one epoch has: ``per_step[i]`` from step ``starts[i]`` on.

    One stretch when every step is alike; a schedule of global batch sizes gives a few. ``before`` and ``step_of``
    translate between a step and the microbatches handed out before it, in O(log stretches).
    """

    starts: tuple[int, ...] = (0,)
    per_step: tuple[int, ...] = (1,)
    offsets: tuple[int, ...] = dataclasses.field(default=(0,), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0 or len(self.starts) != len(self.per_step) or min(self.per_step) < 1:
            raise ValueError(f"a step layout needs stretches from step 0 of >= 1 microbatch, got {self}")
        offsets = [0]
        for (start, per), end in zip(zip(self.starts, self.per_step), self.starts[1:]):
            offsets.append(offsets[-1] + (end - start) * per)
        object.__setattr__(self, "offsets", tuple(offsets))

    @classmethod
    def constant(cls, per_step: int) -> StepLayout:
        return cls((0,), (int(per_step),))

    @property
    def fixed(self) -> bool:
        return len(set(self.per_step)) == 1

    def at(self, step: int) -> int:
        """Microbatches of ``step``."""
        return self.per_step[bisect.bisect_right(self.starts, step) - 1]

    def before(self, step: int) -> int:
        """Microbatches of the steps before ``step``."""
        i = bisect.bisect_right(self.starts, step) - 1
        return self.offsets[i] + (step - self.starts[i]) * self.per_step[i]

    def step_of(self, microbatch: int) -> int:
        """The step that microbatch number ``microbatch`` (from 0) belongs to: whole steps before it."""
        i = bisect.bisect_right(self.offsets, microbatch) - 1
        return self.starts[i] + (microbatch - self.offsets[i]) // self.per_step[i]


@dataclasses.dataclass
class TrainPosition:
    """Where training is: the epoch, and the microbatches this rank handed out in it (``step``: whole steps, of the
    epoch's ``layout``)."""

    epoch: int = 0
    microbatches: int = 0
    layout: StepLayout = dataclasses.field(default_factory=StepLayout)

    @property
    def step(self) -> int:
        return self.layout.step_of(self.microbatches)

    def start(self, epoch: int, step: int, layout: StepLayout | int) -> None:
        self.epoch = epoch
        self.layout = layout if isinstance(layout, StepLayout) else StepLayout.constant(layout)
        self.microbatches = self.layout.before(step)


@dataclasses.dataclass(frozen=True)
class SavedPosition:
    """The common part of every saved data state: ``{"epoch", "step", "fingerprint"}``."""

    epoch: int
    step: int
    fingerprint: dict[str, Any]

    KEYS = ("epoch", "step", "fingerprint")

    @classmethod
    def read(cls, state: Any) -> SavedPosition:
        """Validate a saved data state (``ValueError`` naming a malformed field)."""
        if not isinstance(state, dict):
            raise InvalidDataState(
                "state",
                state,
                "the dict a lightning_d9d DataModule's state_dict() writes, with 'epoch', 'step' and 'fingerprint'",
            )
        for name in cls.KEYS:
            if name not in state:
                raise InvalidDataState(name, MISSING, f"present (the state holds the keys {sorted(map(str, state))})")
        for name in ("epoch", "step"):
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidDataState(name, value, "a whole number >= 0")
        if not isinstance(state["fingerprint"], dict):
            raise InvalidDataState("fingerprint", state["fingerprint"], "a dict of the fields that decide the data")
        return cls(state["epoch"], state["step"], dict(state["fingerprint"]))


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""Stands for a field a saved state lacks (equal to no saved value)."""


class InvalidDataState(ValueError):
    """A malformed or contradictory data state, naming the dotted ``path``, ``value`` and ``valid``."""

    def __init__(self, path: str, value: Any, valid: str):
        super().__init__(f"the checkpoint's data state is invalid: {path} = {_short(value)}: {valid}")
        self.path, self.value, self.valid = path, value, valid


def _short(value: Any, limit: int = 300) -> str:
    if type(value).__name__ == "ndarray":
        return f"array(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
