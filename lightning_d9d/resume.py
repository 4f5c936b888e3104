"""Resume: where training is in the data, and a fingerprint of what decides the data, for every DataModule.

Algorithm: every DataModule of this package defines its training data as a pure function of its settings and
the data, so the position ``(epoch, step)`` — global optimizer steps consumed in the epoch — is all that a
resume needs for the map-style path; the remaining batches are recomputed, never replayed (the streaming path
adds its streams' positions, still positions, never tokens). ``step`` counts the microbatches trained (under a
Trainer, those Lightning has processed, not merely those handed out: a microbatch in flight when an exception or
signal strikes is not trained), divided by microbatches per step and rounded down: a checkpoint taken inside an
accumulation window (whose gradients are not in the checkpoint), or while its last microbatch is in flight,
resumes at the start of that optimizer step and replays its microbatches, so no optimizer step is ever short
or skipped.

The position is counted in global steps, not per-rank microbatches, so it is the same on every rank (rank 0's
saved copy is valid for all) and stays valid when world size, microbatch size or worker count change.

A :class:`Fingerprint` holds exactly what changes the data (and nothing that does not, so an exact resume is
never refused); a resume into a run whose fingerprint differs raises one error that names each differing field
with the checkpoint's value and this run's.

Trade-off: fingerprints summarise large inputs (sampled sort keys, parquet footers) instead of hashing every
byte, so a change that leaves every summarised value intact is not told apart; hashing everything would cost
O(data) at every resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Base of every DataModule's fingerprint: a frozen dataclass of plain values (ints, strings, bools, None).

    Subclasses declare the fields that decide their data.
    """

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
        """How a differing field is named in the error (a subclass may say it better for large values)."""
        return f"{name}: checkpoint {then!r}, this run {now!r}"

    def mismatch_advice(self, saved: dict[str, Any]) -> str | None:
        """What to do instead of the usual advice (same settings, or ``on_order_mismatch``) when a subclass knows
        a better way for the differences from ``saved``; ``None``: the usual advice."""
        return None


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def mismatch_error(owner: str, differences: list[str], epoch: int, advice: str | None = None) -> ValueError:
    """The one error for a checkpoint whose data does not match this run's (naming every differing field), with
    ``advice`` (the fingerprint's ``mismatch_advice``) in place of the usual one when given."""
    advice = advice or (
        f"Resume with the same settings, or pass on_order_mismatch='restart_epoch' to start epoch {epoch} over "
        "with this run's data"
    )
    return ValueError(f"the checkpoint's data does not match this {owner} ({'; '.join(differences)}). {advice}")


@dataclasses.dataclass
class TrainPosition:
    """The one place that knows where training is: epoch, and microbatches this rank handed out in that epoch.

    ``microbatches`` is this rank's count; ``step`` turns it into whole global optimizer steps.
    """

    epoch: int = 0
    microbatches: int = 0
    microbatches_per_step: int = 1

    @property
    def step(self) -> int:
        return self.microbatches // self.microbatches_per_step

    def start(self, epoch: int, step: int, microbatches_per_step: int) -> None:
        """Stand at the first microbatch of global step ``step`` of ``epoch``."""
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
        """Validate a saved data state.

        Raises:
            ValueError: a state that is not what a lightning_d9d DataModule's ``state_dict()`` writes, naming the
                offending field and value and what would be valid.
        """
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
"""Stands for a field a saved state lacks (never equal to a saved value, and not a string or a list)."""


class InvalidDataState(ValueError):
    """The one error for a malformed or contradictory data state: names the field, its value and what is valid.

    Args:
        path: the field, dotted from the data state's root (``streams.3.sources.web.packing.reader.slot``).
        value: what the state holds there.
        valid: what would be valid.
    """

    def __init__(self, path: str, value: Any, valid: str):
        super().__init__(f"the checkpoint's data state is invalid: {path} = {_short(value)}: {valid}")
        self.path, self.value, self.valid = path, value, valid


def _short(value: Any, limit: int = 300) -> str:
    if type(value).__name__ == "ndarray":
        return f"array(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
