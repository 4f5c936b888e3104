"""PretrainingDataModule: parquet → tokens → packed rows, streamed, the same global batches on any GPU count.

The corpus is dealt to K streams (reader → tokenizing prefetch → packing); step ``s`` takes rows
``[s·G/K, (s+1)·G/K)`` of every stream, so a global step's rows never depend on the world size, workers or
microbatch size. Streams are dealt to data-parallel replicas, never end (an epoch is a step count, the same on every
rank), and ``state_dict`` holds every stream's state at the last step boundary, so any layout valid for K resumes.

The DataModule owns five parts and delegates to them: ``corpus`` (sources, tokenizer, token cache, what setup read,
``corpus.py``), ``run_plan`` (shapes, shares, edits, epoch length, ``plan.py``), ``ledger`` (provenance,
``provenance.py``), ``reports`` (``reports.py``) and ``mixture_control`` (a controller's journal and window,
``mixture_control.py``). Its own state is the position (epoch, step, every stream's
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

from jsonargparse.typing import NonNegativeInt, PositiveInt
from tokenizers import Tokenizer

from lightning_d9d.core.checks import non_negative_int, positive_int
from lightning_d9d.core.resume import StepLayout
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.parts import PartAttribute, SettablePartAttribute
from lightning_d9d.datamodules.pretraining.batch import PretrainingBatch, StepTargets, make_batch, train_batch
from lightning_d9d.datamodules.pretraining.corpus import Corpus, check_backend, reading_arguments, storage_of
from lightning_d9d.datamodules.pretraining.edits import edits_asked
from lightning_d9d.datamodules.pretraining.mixture import (
    OnMixtureChange,
    Sources,
    mixture_arguments,
    say_unvalidated_sources,
)
from lightning_d9d.datamodules.pretraining.mixture_control import MixtureControl, check_mixture_controller
from lightning_d9d.datamodules.pretraining.plan import RunPlan, check_microbatches
from lightning_d9d.datamodules.pretraining.provenance import ProvenanceLedger
from lightning_d9d.datamodules.pretraining.reports import Reports
from lightning_d9d.datamodules.pretraining.state import (
    STATE_VERSION,
    keep_epoch_length,
    migrate,
    restored,
    saved_streams,
    shape_differences_of,
)
from lightning_d9d.mixtures import MixtureController
from lightning_d9d.parallel.topology import DataParallelSetting
from lightning_d9d.streaming.loading.loader import (
    StreamPosition,
    TokenTrainLoader,
    TokenValidationLoader,
    check_layout,
    rank_streams,
)
from lightning_d9d.streaming.packing.rows import RowBlock
from lightning_d9d.streaming.plans.spec import CorpusFingerprint, MixtureSpec, StreamSettings
from lightning_d9d.streaming.provenance.ledger import DEFAULT_EVERY as DEFAULT_PROVENANCE_EVERY
from lightning_d9d.streaming.sources.storage import DEFAULT_READ_RETRY_SECONDS
from lightning_d9d.streaming.tokens.memory import DEFAULT_MAX_DOCUMENT_CHARS

__all__ = ["STATE_VERSION", "PretrainingBatch", "PretrainingDataModule", "storage_of"]

DEFAULT_NUM_STREAMS = 16


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
        mixture_controller: moves a mixture's shares while it trains, from per-source losses
            (``lightning_d9d.mixtures``: ``LossProportional``, ``DoReMi``, ``WeightsFile``, or your own); its
            decisions are journaled in the data state and take effect ``MIXTURE_LAG`` steps later (docs/mixtures.md).

    Raises:
        ValueError: a bad setting, or in ``setup`` missing data, a bad tokenizer or an unusable layout; a
            ``TokenizerBackendError`` for a named backend not installed or unable to serve the tokenizer.
        StorageError: a URL could not be listed or opened, or a read kept failing.
        TokenizerBackendMismatch: (while streaming) a fast backend gave other ids than ``tokenizers`` for a document.
    """

    # The stream settings.
    seq_len = PartAttribute("settings")
    global_batch_size = PartAttribute("settings")  # type: ignore[assignment]
    num_streams = PartAttribute("settings")
    seed = PartAttribute("settings")
    bestfit_buffer_size = PartAttribute("settings")
    max_document_chars = PartAttribute("settings")
    tokenizer_batch_size = PartAttribute("settings")
    context_parallel_size = PartAttribute("settings")
    # The corpus' (corpus.py): how the sources are read, what setup read of them.
    tokenizer = SettablePartAttribute("corpus")  # a subclass may resolve it before setup (the demo's does)
    text_column = PartAttribute("corpus")
    bos_token = PartAttribute("corpus")
    storage = PartAttribute("corpus")
    token_cache = PartAttribute("corpus")
    on_malformed = PartAttribute("corpus")
    allow_shared_files = PartAttribute("corpus")
    tokenizer_backend = PartAttribute("corpus")
    tokenizer_backend_in_use = PartAttribute("corpus", "backend_in_use")
    sources = PartAttribute("corpus")
    val_specs = PartAttribute("corpus")
    val_steps_per_source = PartAttribute("corpus")
    source_pass_rows = PartAttribute("corpus")
    source_pass_rows_at = PartAttribute("corpus")
    source_pass_tokens = PartAttribute("corpus")
    estimated_pass_tokens = PartAttribute("corpus")
    # The run plan's (plan.py): shapes, shares, edits, epoch length.
    settings = PartAttribute("run_plan")
    microbatch_size = PartAttribute("run_plan")  # type: ignore[assignment]
    val_seq_len = PartAttribute("run_plan")
    skip_data = PartAttribute("run_plan")
    exclude_documents = PartAttribute("run_plan")
    train_spec = SettablePartAttribute("run_plan", "spec")
    edits = SettablePartAttribute("run_plan")
    steps_per_epoch = PartAttribute("run_plan")  # type: ignore[assignment]
    shapes = PartAttribute("run_plan")
    max_seq_len = PartAttribute("run_plan")
    step_sizes_vary = PartAttribute("run_plan")  # type: ignore[assignment]
    data_step = PartAttribute("run_plan")
    shape_at = PartAttribute("run_plan")
    microbatches_for = PartAttribute("run_plan")  # type: ignore[assignment]
    check_run = PartAttribute("run_plan")  # type: ignore[assignment]
    # The ledger's (provenance.py) and the reports' (reports.py).
    provenance_dir = SettablePartAttribute("ledger")
    provenance_every = PartAttribute("ledger", "every")
    document = PartAttribute("ledger")
    source_names = PartAttribute("reports")
    val_source_names = PartAttribute("reports")
    val_metric_name = PartAttribute("reports")
    edits_report = PartAttribute("reports")
    shape_report = PartAttribute("reports")
    token_cache_report = PartAttribute("reports")
    # The mixture control's (mixture_control.py).
    mixture_controller = SettablePartAttribute("mixture_control", "controller")
    mixture_journal = PartAttribute("mixture_control", "journal_entries")
    report_token_losses = PartAttribute("mixture_control")
    update_mixture = PartAttribute("mixture_control", "update")
    fingerprint: CorpusFingerprint | None = None

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
        check_backend(tokenizer_backend)
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
        self.train_files, self.val_files, self.weights = train_files, val_files, weights
        reading = reading_arguments(text_column, token_cache, on_malformed)
        self.pin_memory, self.on_order_mismatch = pin_memory, on_order_mismatch
        storage, self.on_mixture_change = storage_of(storage_options, read_retry_seconds), on_mixture_change
        sources = mixture_arguments(train_files, val_files, reading[0], weights, on_mixture_change, allow_shared_files)
        mixture_controller = check_mixture_controller(mixture_controller, sources.mixture)
        say_unvalidated_sources(sources)  # once: setup parses the same sources again
        self.corpus = Corpus(sources, tokenizer, bos_token, storage, *reading, allow_shared_files, val_steps,
                             tokenizer_backend)  # fmt: skip
        self.ledger = ProvenanceLedger(self.run_plan, storage, provenance_dir, provenance_every, self._default_root)
        # Bound methods, not lambdas: the DataModule stays picklable (spawned processes receive it).
        self.mixture_control = MixtureControl(mixture_controller, self.run_plan, self._trainer_now,
                                              self._peers_per_replica)  # fmt: skip
        self.reports, self.position, self.step_targets = (
            Reports(self.corpus, self.run_plan),
            StreamPosition(),
            StepTargets(),
        )

    @property
    def packing(self) -> str:
        """The packing's name (``"bestfit"``, ``"bestfit_split"`` or ``"concat"``)."""
        return self.settings.packing.name

    @property
    def owned_streams(self) -> list[int]:
        """This replica's contiguous block of K / ``dp_size`` streams."""
        return rank_streams(self.num_streams, self.dp_size, self.dp_rank)

    @property
    def val_steps(self) -> int | None:
        """Validation microbatches per rank per run (of the first source; ``None`` without any)."""
        return self.val_steps_per_source[0] if self.val_steps_per_source else None

    def _trainer_now(self) -> Any:
        return self._trainer

    def _peers_per_replica(self) -> int:
        return self.topology.peers_per_replica

    def _default_root(self) -> str | None:
        trainer = getattr(self, "trainer", None)
        return getattr(trainer, "default_root_dir", None) if trainer is not None else None

    # ------------------------------------------------------------------ steps: the run plan's, on this layout
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

    @property
    def reloads_train_loader_every_epoch(self) -> bool:  # type: ignore[override]
        return self.step_sizes_vary  # epochs may differ in microbatches: Lightning reads each epoch's length

    def step_layout(self, epoch: int) -> StepLayout:
        """This replica's microbatches of each step of ``epoch`` (global steps ``epoch × steps_per_epoch`` on)."""
        return self.run_plan.step_layout(epoch, self.dp_size)

    def describe_step(self) -> str:
        return self.run_plan.describe_phases(self.dp_size) if self.step_sizes_vary else super().describe_step()

    # ------------------------------------------------------------------ what the position answers
    def provenance(self, steps: int | Iterable[int], max_replay: int | None = None, untrained: bool = False) -> list:
        """Every piece of every row of the given global optimizer steps (``ProvenanceLedger.provenance``).

        Raises:
            ValueError: as ``ProvenanceLedger.provenance``.
        """
        return self.ledger.provenance(steps, self.position, max_replay, untrained)

    def trained_until(self) -> int:
        """The first step this DataModule does not know the run trained (its position, the ledger's records)."""
        return self.ledger.trained_until(self.position)

    def source_stats(self) -> dict[str, dict[str, float]]:
        """Per training source, over this rank's streams as of the latest step handed out (``Reports``), and
        ``weight``: its share in force at the next step (a mixture controller's journal included)."""
        return self.mixture_control.with_weights(self.reports.source_stats(self.position), self.position)

    def current_shares(self, step: int | None = None) -> dict[str, float]:
        """The shares in force at global step ``step`` (``None``: the next step to train), the journal's included."""
        return self.mixture_control.current_shares(self.position, step)

    def mixture_report(self, run_steps: int, realised: Sequence[int], steps: int) -> list[str]:
        """``inspect``'s mixture lines (none for one corpus), the controller's journal included."""
        return self.mixture_control.report(self.reports.mixture_report(run_steps, realised, steps), self.position)

    def stream_stats(self) -> dict[str, int]:
        """This rank's stream counters so far, summed over its streams; they continue across a resume."""
        return self.reports.stream_stats(self.position)

    def step_metrics(self, rows_by_source: collections.Counter[int]) -> dict[str, float]:
        return self.reports.step_metrics(rows_by_source, self.position)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        """Resolve files, read footers, load the tokenizer, check the layout, size the epoch (counted from the token
        cache or estimated, on rank 0 of a Trainer's processes; nothing is counted where ``steps_per_epoch`` and
        ``val_steps`` are given)."""
        self.resolve_topology()
        corpus, plan = self.corpus, self.run_plan
        # Parsed again: a subclass may have resolved the file specs since construction (the demo's do).
        corpus.sources, train = self._parsed_sources(), None
        reader = corpus.reader(self.settings)
        plan.check_microbatches(self.dp_size)  # raises early when a G is not divisible by D·m
        check_layout(self.num_streams, self.dp_size, self.num_workers)
        if plan.spec is None or stage in (None, "fit"):
            train = corpus.read_train(reader)
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
            self.mixture_control.start(self)

    def _parsed_sources(self) -> Sources:
        return mixture_arguments(self.train_files, self.val_files, self.text_column, self.weights,
                                 self.on_mixture_change, self.allow_shared_files)  # fmt: skip

    # ------------------------------------------------------------------ the resume contract
    def extra_state(self) -> dict[str, Any]:
        """Every stream's state at the last optimizer step, gathered from all ranks (only rank 0 saves), and the
        run plan's state."""
        plan = self.run_plan.state_dict()
        epoch, step = self.saved_position()
        states = self.position.committed_states(step)
        state = {"version": STATE_VERSION, "streams": saved_streams(states, gather=self.dp_size > 1), "plan": plan}
        control = self.mixture_control.state_dict(epoch * (self.steps_per_epoch or 0) + step)
        return state if control is None else {**state, "mixture_control": control}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's position, in its epochs: without ``steps_per_epoch``, the saved epoch length.

        Raises:
            ValueError: as ``SteppedDataModule.load_state_dict``; a saved epoch length that is no positive number.
        """
        if self.restores_training_position():
            keep_epoch_length(state_dict, self.fingerprint, self.run_plan, self.corpus)
        super().load_state_dict(state_dict)

    def other_differences(self, state_dict: dict[str, Any]) -> list[str]:
        """The global batch size and ``seq_len`` (phases) the checkpoint differs in."""
        return shape_differences_of(state_dict, self.run_plan)

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore the streams this rank owns to the checkpoint's last optimizer step, validated first, under the
        checkpoint's plan and the edits asked now (recorded from this step on)."""
        states = {}
        if state is not None:
            states = restored(state, self.run_plan, self.owned_streams, epoch, step, self.on_mixture_change)
        self.position.restart(epoch, step, states, self.step_layout(epoch))
        self.ledger.record(epoch, step, states, resumed=True)
        saved = migrate(state) if state is not None else {}
        self.mixture_control.load_state_dict(saved.get("mixture_control"), epoch * (self.steps_per_epoch or 0) + step,
                                             saved.get("plan", {}).get("mixture"))  # fmt: skip

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> TokenTrainLoader:
        """This rank's training loader of ``PretrainingBatch`` (one epoch per iteration; the same loader, and the
        same running streams, when asked again in a fit)."""
        spec = self.run_plan.require()
        # Held weakly (by track_loader): a loader that refers back to this DataModule must not keep it alive.
        handed = self.handed.get("train")
        if handed is not None and handed.spec is spec:
            return handed
        make = functools.partial(self._train_batch, spec=spec, pin=self.resolve_pin_memory())
        loader = TokenTrainLoader(spec, self.owned_streams, self.num_workers, self.microbatch_size,
                                  lambda epoch: (self.step_layout(epoch), self.steps_in_epoch(epoch)), self.position,
                                  self.start_point, make)  # fmt: skip
        return self.track_loader(loader)

    def _train_batch(self, rows: RowBlock, step_targets: int, spec: MixtureSpec, pin: bool) -> PretrainingBatch:
        return train_batch(rows, step_targets, spec, pin, self.dp_size)

    def complete_batch(self, trainer: Any, batch: Any) -> None:
        """``step_target_tokens`` where padding makes it differ by replica (``StepTargets``)."""
        self.step_targets.complete(trainer, batch, self.topology.peers_per_replica)

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
