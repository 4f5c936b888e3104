"""The saved state of a PretrainingDataModule: its layout by version, and its streams, written from every rank and
read back by the streams' owners.

Version 3 (this one) nests each part's state under its name: ``{"epoch", "step", "fingerprint"}`` (the position),
``"version"``, ``"streams"`` (every stream's state at the last step boundary) and ``"plan"`` (the run plan's
``state_dict``: shares, shapes, edits, epoch length). ``migrate`` reads versions 1 and 2, whose plan lay flat beside
the streams, so checkpoints written before keep resuming exactly.

Lightning saves only rank 0's checkpoint, so every rank's streams are all-gathered into it; a rank reads back the
streams it owns now, validated. Arrays are saved as tensors so checkpoints load with ``weights_only=True``.

A restore runs here in the order the parts need: the plan's edits, the streams read under them, the plan's
shares continued from the streams' step, each stream checked against the plan continued.

Trade-off: every stream travels to every rank at each save (a few KB each), so any layout can resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.pretraining.corpus import Corpus
from lightning_d9d.datamodules.pretraining.mixture import OnMixtureChange
from lightning_d9d.datamodules.pretraining.plan import RunPlan
from lightning_d9d.streaming.plans.spec import MixtureSpec
from lightning_d9d.streaming.plans.state import mapping
from lightning_d9d.streaming.streams.mixture_stream import MixtureState

STATE_VERSION = 3
# The run plan's keys, which versions 1 and 2 kept beside the streams.
PLAN_KEYS = ("mixture", "shapes", "edits", "steps_per_epoch")


def saved_streams(states: Mapping[int, MixtureState], gather: bool) -> dict[int, Any]:
    """Every stream's saved state: this rank's ``states`` and, with ``gather``, every other rank's."""
    mine = {int(sid): _saveable(state.to_dict()) for sid, state in states.items()}
    if gather and torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    # Processes of one data-parallel replica (tensor/context/pipeline peers) own the same streams and hold equal
    # states of them (the peer check compares the rows they came from); the lowest process's copy is kept, so what
    # is saved never depends on the order copies arrive in.
    streams: dict[int, Any] = {}
    for rank in ranks:
        for sid, state in rank.items():
            streams.setdefault(sid, state)
    return streams


def migrate(state: dict[str, Any]) -> dict[str, Any]:
    """A saved state in this version's format (versions 1, one fixed shape, and 2, the plan flat, are read too).

    Raises:
        ValueError: a version this package cannot read.
        InvalidDataState: a version-1 state without the shape its fingerprint held.
    """
    version = state.get("version")
    if version == 1:
        state, version = _from_version_1(state), 2
    if version == 2:
        return _from_version_2(state)
    if version != STATE_VERSION:
        raise ValueError(
            f"unknown PretrainingDataModule state version {version!r} (this version reads 1, 2 and "
            f"{STATE_VERSION}): the checkpoint was written by another version of lightning_d9d"
        )
    return state


def _from_version_2(state: dict[str, Any]) -> dict[str, Any]:
    """Version 2 kept the plan's keys beside the streams; version 3 nests them under ``"plan"`` (a key a state
    lacked stays absent, so the plan names it as before)."""
    plan = {key: state[key] for key in PLAN_KEYS if key in state}
    rest = {key: value for key, value in state.items() if key not in PLAN_KEYS}
    return {**rest, "version": STATE_VERSION, "plan": plan}


