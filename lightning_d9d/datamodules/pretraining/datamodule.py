"""PretrainingDataModule: parquet → tokens → packed rows, streamed, the same global batches on any GPU count.

The corpus is dealt to K streams (reader → tokenizing prefetch → packing); step ``s`` takes rows
``[s·G/K, (s+1)·G/K)`` of every stream, so a global step's rows never depend on the world size, workers or
microbatch size. Streams are dealt to data-parallel replicas, never end (an epoch is a step count, the same on every
rank), and ``state_dict`` holds every stream's state at the last step boundary, so any layout valid for K resumes.

The DataModule owns four parts and delegates to them: ``corpus`` (sources, tokenizer, token cache, what setup read,
``corpus.py``), ``run_plan`` (shapes, shares, edits, epoch length, ``plan.py``), ``ledger`` (provenance,
``provenance.py``) and ``reports`` (``reports.py``). Its own state is the position (epoch, step, every stream's
state); ``state_dict()`` is ``{"epoch", "step", "fingerprint", "version", "streams", "plan": run_plan.state_dict()}``
(``state.py`` migrates older layouts).

Trade-off: a larger K serves more layouts but holds K best-fit buffers, and a step mixes K places of the corpus
rather than a global shuffle.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from tokenizers import Tokenizer

from lightning_d9d.core.checks import non_negative_int, positive_int
from lightning_d9d.core.resume import StepLayout
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.pretraining.batch import PretrainingBatch, make_batch
from lightning_d9d.datamodules.pretraining.corpus import Corpus
from lightning_d9d.datamodules.pretraining.edits import edits_asked
from lightning_d9d.datamodules.pretraining.mixture import (
    OnMixtureChange,
    Sources,
    mixture_arguments,
    say_unvalidated_sources,
)
from lightning_d9d.datamodules.pretraining.plan import RunPlan, check_microbatches
from lightning_d9d.datamodules.pretraining.provenance import ProvenanceLedger
from lightning_d9d.datamodules.pretraining.reports import Reports
from lightning_d9d.datamodules.pretraining.state import (
    STATE_VERSION,
    check_streams,
    migrate,
    read_streams,
    saved_streams,
    streams_step,
)
from lightning_d9d.parallel.topology import DataParallelSetting
from lightning_d9d.streaming.loading.loader import (
    StreamPosition,
    TokenTrainLoader,
    TokenValidationLoader,
    check_layout,
    rank_streams,
)
from lightning_d9d.streaming.packing.rows import RowBlock
from lightning_d9d.streaming.plans.edits import DataEdits, DocumentRef
from lightning_d9d.streaming.plans.shape import Shape, ShapeSchedule
from lightning_d9d.streaming.plans.spec import CorpusFingerprint, MixtureSpec, StreamSettings
from lightning_d9d.streaming.provenance.ledger import DEFAULT_EVERY as DEFAULT_PROVENANCE_EVERY
from lightning_d9d.streaming.provenance.pieces import Piece
from lightning_d9d.streaming.sources.storage import DEFAULT_READ_RETRY_SECONDS, Storage
from lightning_d9d.streaming.tokens.memory import DEFAULT_MAX_DOCUMENT_CHARS
from lightning_d9d.tokenization.backends import TokenizerBackendError, backend_names

__all__ = ["STATE_VERSION", "PretrainingBatch", "PretrainingDataModule", "storage_of"]

DEFAULT_NUM_STREAMS = 16


class _Setting:
    """A read-only DataModule attribute that is one of its stream settings."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner.settings, self.name)


