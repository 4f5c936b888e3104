"""PretrainingDataModule: parquet → tokens → packed rows, streamed, equal on every rank, exactly resumable.

Pipeline: ``parquet_source`` (files → row groups, a seeded order per pass dealt to (rank, worker)) →
``token_stream`` (read + ``encode_batch_fast`` ahead in a thread, pack with ``token_packing``) →
``token_loader`` (one stream per DataLoader worker, round-robin, position committed per optimizer step) →
pin → transfer. This is the only one of those stages that imports Lightning.

Epochs: the streams never end (each cycles through passes over its row groups, reshuffled every pass), so an
epoch is a *count*: ``steps_per_epoch`` optimizer steps, i.e. ``steps_per_epoch * M`` microbatches on every
rank (M = G / (world_size * microbatch_size)). Every rank yields exactly that many: no DDP hang is possible
from uneven data. The default ``steps_per_epoch`` is one pass's worth, *estimated* from the parquet footers'
row counts and a tokenized sample (see ``token_stream.estimate_pass``), not counted.

Resume: ``state_dict`` holds, for every rank and stream, the stream's position at the last optimizer-step
boundary (gathered to rank 0 with ``all_gather_object``, because Lightning saves only rank 0's checkpoint and
every rank loads it), plus a fingerprint of everything that decides the row sequence. Lightning's own restored
batch counters are aligned to that step (``SteppedDataModule``, shared with ``D9DDataModule``).

Trade-off: sequence is defined per (world_size, num_workers, microbatch_size) layout; a checkpoint from another
layout is refused rather than approximately continued (the per-stream state is designed so that an elastic
re-dealing can be added later).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tokenizers import Tokenizer

from lightning_d9d.checks import microbatches_per_step, non_negative_int, positive_int
from lightning_d9d.datamodules.base import SteppedDataModule
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.resume import Fingerprint
from lightning_d9d.streaming.loader import StreamPosition, TokenTrainLoader, TokenValidationLoader
from lightning_d9d.streaming.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.stream import PACKINGS, StreamSpec, estimate_pass

STATE_VERSION = 1


@dataclass(frozen=True)
class StreamFingerprint(Fingerprint):
    """What decides the rows a stream yields (how documents are batched for the tokenizer does not)."""

    files: str
    text_column: str
    tokenizer: str
    bos_token: str
    seq_len: int
    packing: str
    seed: int
    global_batch_size: int
    bestfit_buffer_size: int


@dataclass
class PretrainingBatch:
    """One microbatch of packed rows.

    Attributes:
        inputs: ``(microbatch_size, seq_len)`` int64 token ids.
        targets: ``(microbatch_size, seq_len)`` int64, ``inputs`` shifted left by one (the next token).
        position_ids: ``(microbatch_size, seq_len)`` int64, 0 at every row start and at every BOS.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return len(self.inputs)


