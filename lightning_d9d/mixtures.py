"""Mixture controllers: objects that move a mixture's shares while it trains, from per-source statistics.

A controller is called every ``every`` optimizer steps with the statistics of the steps since its last call, per
source: the summed token loss, tokens and rows of training (all-reduced over data-parallel ranks, so every rank sees
the same), and the latest validation loss where ``val_files={name: files}`` ran. It returns new weights or ``None``
(keep the shares). ``PretrainingDataModule(mixture_controller=...)`` turns the weights into exact rationals, journals
them and applies them ``MIXTURE_LAG`` steps later through the exact per-step planner (docs/mixtures.md).

Built-ins, all a multiplicative-weights update on a per-source score mixed with a prior (the form every online method
in the literature takes):

* :class:`LossProportional`: ``w = (1 − ε)·softmax(L̃ / T) + ε·prior`` on the (optionally EMA-smoothed) window mean
  loss ``L̃``. Trade-off: it chases high loss, also loss that cannot be learned (noise); ``ε`` keeps every source
  observed.
* :class:`DoReMi`: exponentiated excess loss over given reference losses (Xie et al. 2023):
  ``log α ← log α + η·max(L̃ − ref, 0)``, normalised, ``α ← (1 − c)·α + c/k``. Trade-off against the paper: the clip
  applies to the window mean rather than per token, and the weights drive sampling (rows are exact), not a
  reweighted loss.
* :class:`WeightsFile`: weights a person edits in a JSON or YAML file during the run, read at each update.

Every built-in keeps its own state (scores, log-weights, the last file read) in ``state_dict`` so that a resume
continues bit-identically; a decision already made is never recomputed (the journal replays it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DoReMi",
    "LossProportional",
    "MixtureController",
    "SourceStats",
    "WeightsFile",
    "check_controller",
    "check_stats",
    "checked_weights",
    "quantised",
]

# Exact rationals of a decision: 1/10⁶ steps, fine enough for any share a row count can show, coarse enough that
# float differences between machines in the last bits of a softmax never change a journaled share.
DENOMINATOR = 10**6


@dataclass(frozen=True)
class SourceStats:
    """One source's statistics over the steps since the controller's last call (all data-parallel ranks together).

    Attributes:
        loss_sum: the summed per-token training loss of the source's target tokens.
        tokens: the source's target tokens those losses cover.
        rows: the source's rows trained.
        weight: the source's share of the rows in force at the window's last step.
        val_loss: the mean per-token loss of the source's latest validation run, where one ran since the last call.
    """

    loss_sum: float
    tokens: int
    rows: int
    weight: float
    val_loss: float | None = None

    @property
    def mean_loss(self) -> float | None:
        """The window's mean token loss, ``None`` without tokens (a source that was not trained in the window)."""
        return self.loss_sum / self.tokens if self.tokens > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum, "tokens": self.tokens, "rows": self.rows, "weight": self.weight,
                "val_loss": self.val_loss}  # fmt: skip