class PretrainingDataModule(SteppedDataModule):
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
    fingerprint: CorpusFingerprint | None = None
    _step_targets: tuple[int, int] = (-1, 0)  # (global step, its targets over every replica), summed once per step

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
    ):
        super().__init__()
        if tokenizer_backend not in backend_names():
            raise TokenizerBackendError(
                f"tokenizer_backend={tokenizer_backend!r} is not a tokenizer backend: pass one of {backend_names()}"
            )
        self.data_parallel, self.verify_peers, self.data_wait_warning = data_parallel, verify_peers, data_wait_warning
        settings = StreamSettings(seq_len, global_batch_size, packing, seed, num_streams, bestfit_buffer_size,
                                  max_document_chars, tokenizer_batch_size,
                                  context_parallel_size=context_parallel_size)  # fmt: skip
        microbatch_size = positive_int("microbatch_size", microbatch_size)
        check_microbatches(settings.shapes, 1, microbatch_size)  # every phase's G must be a multiple of m
        steps_per_epoch, val_steps, val_seq_len = _positive_or_none(
            steps_per_epoch=steps_per_epoch, val_steps=val_steps, val_seq_len=val_seq_len
        )
        skips, excluded = edits_asked(skip_data, exclude_documents)
        self.run_plan = RunPlan(settings, microbatch_size, steps_per_epoch, val_seq_len, skips, excluded)
        provenance_every = positive_int("provenance_every", provenance_every)
        self.num_workers = non_negative_int("num_workers", num_workers)
        self.train_files, self.val_files = train_files, val_files
        self.text_column, token_cache, on_malformed = _reading(text_column, token_cache, on_malformed)
        self.pin_memory, self.on_order_mismatch = pin_memory, on_order_mismatch
        storage = storage_of(storage_options, read_retry_seconds)
        self.on_mixture_change, self.weights = on_mixture_change, weights
        sources = mixture_arguments(train_files, val_files, self.text_column, weights, on_mixture_change,
                                    allow_shared_files)  # fmt: skip
        say_unvalidated_sources(sources)  # once: setup parses the same sources again
        self.corpus = Corpus(sources, tokenizer, bos_token, storage, token_cache, on_malformed, allow_shared_files,
                             val_steps, tokenizer_backend)  # fmt: skip
        self.ledger = ProvenanceLedger(self.run_plan, storage, provenance_dir, provenance_every, self._default_root)
        self.reports = Reports(self.corpus, self.run_plan)
        self.position = StreamPosition()

    # ------------------------------------------------------------------ the parts' settings, as users name them
    @property
    def settings(self) -> StreamSettings:
        """The stream settings (shapes, packing, K, seed, ...)."""
        return self.run_plan.settings

    @property
    def packing(self) -> str:
        return self.settings.packing.name

    @property
    def microbatch_size(self) -> int:  # type: ignore[override]
        return self.run_plan.microbatch_size

    @property
    def val_seq_len(self) -> int | None:
        return self.run_plan.val_seq_len

    @property
    def skip_data(self) -> tuple[tuple[int, int], ...]:
        return self.run_plan.skip_data

    @property
    def exclude_documents(self) -> Any:
        return self.run_plan.exclude_documents

    @property
    def tokenizer(self) -> str | os.PathLike | Tokenizer:
        return self.corpus.tokenizer

    @tokenizer.setter
    def tokenizer(self, value: str | os.PathLike | Tokenizer) -> None:
        self.corpus.tokenizer = value  # a subclass may resolve it before setup (the demo's does)

    @property
    def tokenizer_backend(self) -> str:
        """The tokenizer backend asked (``"auto"``, ``"tokenizers"`` or a fast backend's name)."""
        return self.corpus.tokenizer_backend

    @property
    def tokenizer_backend_in_use(self) -> tuple[str, str] | None:
        """``(backend, why)`` of the backend encoding the documents, known after ``setup``."""
        return self.corpus.backend_in_use

    @property
    def bos_token(self) -> str:
        return self.corpus.bos_token

    @property
    def storage(self) -> Storage:
        return self.corpus.storage

    @property
    def token_cache(self) -> str | None:
        return self.corpus.token_cache

    @property
    def on_malformed(self) -> str:
        return self.corpus.on_malformed

    @property
    def allow_shared_files(self) -> bool:
        return self.corpus.allow_shared_files

    @property
    def sources(self) -> Sources:
        """The parsed training and validation sources."""
        return self.corpus.sources

    @property
    def provenance_dir(self) -> str | None:
        return self.ledger.provenance_dir

    @provenance_dir.setter
    def provenance_dir(self, value: str | None) -> None:
        self.ledger.provenance_dir = value

    @property
    def provenance_every(self) -> int:
        return self.ledger.every

    @property
    def owned_streams(self) -> list[int]:
        """This replica's contiguous block of K / ``dp_size`` streams."""
        return rank_streams(self.num_streams, self.dp_size, self.dp_rank)

    def _default_root(self) -> str | None:
        trainer = getattr(self, "trainer", None)
        return getattr(trainer, "default_root_dir", None) if trainer is not None else None

    # ------------------------------------------------------------------ what setup read (the corpus)
    @property
    def train_spec(self) -> MixtureSpec | None:
        """The training streams in force: the corpus' spec with the plan's shares, skips and exclusions."""
        return self.run_plan.spec

    @train_spec.setter
    def train_spec(self, spec: MixtureSpec | None) -> None:
        self.run_plan.spec = spec

    @property
    def val_specs(self) -> Sequence[MixtureSpec]:
        """One spec per validation source."""
        return self.corpus.val_specs

    @property
    def val_steps_per_source(self) -> Sequence[int]:
        return self.corpus.val_steps_per_source

    @property
    def val_steps(self) -> int | None:
        """Validation microbatches per rank per run (of the first source; ``None`` without any)."""
        return self.val_steps_per_source[0] if self.val_steps_per_source else None

    @property
    def source_pass_rows(self) -> Mapping[str, float]:
        """Rows of one pass over each training source (see ``Corpus.source_pass_rows``)."""
        return self.corpus.source_pass_rows

    def source_pass_rows_at(self, step: int) -> dict[str, float]:
        """Rows of one pass over each training source at the row length of step ``step`` (longer rows: fewer)."""
        return self.corpus.source_pass_rows_at(step)

    def source_pass_tokens(self) -> dict[str, float]:
        """One pass's document tokens per training source (counted from the token cache where it holds the units,
        else estimated)."""
        return self.corpus.source_pass_tokens()

    @property
    def estimated_pass_tokens(self) -> float | None:
        """One pass's tokens over every training source; ``None`` before ``setup``."""
        return self.corpus.estimated_pass_tokens

    # ------------------------------------------------------------------ the run plan: shapes, edits, epochs
    @property
    def steps_per_epoch(self) -> int | None:  # type: ignore[override]
        """Optimizer steps per epoch (sized at ``setup``; a resume keeps the checkpoint's)."""
        return self.run_plan.steps_per_epoch

    @property
    def shapes(self) -> ShapeSchedule:
        """The global batch size and ``seq_len`` of every step."""
        return self.run_plan.shapes

    @property
    def max_seq_len(self) -> int:
        """The longest rows of the run, training phases and validation."""
        return self.run_plan.max_seq_len

    @property
    def edits(self) -> DataEdits:
        """The skips and exclusions recorded."""
        return self.run_plan.edits

    @edits.setter
    def edits(self, edits: DataEdits) -> None:
        self.run_plan.edits = edits

    def data_step(self, step: int) -> int:
        """The step of data that global optimizer step ``step`` trains (``step`` itself unless data was skipped)."""
        return self.run_plan.data_step(step)

    def shape_at(self, step: int) -> Shape:
        """The shape (global batch size, ``seq_len``) of global optimizer step ``step``: its data step's."""
        return self.run_plan.shape_at(step)

    def global_batch_size_at(self, step: int) -> int:
        """Rows of global optimizer step ``step`` over all ranks (for models and learning-rate schedules)."""
        return self.shape_at(step).global_batch_size

    def seq_len_at(self, step: int) -> int:
        """Inputs per row of global optimizer step ``step``."""
        return self.shape_at(step).seq_len

    def microbatches_at(self, step: int) -> int:
        """M of global optimizer step ``step`` on one data-parallel replica."""
        return self.run_plan.microbatches_at(step, self.dp_size)

    def batches_in_global_step(self, step: int) -> int:
        return self.microbatches_at(step)

    def microbatches_for(self, dp_size: int) -> int:
        """M at data-parallel size ``dp_size`` (``ValueError`` where the global batch size has phases)."""
        return self.run_plan.microbatches_for(dp_size)

    @property
    def step_sizes_vary(self) -> bool:
        return self.run_plan.step_sizes_vary

    @property
    def reloads_train_loader_every_epoch(self) -> bool:  # type: ignore[override]
        return self.step_sizes_vary  # epochs may differ in microbatches: Lightning reads each epoch's length

    def step_layout(self, epoch: int) -> StepLayout:
        """This replica's microbatches of each step of ``epoch`` (global steps ``epoch × steps_per_epoch`` on)."""
        return self.run_plan.step_layout(epoch, self.dp_size)

    def describe_step(self) -> str:
        return self.run_plan.describe_phases(self.dp_size) if self.step_sizes_vary else super().describe_step()

    def check_run(self, total_steps: int | None) -> None:
        """Raises ValueError for a skip that starts where the run has ended (nothing after it would train)."""
        self.run_plan.check_run(total_steps)

    # ------------------------------------------------------------------ provenance (the ledger)
    def provenance(
        self, steps: int | Iterable[int], max_replay: int | None = None, untrained: bool = False
    ) -> list[Piece]:
        """Every piece of every row of the given global optimizer steps (see ``ProvenanceLedger.provenance``).

        Raises:
            ValueError: as ``ProvenanceLedger.provenance``.
        """
        return self.ledger.provenance(steps, self.position, max_replay, untrained)

    def trained_until(self) -> int:
        """The first step this DataModule does not know the run trained (its position, the ledger's records)."""
        return self.ledger.trained_until(self.position)

    def document(self, ref: DocumentRef | Piece | Sequence[Any]) -> dict[str, Any]:
        """A document named as provenance names it: ``{"text": ..., "tokens": ...}`` (BOS first).

        Raises:
            ValueError: a reference to no document of this corpus.
        """
        return self.ledger.document(ref)

    # ------------------------------------------------------------------ reports
    @property
    def source_names(self) -> list[str]:
        """The training sources, in order (``PretrainingBatch.sources`` indexes it); ``["train"]`` for one corpus."""
        return self.reports.source_names

    @property
    def val_source_names(self) -> list[str]:
        """The validation sources, in the order of their loaders (Lightning's ``dataloader_idx``)."""
        return self.reports.val_source_names

    def val_metric_name(self, name: str, dataloader_idx: int = 0) -> str:
        """The key to log a validation metric of loader ``dataloader_idx`` under (see ``Reports.val_metric_name``).

        Raises:
            ValueError: ``dataloader_idx`` is not the index of one of the validation loaders.
        """
        return self.reports.val_metric_name(name, dataloader_idx)

    def source_stats(self) -> dict[str, dict[str, float]]:
        """Per training source, over this rank's streams as of the latest step handed out: ``rows``, ``tokens``,
        ``documents``, ``padding``, ``too_long``, ``excluded`` and ``passes`` (fractional)."""
        return self.reports.source_stats(self.position)

    def stream_stats(self) -> dict[str, int]:
        """This rank's stream counters so far, summed over its streams; they continue across a resume."""
        return self.reports.stream_stats(self.position)

    def step_metrics(self, rows_by_source: collections.Counter[int]) -> dict[str, float]:
        """What the callback logs per step (see ``Reports.step_metrics``)."""
        return self.reports.step_metrics(rows_by_source, self.position)

    def mixture_report(self, run_steps: int, realised: Sequence[int], steps: int) -> list[str]:
        """``inspect``'s mixture lines (none for one corpus)."""
        return self.reports.mixture_report(run_steps, realised, steps)

    def edits_report(self) -> list[str]:
        """``inspect``'s lines for the data edits recorded or asked."""
        return self.reports.edits_report()

    def shape_report(self, run_steps: int, dp_size: int) -> list[str]:
        """``inspect``'s lines for shapes in phases (none for one shape)."""
        return self.reports.shape_report(run_steps, dp_size)

    def token_cache_report(self) -> list[str]:
        """``inspect``'s token-cache lines: per source, the units held and their size."""
        return self.reports.token_cache_report()

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        """Resolve files, read footers, load the tokenizer, check the layout, size the epoch (counted from the token
        cache or estimated, on rank 0 of a Trainer's processes; nothing is counted where ``steps_per_epoch`` and
        ``val_steps`` are given)."""
        self.resolve_topology()
        corpus, plan = self.corpus, self.run_plan
        # Parsed again: a subclass may have resolved the file specs since construction (the demo's do).
        sources = self._parsed_sources()
        corpus.sources, train = sources, None
        reader = corpus.reader(self.settings)
        plan.check_microbatches(self.dp_size)  # raises early when a G is not divisible by D·m
        check_layout(self.num_streams, self.dp_size, self.num_workers)
        if plan.spec is None or stage in (None, "fit"):
            train = corpus.read_train(reader, sources)
            plan.spec, self.fingerprint = train.spec, train.spec.fingerprint()
            self.reports.say_cache_changes(train.spec)
        val_specs = corpus.read_validation(reader, self.val_seq_len)
        corpus.say_backend(reader)
        steps = corpus.size_epochs(self._trainer, train, val_specs, self.dp_size * self.microbatch_size,
                                   plan.steps_per_epoch_asked)  # fmt: skip
        if train is not None:
            plan.steps_per_epoch = steps
        if stage in (None, "fit"):
            plan.start()
            position = StreamPosition(layout=self.step_layout(0), generation=self.position.generation + 1)
            position.on_commit = self.ledger.record
            self.start_fit(position)

    def _parsed_sources(self) -> Sources:
        return mixture_arguments(
            self.train_files, self.val_files, self.text_column, self.weights, self.on_mixture_change,
            self.allow_shared_files,
        )  # fmt: skip

    # ------------------------------------------------------------------ the resume contract
    def extra_state(self) -> dict[str, Any]:
        """Every stream's state at the last optimizer step, gathered from all ranks (only rank 0 saves), and the
        run plan's state."""
        plan = self.run_plan.state_dict()
        _epoch, step = self.saved_position()
        states = self.position.committed_states(step)
        streams = saved_streams(states, gather=self.dp_size > 1)
        return {"version": STATE_VERSION, "streams": streams, "plan": plan}

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
        plan = self.run_plan
        if plan.steps_per_epoch_asked is not None or self.corpus.train is None:
            return
        if not self.restores_training_position():
            return
        try:
            if self.fingerprint is None or self.fingerprint.mismatches(dict(state["fingerprint"])):
                return  # another run's data: this run's epochs (a malformed state is named by the resume itself)
            saved_plan = migrate(state)["plan"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        saved = plan.saved_epoch_length(saved_plan)
        plan.keep_epoch_length(saved if saved is not None else self.corpus.sampled_steps_per_pass())

    def other_differences(self, state_dict: dict[str, Any]) -> list[str]:
        """The global batch size and ``seq_len`` (phases) the checkpoint differs in."""
        try:
            saved = migrate(state_dict)["plan"]
        except (KeyError, TypeError, ValueError):
            return []  # a malformed state is named when it is read
        return self.run_plan.other_differences(saved)

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore the streams this rank owns to the checkpoint's last optimizer step, validated first, under the
        checkpoint's plan and the edits asked now (recorded from this step on)."""
        states, plan = {}, self.run_plan
        global_step = epoch * plan.steps_per_epoch + step
        if state is not None:
            state = migrate(state)
            saved_plan = state["plan"]
            plan.load_edits(saved_plan, global_step)
            states = read_streams(state, plan.require(), self.owned_streams, step)
            plan.load_mixture(saved_plan, streams_step(states), self.on_mixture_change)
            expected = plan.saved_edits(saved_plan).data_step(global_step)
            check_streams(states, plan.require(), expected, global_step)
        self.position.restart(epoch, step, states, self.step_layout(epoch))
        self.ledger.record(epoch, step, states, resumed=True)

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> TokenTrainLoader:
        """This rank's training loader of ``PretrainingBatch`` (one epoch per iteration; the same loader, and the
        same running streams, when asked again in a fit)."""
        spec = self.run_plan.require()
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
