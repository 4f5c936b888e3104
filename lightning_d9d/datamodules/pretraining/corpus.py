"""The corpus, a part of PretrainingDataModule: how its sources are read (tokenizer, storage, token cache), what
``setup`` read of them (the training corpus, the validation specs) and how long one pass is.

An epoch is one pass over the training sources unless ``steps_per_epoch`` is given, and validation one pass unless
``val_steps`` is. A pass is counted from the token cache where it holds the units and estimated from a sample
elsewhere (``streaming/streams/estimate.py``), only where a length is not given, and then on rank 0 of a Trainer's
processes alone: every process takes rank 0's answer, so a cache that another run fills meanwhile cannot give
processes different epochs. The epoch length trained is the run plan's state (``plan.py``): a resume keeps it, so
epochs stay where they were when the cache has been filled since. Validation keeps the sampled estimate (made once
and kept in the cache), so every run validates on the same microbatches. The corpus saves nothing in a checkpoint:
footers are scanned again at every ``setup``, and the fingerprint says whether they are the checkpoint's.

Trade-off: the other processes wait for rank 0's count at setup instead of counting themselves.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer

from lightning_d9d.datamodules.pretraining.mixture import Sources
from lightning_d9d.datamodules.pretraining.specs import PretrainingCorpus, TrainCorpus
from lightning_d9d.streaming.plans.spec import MixtureSpec, StreamSettings
from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.streams.estimate import PassSample, stored_sample
from lightning_d9d.tokenization.backends import AUTO, TokenizerBackendError, backend_names

T = TypeVar("T")


class Corpus:
    """The sources of a PretrainingDataModule, how they are read, and what ``setup`` read of them.

    Args:
        sources: the parsed training and validation sources.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``.
        bos_token: prepended to every document.
        storage: filesystem options and read retries.
        text_column: the column (JSONL: the field) holding the documents.
        token_cache: the token cache's folder or URL (``None``: none).
        on_malformed: a malformed JSONL line: ``"error"`` or ``"skip"``.
        allow_shared_files: accept a file two sources hold.
        val_steps: validation microbatches per rank asked (``None``: one pass).
        tokenizer_backend: what encodes the documents (``"auto"``, ``"tokenizers"`` or a fast backend by name).
    """

    def __init__(
        self,
        sources: Sources,
        tokenizer: str | os.PathLike | Tokenizer,
        bos_token: str,
        storage: Storage,
        text_column: str,
        token_cache: str | None,
        on_malformed: str,
        allow_shared_files: bool,
        val_steps: int | None,
        tokenizer_backend: str = AUTO,
    ):
        self.sources, self.tokenizer, self.bos_token, self.storage = sources, tokenizer, bos_token, storage
        self.text_column = text_column
        self.token_cache, self.on_malformed, self.allow_shared_files = token_cache, on_malformed, allow_shared_files
        self.val_steps_asked, self.tokenizer_backend = val_steps, tokenizer_backend
        self.backend_in_use: tuple[str, str] | None = None  # (backend, why), known after setup
        self.train: TrainCorpus | None = None  # the training side read at the last setup that read it
        self.val_specs: Sequence[MixtureSpec] = ()  # one per validation source
        self.val_steps_per_source: Sequence[int] = ()

    def reader(self, settings: StreamSettings) -> PretrainingCorpus:
        """The loaded tokenizer and ``settings``, which turn sources into specs.

        Raises:
            ValueError: the tokenizer lacks ``bos_token``; ``token_cache`` is a file or lies inside one.
            TokenizerBackendError: a named tokenizer backend unknown, not installed or unable to serve the tokenizer.
        """
        return PretrainingCorpus(settings, self.tokenizer, self.bos_token, self.storage, self.token_cache,
                                 self.on_malformed, self.tokenizer_backend)  # fmt: skip

    def say_backend(self, reader: PretrainingCorpus) -> None:
        """Say (rank 0, once per change) which backend ``reader`` resolved for the documents."""
        if reader.backend is not None and reader.backend != self.backend_in_use:
            self.backend_in_use = reader.backend
            rank_zero_info(f"lightning-d9d: tokenizer backend {reader.backend[0]} ({reader.backend[1]})")

    def read_train(self, reader: PretrainingCorpus) -> TrainCorpus:
        """Read the training sources' footers.

        Raises:
            ValueError: missing, shared or bad files, no text, or too few rows for K streams.
            StorageError: a URL could not be listed or opened.
        """
        sources = self.sources
        self.train = reader.train(sources.train, sources.schedule, sources.mixture, self.allow_shared_files)
        return self.train

    def read_validation(self, reader: PretrainingCorpus, val_seq_len: int | None) -> list[MixtureSpec] | None:
        """The validation specs, read where there are validation sources and none were read yet."""
        if self.sources.validation is None or self.val_specs:
            return None
        return reader.validation(
            self.sources.validation, self.sources.validation_by_source, self.allow_shared_files, val_seq_len
        )

    def size_epochs(
        self,
        trainer: Any,
        train: TrainCorpus | None,
        val_specs: list[MixtureSpec] | None,
        microbatch_rows: int,
        steps_per_epoch: int | None,
    ) -> int | None:
        """One pass's optimizer steps over ``train`` (``None`` without it), and the validation steps of
        ``val_specs``, where not given: decided on rank 0 (a token cache another run fills meanwhile could give
        processes different counts) and taken by every process.

        Args:
            microbatch_rows: rows of one microbatch over every replica (``D·m``); a validation pass is shared by
                the replicas, at least one microbatch each.
            steps_per_epoch: the epoch length asked (``None``: one pass's).
        """
        count_train = train is not None and steps_per_epoch is None
        count_val = val_specs is not None and self.val_steps_asked is None

        def decide() -> tuple[dict[str, PassSample] | None, int | None, list[float] | None]:
            steps = train.steps_per_pass() if count_train else None  # type: ignore[union-attr]
            val_rows = [_val_rows(spec) for spec in val_specs] if count_val else None  # type: ignore[union-attr]
            return (train.counts if count_train else None), steps, val_rows  # type: ignore[union-attr]

        counts, steps, val_rows = on_rank_zero(trainer, decide) if count_train or count_val else (None,) * 3
        if train is not None and counts is not None:
            train.use_counts(counts)  # rank 0's, on every process
        if val_specs is not None:
            rows = val_rows if val_rows is not None else [0.0] * len(val_specs)
            self.val_steps_per_source = [
                self.val_steps_asked or max(1, int(pass_rows // microbatch_rows)) for pass_rows in rows
            ]
            self.val_specs = val_specs
        return None if train is None else steps_per_epoch or steps

    def sampled_steps_per_pass(self) -> int:
        """One pass's steps by the sampled estimate alone, whatever the token cache counts: how epochs were sized
        before counts were taken from the cache (a saved state without its epoch length had that one)."""
        if self.train is None:
            raise RuntimeError("call dm.setup('fit') first (Trainer.fit does it)")
        return self.train.sampled().steps_per_pass()

    @property
    def source_pass_rows(self) -> Mapping[str, float]:
        """Rows of one pass over each training source, counted from the token cache where it holds the units, else
        estimated; counted when first asked (where ``steps_per_epoch`` is given, setup counts nothing)."""
        return MappingProxyType(self.train.source_pass_rows() if self.train is not None else {})

    def source_pass_rows_at(self, step: int) -> dict[str, float]:
        """Rows of one pass over each training source at the row length of step ``step`` (longer rows: fewer)."""
        return self.train.source_pass_rows(step) if self.train is not None else {}

    def source_pass_tokens(self) -> dict[str, float]:
        """One pass's document tokens per training source (counted from the token cache where it holds the units,
        else estimated)."""
        return {name: sample.tokens for name, sample in self.train.counts.items()} if self.train is not None else {}

    @property
    def estimated_pass_tokens(self) -> float | None:
        """One pass's tokens over every training source (exact where the token cache holds every unit), counted when
        first asked; ``None`` before ``setup``."""
        return self.train.pass_tokens if self.train is not None else None


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


def check_backend(tokenizer_backend: Any) -> None:
    """Raises ``TokenizerBackendError`` (a ``ValueError``) for a name that is no tokenizer backend."""
    if tokenizer_backend not in backend_names():
        raise TokenizerBackendError(
            f"tokenizer_backend={tokenizer_backend!r} is not a tokenizer backend: pass one of {backend_names()}"
        )


def reading_arguments(text_column: Any, token_cache: Any, on_malformed: Any) -> tuple[str, str | None, str]:
    """``text_column``, ``token_cache`` (as a string) and ``on_malformed``, checked.

    Raises:
        ValueError: an empty or non-string column, a ``token_cache`` that is no folder or URL, an ``on_malformed``
            other than ``"error"`` or ``"skip"``.
    """
    if not isinstance(text_column, str) or not text_column:
        raise ValueError(f"text_column must be a non-empty column name, got {text_column!r}")
    if token_cache is not None and (not isinstance(token_cache, (str, os.PathLike)) or not os.fspath(token_cache)):
        raise ValueError(f"token_cache must be a folder or URL (or None: no cache), got {token_cache!r}")
    if on_malformed not in ("error", "skip"):
        raise ValueError(f"on_malformed must be 'error' or 'skip', got {on_malformed!r}")
    return text_column, None if token_cache is None else os.fspath(token_cache), on_malformed


def storage_of(storage_options: dict[str, Any] | None, read_retry_seconds: float) -> Storage:
    """The checked storage settings.

    Raises:
        ValueError: ``storage_options`` not a dict, or ``read_retry_seconds`` not a number >= 0.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ValueError(f"storage_options must be a dict of filesystem options, got {storage_options!r}")
    seconds = read_retry_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"read_retry_seconds must be a number of seconds >= 0, got {read_retry_seconds!r}")
    return Storage(dict(storage_options or {}), float(seconds))