class PretrainingDataModule(SteppedDataModule):
    """Stream parquet text into packed token rows for ``Trainer.fit``, with exact resume.

    Args:
        train_files: a directory, a glob, a file, a ``s3://``/``gs://``/``file://`` (or any fsspec) URL of
            those, or a list of them.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``. Documents are encoded without its
            post-processor's special tokens, truncation or padding: each document is ``bos_token`` + its tokens.
        seq_len: tokens per row of ``inputs`` (each row is cut from ``seq_len + 1`` tokens).
        global_batch_size: rows per optimizer step, summed over ranks and accumulation (G).
        microbatch_size: rows per forward/backward on one rank (m).
        val_files: optional validation files (same forms), read in file order from the start on every run.
        text_column: the column holding the documents.
        bos_token: the token prepended to every document; it must be in the tokenizer's vocabulary.
        packing: ``"bestfit"`` (every row starts at BOS, cropping) or ``"concat"`` (one stream, no waste).
        steps_per_epoch: optimizer steps per Lightning epoch; ``None``: one pass's worth, estimated.
        val_steps: validation microbatches per rank per validation run; ``None``: one pass's worth, estimated.
        num_workers: DataLoader worker processes per rank; each runs one stream and tokenizes on one core, so
            this is the number of cores a rank tokenizes on. 0 runs one stream in the training process, whose
            tokenizer then uses every core.
        tokenizer_batch_size: documents per ``encode_batch_fast`` call, at most (a worker's call also ends at
            ``token_loader.WORKER_CHUNK_CHARS`` characters of text: on one core a larger call is no faster, only
            burstier).
        seed: seeds the row-group order of every pass.
        bestfit_buffer_size: documents best-fit chooses from.
        pin_memory: ``None`` pins exactly when the trainer's device is CUDA; ``True``/``False`` force it.

    Raises:
        ValueError: at construction, a size ≤ 0, an unknown packing, G not divisible by m; in ``setup``, no file
            matches, a file is not parquet or lacks the column, the tokenizer lacks the BOS token, fewer row
            groups than ranks × workers, a dataset too small for one step, G not divisible by world_size × m.
    """

    def __init__(
        self,
        train_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: str | os.PathLike | Tokenizer,
        seq_len: int = 1024,
        global_batch_size: int = 64,
        microbatch_size: int = 8,
        val_files: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        text_column: str = "text",
        bos_token: str = "<|bos|>",
        packing: Literal["bestfit", "concat"] = "bestfit",
        steps_per_epoch: int | None = None,
        val_steps: int | None = None,
        num_workers: int = 2,
        tokenizer_batch_size: int = 128,
        seed: int = 0,
        bestfit_buffer_size: int = 1000,
        pin_memory: bool | None = None,
    ):
        super().__init__()
        self.seq_len = positive_int("seq_len", seq_len)
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.microbatch_size = positive_int("microbatch_size", microbatch_size)
        self.tokenizer_batch_size = positive_int("tokenizer_batch_size", tokenizer_batch_size)
        self.bestfit_buffer_size = positive_int("bestfit_buffer_size", bestfit_buffer_size)
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
        self.yield_packs = False  # SteppedDataModule: one microbatch per batch, accumulation over M

        self.train_spec: StreamSpec | None = None
        self.val_spec: StreamSpec | None = None
        self.steps_per_epoch: int | None = None
        self.val_steps: int | None = None
        self.estimated_pass_tokens: float | None = None
        self.fingerprint: StreamFingerprint | None = None
        self.position = StreamPosition()

    @property
    def streams_per_rank(self) -> int:
        return max(1, self.num_workers)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        """Resolve files, read footers, load the tokenizer, size the epoch; under a Trainer set accumulation."""
        tokenizer = self._load_tokenizer()
        bos_id = tokenizer.token_to_id(self.bos_token)
        if bos_id is None:
            special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values())
            raise ValueError(
                f"the tokenizer has no token bos_token={self.bos_token!r}; its added/special tokens are "
                f"{special}: pass one of them as bos_token or add it to the tokenizer"
            )
        tokenizer_json = tokenizer.to_str()
        _ = self.microbatches_per_step  # raises early when G is not divisible by W·m
        streams = self.world_size * self.streams_per_rank
        if self.train_spec is None or stage in (None, "fit"):
            files = resolve_files(self.train_files, "train_files")
            index = RowGroupIndex.scan(files, self.text_column)
            self._check_enough_groups(index, streams, "train_files")
            self.train_spec = self._spec(index, tokenizer_json, bos_id, shuffle=True, streams=streams)
            tokens, rows = estimate_pass(self.train_spec)
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
            self.fingerprint = self._fingerprint(index, tokenizer_json)
        if self.val_files is not None and (self.val_spec is None or self.val_spec.num_streams != streams):
            index = RowGroupIndex.scan(resolve_files(self.val_files, "val_files"), self.text_column)
            self._check_enough_groups(index, streams, "val_files")
            self.val_spec = self._spec(index, tokenizer_json, bos_id, shuffle=False, streams=streams)
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
        return self.track_loader(
            TokenTrainLoader(
                spec,
                self.rank,
                self.num_workers,
                self.steps_per_epoch * per_step,
                per_step,
                self.position,
                self.start_point,
                self._make_batch,
            )
        )

    def val_dataloader(self) -> TokenValidationLoader | list:
        """The same ``val_steps`` microbatches per rank on every validation run (``[]`` without val_files)."""
        if self.val_files is None:
            return []
        spec = self._require(self.val_spec)
        return TokenValidationLoader(spec, self.rank, self.num_workers, self.val_steps, self._make_batch)

    def stream_stats(self) -> dict[str, int]:
        """This rank's stream counters so far, summed over its streams.

        Keys: ``docs`` read, ``empty`` (empty or null texts skipped), ``tokens`` tokenized, ``emitted`` (tokens in
        rows), ``crops`` (best-fit documents cropped) and ``cropped`` (their dropped remainder tokens). Best-fit's
        yield is ``emitted / tokens``. Counters are as of the latest microbatch (and survive a resume).
        """
        keys = ("docs", "empty", "tokens", "emitted", "crops", "cropped")
        return {key: sum(int(state.get(key, 0)) for state in self.position.states.values()) for key in keys}

    def extra_state(self) -> dict[str, Any]:
        """Every rank's stream states at the last optimizer step (< 100 KiB per stream), and the layout.

        Under DDP it gathers all ranks' states (it runs on every rank while a checkpoint is saved), because
        Lightning writes only rank 0's checkpoint and every rank loads that one.
        """
        _epoch, _step, states = self.position.committed
        mine = {int(sid): _to_saveable(state) for sid, state in states.items()}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        return {"version": STATE_VERSION, "layout": self._layout(), "ranks": ranks}

    def restore_extra_state(self, state: dict[str, Any] | None, epoch: int, step: int) -> None:
        """Restore every stream of this rank to the checkpoint's last optimizer step.

        Raises:
            ValueError: an unknown state version, or another world size / num_workers / microbatch_size.
        """
        if state is None:
            self.position.restart(epoch, step, {}, self.microbatches_per_step)
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"unknown PretrainingDataModule state version {state.get('version')!r}; expected {STATE_VERSION}"
            )
        layout, saved_layout = self._layout(), state["layout"]
        if layout != saved_layout:
            diffs = [
                f"{key}: checkpoint {saved_layout.get(key)!r}, this run {value!r}"
                for key, value in layout.items()
                if saved_layout.get(key) != value
            ]
            raise ValueError(
                "cannot resume the token streams on another layout (" + "; ".join(diffs) + "): the "
                "rows each rank trains depend on it. Resume with the checkpoint's world_size, "
                "num_workers and microbatch_size (elastic resume is not supported yet)"
            )
        states = {int(sid): dict(state) for sid, state in state["ranks"][self.rank].items()}
        self.position.restart(epoch, step, states, self.microbatches_per_step)

    # ------------------------------------------------------------------ internals
    def _make_batch(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor) -> PretrainingBatch:
        batch = PretrainingBatch(inputs, targets, positions)
        return pin_batch(batch) if self._pin else batch

    @property
    def _pin(self) -> bool:
        return self.resolve_pin_memory()

    def _spec(self, index: RowGroupIndex, tokenizer_json: str, bos_id: int, shuffle: bool, streams: int) -> StreamSpec:
        return StreamSpec(
            index=index,
            tokenizer_json=tokenizer_json,
            bos_id=bos_id,
            seq_len=self.seq_len,
            microbatch_size=self.microbatch_size,
            packing=self.packing,
            seed=self.seed,
            shuffle=shuffle,
            num_streams=streams,
            tokenizer_batch_size=self.tokenizer_batch_size,
            buffer_size=self.bestfit_buffer_size,
        )

    def _check_enough_groups(self, index: RowGroupIndex, streams: int, what: str) -> None:
        if len(index) < streams:
            raise ValueError(
                f"{what} hold {len(index)} parquet row groups, fewer than the {streams} streams that read them "
                f"(world_size={self.world_size} x max(1, num_workers={self.num_workers})), so a rank would get no "
                "data: add data, write smaller row groups (pyarrow.parquet.write_table(..., row_group_size=...)), "
                "or use fewer workers"
            )

    def _load_tokenizer(self) -> Tokenizer:
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer
        path = os.fspath(self.tokenizer)
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer={path!r} is not a file: give a tokenizer.json path or a tokenizers.Tokenizer")
        try:
            return Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"tokenizer={path!r} is not a valid tokenizers JSON file: {err}") from err

    def _fingerprint(self, index: RowGroupIndex, tokenizer_json: str) -> StreamFingerprint:
        files = hashlib.sha256()
        for path in index.files:
            files.update(path.encode() + b"\0")
        files.update(index.num_rows.tobytes())
        return StreamFingerprint(
            files=f"{len(index.files)} files, {index.total_rows} rows, sha256 {files.hexdigest()[:16]}",
            text_column=self.text_column,
            tokenizer=f"sha256 {hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]}",
            bos_token=self.bos_token,
            seq_len=self.seq_len,
            packing=self.packing,
            seed=self.seed,
            global_batch_size=self.global_batch_size,
            bestfit_buffer_size=self.bestfit_buffer_size,
        )

    def _layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "num_workers": self.num_workers, "microbatch_size": self.microbatch_size}

    @staticmethod
    def _require(value: Any) -> Any:
        if value is None:
            raise RuntimeError("call dm.setup('fit') first (Trainer.fit does it)")
        return value


def _to_saveable(state: dict[str, Any]) -> dict[str, Any]:
    """Plain ints and an int64 tensor only, so checkpoints load with ``torch.load(weights_only=True)``."""
    out = {key: int(value) for key, value in state.items() if key != "buffer"}
    if "buffer" in state:
        out["buffer"] = torch.as_tensor(state["buffer"], dtype=torch.int64).clone()
    return out
