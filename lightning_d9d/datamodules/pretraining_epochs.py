"""How long a PretrainingDataModule's epochs are: one pass over the training sources unless ``steps_per_epoch`` is
given, and the validation steps unless ``val_steps`` is.

A pass is counted from the token cache where it holds the units and estimated from a sample elsewhere
(``streaming/streams/estimate.py``), only where a length is not given, and then on rank 0 of a Trainer's processes
alone: every process takes rank 0's answer, so a cache that another run fills meanwhile cannot give processes different
epochs. The epoch length is saved with the data state, and a resume without ``steps_per_epoch`` keeps it, so
epochs stay where they were when the cache has been filled since. Validation keeps the sampled estimate (made once
and kept in the cache), so every run validates on the same microbatches. Trade-off: the other processes wait for
rank 0's count at setup instead of counting themselves.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.pretraining_corpus import TrainCorpus
from lightning_d9d.streaming.plans.spec import CorpusFingerprint, MixtureSpec
from lightning_d9d.streaming.streams.estimate import PassSample, stored_sample

T = TypeVar("T")


class PretrainingEpochs:
    """The epoch lengths of a PretrainingDataModule: sized at ``setup``, saved and kept by a resume."""

    _steps_per_epoch_arg: int | None
    _val_steps_arg: int | None
    steps_per_epoch: int | None
    fingerprint: CorpusFingerprint | None
    microbatch_size: int
    val_specs: Any
    val_steps_per_source: Any
    _layouts: dict
    _train: TrainCorpus | None = None

    def _size_epochs(self, train: TrainCorpus | None, val_specs: list[MixtureSpec] | None) -> None:
        """``steps_per_epoch`` and the validation steps, where not given: one pass's, decided on rank 0 (a token cache
        another run fills meanwhile could give processes different counts) and taken by every process."""
        count_train = train is not None and self._steps_per_epoch_arg is None
        count_val = val_specs is not None and self._val_steps_arg is None

        def decide() -> tuple[dict[str, PassSample] | None, int | None, list[float] | None]:
            steps = train.steps_per_pass() if count_train else None  # type: ignore[union-attr]
            val_rows = [_val_rows(spec) for spec in val_specs] if count_val else None  # type: ignore[union-attr]
            return (train.counts if count_train else None), steps, val_rows  # type: ignore[union-attr]

        counts, steps, val_rows = on_rank_zero(self._trainer, decide) if count_train or count_val else (None,) * 3
        if train is not None:
            if counts is not None:
                train.use_counts(counts)  # rank 0's, on every process
            self.steps_per_epoch = self._steps_per_epoch_arg or steps
        if val_specs is not None:
            unit = self.dp_size * self.microbatch_size  # one pass shared by the replicas, at least one microbatch
            rows = val_rows if val_rows is not None else [0.0] * len(val_specs)
            self.val_steps_per_source = [self._val_steps_arg or max(1, int(pass_rows // unit)) for pass_rows in rows]
            self.val_specs = val_specs

    @property
    def source_pass_rows(self) -> Mapping[str, float]:
        """Rows of one pass over each training source, counted from the token cache where it holds the units, else
        estimated; counted when first asked (where ``steps_per_epoch`` is given, setup counts nothing)."""
        return MappingProxyType(self._train.source_pass_rows() if self._train is not None else {})

    def source_pass_rows_at(self, step: int) -> dict[str, float]:
        """Rows of one pass over each training source at the row length of step ``step`` (longer rows: fewer)."""
        return self._train.source_pass_rows(step) if self._train is not None else {}

    def source_pass_tokens(self) -> dict[str, float]:
        """One pass's document tokens per training source (counted from the token cache where it holds the units,
        else estimated)."""
        return {name: sample.tokens for name, sample in self._train.counts.items()} if self._train is not None else {}

    @property
    def estimated_pass_tokens(self) -> float | None:
        """One pass's tokens over every training source (exact where the token cache holds every unit), counted when
        first asked; ``None`` before ``setup``."""
        return self._train.pass_tokens if self._train is not None else None

    def extra_state(self) -> dict[str, Any]:
        """The streams' and edits' state, and the epoch length, which a resume keeps unless ``steps_per_epoch`` is
        given (a token cache filled since could otherwise count another one)."""
        return {**super().extra_state(), "steps_per_epoch": int(self.steps_per_epoch or 0)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's position, in its epochs: without ``steps_per_epoch``, the saved epoch length.

        Raises:
            ValueError: as ``SteppedDataModule.load_state_dict``; a saved epoch length that is no positive number.
        """
        self._keep_epoch_length(state_dict)
        super().load_state_dict(state_dict)

    def _keep_epoch_length(self, state: Any) -> None:
        """Take the checkpoint's epoch length where this run counted its own and the data is the checkpoint's (a
        state written before epoch lengths were saved had the sampled estimate's)."""
        if self._steps_per_epoch_arg is not None or self._train is None or not self.restores_training_position():
            return
        try:
            if self.fingerprint is None or self.fingerprint.mismatches(dict(state["fingerprint"])):
                return  # another run's data: this run's epochs (a malformed state is named by the resume itself)
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        saved = state.get("steps_per_epoch")
        if saved is None:
            saved = self._train.sampled().steps_per_pass()
        if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
            raise InvalidDataState("steps_per_epoch", saved, "a whole number of optimizer steps >= 1")
        if saved != self.steps_per_epoch:
            self.steps_per_epoch, self._layouts = saved, {}


def _val_rows(spec: MixtureSpec) -> float:
    """Rows of one pass over a validation source: the sampled estimate (made once per files and kept in the token
    cache), never the cache's count, so every run validates on the same microbatches whatever the cache holds."""
    source = spec.sources[0]
    return stored_sample(source).rows(source, source.capacity_at(0))


def on_rank_zero(trainer: Any, decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0 of a Trainer's processes, broadcast to all (in one process, or without a Trainer, run
    here); an exception on rank 0 is raised on every process."""
    if trainer is None or trainer.world_size <= 1:
        return decide()
    if trainer.global_rank != 0:
        done, value = trainer.strategy.broadcast(None, src=0)
        if not done:
            raise value
        return value
    try:
        value = decide()
    except Exception as error:
        trainer.strategy.broadcast((False, _sendable(error)), src=0)
        raise
    trainer.strategy.broadcast((True, value), src=0)
    return value


def _sendable(error: Exception) -> Exception:
    """``error``, or where it cannot be pickled, a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
