"""Weighted mixtures for PretrainingDataModule: named sources, the plan saved and restored, counters per source.

``train_files`` (and ``val_files``) may map names to sources: ``{name: file spec}`` or ``{name: {"files": spec,
"text_column": column}}``. The rows of each step are planned per source by
:mod:`lightning_d9d.streaming.mixture` and taken by :mod:`lightning_d9d.streaming.mixture_stream`; this module
holds what the DataModule adds around them:

* **parsing** the sources (one error naming the value and what is valid); beside a mixture, the names of a
  mapping ``val_files`` must be training sources' (a validation source measures the source of its name), and
  the training sources left without one are said once (:func:`say_unvalidated_sources`);
* **the plan on resume** (:func:`resumed_plan`): the checkpoint's plan is kept when the shares are unchanged;
  other shares are refused with one error naming the old and new shares, unless ``on_mixture_change=
  "continue"``: the new shares then count from the resume step, every source from the rows it had given;
* **counters per source** (:func:`source_stats`).

Trade-off: the shares are not part of the fingerprint (which only tells "same data" from "other data"), so a
change of shares gets its own check and its own way to continue, instead of restarting an epoch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

from lightning_d9d.streaming.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.mixture_stream import MixtureSpec, MixtureState
from lightning_d9d.streaming.state import InvalidDataState
from lightning_d9d.streaming.stream import StreamSpec, StreamState

OnMixtureChange = Literal["raise", "continue"]
ON_MIXTURE_CHANGE = ("raise", "continue")
SINGLE_SOURCE_NAME = "train"  # the source name of a single corpus (``source_names``)


@dataclass(frozen=True)
class SourceConfig:
    """One named source: its file spec and the column holding its documents."""

    name: str
    files: Any
    text_column: str


def parse_sources(files: Any, text_column: str, what: str) -> list[SourceConfig] | None:
    """The named sources of a mapping ``files``, in its order; ``None`` when ``files`` is one corpus.

    Raises:
        ValueError: an empty mapping, a name that is not a non-empty string, a source given as a mapping
            without ``files`` or with keys other than ``files`` and ``text_column``, an empty text column.
    """
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


def mixture_arguments(
    train_files: Any,
    val_files: Any,
    text_column: str,
    weights: Any,
    on_mixture_change: Any,
    allow_shared_files: Any = False,
) -> tuple[list[SourceConfig] | None, list[SourceConfig] | None, MixtureSchedule | None]:
    """The training and validation sources (``None``: one corpus) and the validated schedule of the shares.

    A mapping ``val_files`` beside one training corpus may name its sources freely (there are no training names
    to match).

    Raises:
        ValueError: a bad source, ``weights`` without a mixture, weights the schedule refuses (unknown names,
            negative or all-zero weights, phases out of order), an unknown ``on_mixture_change``, a validation
            source beside a mixture that is named after no training source (naming the training sources), an
            ``allow_shared_files`` that is not a bool.
    """
    if on_mixture_change not in ON_MIXTURE_CHANGE:
        raise ValueError(f"on_mixture_change must be one of {list(ON_MIXTURE_CHANGE)}, got {on_mixture_change!r}")
    if not isinstance(allow_shared_files, bool):
        raise ValueError(f"allow_shared_files must be True or False, got {allow_shared_files!r}")
    train_sources = parse_sources(train_files, text_column, "train_files")
    val_sources = parse_sources(val_files, text_column, "val_files")
    if train_sources is None:
        if weights is not None:
            raise ValueError(
                f"weights={weights!r} needs a mixture: give train_files as a mapping {{name: files}} of sources"
            )
        return None, val_sources, None
    names = [source.name for source in train_sources]
    unknown = [source.name for source in val_sources or () if source.name not in names]
    if unknown:
        what = "is not a training source" if len(unknown) == 1 else "are not training sources"
        raise ValueError(
            f"val_files names {unknown}, which {what}: a validation source is named after the training source it "
            f"measures, one of {names}"
        )
    return train_sources, val_sources, MixtureSchedule(names, weights)


def say_unvalidated_sources(
    train_sources: Sequence[SourceConfig] | None, val_sources: Sequence[SourceConfig] | None
) -> list[str]:
    """The training sources of a mixture that a mapping ``val_files`` gives no validation source (``[]`` when
    either is not a mapping), said in one info message on rank 0 when there are any."""
    if train_sources is None or val_sources is None:
        return []
    validated = [source.name for source in val_sources]
    missing = [source.name for source in train_sources if source.name not in validated]
    if missing:
        rank_zero_info(
            f"val_files validates {validated} only: training sources {missing} have no validation data (no "
            "validation loss is measured for them)"
        )
    return missing


def resumed_plan(
    spec: MixtureSpec, saved: Any, states: Mapping[int, MixtureState], on_change: OnMixtureChange
) -> MixturePlan:
    """The plan a resume continues with: the checkpoint's when the shares are unchanged, else (with
    ``on_change="continue"``) this run's shares from the resume step on, every source from the rows it gave.

    Raises:
        InvalidDataState: a missing or malformed saved plan, streams saved at different steps.
        ValueError: other shares (or sources in another order) with ``on_change="raise"``, naming the old and
            new shares.
    """
    try:
        old = MixturePlan.from_dict(saved)
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidDataState("mixture", saved, f"expected the mixture plan a checkpoint saves ({err})") from err
    steps = sorted({state.step for state in states.values()})
    if len(steps) > 1:
        raise InvalidDataState("streams.*.step", steps, "every stream is saved at the same step")
    step = steps[0] if steps else 0
    new = spec.plan.schedule
    message = old.schedule.change_message(new, step)
    if message is None and old.schedule.sources != new.sources:
        message = (
            f"the sources are in another order than the checkpoint's ({list(old.schedule.sources)}, now "
            f"{list(new.sources)}); keep their order, or pass on_mixture_change='continue'"
        )
    if message is None:
        return old
    if on_change != "continue":
        raise ValueError(message)
    done = dict(zip(old.schedule.sources, old.cumulative_rows(step)))
    return MixturePlan(new, spec.plan.rows_per_step, step, [done.get(name, 0) for name in new.sources])


def read_states(saved: Mapping[Any, Any], streams: Sequence[int], packing: str, loaded: Any) -> dict[int, MixtureState]:
    """The saved mixture states of ``streams`` (those present), type-checked."""
    states = {}
    for sid in streams:
        value = saved.get(sid, saved.get(str(sid)))
        if value is not None:
            states[sid] = MixtureState.from_dict(loaded(value), packing, f"streams.{sid}")
    return states


def source_stats(spec: StreamSpec | MixtureSpec, names: Sequence[str], states: Mapping[int, Any]) -> dict:
    """Per source: ``rows``, ``tokens``, ``documents``, ``padding``, ``too_long`` of the given streams, summed, and
    ``passes`` (the mean over the streams of the passes their reader has completed, fractional)."""
    stats = {}
    for i, name in enumerate(names):
        source_spec = spec.sources[i] if isinstance(spec, MixtureSpec) else spec
        rows = tokens = docs = padding = too_long = 0
        passes = []
        for sid, state in states.items():
            sub = state.sources.get(name) if isinstance(state, MixtureState) else state
            if sub is None:
                passes.append(0.0)
                continue
            c = sub.counters
            rows, tokens, docs, padding = rows + c.rows, tokens + c.emitted, docs + c.docs, padding + c.padding
            too_long += c.too_long
            passes.append(_passes_read(source_spec, sid, sub))
        mean = sum(passes) / len(passes) if passes else 0.0
        stats[name] = {"rows": rows, "tokens": tokens, "documents": docs, "padding": padding, "too_long": too_long,
                       "passes": mean}  # fmt: skip
    return stats


def _passes_read(spec: StreamSpec, stream: int, state: StreamState) -> float:
    """Passes stream ``stream`` has read: its pass index plus the share of that pass's rows before its position."""
    read = state.packing.read
    units = spec.stream_units(stream)
    slots = units.of_pass(read.pass_index)
    sizes = (units.units.stop[slots] - units.units.start[slots]).tolist()
    total = sum(sizes)
    if not total or read.slot >= len(slots):
        return float(read.pass_index)
    unit = int(slots[read.slot])
    done = sum(sizes[: read.slot]) + read.row - int(units.units.start[unit])
    return read.pass_index + done / total


def mixture_report(
    spec: MixtureSpec, pass_rows: Mapping[str, float], run_steps: int, realised: Sequence[int], steps: int
) -> list[str]:
    """``inspect``'s mixture lines: the phases, each source's expected passes over ``run_steps`` steps, and the
    shares realised in the first ``steps`` steps (``realised`` rows per source) beside their targets."""
    plan = spec.plan
    lines = ["mixture:", *(f"  phase {line}" for line in plan.schedule.describe())]
    passes = plan.expected_passes(pass_rows, run_steps)
    lines.append(f"  expected passes over {run_steps} steps: " + ", ".join(f"{n} {p:.3g}" for n, p in passes.items()))
    total = sum(realised)
    if total:
        targets = plan.target_rows(steps)
        shown = [
            f"{name} {100 * rows / total:.1f}% (target {100 * float(target) / total:.1f}%)"
            for name, rows, target in zip(plan.schedule.sources, realised, targets)
        ]
        lines.append(f"  realised shares of the first {steps} steps: " + ", ".join(shown))
    return lines


def replace_plan(spec: MixtureSpec, plan: MixturePlan) -> MixtureSpec:
    return dataclasses.replace(spec, plan=plan)
