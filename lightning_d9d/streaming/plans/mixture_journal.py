"""The mixture journal: a controller's decisions as data, and the plan that follows them, exactly, in every process.

Each update at global step ``u`` (a multiple of the controller's ``every``) is journaled, a change of shares or not,
with the exact shares (``Fraction``s), the controller's inputs and, for a change, the data step ``e`` it takes effect
at (the data step of training step ``u + MIXTURE_LAG``) and the rows each source had given by then. From ``e`` on the
plan is ``MixturePlan(new shares, G, start_step=e, start_rows=those rows)``: every step takes the rows the shares in
force ask for, each source within a row of ``its rows at e + G·Σ shares`` (the exact planner, as a resume under new
weights). A user's phase that gives a source 0 still pauses it (the decision's shares renormalised over the others).

When: a stream making data step ``d`` (training step ``t``) needs every update ``u <= t − MIXTURE_LAG`` decided and no
other. The training process decides ``u`` once step ``u − 1`` has trained, before it asks for step ``u``'s data; the
streams in it make a step only when it is asked for, so they always find its decisions. DataLoader workers read
ahead, so they wait for a decision they need, reading the journal's entries from a feed file the training process
appends to (workers of either start method can read a path). ``MIXTURE_LAG = 2`` matches the workers' read-ahead of
two steps, so in a steady run they never wait. Trade-off: a decision acts two steps after the statistics it used.

A resume rebuilds the plan from the journal's entries (their rows stored, so in O(entries)), never calling the
controller for a decision already made.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule, deal_rows

MIXTURE_LAG = 2
_POLL_SECONDS = 0.002


@dataclass(frozen=True)
class JournalEntry:
    """One update of a mixture controller.

    Attributes:
        update_step: the global step ``u`` it was made at (after steps ``[0, u)`` trained).
        effective_step: the training step its shares start at, ``u + MIXTURE_LAG``.
        data_step: the data step they start at (``effective_step`` unless data was skipped before it).
        shares: the new shares in source order, exact and summing to 1, or ``None`` (the shares were kept).
        start_rows: rows each source had given before ``data_step`` (with ``shares`` only).
        inputs: what the controller was given, ``{source: SourceStats.to_dict()}``, and its raw answer.
    """

    update_step: int
    effective_step: int
    data_step: int
    shares: tuple[Fraction, ...] | None
    start_rows: tuple[int, ...] | None
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self, names: Sequence[str]) -> dict[str, Any]:
        shares = None if self.shares is None else {n: str(s) for n, s in zip(names, self.shares)}
        rows = None if self.start_rows is None else dict(zip(names, self.start_rows))
        return {"update_step": self.update_step, "effective_step": self.effective_step, "data_step": self.data_step,
                "shares": shares, "start_rows": rows, "inputs": self.inputs}  # fmt: skip

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], names: Sequence[str]) -> JournalEntry:
        shares, rows = state["shares"], state["start_rows"]
        return cls(
            int(state["update_step"]),
            int(state["effective_step"]),
            int(state["data_step"]),
            None if shares is None else tuple(Fraction(shares.get(n, "0")) for n in names),
            None if rows is None else tuple(int(rows.get(n, 0)) for n in names),
            dict(state.get("inputs") or {}),
        )

    def weights(self, names: Sequence[str]) -> dict[str, float] | None:
        return None if self.shares is None else {n: float(s) for n, s in zip(names, self.shares)}


class MixtureJournal:
    """Every update decided so far, in order, and the step through which updates are settled.

    Args:
        names: the sources, in order.
        entries: the updates decided (from a checkpoint).
        decided_through: every update at a global step up to this one is decided (or was never due).
        feed: a file the entries are appended to for DataLoader workers (``None``: none read it).
    """

    def __init__(self, names: Sequence[str], entries: Sequence[JournalEntry] = (), decided_through: int = 0,
                 feed: str | None = None):  # fmt: skip
        self.names, self.entries, self.decided_through = tuple(names), list(entries), int(decided_through)
        self.feed, self.owner = feed, os.getpid()
        self._read = 0  # bytes of the feed read (in a worker)
        if feed is not None:
            with open(feed, "w", encoding="utf-8") as file:
                file.writelines(self._line(entry) for entry in self.entries)
                file.write(self._line(None))

    def add(self, entry: JournalEntry) -> None:
        """Record the update of ``entry.update_step`` (after every earlier one), and send it to the workers."""
        if entry.update_step <= self.decided_through:
            raise ValueError(f"update step {entry.update_step} is already decided (through {self.decided_through})")
        self.entries.append(entry)
        self.decided_through = entry.update_step
        self._append(self._line(entry))

    def settle_through(self, step: int) -> None:
        """Mark every update up to ``step`` settled (a resume at ``step``: none before it will be made any more)."""
        if step > self.decided_through:
            self.decided_through = step
            self._append(self._line(None))

    def changes(self) -> list[JournalEntry]:
        """The entries that changed the shares."""
        return [entry for entry in self.entries if entry.shares is not None]

    def wait_for(self, step: int) -> None:
        """Return once updates up to ``step`` are decided: at once in the training process (RuntimeError if not),
        after reading the feed in a worker."""
        while self.decided_through < step:
            if self.feed is None or os.getpid() == self.owner:
                raise RuntimeError(
                    f"the mixture's data needs the controller's update at step {step}, which has not been made "
                    f"(updates are decided through step {self.decided_through}): the training loop decides it once "
                    f"step {step - 1} has trained, and only then may the data of step {step + MIXTURE_LAG} be read"
                )
            if not self._read_feed():
                time.sleep(_POLL_SECONDS)

    def to_dict(self) -> dict[str, Any]:
        return {"sources": list(self.names), "decided_through": self.decided_through,
                "entries": [entry.to_dict(self.names) for entry in self.entries]}  # fmt: skip

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], names: Sequence[str], feed: str | None = None) -> MixtureJournal:
        entries = [JournalEntry.from_dict(entry, names) for entry in state["entries"]]
        return cls(names, entries, int(state["decided_through"]), feed)

    # ------------------------------------------------------------------ the feed
    def _line(self, entry: JournalEntry | None) -> str:
        record = {
            "decided_through": self.decided_through,
            "entry": None if entry is None else entry.to_dict(self.names),
        }
        return json.dumps(record) + "\n"

    def _append(self, line: str) -> None:
        if self.feed is not None:
            # One write of a whole line on an append descriptor: a reader sees whole lines or none of it.
            fd = os.open(self.feed, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def _read_feed(self) -> bool:
        """Take the feed's new whole lines; whether any came."""
        with open(self.feed, "rb") as file:  # type: ignore[arg-type]
            file.seek(self._read)
            data = file.read()
        end = data.rfind(b"\n") + 1
        if not end:
            return False
        self._read += end
        for line in data[:end].splitlines():
            record = json.loads(line)
            if record["entry"] is not None:
                entry = JournalEntry.from_dict(record["entry"], self.names)
                if entry.update_step > max((e.update_step for e in self.entries[-1:]), default=-1):
                    self.entries.append(entry)
            self.decided_through = max(self.decided_through, int(record["decided_through"]))
        return True


