"""PretrainingDataModule: parquet → tokens → packed rows, streamed, the same global batches on any GPU count.

The corpus is dealt to K streams (reader → tokenizing prefetch → packing); step ``s`` takes rows
``[s·G/K, (s+1)·G/K)`` of every stream, so a global step's rows never depend on the world size, workers or
microbatch size. Streams are dealt to data-parallel replicas, never end (an epoch is a step count, the same on every
rank), and ``state_dict`` holds every stream's state at the last step boundary, so any layout valid for K resumes.

Trade-off: a larger K serves more layouts but holds K best-fit buffers, and a step mixes K places of the corpus
rather than a global shuffle.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer

from lightning_d9d.core.checks import non_negative_int, positive_int
from lightning_d9d.core.hf_inputs import hf_attention_inputs
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.mixture_control import PretrainingMixtureControl, check_mixture_controller
from lightning_d9d.datamodules.pretraining_corpus import PretrainingCorpus
from lightning_d9d.datamodules.pretraining_epochs import PretrainingEpochs
from lightning_d9d.datamodules.pretraining_mixture import (
    OnMixtureChange,
    Sources,
    mixture_arguments,
    say_unvalidated_sources,
)
from lightning_d9d.datamodules.pretraining_provenance import PretrainingProvenance, edits_asked
from lightning_d9d.datamodules.pretraining_reports import PretrainingReports
from lightning_d9d.datamodules.pretraining_shapes import PretrainingShapes
from lightning_d9d.datamodules.pretraining_state import STATE_VERSION
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.mixtures import MixtureController
from lightning_d9d.parallel.topology import DataParallelSetting
from lightning_d9d.streaming.loading.loader import (
    StreamPosition,
    TokenTrainLoader,
    TokenValidationLoader,
    check_layout,
    rank_streams,
)
from lightning_d9d.streaming.loading.step_tensors import microbatch_tensors
from lightning_d9d.streaming.packing.rows import RowBlock
from lightning_d9d.streaming.plans.spec import CorpusFingerprint, MixtureSpec, StreamSettings
from lightning_d9d.streaming.provenance.ledger import DEFAULT_EVERY as DEFAULT_PROVENANCE_EVERY
from lightning_d9d.streaming.sources.storage import DEFAULT_READ_RETRY_SECONDS, Storage
from lightning_d9d.streaming.tokens.memory import DEFAULT_MAX_DOCUMENT_CHARS
from lightning_d9d.tokenization.backends import TokenizerBackendError, backend_names

__all__ = ["STATE_VERSION", "PretrainingBatch", "PretrainingDataModule", "storage_of"]

DEFAULT_NUM_STREAMS = 16


@dataclass
class PretrainingBatch:
    """One microbatch of packed rows.

    Attributes:
        input_ids: ``(microbatch_size, seq_len)`` int64 token ids.
        targets: shifted ``input_ids``; ``-100`` where there is no next token.
        position_ids: 0 at every row, document, chunk and padding-run start.
        sources: each row's index in ``dm.source_names`` (validation: in ``dm.val_source_names``).
        cu_seqlens: int32 sequence offsets in the flattened microbatch (flash-attention varlen).
        cu_seqlens_padded: the offsets with CP padding (equal to ``cu_seqlens`` without CP).
        max_seqlen: the longest of those sequences.
        step_target_tokens: the targets (``targets != -100``) of the whole optimizer step over every data-parallel
            replica, what a per-token mean over the step divides by; ``None`` until known (several replicas outside
            a Trainer: sum ``rank_step_target_tokens`` over them).
        rank_step_target_tokens: the targets of this replica's microbatches of the step.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    sources: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    step_target_tokens: int | None = None
    rank_step_target_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def hf_inputs(self, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM's ``model(**...)`` that keep the packed sequences apart.

        ``input_ids``, ``position_ids``, ``use_cache=False``, the mask or varlen arguments ``attn_implementation``
        reads (``lightning_d9d/core/hf_inputs.py``), ``labels`` and ``shift_labels``: the targets are already shifted
        (a row's last target is the token after it), so the model's loss takes them as ``shift_labels`` and shifts
        nothing. Its loss is the mean over the microbatch's targets; add ``num_items_in_batch=step_target_tokens``
        for the step's per-token mean (``docs/streaming.md``).

        Args:
            attn_implementation: the model's ``config._attn_implementation`` (``eager``, ``sdpa``,
                ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``).
            dtype: the model's floating dtype (the ``eager`` mask is added to its attention scores).

        Raises:
            ValueError: an unknown ``attn_implementation``; a context-parallel slice (the model needs whole rows).
        """
        inputs = hf_attention_inputs(
            self.input_ids, self.position_ids, self.cu_seqlens_padded, attn_implementation, dtype
        )
        return inputs | {"labels": self.targets, "shift_labels": self.targets}


def make_batch(
    rows: RowBlock,
    step_targets: int | None,
    spec: MixtureSpec,
    pin: bool,
    source: int | None = None,
    all_targets: int | None = None,
) -> PretrainingBatch:
    """The ``PretrainingBatch`` of a microbatch's rows; ``source``, where given, labels every row.

    Args:
        step_targets: the targets of the replica's rows of the whole step (``None``: validation).
        all_targets: the step's targets over every replica, where known without asking the others.
    """
    built = microbatch_tensors(rows, spec.bos_id, spec.sources[0].settings.context_parallel_size)
    sources = built.sources if source is None else torch.full((len(rows),), source, dtype=torch.int64)
    batch = PretrainingBatch(built.input_ids, built.targets, built.position_ids, sources, built.cu_seqlens,
                             built.cu_seqlens_padded, built.max_seqlen, all_targets, step_targets)  # fmt: skip
    return pin_batch(batch) if pin else batch


class _Setting:
    """A read-only DataModule attribute that is one of its stream settings."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.settings, self.name)


class PretrainingDataModule(
    PretrainingMixtureControl,
    PretrainingEpochs,
    PretrainingProvenance,
    PretrainingShapes,
    PretrainingReports,
    SteppedDataModule,
):
    """Stream parquet or JSONL text into packed token rows: the same global batches on any number of GPUs.

    Args:
        train_files: parquet or JSONL files (directory, glob, file, URL or list), or a mixture ``{name: files}``.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``.
        seq_len: tokens per row of ``input_ids``: a number, or phases ``[[from_step, seq_len], ...]`` (the first from
            step 0); a new length carries every stream over, nothing dropped or repeated (docs/schedules.md).
        global_batch_size: rows per optimizer step over all ranks (G): a number, phases ``[[from_step, G], ...]``, or
            phases by trained tokens ``[{"from_tokens": n, "value": G}, ...]``; Lightning's accumulation follows.
        microbatch_size: rows per forward/backward on one rank.
        val_files: validation files, read in order; ``{name: files}``: one loader per source.
        text_column: the column (JSONL: the field) holding the documents.
        bos_token: prepended to every document; must be in the vocabulary.
        packing: ``"bestfit"`` (crop), ``"bestfit_split"`` (split long documents) or ``"concat"``.
        steps_per_epoch, val_steps: steps per epoch / validation microbatches per rank; ``None``: one pass.
        num_streams: K; must divide G and be divisible by the data-parallel size.
        num_workers: DataLoader workers per rank; 0: in the training process.
        tokenizer_batch_size: documents per tokenizer call (never changes a row).
        tokenizer_backend: what encodes the documents (never changes a row): ``"auto"`` (the fastest installed
            backend that serves this tokenizer with ids identical to ``tokenizers``, checked at setup on a sample of
            the run's documents; else ``"tokenizers"``), ``"tokenizers"``, or a fast backend by name
            (``"fastokens"``); docs/tokenizer_backends.md.
        seed: seeds the unit order of every pass.
        max_document_chars: longer documents are skipped; ``None``: no limit.
        bestfit_buffer_size: documents or pieces best-fit chooses from.
        pin_memory: ``None``: pin when the trainer's device is CUDA.
        on_order_mismatch: a checkpoint of other data or settings: ``"raise"`` or ``"restart_epoch"``.
        storage_options: filesystem options for URLs (a URL's query wins).
        read_retry_seconds: how long reads retry transient storage failures.
        weights: a mixture's shares, ``{name: weight}`` or phases ``[[from_step, {name: weight}], ...]``.
        on_mixture_change: resuming under other weights, sources, global batch sizes or ``seq_len`` (or their
            phases): ``"raise"``, or ``"continue"`` every stream where it stopped under the new settings.
        allow_shared_files: accept a file two sources hold (it is then read twice).
        token_cache: a folder or URL keeping each unit's tokens for later passes and runs; ``None``: no cache.
        on_malformed: a malformed JSONL line: ``"error"`` or ``"skip"``.
        data_parallel: which processes share data; ``None`` follows the strategy.
        verify_peers: the first N steps compare microbatches among each replica's processes (0: off).
        data_wait_warning: warn once a fit if waiting for data exceeds this share of its steps.
        context_parallel_size: the CP size c rows are laid out for; for ``c > 1``, ``seq_len`` must be a multiple
            of ``2·c``.
        val_seq_len: validation rows' ``seq_len``; ``None``: that of the last ``seq_len`` phase.
        skip_data: ranges ``[start, stop)`` of optimizer steps whose data is never trained: resumed before
            ``start``, step ``start`` trains what step ``stop`` would have (recorded: later resumes keep it).
        exclude_documents: documents never trained from this resume on, as ``dm.provenance()`` names them
            (``[source, file, row_group, row]``), or a JSONL file of them (docs/provenance.md).
        provenance_dir: where every stream's state is recorded every ``provenance_every`` steps, so that
            ``dm.provenance(step)`` replays a few steps, not the run; ``None``: ``<default_root_dir>/data_provenance``
            under a Trainer, none without.
        provenance_every: optimizer steps between records.
        mixture_controller: moves a mixture's shares while it trains, from per-source losses
            (``lightning_d9d.mixtures``: ``LossProportional``, ``DoReMi``, ``WeightsFile``, or your own); its
            decisions are journaled in the data state and take effect ``MIXTURE_LAG`` steps later (docs/mixtures.md).

    Raises:
        ValueError: a bad setting, or in ``setup`` missing data, a bad tokenizer or an unusable layout; a
            ``TokenizerBackendError`` for a named backend not installed or unable to serve the tokenizer.
        StorageError: a URL could not be listed or opened, or a read kept failing.
        TokenizerBackendMismatch: (while streaming) a fast backend gave other ids than ``tokenizers`` for a document.
    """

    seq_len = _Setting("seq_len")
    global_batch_size = _Setting("global_batch_size")  # type: ignore[assignment]
    num_streams = _Setting("num_streams")
    seed = _Setting("seed")
    bestfit_buffer_size = _Setting("bestfit_buffer_size")
    max_document_chars = _Setting("max_document_chars")
    tokenizer_batch_size = _Setting("tokenizer_batch_size")
    context_parallel_size = _Setting("context_parallel_size")
    train_spec: MixtureSpec | None = None  # set by setup, as the rest
    fingerprint: CorpusFingerprint | None = None
    steps_per_epoch: int | None = None  # type: ignore[assignment]
    _step_targets: tuple[int, int] = (-1, 0)  # (global step, its targets over every replica), summed once per step
    val_specs: Sequence[MixtureSpec] = ()  # one per validation source
    val_steps_per_source: Sequence[int] = ()

    def __init__(
        self,
        train_files: Mapping[str, Any] | str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: str | os.PathLike | Tokenizer,
        seq_len: PositiveInt | list[tuple[NonNegativeInt, PositiveInt]] = 1024,
        global_batch_size: PositiveInt | list[tuple[NonNegativeInt, PositiveInt]] | list[dict[str, int]] = 64,
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
        token_cache: str | None = None,
        on_malformed: Literal["error", "skip"] = "error",
        data_parallel: DataParallelSetting = None,
        verify_peers: NonNegativeInt = 0,
        data_wait_warning: float | None = 0.2,
        context_parallel_size: PositiveInt = 1,
        val_seq_len: PositiveInt | None = None,
        skip_data: list[tuple[NonNegativeInt, PositiveInt]] | None = None,
        exclude_documents: list[list[Any]] | list[dict[str, Any]] | str | None = None,
        provenance_dir: str | None = None,
        provenance_every: PositiveInt = DEFAULT_PROVENANCE_EVERY,
        tokenizer_backend: str = "auto",
        mixture_controller: MixtureController | None = None,
    ):
        super().__init__()
        if tokenizer_backend not in backend_names():
            raise TokenizerBackendError(
                f"tokenizer_backend={tokenizer_backend!r} is not a tokenizer backend: pass one of {backend_names()}"
            )
        self.tokenizer_backend = tokenizer_backend
        self.tokenizer_backend_in_use: tuple[str, str] | None = None  # (backend, why), known after setup
        self.data_parallel, self.verify_peers, self.data_wait_warning = data_parallel, verify_peers, data_wait_warning
        self.settings = StreamSettings(seq_len, global_batch_size, packing, seed, num_streams, bestfit_buffer_size,
                                       max_document_chars, tokenizer_batch_size,
                                       context_parallel_size=context_parallel_size)  # fmt: skip
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        self._check_microbatches(1)  # every phase's G must be a multiple of m
        self._steps_per_epoch_arg, self._val_steps_arg, self.val_seq_len = _positive_or_none(
            steps_per_epoch=steps_per_epoch, val_steps=val_steps, val_seq_len=val_seq_len
        )
        self.skip_data, self.exclude_documents = edits_asked(skip_data, exclude_documents)
        self.provenance_dir, self.provenance_every = provenance_dir, positive_int("provenance_every", provenance_every)
        self.num_workers = non_negative_int("num_workers", num_workers)
        self.train_files, self.val_files, self.tokenizer, self.bos_token = train_files, val_files, tokenizer, bos_token
        self.text_column, self.token_cache, self.on_malformed = _reading(text_column, token_cache, on_malformed)
        self.pin_memory, self.on_order_mismatch = pin_memory, on_order_mismatch
        self.storage = storage_of(storage_options, read_retry_seconds)
        self.on_mixture_change, self.weights, self.allow_shared_files = on_mixture_change, weights, allow_shared_files
        self.sources = self._parsed_sources()
        self.mixture_controller = check_mixture_controller(mixture_controller, self.sources.mixture)
        say_unvalidated_sources(self.sources)  # once: setup parses the same sources again
        self.position = StreamPosition()

    @property
    def packing(self) -> str:
        return self.settings.packing.name

    @property
    def owned_streams(self) -> list[int]:
        """This replica's contiguous block of K / ``dp_size`` streams."""
        return rank_streams(self.num_streams, self.dp_size, self.dp_rank)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        """Resolve files, read footers, load the tokenizer, check the layout, size the epoch (counted from the token
        cache or estimated, on rank 0 of a Trainer's processes; nothing is counted where ``steps_per_epoch`` and
        ``val_steps`` are given)."""
        self.resolve_topology()
        # Parsed again: a subclass may have resolved the file specs since construction (the demo's do).
        self.sources = self._parsed_sources()
        corpus = PretrainingCorpus(self.settings, self.tokenizer, self.bos_token, self.storage, self.token_cache,
                                   self.on_malformed, self.tokenizer_backend)  # fmt: skip
        self._check_microbatches(self.dp_size)  # raises early when a G is not divisible by D·m
        check_layout(self.num_streams, self.dp_size, self.num_workers)
        train, val_specs = None, None
        if self.train_spec is None or stage in (None, "fit"):
            sources = self.sources
            train = corpus.train(sources.train, sources.schedule, sources.mixture, self.allow_shared_files)
            self._train, self.train_spec, self.fingerprint = train, train.spec, train.spec.fingerprint()
            self._say_cache_changes(train.spec)
        if self.sources.validation is not None and not self.val_specs:
            by_source = self.sources.validation_by_source
            val_specs = corpus.validation(self.sources.validation, by_source, self.allow_shared_files, self.val_seq_len)
        if corpus.backend is not None and corpus.backend != self.tokenizer_backend_in_use:
            self.tokenizer_backend_in_use = corpus.backend
            rank_zero_info(f"lightning-d9d: tokenizer backend {corpus.backend[0]} ({corpus.backend[1]})")
        self._size_epochs(train, val_specs)
        if stage in (None, "fit"):
            self._fresh_edits()
            position = StreamPosition(layout=self.step_layout(0), generation=self.position.generation + 1)
            position.on_commit = self._record_step
            self.start_fit(position)
            self._start_mixture_control()

    def _parsed_sources(self) -> Sources:
        return mixture_arguments(
            self.train_files, self.val_files, self.text_column, self.weights, self.on_mixture_change,
            self.allow_shared_files,
        )  # fmt: skip

    @property
    def val_steps(self) -> int | None:
        """Validation microbatches per rank per run (of the first source; ``None`` without any)."""
        return self.val_steps_per_source[0] if self.val_steps_per_source else None

    def train_dataloader(self) -> TokenTrainLoader:
        """This rank's training loader of ``PretrainingBatch`` (one epoch per iteration; the same loader, and the
        same running streams, when asked again in a fit)."""
        spec = self._require(self.train_spec)
        # Held weakly (by track_loader): a loader that refers back to this DataModule must not keep it alive.
        handed = getattr(self, "_loaders", {}).get("train")
        if handed is not None and handed() is not None and handed().spec is spec:
            return handed()
        loader = TokenTrainLoader(
            spec,
            self.owned_streams,
            self.num_workers,
            self.microbatch_size,
            lambda epoch: (self.step_layout(epoch), self.steps_in_epoch(epoch)),
            self.position,
            self.start_point,
            functools.partial(self._train_batch, spec=spec, pin=self.resolve_pin_memory()),
        )
        return self.track_loader(loader)

    def complete_batch(self, trainer: Any, batch: Any) -> None:
        """``step_target_tokens`` where padding makes it differ by replica: the replicas' counts summed, once per
        step (TP/CP/PP peers hold their replica's count, so the sum over processes is divided by them)."""
        if not isinstance(batch, PretrainingBatch) or batch.step_target_tokens is not None:
            return
        step, counted = self._step_targets
        if step != trainer.global_step:
            local = torch.tensor(
                [batch.rank_step_target_tokens], dtype=torch.int64, device=trainer.strategy.root_device
            )
            total = trainer.strategy.reduce(local, reduce_op="sum")
            counted = int(total.item()) // self.topology.peers_per_replica
            self._step_targets = (trainer.global_step, counted)
        batch.step_target_tokens = counted

    def _train_batch(self, rows: RowBlock, step_targets: int, spec: MixtureSpec, pin: bool) -> PretrainingBatch:
        all_targets = None
        if not (spec.packing.flagged or spec.sources[0].settings.cp_multiple > 1):
            all_targets = step_targets * self.dp_size  # every position has a target: the same count on every replica
        elif self.dp_size == 1:
            all_targets = step_targets
        return make_batch(rows, step_targets, spec, pin, all_targets=all_targets)

    def val_dataloader(self) -> TokenValidationLoader | list:
        """The same ``val_steps`` microbatches per rank on every run; one loader per mapped source."""
        loaders = [
            self.track_loader(TokenValidationLoader(
                spec, self.owned_streams, self.num_workers, self.microbatch_size, steps,
                functools.partial(make_batch, spec=spec, pin=self.resolve_pin_memory(), source=j),
            ), f"val/{j}")
            for j, (spec, steps) in enumerate(zip(self.val_specs, self.val_steps_per_source))
        ]  # fmt: skip
        return loaders if self.sources.validation_by_source else (loaders[0] if loaders else [])


def _positive_or_none(**values: Any) -> tuple[int | None, ...]:
    return tuple(positive_int(name, value, allow_none=True) for name, value in values.items())


def _reading(text_column: Any, token_cache: Any, on_malformed: Any) -> tuple[str, str | None, str]:
    """``text_column``, ``token_cache`` and ``on_malformed``, checked."""
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