def _from_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had one shape, in the fingerprint, and best-fit pieces located by chunk number (of that row
    length) with a checksum over a whole row's prefix; version 2 saves the shapes and locates pieces by token.
    """
    fingerprint = mapping(state.get("fingerprint"), "fingerprint")
    seq_len, size = fingerprint.get("seq_len"), fingerprint.get("global_batch_size")
    if not isinstance(seq_len, int) or not isinstance(size, int):
        raise InvalidDataState("fingerprint", fingerprint, "a version-1 state holds seq_len and global_batch_size")
    capacity = seq_len + 1
    streams = {}
    for sid, stream in mapping(state.get("streams"), "streams").items():
        sources = {}
        for name, sub in mapping(mapping(stream, f"streams.{sid}").get("sources"), f"streams.{sid}.sources").items():
            packing = dict(mapping(mapping(sub, name).get("packing"), f"streams.{sid}.sources.{name}.packing"))
            if packing.get("kind") in ("bestfit", "bestfit_split") and "buffer" in packing:
                packing["buffer"] = _buffer_from_version_1(_loaded(packing["buffer"]), packing["kind"], capacity)
            counters = {**mapping(sub.get("counters", {}), f"streams.{sid}.sources.{name}.counters"), "excluded": 0}
            sources[name] = {**sub, "packing": packing, "counters": counters}
        streams[sid] = {**stream, "sources": sources}
    shapes = {"global_batch_size": [[0, size]], "seq_len": [[0, seq_len]]}
    edits = {"skips": [], "exclusions": []}
    return {**state, "version": 2, "streams": streams, "shapes": shapes, "edits": edits}


def _buffer_from_version_1(buffer: Any, kind: str, capacity: int) -> Any:
    if not isinstance(buffer, np.ndarray) or buffer.ndim != 2 or buffer.shape[1] != 7:
        return buffer  # left to the stream's own check, which names it
    seq, length, key0, key1, chunk, final, checksum = (buffer[:, i] for i in range(7))
    if kind == "bestfit_split":
        offset, hashed = chunk * capacity, np.where((chunk == 0) & (final == 1), 0, length)
    else:
        offset, hashed = np.zeros_like(chunk), np.where(final == 1, 0, capacity)
    return np.stack([seq, length, key0, key1, offset, final, checksum, hashed], axis=1).astype(np.int64)


def read_streams(state: dict[str, Any], spec: MixtureSpec, owned: Sequence[int], step: int) -> dict[int, MixtureState]:
    """The ``owned`` streams' saved states of a migrated ``state``, all at one data step (checked against ``spec``
    by ``check_streams`` once the plan they continue is known).

    Raises:
        ValueError: a missing owned stream past step 0.
        InvalidDataState: a malformed stream state, naming the field's path; streams saved at different steps.
    """
    saved = mapping(state.get("streams"), "streams")
    missing = [sid for sid in owned if sid not in saved and str(sid) not in saved]
    if missing and step > 0:
        raise ValueError(f"the checkpoint's data state lacks streams {missing} (it holds {sorted(saved)})")
    states = {}
    for sid in owned:
        value = saved.get(sid, saved.get(str(sid)))
        if value is not None:
            states[sid] = MixtureState.from_dict(_loaded(value), spec, f"streams.{sid}")
    steps = sorted({state.step for state in states.values()})
    if len(steps) > 1:
        raise InvalidDataState("streams.*.step", steps, "every stream is saved at the same step")
    return states


def streams_step(states: Mapping[int, MixtureState]) -> int:
    """The data step the streams were saved at (0 where this rank holds none)."""
    return next(iter(states.values())).step if states else 0


def check_streams(states: Mapping[int, MixtureState], spec: MixtureSpec, expected: int, global_step: int) -> None:
    """Each stream's state valid under ``spec`` (the plan continued), at the data step ``expected`` of
    ``global_step``.

    Raises:
        InvalidDataState: a state that ``spec`` cannot continue, or streams at another data step.
    """
    for sid, stream_state in states.items():
        stream_state.check(spec, sid, f"streams.{sid}")
    if any(saved.step != expected for saved in states.values()):
        found = sorted({saved.step for saved in states.values()})
        raise InvalidDataState("streams.*.step", found, f"the data step of global step {global_step}: {expected}")


def _saveable(value: Any) -> Any:
    """Numpy arrays as int64 tensors and ints as plain ints, so checkpoints load with ``weights_only=True``."""
    if isinstance(value, dict):
        return {key: _saveable(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value, np.int64)).clone()
    if isinstance(value, (np.integer, int)) and not isinstance(value, bool):
        return int(value)
    return value


def _loaded(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _loaded(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return value


def restored(
    state: dict[str, Any],
    plan: RunPlan,
    owned: Sequence[int],
    epoch: int,
    step: int,
    on_mixture_change: OnMixtureChange,
) -> dict[int, MixtureState]:
    """The ``owned`` streams' states of a checkpoint's ``state`` at ``(epoch, step)``, validated, and ``plan``
    continued: the saved edits with those asked now first (the streams are read under them), then the saved shares
    and shapes from the streams' data step, then each stream checked against the plan continued.

    Raises:
        ValueError: an unknown version, a missing owned stream, or changed shares under ``"raise"``.
        InvalidDataState: a malformed state, naming the field's path.
    """
    global_step = epoch * plan.steps_per_epoch + step
    state = migrate(state)
    saved_plan = state["plan"]
    plan.load_edits(saved_plan, global_step)
    states = read_streams(state, plan.require(), owned, step)
    plan.load_mixture(saved_plan, streams_step(states), on_mixture_change)
    check_streams(states, plan.require(), plan.saved_edits(saved_plan).data_step(global_step), global_step)
    return states


def keep_epoch_length(state: Any, fingerprint: Any, plan: RunPlan, corpus: Corpus) -> None:
    """Size ``plan``'s epochs as the checkpoint did, where this run counted its own (no ``steps_per_epoch`` asked)
    and the data is the checkpoint's; a state written before epoch lengths were saved had the sampled estimate's.
    A malformed state is left to the resume, which names it.

    Raises:
        InvalidDataState: a saved epoch length that is no whole number >= 1.
    """
    if plan.steps_per_epoch_asked is not None or corpus.train is None:
        return
    try:
        if fingerprint is None or fingerprint.mismatches(dict(state["fingerprint"])):
            return  # another run's data: this run's epochs
        saved_plan = migrate(state)["plan"]
    except (KeyError, TypeError, ValueError, AttributeError):
        return
    saved = plan.saved_epoch_length(saved_plan)
    plan.keep_epoch_length(saved if saved is not None else corpus.sampled_steps_per_pass())


def shape_differences_of(state: dict[str, Any], plan: RunPlan) -> list[str]:
    """The global batch size and ``seq_len`` (phases) a checkpoint's ``state`` differs from ``plan`` in."""
    try:
        saved_plan = migrate(state)["plan"]
    except (KeyError, TypeError, ValueError):
        return []  # a malformed state is named when it is read
    return plan.other_differences(saved_plan)
