"""Weighted mixtures for PretrainingDataModule: named sources, the plan saved and restored, counters per source.

Changed shares on resume are refused unless ``on_mixture_change="continue"``, when the new shares count from the
resume step. Trade-off: shares are not in the fingerprint, so a change gets its own check instead of an epoch restart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.plans.shape import ShapeSchedule
from lightning_d9d.streaming.plans.spec import MixtureSpec, StreamSpec
from lightning_d9d.streaming.sources.reader import StreamUnits
from lightning_d9d.streaming.streams.mixture_stream import MixtureState
from lightning_d9d.streaming.streams.stream import StreamState

OnMixtureChange = Literal["raise", "continue"]
ON_MIXTURE_CHANGE = ("raise", "continue")
SINGLE_SOURCE_NAME = "train"  # the source name of a single corpus (``source_names``)
SINGLE_VALIDATION_NAME = "val"  # the source name of a single validation corpus (``val_source_names``)


@dataclass(frozen=True)
class SourceConfig:
    """One named source: its file spec and the column holding its documents."""

    name: str
    files: Any
    text_column: str


def parse_sources(files: Any, text_column: str, what: str) -> list[SourceConfig] | None:
    """The named sources of a mapping ``files``, in order; ``None`` when ``files`` is one corpus."""
    if not isinstance(files, Mapping):
        return None
    if not files:
        raise ValueError(f"{what}={{}} names no source: give {{name: files}} with at least one source")
    sources = []
    for name, value in files.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what} source names must be non-empty strings, got {name!r}")
        column = text_column
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"files", "text_column"})
            if "files" not in value or unknown:
                raise ValueError(
                    f"{what}[{name!r}] = {dict(value)!r} is not valid: a source is a file spec (dir, glob, file, URL "
                    "or a list) or {'files': spec, 'text_column': column}"
                )
            column = value.get("text_column", text_column)
            value = value["files"]
        if not isinstance(column, str) or not column:
            raise ValueError(f"{what}[{name!r}] text_column must be a non-empty column name, got {column!r}")
        if not isinstance(value, (str, os.PathLike, Sequence)):
            raise ValueError(f"{what}[{name!r}] = {value!r} is not a file spec: give a dir, glob, file, URL or list")
        sources.append(SourceConfig(name, value, column))
    return sources


@dataclass(frozen=True)
class Sources:
    """The parsed training and validation sources (a single corpus: one, ``"train"``/``"val"``) and the shares."""

    train: list[SourceConfig]
    validation: list[SourceConfig] | None
    schedule: MixtureSchedule
    mixture: bool
    validation_by_source: bool


def mixture_arguments(
    train_files: Any, val_files: Any, text_column: str, weights: Any, on_mixture_change: Any, allow_shared_files: Any
) -> Sources:
    """The training and validation sources and the validated schedule of the shares (``ValueError`` if bad)."""
    if on_mixture_change not in ON_MIXTURE_CHANGE:
        raise ValueError(f"on_mixture_change must be one of {list(ON_MIXTURE_CHANGE)}, got {on_mixture_change!r}")
    if not isinstance(allow_shared_files, bool):
        raise ValueError(f"allow_shared_files must be True or False, got {allow_shared_files!r}")
    train = parse_sources(train_files, text_column, "train_files")
    validation = parse_sources(val_files, text_column, "val_files")
    if train is None:
        if weights is not None:
            raise ValueError(
                f"weights={weights!r} needs a mixture: give train_files as a mapping {{name: files}} of sources"
            )
        train_sources = [SourceConfig(SINGLE_SOURCE_NAME, train_files, text_column)]
    else:
        train_sources = train
    if validation is None and val_files is not None:
        validation_sources: list[SourceConfig] | None = [SourceConfig(SINGLE_VALIDATION_NAME, val_files, text_column)]
    else:
        validation_sources = validation
    names = [source.name for source in train_sources]
    unknown = [source.name for source in validation or () if source.name not in names] if train is not None else []
    if unknown:
        what = "is not a training source" if len(unknown) == 1 else "are not training sources"
        raise ValueError(
            f"val_files names {unknown}, which {what}: a validation source is named after the training source it "
            f"measures, one of {names}"
        )
    return Sources(train_sources, validation_sources, MixtureSchedule(names, weights), train is not None,
                   validation is not None)  # fmt: skip


def say_unvalidated_sources(sources: Sources) -> list[str]:
    """The training sources a mapping ``val_files`` leaves unvalidated, said once on rank 0."""
    if not (sources.mixture and sources.validation_by_source):
        return []
    validated = [source.name for source in sources.validation or ()]
    missing = [source.name for source in sources.train if source.name not in validated]
    if missing:
        rank_zero_info(
            f"val_files validates {validated} only: training sources {missing} have no validation data (no "
            "validation loss is measured for them)"
        )
    return missing


def resumed_plan(
    spec: MixtureSpec, saved: Any, saved_shapes: Any, step: int, on_change: OnMixtureChange
) -> MixturePlan:
    """The plan a resume continues with: the checkpoint's if its shares and shapes are this run's, else
    (``"continue"``) this run's, counted from ``step`` on from the rows each source gave before it.

    Raises:
        ValueError: other shares, sources, global batch sizes or ``seq_len`` with ``on_change="raise"``.
        InvalidDataState: a malformed saved plan or shape schedule.
    """
    try:
        old = MixturePlan.from_dict(saved)
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidDataState("mixture", saved, f"expected the mixture plan a checkpoint saves ({err})") from err
    try:
        old_shapes = ShapeSchedule.from_dict(saved_shapes)
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidDataState("shapes", saved_shapes, f"the shape schedule a checkpoint saves ({err})") from err
    new = spec.plan.schedule
    changes = (old.schedule.change_message(new, step), _shape_change(old_shapes, spec.shapes, step))
    messages = [message for message in changes if message]
    if not messages and old.schedule.sources != new.sources:
        messages.append(
            f"the sources are in another order than the checkpoint's ({list(old.schedule.sources)}, now "
            f"{list(new.sources)}); keep their order, or pass on_mixture_change='continue'"
        )
    if not messages:
        return old
    if on_change != "continue":
        raise ValueError("; ".join(messages))
    done = dict(zip(old.schedule.sources, old.cumulative_rows(step)))
    return MixturePlan(new, spec.plan.rows_per_step, step, [done.get(name, 0) for name in new.sources])


def shape_differences(old: ShapeSchedule, new: ShapeSchedule) -> tuple[int | None, list[str]]:
    """The first step whose shape differs, and ``name: checkpoint X, this run Y`` for each setting that differs."""
    first = old.first_difference(new)
    if first is None:
        return None, []
    was, now = old.to_dict(), new.to_dict()
    return first, [
        f"{name}: checkpoint {_spelled(was[name])}, this run {_spelled(now[name])}"
        for name in ("global_batch_size", "seq_len")
        if was[name] != now[name]
    ]


def _spelled(phases: list[list[int]]) -> Any:
    return phases[0][1] if len(phases) == 1 else phases


def _shape_change(old: ShapeSchedule, new: ShapeSchedule, step: int) -> str | None:
    """Why resuming at ``step`` with ``new`` shapes (``old`` the checkpoint's) is a change, or ``None``."""
    first, changed = shape_differences(old, new)
    if first is None:
        return None
    return (
        f"the shapes differ from the checkpoint's from step {first} (resuming at step {step}): {', '.join(changed)}; "
        "restore the checkpoint's global_batch_size and seq_len (and their phases), or pass "
        "on_mixture_change='continue' to continue every stream from where it stopped in the new shapes"
    )


def source_stats(spec: MixtureSpec, states: Mapping[int, MixtureState]) -> dict:
    """Per source: the streams' counters summed, and ``passes`` (the mean passes completed, fractional)."""
    stats = {}
    for name, source_spec in zip(spec.names, spec.sources):
        rows = tokens = docs = padding = too_long = excluded = 0
        passes = []
        for sid, state in states.items():
            sub = state.sources.get(name)
            if sub is None:
                passes.append(0.0)
                continue
            c = sub.counters
            rows, tokens, docs, padding = rows + c.rows, tokens + c.emitted, docs + c.docs, padding + c.padding
            too_long, excluded = too_long + c.too_long, excluded + c.excluded
            passes.append(_passes_read(source_spec, sid, sub))
        mean = sum(passes) / len(passes) if passes else 0.0
        stats[name] = {"rows": rows, "tokens": tokens, "documents": docs, "padding": padding, "too_long": too_long,
                       "excluded": excluded, "passes": mean}  # fmt: skip
    return stats


def _passes_read(spec: StreamSpec, stream: int, state: StreamState) -> float:
    read = state.packing.read
    units = StreamUnits.of_spec(spec, stream)
    slots = units.of_pass(read.pass_index)
    sizes = (units.units.stop[slots] - units.units.start[slots]).tolist()
    total = sum(sizes)
    if not total or read.slot >= len(slots):
        return float(read.pass_index)
    unit = int(slots[read.slot])
    done = sum(sizes[: read.slot]) + read.row - int(units.units.start[unit])
    return read.pass_index + done / total


def expected_passes(
    spec: MixtureSpec, pass_rows_at: Callable[[int], Mapping[str, float]], run_steps: int
) -> dict[str, float]:
    """Passes over each source after ``run_steps`` steps: every stretch of one ``seq_len`` counts its target rows
    against a pass's rows at that length (``pass_rows_at(step)``), since a pass holds fewer rows the longer they are.
    """
    plan, passes = spec.plan, dict.fromkeys(spec.plan.schedule.sources, 0.0)
    for first, end, _ in spec.shapes.seq_lens.segments(0, run_steps):
        rows = pass_rows_at(first)
        before, after = plan.expected_passes(rows, first), plan.expected_passes(rows, int(end))
        for name in passes:
            passes[name] += after[name] - before[name]
    return passes


def mixture_report(
    spec: MixtureSpec,
    pass_rows_at: Callable[[int], Mapping[str, float]],
    run_steps: int,
    realised: Sequence[int],
    steps: int,
) -> list[str]:
    """``inspect``'s mixture lines: phases, expected passes per source (``pass_rows_at(step)``: a pass's rows of
    each source at the row length of ``step``), and realised shares beside targets."""
    plan = spec.plan
    lines = ["mixture:", *(f"  phase {line}" for line in plan.schedule.describe())]
    passes = expected_passes(spec, pass_rows_at, run_steps)
    lines.append(f"  expected passes over {run_steps} steps: " + ", ".join(f"{n} {p:.4g}" for n, p in passes.items()))
    total = sum(realised)
    if total:
        targets = plan.target_rows(steps)
        shown = [
            f"{name} {100 * rows / total:.1f}% (target {100 * float(target) / total:.1f}%)"
            for name, rows, target in zip(plan.schedule.sources, realised, targets)
        ]
        lines.append(f"  realised shares of the first {steps} steps: " + ", ".join(shown))
    return lines