def training_step_of(data_step: int, skipped: Sequence[tuple[int, int]]) -> int:
    """The training step that data step ``data_step`` trains, or (skipped) the one that trains next."""
    return data_step - sum(max(0, min(data_step, stop) - start) for start, stop in skipped if start < data_step)


class JournaledPlan:
    """A :class:`MixturePlan` followed by the journal's changes: the plan the streams of a controlled mixture take.

    Args:
        base: the plan without a controller (the user's weights; a resume's plan).
        journal: the updates (live in the training process, a copy reading the feed in a worker).
        every: the controller's update interval.
        skipped: data steps consumed untrained (``MixtureSpec.skipped``).
        ignore_through: entries of updates up to this step are not followed (a resume that replaced the base plan
            with new weights: they take over from there).
    """

    def __init__(self, base: MixturePlan, journal: MixtureJournal, every: int,
                 skipped: Sequence[tuple[int, int]] = (), ignore_through: int = -1):  # fmt: skip
        self.base, self.journal, self.every, self.skipped = base, journal, every, tuple(skipped)
        self.ignore_through = ignore_through
        self._segments: list[tuple[int, MixturePlan]] = [(base.start_step, base)]
        self._used = 0  # journal entries turned into segments

    # what the streams and reports ask of a plan
    @property
    def schedule(self) -> MixtureSchedule:
        return self.base.schedule

    @property
    def rows_per_step(self) -> Any:
        return self.base.rows_per_step

    @property
    def start_step(self) -> int:
        return self.base.start_step

    def rows_at(self, step: int) -> int:
        return self.base.rows_at(step)

    def with_skipped(self, skipped: Sequence[tuple[int, int]]) -> JournaledPlan:
        return JournaledPlan(self.base, self.journal, self.every, skipped, self.ignore_through)

    def to_dict(self) -> dict[str, Any]:
        """The base plan's (the journal is saved on its own)."""
        return self.base.to_dict()

    def expected_passes(self, rows_per_pass_by_source: Mapping[str, float], total_steps: int) -> dict[str, float]:
        return self.base.expected_passes(rows_per_pass_by_source, total_steps)

    def needed_update(self, data_step: int) -> int:
        """The last update step whose decision data step ``data_step`` depends on (0: none)."""
        last = training_step_of(data_step, self.skipped) - MIXTURE_LAG
        return max(0, last - last % self.every)

    def segment(self, data_step: int) -> MixturePlan:
        """The plan in force at ``data_step`` (waiting for the decisions it depends on, in a worker)."""
        self.journal.wait_for(self.needed_update(data_step))
        self._take_entries()
        for start, plan in reversed(self._segments):
            if start <= data_step:
                return plan
        raise ValueError(f"data step {data_step} is before this plan's start step {self.base.start_step}")

    def shares_at(self, data_step: int) -> tuple[Fraction, ...]:
        """The shares in force at ``data_step``."""
        return self.segment(data_step).schedule.shares_at(data_step)

    def target_rows(self, step: int) -> tuple[Fraction, ...]:
        return self.segment(max(self.base.start_step, step - 1)).target_rows(step)

    def cumulative_rows(self, step: int) -> tuple[int, ...]:
        """Rows each source took before data step ``step``."""
        if step <= self.base.start_step:
            return self.base.cumulative_rows(step)
        return self.segment(step - 1).cumulative_rows(step)

    def rows_of_step(self, step: int) -> tuple[int, ...]:
        return self.segment(step).rows_of_step(step)

    def stream_rows_of_step(self, step: int, num_streams: int) -> list[tuple[int, ...]]:
        return deal_rows(self.rows_of_step(step), step, num_streams)

    def quotas_from(self, step: int) -> Iterator[tuple[int, ...]]:
        """``rows_of_step`` of ``step``, ``step + 1``, …; a segment's own iterator until the next one starts."""
        current, quotas = None, None
        while True:
            plan = self.segment(step)
            if plan is not current:
                current, quotas = plan, plan.quotas_from(step)
            yield next(quotas)  # type: ignore[arg-type]
            step += 1

    def _take_entries(self) -> None:
        entries = self.journal.entries
        while self._used < len(entries):
            entry = entries[self._used]
            self._used += 1
            if (
                entry.shares is None
                or entry.data_step < self.base.start_step
                or entry.update_step <= self.ignore_through
            ):
                continue  # kept shares, or a decision a resume under new weights replaced
            start_rows = entry.start_rows
            if start_rows is None:  # pragma: no cover (journaled with every change)
                start_rows = self._segments[-1][1].cumulative_rows(entry.data_step)
            schedule = masked_schedule(self.base.schedule, entry.shares, entry.data_step)
            plan = MixturePlan(schedule, self.base.rows_per_step, entry.data_step, list(start_rows))
            self._segments = [s for s in self._segments if s[0] < entry.data_step] + [(entry.data_step, plan)]


def masked_schedule(base: MixtureSchedule, shares: Sequence[Fraction], start: int) -> MixtureSchedule:
    """``shares`` from ``start`` on, paused (0) where a phase of ``base`` gives a source 0, renormalised; a phase
    where that leaves nothing takes the base's shares."""
    names = base.sources
    # Steps before ``start`` are never asked of a plan starting there; equal shares make the phase valid whatever
    # the decision pauses.
    phases: list[tuple[int, dict[str, Fraction]]] = [(0, dict.fromkeys(names, Fraction(1)))] if start else []
    for at in [start] + [p.from_step for p in base.phases if p.from_step > start]:
        own = base.shares_at(at)
        masked = [s if o else Fraction(0) for s, o in zip(shares, own)]
        phases.append((at, dict(zip(names, masked if any(masked) else own))))
    return MixtureSchedule(names, phases)
