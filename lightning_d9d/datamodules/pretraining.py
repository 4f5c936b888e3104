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

Trade-off: a larger K serves more layouts but holds K best-fit buffers and starts K streams after every resume;
and a stream is a sequence, so a step's rows come from K places of the corpus rather than from a global shuffle.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from tokenizers import Tokenizer

from lightning_d9d.checks import microbatches_per_step, non_negative_int, positive_int
from lightning_d9d.datamodules.base import OnOrderMismatch, SteppedDataModule
from lightning_d9d.datamodules.pretraining_mixture import (
    SINGLE_SOURCE_NAME,
    OnMixtureChange,
    mixture_arguments,
    mixture_fingerprint,
    mixture_report,
    read_states,
    replace_plan,
    resumed_plan,
    source_stats,
)
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.resume import Fingerprint
from lightning_d9d.streaming.estimate import estimate_pass, first_text
from lightning_d9d.streaming.loader import (
    StreamPosition,
    TokenTrainLoader,
    TokenValidationLoader,
    check_layout,
    rank_streams,
)
from lightning_d9d.streaming.mixture import MixturePlan
from lightning_d9d.streaming.mixture_stream import MixtureSpec
from lightning_d9d.streaming.packing import microbatch_tensors, split_microbatch_tensors
from lightning_d9d.streaming.reader import DEFAULT_MAX_DOCUMENT_CHARS
from lightning_d9d.streaming.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.state import mapping
from lightning_d9d.streaming.storage import DEFAULT_READ_RETRY_SECONDS, Storage
from lightning_d9d.streaming.stream import PACKINGS, RowBlock, StreamCounters, StreamSpec, StreamState
from lightning_d9d.tokenizer import pad_token_id, read_tokenizer

STATE_VERSION = 3  # 3: each stream's state nests its packing's (with a kind), which nests its reader's
READABLE_STATE_VERSIONS = (2, 3)  # 2: the stream's, packing's and reader's fields side by side
DEFAULT_NUM_STREAMS = 16


@dataclass(frozen=True)
class StreamFingerprint(Fingerprint):
    """What decides the rows of every step (how documents are batched for the tokenizer does not).

    ``file_digests`` holds one footer digest per file (row counts, sizes and text statistics of its row
    groups), so a file rewritten with other text is noticed and named; ``file_labels`` only names files in
    messages and is not compared.
    """

    files: str
    file_digests: tuple[int, ...]
    text_column: str
    tokenizer: str
    bos_token: str
    seq_len: int
    packing: str
    seed: int
    global_batch_size: int
    num_streams: int
    bestfit_buffer_size: int
    # Checkpoints from before the cap had none; the default cap changes no row of an ordinary corpus.
    max_document_chars: int | None = field(
        default=DEFAULT_MAX_DOCUMENT_CHARS, metadata={"when_missing": (None, DEFAULT_MAX_DOCUMENT_CHARS)}
    )
    file_labels: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def describe_difference(self, name: str, then: Any, now: Any) -> str:
        if name != "file_digests":
            return super().describe_difference(name, then, now)
        if not isinstance(then, list):
            return super().describe_difference(name, then, now)
        if len(then) != len(now):
            return f"file_digests: checkpoint {len(then)} files, this run {len(now)}"
        changed = [i for i, (a, b) in enumerate(zip(then, now)) if a != b]
        names = [self.file_labels[i] if i < len(self.file_labels) else f"file {i}" for i in changed]
        shown = ", ".join(repr(name) for name in names[:5]) + (" ..." if len(names) > 5 else "")
        return f"files: {len(changed)} of {len(now)} changed since the checkpoint ({shown})"


@dataclass
class PretrainingBatch:
    """One microbatch of packed rows.

    Attributes:
        inputs: ``(microbatch_size, seq_len)`` int64 token ids.
        targets: ``(microbatch_size, seq_len)`` int64: the next token of each input; ``-100`` (PyTorch's
            ``ignore_index``) where there is none (``bestfit_split``: padding, and where a continuation chunk
            follows another document). ``bestfit_split``'s padding inputs are the tokenizer's pad token (or a
            usual pad token, else any id but BOS).
        position_ids: ``(microbatch_size, seq_len)`` int64: 0 at every row start and every document start
            (BOS), and, for ``bestfit_split``, at every chunk start and every padding run, counting up from there.
        sources: (a property) ``(microbatch_size,)`` int64: the index of each row's source in
            ``dm.source_names`` (all 0 for a single corpus); in a validation batch of per-source validation, its
            loader's index in ``dm.val_source_names``. ``row_sources`` holds it, ``None`` for a single corpus.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    row_sources: torch.Tensor | None = None

    @property
    def sources(self) -> torch.Tensor:
        """``(microbatch_size,)`` int64, each row's source (see the class docstring)."""
        if self.row_sources is None:  # one corpus: no tensor travels, every row is of source 0
            return torch.zeros(len(self.inputs), dtype=torch.int64, device=self.inputs.device)
        return self.row_sources

    def __len__(self) -> int:
        return len(self.inputs)


