"""PretrainingDataModule: parquet → tokens → packed rows, streamed, the same global batches on any GPU count.

Pipeline: ``streaming.source`` (files → row groups → units, each pass's units dealt to K streams) →
``streaming.stream`` (per stream: reader → tokenizing prefetch → packing) → ``streaming.loader`` (the streams a
rank owns, in DataLoader workers; step ``s`` is rows ``[s·G/K, (s+1)·G/K)`` of every stream) → pin → transfer.

Topology independence: the K streams are functions of the data and the settings only, and a step takes the
same rows from each, so the rows of global step ``s`` — as a multiset over ranks and microbatches — do not
depend on the world size, ``num_workers`` or ``microbatch_size``; one process and eight train the same global
batches. Valid layouts: the world size divides K, ``num_workers`` divides K / world size, K divides G (see
``streaming.loader.check_layout``); the default K = 16 serves 1, 2, 4 and 8 ranks with 2 workers each.

Epochs: the streams never end (each cycles through passes, reshuffled every pass), so an epoch is a *count*:
``steps_per_epoch`` optimizer steps, i.e. ``steps_per_epoch * M`` microbatches on every rank (M = G / (W·m)), so
no DDP hang is possible from uneven data. The default ``steps_per_epoch`` is one pass's worth, *estimated* from
the parquet footers and a tokenized sample (``streaming.estimate``), not counted.

Resume: ``state_dict`` holds every stream's state at the last optimizer-step boundary (gathered from all ranks
with ``all_gather_object``, because Lightning saves only rank 0's checkpoint and every rank loads it) and the
fingerprint of everything that decides the rows; any layout valid for K restores it, each rank taking the
streams it now owns. Lightning's own restored batch counters are aligned to that step (``SteppedDataModule``).

Mixtures: ``train_files={name: files}`` with ``weights`` makes each of the K streams a mixture stream
(``streaming.mixture_stream``) taking every step exactly the rows ``streaming.mixture`` plans per source; the
sources, their fingerprint and the plan on resume are ``datamodules.pretraining_mixture``'s.

Parts: the corpus (files scanned per source, the stream specs, the fingerprint, the pass estimate) is
``datamodules.pretraining_corpus``'s, the streams' saved state ``datamodules.pretraining_state``'s, the reports on
sources and streams ``datamodules.pretraining_reports``'s; the class holds the topology, the loaders and the
resume contract.

Trade-off: a larger K serves more layouts but holds K best-fit buffers and starts K streams after every resume;
and a stream is a sequence, so a step's rows come from K places of the corpus rather than from a global shuffle.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from tokenizers import Tokenizer

from lightning_d9d.checks import microbatches_per_step, non_negative_int, positive_int
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.pretraining_corpus import PretrainingCorpus
from lightning_d9d.datamodules.pretraining_mixture import OnMixtureChange, mixture_arguments, say_unvalidated_sources
from lightning_d9d.datamodules.pretraining_reports import PretrainingReports
from lightning_d9d.datamodules.pretraining_state import STATE_VERSION, restored_streams, saved_streams
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.streaming.estimate import estimate_pass
from lightning_d9d.streaming.loader import (
    StreamPosition,
    TokenTrainLoader,
    TokenValidationLoader,
    check_layout,
    rank_streams,
)
from lightning_d9d.streaming.packing import RowBlock
from lightning_d9d.streaming.reader import DEFAULT_MAX_DOCUMENT_CHARS
from lightning_d9d.streaming.spec import CorpusFingerprint, MixtureSpec, StreamSettings
from lightning_d9d.streaming.storage import DEFAULT_READ_RETRY_SECONDS, Storage
from lightning_d9d.tokens import cu_seqlens_of

__all__ = ["STATE_VERSION", "PretrainingBatch", "PretrainingDataModule", "storage_of"]

DEFAULT_NUM_STREAMS = 16


@dataclass
class PretrainingBatch:
    """One microbatch of packed rows.

    Attributes:
        input_ids: ``(microbatch_size, seq_len)`` int64 token ids.
        targets: ``(microbatch_size, seq_len)`` int64: the next token of each input (already shifted); ``-100``
            (PyTorch's ``ignore_index``) where there is none (``bestfit_split``: padding, and where a continuation
            chunk follows another document). ``bestfit_split``'s padding inputs are the tokenizer's pad token (or
            a usual pad token, else any id but BOS).
        position_ids: ``(microbatch_size, seq_len)`` int64: 0 at every row start and every document start
            (BOS), and, for ``bestfit_split``, at every chunk start and every padding run, counting up from there.
        sources: ``(microbatch_size,)`` int64: the index of each row's source in ``dm.source_names`` (all 0 for
            a single corpus); in a validation batch, its loader's index in ``dm.val_source_names``.
        cu_seqlens: int32 offsets of every sequence (a row start, a document, a chunk or a padding run: where
            ``position_ids`` is 0) in the flattened microbatch, with its total length last (flash-attention's
            varlen convention).
        max_seqlen: the longest of those sequences.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    sources: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    def __len__(self) -> int:
        return len(self.input_ids)