@runtime_checkable
class MixtureController(Protocol):
    """What ``PretrainingDataModule(mixture_controller=...)`` calls: these methods, and an attribute ``every``, the
    optimizer steps between calls (the update steps are the global steps ``every, 2·every, ...``). A class with
    them, no base class needed, is a controller (LightningCLI configs name it by ``class_path``)."""

    def update(self, step: int, stats: Mapping[str, SourceStats]) -> Mapping[str, float] | None:
        """New weights ``{source: weight >= 0}`` (normalised by the loader; unnamed sources get 0), or ``None`` to
        keep the shares in force. Called on every rank with the same ``stats``; must be deterministic."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The controller's own state (plain values), saved in the DataModule's checkpoint state."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


def check_controller(controller: Any) -> MixtureController:
    """``controller`` if it is one, else ``ValueError`` naming what it lacks.

    Raises:
        ValueError: missing methods, or ``every`` not a positive integer.
    """
    missing = [
        name for name in ("update", "state_dict", "load_state_dict") if not callable(getattr(controller, name, None))
    ]
    if missing:
        raise ValueError(
            f"mixture_controller={controller!r} is not a mixture controller: it lacks {missing} (see "
            "lightning_d9d.mixtures.MixtureController; built-ins: LossProportional, DoReMi, WeightsFile)"
        )
    _positive_int("every", getattr(controller, "every", None), type(controller).__name__)
    return controller


def check_stats(step: int, stats: Mapping[str, SourceStats]) -> None:
    """``ValueError`` naming the update step and the source where a loss is NaN or infinite (never fed to a
    controller nor journaled)."""
    for name, stat in stats.items():
        for what, value in (("training loss sum", stat.loss_sum), ("validation loss", stat.val_loss)):
            if value is not None and not math.isfinite(value):
                raise ValueError(
                    f"mixture update at step {step}: source {name!r} has a {what} of {value!r} over the steps since "
                    "the last update; the mixture controller takes only finite losses (look for a diverged loss or "
                    "a token_losses tensor with NaN/inf at masked positions)"
                )


def checked_weights(step: int, weights: Any, sources: Sequence[str], controller: Any = None) -> list[Fraction]:
    """A controller's weights as exact, non-negative Fractions per source (unnamed sources 0), not yet normalised.

    Raises:
        ValueError: not a mapping, an unknown source, a weight that is negative, NaN, infinite or no number, or all 0;
            the message names the update step and the controller.
    """
    who = f"mixture controller {type(controller).__name__} at update step {step}" if controller is not None else (
        f"mixture update at step {step}"
    )  # fmt: skip
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"{who} returned {weights!r}: give a mapping {{source: weight >= 0}} of {list(sources)}, or None"
        )
    unknown = [name for name in weights if name not in sources]
    if unknown:
        raise ValueError(f"{who} returned weights for unknown sources {unknown}; the sources are {list(sources)}")
    exact = []
    for name in sources:
        value = weights.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
            try:
                value = float(value)  # numpy and torch scalars
            except (TypeError, ValueError):
                raise ValueError(
                    f"{who} returned weight {value!r} for source {name!r}: weights are numbers >= 0"
                ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{who} returned weight {value!r} for source {name!r}: weights are finite numbers >= 0")
        if value < 0:
            raise ValueError(f"{who} returned weight {value!r} for source {name!r}: weights are numbers >= 0")
        exact.append(Fraction(value))
    if not any(exact):
        raise ValueError(f"{who} returned all-zero weights {dict(weights)!r}: at least one source needs a weight > 0")
    return exact


def quantised(weights: Sequence[Fraction | float], floor: Fraction = Fraction(0)) -> tuple[Fraction, ...]:
    """Normalised shares as multiples of ``1 / DENOMINATOR`` summing to exactly 1 (largest remainder, ties to the
    earlier source); every positive weight keeps at least ``max(floor, 1 / DENOMINATOR)``, taken from the largest.

    Args:
        weights: non-negative weights, at least one positive.
        floor: the least share a source with a positive weight keeps (e.g. ``1 / G``: one row per step).
    """
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    scaled = [w / total * DENOMINATOR for w in exact]
    units = [math.floor(s) for s in scaled]
    order = sorted(range(len(units)), key=lambda i: (-(scaled[i] - units[i]), i))
    for i in order[: DENOMINATOR - sum(units)]:
        units[i] += 1
    least = max(1, math.ceil(floor * DENOMINATOR))
    positive = [i for i, w in enumerate(exact) if w > 0]
    if least * len(positive) <= DENOMINATOR:
        raised = [i for i in positive if units[i] < least]
        excess = sum(least - units[i] for i in raised)
        for i in raised:
            units[i] = least
        # Taken from the largest shares first (ties: the later source), never below the floor.
        for j in sorted(positive, key=lambda j: (-units[j], -j)):
            take = min(excess, units[j] - least)
            units[j] -= take
            excess -= take
    return tuple(Fraction(u, DENOMINATOR) for u in units)


class LossProportional:
    """Shares towards the sources with the higher training loss: ``(1 − ε)·softmax(L̃ / T) + ε·prior``.

    Args:
        every: optimizer steps between updates.
        temperature: T > 0; higher is gentler (equal losses give exactly the prior).
        smoothing: ε in [0, 1], the prior's part, which keeps every source trained (and so observed).
        ema: β in [0, 1): ``L̃ ← β·L̃ + (1 − β)·L`` across windows (0: the window's mean alone).
        prior: the weights mixed in, ``{source: weight}`` (``None``: equal).
        warmup: updates before this global step return ``None`` (scores are still tracked).
        use_validation: score on the latest validation loss where a source has one, else its training loss.

    Raises:
        ValueError: a setting out of its range.
    """

    def __init__(self, every: int = 10, temperature: float = 1.0, smoothing: float = 0.1, ema: float = 0.0,
                 prior: dict[str, float] | None = None, warmup: int = 0, use_validation: bool = False):  # fmt: skip
        name = type(self).__name__
        self.every = _positive_int("every", every, name)
        self.temperature = _in_range("temperature", temperature, name, low=0, low_open=True)
        self.smoothing = _in_range("smoothing", smoothing, name, low=0, high=1)
        self.ema = _in_range("ema", ema, name, low=0, high=1, high_open=True)
        self.prior = _prior(prior, name)
        self.warmup = _non_negative_int("warmup", warmup, name)
        self.use_validation = bool(use_validation)
        self.scores: dict[str, float] = {}

    def update(self, step: int, stats: Mapping[str, SourceStats]) -> Mapping[str, float] | None:
        names = list(stats)
        for name in names:
            loss = _loss(stats[name], self.use_validation)
            if loss is not None:  # a source without tokens keeps its previous score
                old = self.scores.get(name)
                self.scores[name] = loss if old is None else self.ema * old + (1 - self.ema) * loss
        if step < self.warmup or not self.scores:
            return None
        known = [self.scores[n] for n in names if n in self.scores]
        fill = sum(known) / len(known)  # a source never observed scores the mean of the others
        scores = [self.scores.get(n, fill) / self.temperature for n in names]
        top = max(scores)
        exps = [math.exp(s - top) for s in scores]
        prior = _prior_of(self.prior, names)
        return {n: (1 - self.smoothing) * e / sum(exps) + self.smoothing * p for n, e, p in zip(names, exps, prior)}

    def state_dict(self) -> dict[str, Any]:
        return {"scores": dict(self.scores)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scores = {str(k): float(v) for k, v in state.get("scores", {}).items()}


class DoReMi:
    """Exponentiated excess loss over reference losses (DoReMi's group-DRO update, applied to sampling).

    Each update: ``λ_i = max(L̃_i − ref_i, 0)``, ``log α_i ← log α_i + η·λ_i``, normalised, then
    ``α ← (1 − c)·α + c/k``. α starts at the shares in force at the first update. ``average_weights`` is the mean of
    every α so far, the paper's output for a later run.

    Args:
        reference_losses: ``{source: loss}``, e.g. a reference run's per-source loss; every source needs one.
        every: optimizer steps between updates.
        step_size: η > 0.
        smoothing: c in [0, 1], the uniform part.
        ema: β in [0, 1) across windows (0: the window's mean alone).
        use_validation: score on the latest validation loss where a source has one.

    Raises:
        ValueError: a setting out of its range, or a reference loss that is no finite number.
    """

    def __init__(self, reference_losses: dict[str, float], every: int = 10, step_size: float = 1.0,
                 smoothing: float = 1e-3, ema: float = 0.0, use_validation: bool = False):  # fmt: skip
        name = type(self).__name__
        if not isinstance(reference_losses, Mapping) or not reference_losses:
            raise ValueError(f"{name}(reference_losses={reference_losses!r}): give {{source: loss}} for every source")
        self.reference_losses = {
            str(k): _finite(f"reference_losses[{k!r}]", v, name) for k, v in reference_losses.items()
        }
        self.every = _positive_int("every", every, name)
        self.step_size = _in_range("step_size", step_size, name, low=0, low_open=True)
        self.smoothing = _in_range("smoothing", smoothing, name, low=0, high=1)
        self.ema = _in_range("ema", ema, name, low=0, high=1, high_open=True)
        self.use_validation = bool(use_validation)
        self.weights: dict[str, float] = {}
        self.scores: dict[str, float] = {}
        self.weight_sums: dict[str, float] = {}
        self.updates = 0

    def update(self, step: int, stats: Mapping[str, SourceStats]) -> Mapping[str, float] | None:
        names = list(stats)
        missing = [n for n in names if n not in self.reference_losses]
        if missing:
            raise ValueError(
                f"DoReMi at update step {step}: no reference loss for sources {missing} (reference_losses names "
                f"{sorted(self.reference_losses)})"
            )
        if not self.weights:
            self.weights = {n: stats[n].weight for n in names}
        for n in names:
            loss = _loss(stats[n], self.use_validation)
            if loss is not None:  # no tokens: the previous score stands
                old = self.scores.get(n)
                self.scores[n] = loss if old is None else self.ema * old + (1 - self.ema) * loss
        logs = []
        for n in names:
            excess = max(self.scores.get(n, self.reference_losses[n]) - self.reference_losses[n], 0.0)
            logs.append(math.log(max(self.weights[n], 1e-300)) + self.step_size * excess)
        top = max(logs)
        exps = [math.exp(v - top) for v in logs]
        k = len(names)
        self.weights = {n: (1 - self.smoothing) * e / sum(exps) + self.smoothing / k for n, e in zip(names, exps)}
        self.updates += 1
        for n in names:
            self.weight_sums[n] = self.weight_sums.get(n, 0.0) + self.weights[n]
        return dict(self.weights)

    @property
    def average_weights(self) -> dict[str, float]:
        """The mean of every update's weights (DoReMi's ᾱ)."""
        return {n: s / self.updates for n, s in self.weight_sums.items()} if self.updates else {}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self.weights), "scores": dict(self.scores), "weight_sums": dict(self.weight_sums),
                "updates": self.updates}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = {str(k): float(v) for k, v in state.get("weights", {}).items()}
        self.scores = {str(k): float(v) for k, v in state.get("scores", {}).items()}
        self.weight_sums = {str(k): float(v) for k, v in state.get("weight_sums", {}).items()}
        self.updates = int(state.get("updates", 0))


class WeightsFile:
    """Weights a person edits during the run: ``{source: weight}`` in a JSON or YAML file, read at each update.

    A missing file, or one whose weights equal the last applied, keeps the shares (``None``); new weights are
    returned once. Weights are validated as any controller's (a bad edit stops the run with one error naming the file
    and the update step).

    Args:
        path: the file (``.json``, else YAML, a superset of JSON).
        every: optimizer steps between reads.

    Raises:
        ValueError: ``every`` not a positive integer.
    """

    def __init__(self, path: str, every: int = 10):
        self.path = os.fspath(path)
        self.every = _positive_int("every", every, type(self).__name__)
        self.applied: dict[str, float] | None = None

    def update(self, step: int, stats: Mapping[str, SourceStats]) -> Mapping[str, float] | None:
        try:
            with open(self.path, encoding="utf-8") as file:
                text = file.read()
        except FileNotFoundError:
            return None
        try:
            if self.path.endswith(".json"):
                weights = json.loads(text)
            else:
                import yaml

                weights = yaml.safe_load(text)
        except Exception as error:  # json's and yaml's own errors (yaml's is no ValueError)
            raise ValueError(f"WeightsFile {self.path!r} at update step {step}: cannot parse it ({error})") from error
        if not isinstance(weights, Mapping):
            raise ValueError(
                f"WeightsFile {self.path!r} at update step {step} holds {weights!r}: write a mapping {{source: weight}}"
            )
        weights = dict(weights)
        if weights == self.applied:
            return None
        checked_weights(step, weights, list(stats), self)  # a bad edit is named with the file before it is applied
        self.applied = weights
        return weights

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        applied = state.get("applied")
        self.applied = dict(applied) if applied is not None else None


# ---------------------------------------------------------------------------------------------------- helpers
def _loss(stat: SourceStats, use_validation: bool) -> float | None:
    if use_validation and stat.val_loss is not None:
        return stat.val_loss
    return stat.mean_loss


def _prior(prior: Any, who: str) -> dict[str, float] | None:
    if prior is None:
        return None
    if not isinstance(prior, Mapping) or not prior:
        raise ValueError(f"{who}(prior={prior!r}): give {{source: weight >= 0}} or None (equal)")
    checked = {str(k): _finite(f"prior[{k!r}]", v, who) for k, v in prior.items()}
    if any(v < 0 for v in checked.values()) or not any(checked.values()):
        raise ValueError(f"{who}(prior={prior!r}): weights are numbers >= 0, at least one > 0")
    return checked


def _prior_of(prior: dict[str, float] | None, names: Sequence[str]) -> list[float]:
    if prior is None:
        return [1 / len(names)] * len(names)
    values = [prior.get(n, 0.0) for n in names]
    total = sum(values)
    if not total:
        raise ValueError(f"prior {prior!r} gives every source of {list(names)} weight 0")
    return [v / total for v in values]


def _positive_int(name: str, value: Any, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}({name}={value!r}): {name} must be an integer >= 1")
    return value


def _non_negative_int(name: str, value: Any, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}({name}={value!r}): {name} must be an integer >= 0")
    return value


def _finite(name: str, value: Any, who: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{who}: {name} = {value!r} must be a finite number")
    return float(value)


def _in_range(name: str, value: Any, who: str, low: float, high: float = math.inf, low_open: bool = False,
              high_open: bool = False) -> float:  # fmt: skip
    value = _finite(name, value, who)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{who}({name}={value!r}): {name} must be in {left}{low}, {high}{right}")
    return value