class PretrainingDataModule(SteppedDataModule):
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
            ``dataloader_idx``; ``dm.val_source_names``).
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

    Raises:
        ValueError: at construction, a size ≤ 0, an unknown packing, G not divisible by m; in ``setup``, no file
            matches, a file is not parquet or lacks the column, the files hold no text, the tokenizer lacks the
            BOS token, a layout that cannot share K streams (naming K, the world size, ``num_workers`` and what
            would be valid), a dataset too small for one step, a text that is not valid UTF-8 (naming the file,
            row group and row; also when met later, while streaming).
        StorageError: in ``setup`` (an ``OSError``), a URL could not be listed or opened (unreachable endpoint,
            refused credentials, access denied), naming the URL and the cause; while streaming, a read that kept
            failing for ``read_retry_seconds``.
    """

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
    ):
        super().__init__()
        self.seq_len = positive_int("seq_len", seq_len)
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        self.tokenizer_batch_size = positive_int("tokenizer_batch_size", tokenizer_batch_size)
        self.bestfit_buffer_size = positive_int("bestfit_buffer_size", bestfit_buffer_size)
        self.max_document_chars = positive_int("max_document_chars", max_document_chars, allow_none=True)
        self.num_streams = positive_int("num_streams", num_streams)
        self._steps_per_epoch_arg = positive_int("steps_per_epoch", steps_per_epoch, allow_none=True)
        self._val_steps_arg = positive_int("val_steps", val_steps, allow_none=True)
        microbatches_per_step(self.global_batch_size, 1, self.microbatch_size)  # G must be a multiple of m
        if packing not in PACKINGS:
            raise ValueError(f"packing={packing!r} is not valid: use one of {list(PACKINGS)}")
        if not isinstance(text_column, str) or not text_column:
            raise ValueError(f"text_column must be a non-empty column name, got {text_column!r}")
        self.train_files, self.val_files, self.tokenizer = train_files, val_files, tokenizer
        self.text_column, self.bos_token, self.packing = text_column, bos_token, packing
        self.num_workers = non_negative_int("num_workers", num_workers)
        self.seed, self.pin_memory = non_negative_int("seed", seed), pin_memory
        self.on_order_mismatch = on_order_mismatch
        self.storage = storage_of(storage_options, read_retry_seconds)
        self.on_mixture_change, self.weights = on_mixture_change, weights
        self.train_sources, self.val_sources, self.schedule = mixture_arguments(
            train_files, val_files, text_column, weights, on_mixture_change
        )
        self.yield_packs = False  # SteppedDataModule: one microbatch per batch, accumulation over M

        self.train_spec: StreamSpec | None = None
        self.val_spec: StreamSpec | None = None
        self.val_specs: list[StreamSpec] = []  # one per validation source (a mapping val_files)
        self.source_pass_rows: dict[str, float] = {}  # estimated rows of one pass over each source
        self.steps_per_epoch: int | None = None  # type: ignore[assignment]
        self.val_steps: int | None = None
        self.estimated_pass_tokens: float | None = None
        self.fingerprint: StreamFingerprint | None = None
        self.position = StreamPosition()

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
        self.train_sources, self.val_sources, self.schedule = mixture_arguments(
            self.train_files, self.val_files, self.text_column, self.weights, self.on_mixture_change
        )
        tokenizer = read_tokenizer(self.tokenizer)
        bos_id = tokenizer.token_to_id(self.bos_token)
        if bos_id is None:
            special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values())
            raise ValueError(
                f"the tokenizer has no token bos_token={self.bos_token!r}; its added/special tokens are "
                f"{special}: pass one of them as bos_token or add it to the tokenizer"
            )
        tokenizer_json = tokenizer.to_str()
        # BOS marks document starts, so padding must not use it.
        self._pad_id = pad_token_id(tokenizer, avoid=bos_id)
        _ = self.microbatches_per_step  # raises early when G is not divisible by W·m
        check_layout(self.num_streams, self.global_batch_size, self.world_size, self.num_workers)
        if self.train_spec is None or stage in (None, "fit"):
            if self.train_sources is None:
                index = self._scan(self.train_files, "train_files")
                self.train_spec = self._spec(index, tokenizer_json, bos_id, shuffle=True)
                tokens, rows = estimate_pass(self.train_spec)
                self.source_pass_rows = {SINGLE_SOURCE_NAME: rows}
                self.fingerprint = self._fingerprint(index, tokenizer_json)
            else:
                tokens, rows = self._setup_mixture(tokenizer_json, bos_id)
            self.estimated_pass_tokens = tokens
            if self._steps_per_epoch_arg is not None:
                self.steps_per_epoch = self._steps_per_epoch_arg
            else:
                self.steps_per_epoch = int(rows // self.global_batch_size)
                if self.steps_per_epoch < 1:
                    raise ValueError(
                        f"train_files are too small for one optimizer step: about {tokens:.0f} tokens "
                        f"({rows:.1f} rows of seq_len+1={self.seq_len + 1}) per pass, but one step takes "
                        f"global_batch_size={self.global_batch_size} rows; add data, lower seq_len or "
                        "global_batch_size, or set steps_per_epoch to cycle the data"
                    )
        if self.val_sources is not None and not self.val_specs:
            self._setup_val_sources(tokenizer_json, bos_id)
        elif self.val_files is not None and self.val_sources is None and self.val_spec is None:
            index = self._scan(self.val_files, "val_files")
            self.val_spec = self._spec(index, tokenizer_json, bos_id, shuffle=False)
            if self._val_steps_arg is not None:
                self.val_steps = self._val_steps_arg
            else:
                _, rows = estimate_pass(self.val_spec)
                self.val_steps = max(1, int(rows // (self.world_size * self.microbatch_size)))
        if stage in (None, "fit"):
            self.start_fit(
                StreamPosition(
                    microbatches_per_step=self.microbatches_per_step, generation=self.position.generation + 1
                )
            )

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
            self._make_batch,
        )
        return self.track_loader(loader)

    @property
    def source_names(self) -> list[str]:
        """The training sources, in order (``PretrainingBatch.sources`` indexes it); ``["train"]`` for one corpus."""
        return [s.name for s in self.train_sources] if self.train_sources is not None else [SINGLE_SOURCE_NAME]

    @property
    def val_source_names(self) -> list[str]:
        """The validation sources, in the order of their loaders (Lightning's ``dataloader_idx``)."""
        if self.val_files is None:
            return []
        return [s.name for s in self.val_sources] if self.val_sources is not None else ["val"]

    def source_stats(self) -> dict[str, dict[str, float]]:
        """Per training source, as of the latest step handed out, over the streams this rank owns: ``rows``,
        ``tokens`` (document tokens in rows), ``documents`` (taken by the packer), ``padding``, ``too_long``
        (documents over ``max_document_chars`` skipped) and ``passes``
        (passes read, fractional: the mean over the rank's streams; the run's figure with one rank)."""
        return source_stats(self._require(self.train_spec), self.source_names, self.position.states)

    def mixture_report(self, run_steps: int, realised: Sequence[int], steps: int) -> list[str]:
        """``inspect``'s lines on the mixture (none for one corpus): phases, expected passes of each source over
        ``run_steps`` steps, and the realised shares (``realised`` rows per source) of the first ``steps``."""
        spec = self._require(self.train_spec)
        if not isinstance(spec, MixtureSpec):
            return []
        return mixture_report(spec, self.source_pass_rows, run_steps, realised, steps)

    def val_dataloader(self) -> TokenValidationLoader | list:
        """The same ``val_steps`` microbatches per rank on every validation run (``[]`` without val_files)."""
        if self.val_files is None:
            return []
        if self.val_sources is not None:
            return [
                TokenValidationLoader(
                    spec, self.owned_streams, self.num_workers, self.microbatch_size, steps,
                    functools.partial(self._make_batch, source=j),
                )
                for j, (spec, steps) in enumerate(zip(self.val_specs, self.val_steps_per_source))
            ]  # fmt: skip
        spec = self._require(self.val_spec)
        return TokenValidationLoader(
            spec, self.owned_streams, self.num_workers, self.microbatch_size, self.val_steps, self._make_batch
        )

    def stream_stats(self) -> dict[str, int]:
        """This rank's stream counters so far, summed over the streams it owns (see ``StreamCounters``).

        Keys: ``docs`` (documents taken by the packer), ``empty`` (null or empty texts skipped),
        ``text_free_units`` (units skipped for holding no text), ``too_long`` (documents over
        ``max_document_chars`` skipped), ``tokens`` (tokens of the documents taken,
        BOS included), ``emitted`` (document tokens in rows), ``padding`` (padding tokens in rows,
        ``bestfit_split``), ``crops``/``cropped`` (documents cropped and their dropped tokens, ``bestfit``),
        ``split_docs``/``chunks`` (documents split and their pieces, ``bestfit_split``), ``rows``. Counters are
        as of the latest step handed out, and continue across a resume.
        """
        totals = StreamCounters().to_dict()
        for state in self.position.states.values():
            for key, value in state.counters.to_dict().items():
                totals[key] += value
        return totals

    # ------------------------------------------------------------------ the resume contract
    def extra_state(self) -> dict[str, Any]:
        """Every stream's state at the last optimizer step (gathered from all ranks under DDP).

        Under DDP it gathers, because it runs on every rank while a checkpoint is saved but Lightning writes only
        rank 0's checkpoint, which every rank then loads.
        """
        _epoch, step = self.saved_position()
        states = self.position.committed_states(step)
        mine = {int(sid): _saveable(state.to_dict()) for sid, state in states.items()}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        streams = {sid: state for rank in ranks for sid, state in rank.items()}
        if isinstance(self.train_spec, MixtureSpec):
            return {"version": STATE_VERSION, "streams": streams, "mixture": self.train_spec.plan.to_dict()}
        return {"version": STATE_VERSION, "streams": streams}

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore the streams this rank owns to the checkpoint's last optimizer step.

        Every stream state is validated against this run's data before anything runs from it.

        Raises:
            ValueError: an unknown state version, or a state that lacks a stream this rank owns.
            InvalidDataState: (a ValueError) a stream state with a missing, mistyped or out-of-range field,
                naming its path (``streams.<stream>.packing.reader.slot``), its value and what is valid.
        """
        if state is None:
            self.position.restart(epoch, step, {}, self.microbatches_per_step)
            return
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(
                f"unknown PretrainingDataModule state version {state.get('version')!r} (this version reads "
                f"{list(READABLE_STATE_VERSIONS)}): the checkpoint was written by another version of lightning_d9d"
            )
        saved = mapping(state.get("streams"), "streams")
        missing = [sid for sid in self.owned_streams if sid not in saved and str(sid) not in saved]
        if missing and step > 0:
            raise ValueError(f"the checkpoint's data state lacks streams {missing} (it holds {sorted(saved)})")
        spec = self._require(self.train_spec)
        if isinstance(spec, MixtureSpec):
            self._restore_mixture(state, saved, epoch, step)
            return
        states = {}
        for sid in self.owned_streams:
            if sid in missing:
                continue
            path = f"streams.{sid}"
            stream_state = StreamState.from_dict(_loaded(saved.get(sid, saved.get(str(sid)))), spec.packing, path)
            stream_state.check(spec, sid, path)
            states[sid] = stream_state
        self.position.restart(epoch, step, states, self.microbatches_per_step)

    def _restore_mixture(self, state: dict[str, Any], saved: Any, epoch: int, step: int) -> None:
        """Restore a mixture's streams; the plan is the checkpoint's, or continued under new shares."""
        spec = self.train_spec
        states = read_states(saved, self.owned_streams, spec.packing, _loaded)
        plan = resumed_plan(spec, state.get("mixture"), states, self.on_mixture_change)
        self.train_spec = spec = replace_plan(spec, plan)
        for sid, stream_state in states.items():
            stream_state.check(spec, sid, f"streams.{sid}")
        self.position.restart(epoch, step, states, self.microbatches_per_step)

    # ------------------------------------------------------------------ internals
    def _make_batch(self, rows: RowBlock, source: int | None = None) -> PretrainingBatch:
        if rows.flags is None:
            tensors = microbatch_tensors(rows.tokens, self._require(self.train_spec).bos_id)
        else:
            tensors = split_microbatch_tensors(rows.tokens, rows.flags)
        if rows.sources is not None:
            sources = torch.from_numpy(np.array(rows.sources, np.int64))
        elif self.val_sources is not None and source is not None:
            sources = torch.full((len(rows),), source, dtype=torch.int64)
        else:
            sources = None
        batch = PretrainingBatch(*tensors, sources)
        return pin_batch(batch) if self._pin else batch

    def _setup_mixture(self, tokenizer_json: str, bos_id: int) -> tuple[float, float]:
        """Scan every source, plan the mixture; returns the tokens and rows of one pass over all sources."""
        specs, indexes, total_tokens = [], [], 0.0
        for source in self.train_sources:
            index = self._scan(source.files, f"train_files[{source.name!r}]", source.text_column)
            try:
                spec = self._spec(index, tokenizer_json, bos_id, shuffle=True)
            except ValueError as error:  # too few rows for K streams: say which source
                raise ValueError(f"train_files[{source.name!r}]: {error}") from error
            tokens, self.source_pass_rows[source.name] = estimate_pass(spec)
            specs.append(spec)
            indexes.append(index)
            total_tokens += tokens
        plan = MixturePlan(self.schedule, self.global_batch_size)
        self.train_spec = MixtureSpec(tuple(self.source_names), tuple(specs), plan)
        self.fingerprint = mixture_fingerprint(
            self.train_sources, indexes, tokenizer=_tokenizer_digest(tokenizer_json), bos_token=self.bos_token,
            seq_len=self.seq_len, packing=self.packing, seed=self.seed, global_batch_size=self.global_batch_size,
            num_streams=self.num_streams, bestfit_buffer_size=self.bestfit_buffer_size,
        )  # fmt: skip
        return total_tokens, sum(self.source_pass_rows.values())

    def _setup_val_sources(self, tokenizer_json: str, bos_id: int) -> None:
        self.val_specs, self.val_steps_per_source = [], []
        for source in self.val_sources:
            index = self._scan(source.files, f"val_files[{source.name!r}]", source.text_column)
            spec = self._spec(index, tokenizer_json, bos_id, shuffle=False)
            self.val_specs.append(spec)
            if self._val_steps_arg is not None:
                self.val_steps_per_source.append(self._val_steps_arg)
            else:
                _, rows = estimate_pass(spec)
                self.val_steps_per_source.append(max(1, int(rows // (self.world_size * self.microbatch_size))))

    @property
    def _pin(self) -> bool:
        return self.resolve_pin_memory()

    def _scan(self, files: Any, what: str, text_column: str | None = None) -> RowGroupIndex:
        text_column = text_column or self.text_column
        index = RowGroupIndex.scan(resolve_files(files, what, self.storage), text_column, self.storage)
        if first_text(index) is None:
            raise ValueError(
                f"{what} hold no text: every value of column {text_column!r} in {len(index.files)} file(s) "
                f"({index.total_rows} rows) is null or empty"
            )
        return index

    def _spec(self, index: RowGroupIndex, tokenizer_json: str, bos_id: int, shuffle: bool) -> StreamSpec:
        return StreamSpec(
            index=index,
            units=Units.of(index, self.num_streams),
            tokenizer_json=tokenizer_json,
            bos_id=bos_id,
            seq_len=self.seq_len,
            rows_per_block=self.global_batch_size // self.num_streams,
            packing=self.packing,
            seed=self.seed,
            shuffle=shuffle,
            num_streams=self.num_streams,
            tokenizer_batch_size=self.tokenizer_batch_size,
            buffer_size=self.bestfit_buffer_size,
            pad_id=self._pad_id,
            max_document_chars=self.max_document_chars,
        )

    def _fingerprint(self, index: RowGroupIndex, tokenizer_json: str) -> StreamFingerprint:
        labels = index.file_labels()
        files = hashlib.sha256()
        for label, digest in zip(labels, index.file_digests):
            files.update(f"{label}\0{digest}\0".encode())
        return StreamFingerprint(
            files=f"{len(index.files)} files, {index.total_rows} rows, sha256 {files.hexdigest()[:16]}",
            file_digests=tuple(index.file_digests),
            text_column=self.text_column,
            tokenizer=_tokenizer_digest(tokenizer_json),
            bos_token=self.bos_token,
            seq_len=self.seq_len,
            packing=self.packing,
            seed=self.seed,
            global_batch_size=self.global_batch_size,
            num_streams=self.num_streams,
            bestfit_buffer_size=self.bestfit_buffer_size,
            max_document_chars=self.max_document_chars,
            file_labels=tuple(labels),
        )

    @staticmethod
    def _require(value: Any) -> Any:
        if value is None:
            raise RuntimeError("call dm.setup('fit') first (Trainer.fit does it)")
        return value


def _tokenizer_digest(tokenizer_json: str) -> str:
    return f"sha256 {hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]}"


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
    """The inverse of ``_saveable``: tensors back to numpy."""
    if isinstance(value, dict):
        return {key: _loaded(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return value