def make_batch(rows: RowBlock, spec: MixtureSpec, pin: bool, source: int | None = None) -> PretrainingBatch:
    """The ``PretrainingBatch`` of a microbatch's rows (pinned with ``pin``); ``source``, where given, is the
    index a validation loader of one source gives all its rows."""
    input_ids, targets, positions = spec.packing.tensors(rows, spec.bos_id)
    if source is None:
        sources = torch.from_numpy(np.asarray(rows.sources, np.int64))
    else:
        sources = torch.full((len(rows),), source, dtype=torch.int64)
    batch = PretrainingBatch(input_ids, targets, positions, sources, *cu_seqlens_of(positions))
    return pin_batch(batch) if pin else batch


class _Setting:
    """A DataModule attribute that is one of its stream settings (read-only: the settings are checked once)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.settings, self.name)


class PretrainingDataModule(PretrainingReports, SteppedDataModule):
    """Stream parquet text into packed token rows for ``Trainer.fit``: the same global batches on any GPU count.

    Args:
        train_files: a directory, a glob, a file, a ``s3://``/``gs://``/``file://`` (or any fsspec) URL of
            those, or a list of them; or a weighted mixture: a mapping ``{name: files}`` or
            ``{name: {"files": files, "text_column": column}}`` (see ``weights``).
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``. Documents are encoded without its
            post-processor's special tokens, truncation or padding: each document is ``bos_token`` + its tokens.
        seq_len: tokens per row of ``inputs`` (each row is cut from ``seq_len + 1`` tokens).
        global_batch_size: rows per optimizer step, summed over ranks and accumulation (G).
        microbatch_size: rows per forward/backward on one rank (m).
        val_files: optional validation files (same forms), read in file order from the start on every run; a
            mapping ``{name: files}`` gives one validation loader per source, in its order (Lightning's
            ``dataloader_idx``; ``dm.val_source_names``); beside a mixture, a name is a training source's.
        text_column: the column holding the documents.
        bos_token: the token prepended to every document; it must be in the tokenizer's vocabulary.
        packing: ``"bestfit"`` (every row starts at BOS; a document that does not fit is cropped, its rest
            dropped), ``"bestfit_split"`` (documents longer than a row are split into row-sized chunks, nothing
            fitting a row is ever cut, gaps are padded) or ``"concat"`` (one token stream cut into rows).
        steps_per_epoch: optimizer steps per Lightning epoch; ``None``: one pass's worth, estimated.
        val_steps: validation microbatches per rank per validation run; ``None``: one pass's worth, estimated.
        num_streams: K, the streams the corpus is dealt to; the rows of every step are a function of K and the
            data, whatever the world size, ``num_workers`` or ``microbatch_size``. The world size must divide K,
            ``num_workers`` must divide K / world size, and K must divide ``global_batch_size``.
        num_workers: DataLoader worker processes per rank; each tokenizes on one core and hosts K / (world size
            · num_workers) streams. 0 runs the rank's streams in the training process, whose tokenizer then uses
            every core.
        tokenizer_batch_size: documents per ``encode_batch_fast`` call, at most (a worker's call also ends at
            ``streaming.loader.WORKER_CHUNK_CHARS`` characters of text). It does not change the rows.
        seed: seeds the unit order of every pass.
        max_document_chars: a document longer than this many characters is skipped (never read into a Python
            string, tokenized or packed), counted in ``stream_stats()["too_long"]`` and named (file, row group,
            row, length) in one warning per process, so that memory stays bounded by the settings whatever the
            data (docs/streaming.md). The default, 64 Mi, is far beyond natural documents; ``None``: no limit.
            It changes the rows, so a resume needs the same value (checkpoints from before it match the default
            and ``None``).
        bestfit_buffer_size: documents (``bestfit``) or pieces (``bestfit_split``) best-fit chooses from.
        pin_memory: ``None`` pins exactly when the trainer's device is CUDA; ``True``/``False`` force it.
        on_order_mismatch: resuming from a checkpoint of other data or settings: ``"raise"``, or
            ``"restart_epoch"`` to start that epoch over with fresh streams.
        storage_options: options for the filesystem of every URL in ``train_files``/``val_files``, in fsspec's
            convention (for ``s3://``: ``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs``, or
            pyarrow's ``endpoint_override``, ``scheme``, ``region``, ...; see docs/object_storage.md). Options in
            a URL's query win over them; the AWS environment and config files fill in what neither gives. They
            decide no row, so a resume may reach the same files through other options.
        read_retry_seconds: how long a read keeps retrying transient storage failures (refused or reset
            connections, timeouts, HTTP 5xx, throttling) before the run fails with an error naming the file, the
            row group and the last cause.
        weights: a mixture's shares of every step's rows: ``{name: weight}`` (non-negative, normalised; ``None``:
            equal), or phases ``[[from_step, {name: weight}], ...]``, the first from step 0, piecewise constant
            in the global step. Every step takes exactly the planned rows of each source, cumulatively within one
            row of ``global_batch_size × Σ shares`` (after a paused source, see ``streaming.mixture``).
        on_mixture_change: resuming a mixture under other weights or sources: ``"raise"`` (one error naming the
            old and new shares), or ``"continue"``: every source continues where it stopped under the new
            shares (a source added starts fresh).
        allow_shared_files: accept a file that two sources of ``train_files`` (or of ``val_files``) hold; else it
            is refused, naming both and the file: each source reads it, so its documents would be read twice a pass.

    Raises:
        ValueError: at construction, a size ≤ 0, an unknown packing or ``val_files`` name, G not divisible by m or
            by K; in ``setup``, no file matches, a file two sources hold, a file not parquet or without the column,
            no text, the tokenizer lacks the BOS token, a layout that cannot share K streams (naming K, the world
            size, ``num_workers`` and what would be valid), a dataset too small for one step, a text that is not
            valid UTF-8 (naming the file, row group and row; also when met later, while streaming).
        StorageError: in ``setup`` (an ``OSError``), a URL could not be listed or opened (unreachable endpoint,
            refused credentials, access denied), naming the URL and the cause; while streaming, a read that kept
            failing for ``read_retry_seconds``.
    """

    seq_len = _Setting("seq_len")
    global_batch_size = _Setting("global_batch_size")  # type: ignore[assignment]
    num_streams = _Setting("num_streams")
    seed = _Setting("seed")
    bestfit_buffer_size = _Setting("bestfit_buffer_size")
    max_document_chars = _Setting("max_document_chars")
    tokenizer_batch_size = _Setting("tokenizer_batch_size")
    train_spec: MixtureSpec | None = None  # set by setup, as the rest
    fingerprint: CorpusFingerprint | None = None
    steps_per_epoch: int | None = None  # type: ignore[assignment]
    estimated_pass_tokens: float | None = None

    def __init__(
        self,
        train_files: Mapping[str, Any] | str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: str | os.PathLike | Tokenizer,
        seq_len: PositiveInt = 1024,
        global_batch_size: PositiveInt = 64,
        microbatch_size: PositiveInt = 8,
        val_files: Mapping[str, Any] | str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        text_column: str = "text",
        bos_token: str = "<|bos|>",
        packing: Literal["bestfit", "bestfit_split", "concat"] = "bestfit",
        steps_per_epoch: PositiveInt | None = None,
        val_steps: PositiveInt | None = None,
        num_streams: PositiveInt = DEFAULT_NUM_STREAMS,
        num_workers: NonNegativeInt = 2,
        tokenizer_batch_size: PositiveInt = 128,
        seed: NonNegativeInt = 0,
        bestfit_buffer_size: PositiveInt = 1000,
        pin_memory: bool | None = None,
        on_order_mismatch: OnOrderMismatch = "raise",
        storage_options: dict[str, Any] | None = None,
        read_retry_seconds: float = DEFAULT_READ_RETRY_SECONDS,
        weights: dict[str, float] | list[tuple[int, dict[str, float]]] | list[dict[str, Any]] | None = None,
        on_mixture_change: OnMixtureChange = "raise",
        max_document_chars: PositiveInt | None = DEFAULT_MAX_DOCUMENT_CHARS,
        allow_shared_files: bool = False,
    ):
        super().__init__()
        self.settings = StreamSettings(
            seq_len=seq_len, global_batch_size=global_batch_size, packing=packing, seed=seed, num_streams=num_streams,
            bestfit_buffer_size=bestfit_buffer_size, max_document_chars=max_document_chars,
            tokenizer_batch_size=tokenizer_batch_size,
        )  # fmt: skip
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        microbatches_per_step(self.global_batch_size, 1, self.microbatch_size)  # G must be a multiple of m
        self._steps_per_epoch_arg = positive_int("steps_per_epoch", steps_per_epoch, allow_none=True)
        self._val_steps_arg = positive_int("val_steps", val_steps, allow_none=True)
        if not isinstance(text_column, str) or not text_column:
            raise ValueError(f"text_column must be a non-empty column name, got {text_column!r}")
        self.train_files, self.val_files, self.tokenizer = train_files, val_files, tokenizer
        self.text_column, self.bos_token = text_column, bos_token
        self.num_workers = non_negative_int("num_workers", num_workers)
        self.pin_memory, self.on_order_mismatch = pin_memory, on_order_mismatch
        self.storage = storage_of(storage_options, read_retry_seconds)
        self.on_mixture_change, self.weights, self.allow_shared_files = on_mixture_change, weights, allow_shared_files
        self.sources = mixture_arguments(
            train_files, val_files, text_column, weights, on_mixture_change, allow_shared_files
        )
        say_unvalidated_sources(self.sources)  # once: setup parses the same sources again
        self.yield_packs = False  # SteppedDataModule: one microbatch per batch, accumulation over M
        self.val_specs: list[MixtureSpec] = []  # one per validation source
        self.val_steps_per_source: list[int] = []
        self.source_pass_rows: dict[str, float] = {}  # estimated rows of one pass over each source
        self.position = StreamPosition()

    @property
    def packing(self) -> str:
        """The packing's name."""
        return self.settings.packing.name

    @property
    def owned_streams(self) -> list[int]:
        """The streams this rank reads (a contiguous block of K / world size)."""
        return rank_streams(self.num_streams, self.world_size, self.rank)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        """Resolve files, read footers, load the tokenizer, check the layout, size the epoch.

        Raises:
            ValueError: see the class docstring.
        """
        # Parsed again: a subclass may have resolved the file specs since construction (the demo's do).
        self.sources = mixture_arguments(
            self.train_files, self.val_files, self.text_column, self.weights, self.on_mixture_change,
            self.allow_shared_files,
        )  # fmt: skip
        corpus = PretrainingCorpus(self.settings, self.tokenizer, self.bos_token, self.storage)
        _ = self.microbatches_per_step  # raises early when G is not divisible by W·m
        check_layout(self.num_streams, self.world_size, self.num_workers)
        if self.train_spec is None or stage in (None, "fit"):
            sources = self.sources
            train = corpus.train(sources.train, sources.schedule, sources.mixture, self.allow_shared_files)
            self.train_spec, self.fingerprint = train.spec, train.spec.fingerprint()
            self.source_pass_rows, self.estimated_pass_tokens = train.source_pass_rows, train.pass_tokens
            self.steps_per_epoch = self._steps_per_epoch_arg or train.steps_per_pass()
        if self.sources.validation is not None and not self.val_specs:
            by_source = self.sources.validation_by_source
            self.val_specs = corpus.validation(self.sources.validation, by_source, self.allow_shared_files)
            self.val_steps_per_source = [self._val_steps_of(spec) for spec in self.val_specs]
        if stage in (None, "fit"):
            self.start_fit(
                StreamPosition(
                    microbatches_per_step=self.microbatches_per_step, generation=self.position.generation + 1
                )
            )

    @property
    def val_steps(self) -> int | None:
        """Validation microbatches per rank per run (of the first validation source; ``None`` without any)."""
        return self.val_steps_per_source[0] if self.val_steps_per_source else None

    def train_dataloader(self) -> TokenTrainLoader:
        """This rank's training loader: a sized iterable of ``PretrainingBatch`` (one epoch per iteration)."""
        spec = self._require(self.train_spec)
        per_step = self.microbatches_per_step
        loader = TokenTrainLoader(
            spec,
            self.owned_streams,
            self.num_workers,
            self.microbatch_size,
            self.steps_per_epoch * per_step,
            per_step,
            self.position,
            self.start_point,
            functools.partial(make_batch, spec=spec, pin=self.resolve_pin_memory()),
        )
        return self.track_loader(loader)

    def val_dataloader(self) -> TokenValidationLoader | list:
        """The same ``val_steps`` microbatches per rank on every validation run (``[]`` without val_files); a
        mapping ``val_files`` gives one loader per source, in its order."""
        loaders = [
            self.track_loader(TokenValidationLoader(
                spec, self.owned_streams, self.num_workers, self.microbatch_size, steps,
                functools.partial(make_batch, spec=spec, pin=self.resolve_pin_memory(), source=j),
            ), f"val/{j}")
            for j, (spec, steps) in enumerate(zip(self.val_specs, self.val_steps_per_source))
        ]  # fmt: skip
        return loaders if self.sources.validation_by_source else (loaders[0] if loaders else [])

    # ------------------------------------------------------------------ the resume contract
    def extra_state(self) -> dict[str, Any]:
        """Every stream's state at the last optimizer step (gathered from all ranks under DDP).

        Under DDP it gathers, because it runs on every rank while a checkpoint is saved but Lightning writes only
        rank 0's checkpoint, which every rank then loads.
        """
        _epoch, step = self.saved_position()
        states = self.position.committed_states(step)
        return saved_streams(states, self._require(self.train_spec), gather=self.world_size > 1)

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore the streams this rank owns to the checkpoint's last optimizer step (and the plan of the mix).

        Every stream state is validated against this run's data before anything runs from it.

        Raises:
            ValueError: an unknown state version, or a state that lacks a stream this rank owns.
            InvalidDataState: (a ValueError) a stream state with a missing, mistyped or out-of-range field,
                naming its path (``streams.<stream>.sources.<name>.packing.reader.slot``), its value and what is
                valid.
        """
        states = {}
        if state is not None:
            spec = self._require(self.train_spec)
            self.train_spec, states = restored_streams(state, spec, self.owned_streams, step, self.on_mixture_change)
        self.position.restart(epoch, step, states, self.microbatches_per_step)

    # ------------------------------------------------------------------ internals
    def _val_steps_of(self, spec: MixtureSpec) -> int:
        """``val_steps``, else one estimated pass over ``spec`` shared by the ranks (at least 1)."""
        if self._val_steps_arg is not None:
            return self._val_steps_arg
        _, rows = estimate_pass(spec.sources[0])
        return max(1, int(rows // (self.world_size * self.microbatch_size)))


def storage_of(storage_options: dict[str, Any] | None, read_retry_seconds: float) -> Storage:
    """The checked storage settings (options are checked again, per scheme, when a URL is opened).

    Raises:
        ValueError: ``storage_options`` not a dict, or ``read_retry_seconds`` not a number ≥ 0.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ValueError(f"storage_options must be a dict of filesystem options, got {storage_options!r}")
    seconds = read_retry_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"read_retry_seconds must be a number of seconds >= 0, got {read_retry_seconds!r}")
    return Storage(dict(storage_options or {}), float(seconds))
