"""Resume: where training is in the data, and a fingerprint of what decides the data, for every DataModule.

Data is a pure function of settings and data, so the global position ``(epoch, step)`` in optimizer steps is all a
map-style resume needs: the rest is recomputed on any layout. ``step`` rounds down to whole steps, so a checkpoint
inside an accumulation window replays that step. A :class:`Fingerprint` mismatch names every differing field.

Trade-off: fingerprints summarise large inputs (sampled keys, parquet footers) instead of hashing every byte.
"""

from __future__ import annotations

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


@dataclasses.dataclass
class TrainPosition:
    """Where training is: the epoch, and the microbatches this rank handed out in it (``step``: whole global steps)."""

    epoch: int = 0
    microbatches: int = 0
    microbatches_per_step: int = 1

    @property
    def step(self) -> int:
        return self.microbatches // self.microbatches_per_step

    def start(self, epoch: int, step: int, microbatches_per_step: int) -> None:
        self.epoch, self.microbatches_per_step = epoch, microbatches_per_step
        self.microbatches = step * microbatches_per_step


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
