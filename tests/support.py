"""What the tests share: real test data, one recording module, one checkpoint callback, one fit.

* Data: ``LengthDataset`` (map-style, heavy-tailed lengths), ``make_docs``/``write_parquet`` (real parquet
  files), ``make_texts`` and ``train_tokenizer`` (a real ``tokenizers`` tokenizer trained on the test text).
* ``RecordingModule``: trains one weight and appends one JSON line per microbatch it trains or validates
  (run, kind, epoch, global step, batch_idx, rank, the sample ids when the batch carries them, and a digest of
  every tensor) to ``<record_dir>/records-rank<R>.jsonl``.
* ``BatchRecorder``: the same records as a callback, for the CLI's runs of the demo model.
* ``SaveAtBatch``: saves a checkpoint at given (epoch, batch_idx) points, mid accumulation window like a
  time-based checkpoint would.
* ``fit(config)``: builds a D9DDataModule, TextDataModule or PretrainingDataModule from a JSON-able config and
  runs every fit of ``config["runs"]`` in turn (a run may name its strategy: ``"ddp"`` or
  ``[data_parallel_size, tensor_parallel_size]`` for Lightning's ``ModelParallelStrategy``);
  ``tests/fit_script.py`` runs it as a script, because Lightning's DDP launcher re-runs the main script in each
  rank's process (so DDP start-up is paid once for several fits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_d9d import D9DDataModule, PretrainingBatch, PretrainingDataModule, SeededPermutation, TextDataModule
from lightning_d9d.core.digest import Hasher
from lightning_d9d.parallel.peer_check import NothingToCompareWarning
from lightning_d9d.parallel.topology import DataParallelTopology
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.plans.packings import BufferGrowth
from lightning_d9d.streaming.plans.spec import MixtureSpec, StreamSettings, StreamSpec
from lightning_d9d.streaming.sources.source import Units

TESTS = Path(__file__).resolve().parent
BOS = "<|bos|>"
WORDS = [f"w{chr(97 + i)}{chr(97 + j)}" for i in range(26) for j in range(8)]  # 208 distinct "words"


# ------------------------------------------------------------------------------------------------ test data
class LengthDataset(torch.utils.data.Dataset):
    """N samples with heavy-tailed (log-normal) lengths; a sample is its id and a row of ``length`` ones."""

    def __init__(self, size: int, seed: int = 0):
        self.lengths = np.clip(np.random.default_rng(seed).lognormal(3.0, 1.0, size).astype(np.int64), 1, 2000)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "tokens": torch.ones(int(self.lengths[index]))}

    def sort_key(self, index: int) -> int:
        return int(self.lengths[index])


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(sample["tokens"]) for sample in samples)
    tokens = torch.zeros(len(samples), longest)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample["tokens"])] = sample["tokens"]
    return {"ids": torch.tensor([sample["id"] for sample in samples]), "tokens": tokens}


def make_docs(
    n: int,
    seed: int = 0,
    long_every: int = 7,
    max_words: int = 60,
    long_words: int = 400,
    empties: bool = True,
) -> list[str | None]:
    """Documents of random words; every ``long_every``-th is long; some are empty or null."""
    rng = random.Random(seed)
    docs: list[str | None] = []
    for i in range(n):
        if empties and i % 23 == 5:
            docs.append(None if i % 2 else "")
            continue
        length = rng.randint(long_words // 2, long_words) if i % long_every == 3 else rng.randint(1, max_words)
        docs.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return docs


def make_texts(count: int, seed: int = 0) -> list[str]:
    """Documents with heavy-tailed word counts (like real text), plus an empty one that must be dropped."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(12), 0.9, size=count), 1, 200).astype(int)
    texts = [" ".join(rng.choice(WORDS[:19], size=n)) for n in lengths]
    texts[3] = ""
    return texts


def write_parquet(
    directory: Path, docs: list[str | None], files: int = 3, row_group_size: int = 20, column: str = "text"
) -> list[Path]:
    """Split ``docs`` over ``files`` parquet files with small row groups."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    paths = []
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        path = directory / f"part-{f:03d}.parquet"
        table = pa.table({column: pa.array(part, pa.string()), "id": list(range(len(part)))})
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def train_tokenizer(
    texts: list[str | None],
    path: Path | None = None,
    kind: str = "word",
    bos: str | None = BOS,
    vocab_size: int = 300,
) -> Tokenizer:
    """A real tokenizer trained on ``texts``, saved to ``path`` if given.

    ``kind="word"``: WordLevel over whitespace-split words, with ``<unk>`` and ``bos`` as special tokens
    (decoding joins words with spaces). ``kind="bpe"``: byte-level BPE with ``<pad>`` and ``<eos>``, whose
    post-processor appends ``<eos>`` to every document (as a fine-tuning tokenizer would).
    """
    texts = [text for text in texts if text]
    if kind == "word":
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        special = ["<unk>"] + ([bos] if bos else [])
        tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=special, show_progress=False))
    elif kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        eos = tokenizer.token_to_id("<eos>")
        tokenizer.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", eos)])
    else:
        raise ValueError(f"kind must be 'word' or 'bpe', got {kind!r}")
    if path is not None:
        tokenizer.save(str(path))
    return tokenizer


# ------------------------------------------------------------------------------------------------ recording
def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch (dict, dataclass, list), in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if dataclasses.is_dataclass(batch):
        return [t for field in dataclasses.fields(batch) for t in tensors_of(getattr(batch, field.name))]
    if isinstance(batch, dict):
        return [t for key in sorted(batch) for t in tensors_of(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in tensors_of(item)]
    return []


def digest(batch: Any) -> str:
    """The digest of a batch's tensors' bytes, in field order."""
    return Hasher().add(*(t.detach().cpu().contiguous().numpy().tobytes() for t in tensors_of(batch))).hexdigest()


class RecordingModule(pl.LightningModule):
    """Trains one weight and appends one JSON line per trained or validated microbatch.

    Args:
        record_dir: where ``records-rank<R>.jsonl`` (and ``val-rank<R>.jsonl``) are appended to.
        run: a name written into every record.
        packs: batches are packs of microbatches (manual optimization, one optimizer step per pack).
        use_estimated_steps: ask for ``trainer.estimated_stepping_batches`` in ``configure_optimizers``
            (with Lightning's own loader restore, doing so leaves the loader's state unloaded).
        kill_at_step: SIGKILL this process at this global step, like a preempted job.
    """

    def __init__(
        self,
        record_dir: str,
        run: str = "",
        packs: bool = False,
        use_estimated_steps: bool = False,
        kill_at_step: int | None = None,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.record_dir, self.run, self.packs = record_dir, run, packs
        self.use_estimated_steps, self.kill_at_step = use_estimated_steps, kill_at_step
        self.automatic_optimization = not packs
        Path(record_dir).mkdir(parents=True, exist_ok=True)

    def _record(self, kind: str, batch: Any, batch_idx: int) -> None:
        line: dict[str, Any] = {
            "run": self.run,
            "kind": kind,
            "epoch": self.current_epoch,
            "step": self.global_step,
            "rank": self.global_rank,
            "dp_rank": getattr(self.trainer.datamodule, "dp_rank", self.global_rank),
            "accumulate": self.trainer.accumulate_grad_batches,
            "batch_idx": batch_idx,
            "digest": digest(batch),
        }
        if isinstance(batch, dict) and "ids" in batch:
            line["ids"] = batch["ids"].tolist()
        if isinstance(batch, PretrainingBatch):  # packed rows: a digest per row, to compare steps as multisets
            line["rows"] = [
                digest([batch.input_ids[i], batch.targets[i], batch.position_ids[i]]) for i in range(len(batch))
            ]
            line["seq_len"], line["step_targets"] = batch.input_ids.shape[1], batch.step_target_tokens
            line["targets"] = int((batch.targets != -100).sum())
        if kind == "train" and not self.packs:  # what the gradient of this microbatch's loss depends on
            line["scale"], line["weight"] = self._scale(batch), float(self._weight().detach())
        prefix = "records" if kind == "train" else "val"
        with open(Path(self.record_dir) / f"{prefix}-rank{self.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")

    @staticmethod
    def _scale(batch: Any) -> float:
        return sum(float(t.double().sum()) for t in tensors_of(batch)) / 1e4

    def _weight(self) -> torch.Tensor:
        return self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight

    def _loss(self, batch: Any) -> torch.Tensor:
        return ((self._weight() - self._scale(batch)) ** 2).mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Records each optimizer step's accumulated gradient (``steps-rank<R>.jsonl``)."""
        grad = self._weight().grad
        line = {"run": self.run, "step": self.global_step, "grad": None if grad is None else float(grad.sum())}
        with open(Path(self.record_dir) / f"steps-rank{self.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.kill_at_step is not None and self.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # die like a preempted job: no cleanup, no final checkpoint
        if not self.packs:
            self._record("train", batch, batch_idx)
            return self._loss(batch)
        optimizer = self.optimizers()
        for microbatch in batch:
            self._record("train", microbatch, batch_idx)
            self.manual_backward(self._loss(microbatch) / len(batch))
        optimizer.step()
        optimizer.zero_grad()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("val", batch, batch_idx)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy (which requires this hook) the weight becomes a DTensor replicated over the
        mesh: the strategy saves and loads only distributed modules."""
        mesh = self.device_mesh
        if mesh is not None and not hasattr(self.weight, "to_local"):
            from torch.distributed.tensor import Replicate, distribute_tensor

            placements = [Replicate()] * mesh.ndim
            self.weight = torch.nn.Parameter(distribute_tensor(self.weight.data, mesh, placements))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.use_estimated_steps:
            assert self.trainer.estimated_stepping_batches > 0
        # Momentum under ModelParallelStrategy: its loader cannot restore an optimizer state without entries.
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9 if self.device_mesh is not None else 0)


class SaveAtBatch(pl.Callback):
    """Saves ``mid-e<epoch>-b<batch_idx>.ckpt`` at given (epoch, batch_idx) points, possibly mid-window."""

    def __init__(self, dirpath: str, points: list[list[int]]):
        self.dirpath, self.points = dirpath, {tuple(point) for point in points}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch_idx = args[-1]
        if (trainer.current_epoch, batch_idx) in self.points:
            trainer.save_checkpoint(f"{self.dirpath}/mid-e{trainer.current_epoch}-b{batch_idx}.ckpt")


class BatchRecorder(pl.Callback):
    """Appends (optimizer step, epoch, batch_idx, digest) of every training microbatch to ``$<ENV>``.

    For runs whose module is not a ``RecordingModule`` (the CLI's demo model): name it in ``trainer.callbacks``.
    """

    ENV = "LIGHTNING_D9D_TEST_RECORD"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": idx, "sha": digest(batch)}
        with open(os.environ[self.ENV], "a") as file:
            file.write(json.dumps(record) + "\n")


def read_records(record_dir: str | Path, kind: str = "train", run: str | None = None) -> list[dict[str, Any]]:
    """Every record of ``kind`` (``"train"`` or ``"val"``) over all ranks, in training order."""
    prefix = "records" if kind == "train" else "val"
    records = []
    for path in sorted(Path(record_dir).glob(f"{prefix}-rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    if run is not None:
        records = [r for r in records if r["run"] == run]
    return sorted(records, key=lambda r: (r["run"], r["epoch"], r["step"], r["rank"], r["batch_idx"]))


# ------------------------------------------------------------------------------------------------ fitting
class DealtByProcess(D9DDataModule):
    """A broken D9DDataModule that deals its training data by process (wrong under model parallelism: peers get
    different rows), for the peer check to catch."""

    def train_dataloader(self):  # type: ignore[override]
        trainer = self.trainer
        return self.track_loader(
            self._train_loader(trainer.world_size, trainer.global_rank, self.position, self.start_point)
        )


class DealtByOwnMesh(D9DDataModule):
    """A D9DDataModule whose ``data_parallel`` comes from a ``DeviceMesh`` of the user's, built at ``setup`` (the
    process group exists then). ``mesh``: ``shape``, ``names``, and ``dims`` (absent: the mesh itself is passed;
    a list: ``DataParallelTopology.from_device_mesh(mesh, dims)``)."""

    def __init__(self, *args: Any, mesh: dict[str, Any], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._mesh = mesh

    def setup(self, stage: str | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        own = init_device_mesh("cpu", tuple(self._mesh["shape"]), mesh_dim_names=tuple(self._mesh["names"]))
        dims = self._mesh.get("dims")
        self.data_parallel = own if dims is None else DataParallelTopology.from_device_mesh(own, dims)
        super().setup(stage)


_D9D_KINDS = {"d9d": D9DDataModule, "d9d_by_process": DealtByProcess, "d9d_mesh": DealtByOwnMesh}


class CacheFillingDataModule(PretrainingDataModule):
    """Rank 1 fills the token cache during its setup (every unit tokenized and stored, in its own process), after the
    processes met to confirm their layout and before it sizes the epoch, while rank 0 goes on at once: each would
    count another pass if it counted its own. Every rank writes its ``steps_per_epoch`` to
    ``<record_dir>/epochs-rank<R>.txt``."""

    def __init__(self, *args: Any, record_dir: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.record_dir, self.filled = record_dir, False

    def resolve_topology(self) -> Any:
        topology = super().resolve_topology()  # a collective: both processes are in setup from here on
        if self.trainer.global_rank == 1 and not self.filled:
            self.filled = True
            fill_token_cache(self.train_files, self.tokenizer, self.token_cache, seq_len=self.seq_len,
                             num_streams=self.num_streams, global_batch_size=self.global_batch_size,
                             max_document_chars=self.max_document_chars)  # fmt: skip
        return topology

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        (Path(self.record_dir) / f"epochs-rank{self.trainer.global_rank}.txt").write_text(str(self.steps_per_epoch))


def fill_token_cache(train_files: Any, tokenizer: Any, cache: str, **options: Any) -> int:
    """Read passes with ``cache`` until it holds every unit with rows that may hold text (in this process); the
    batches read."""
    options.setdefault("microbatch_size", options.get("global_batch_size", 8))
    dm = PretrainingDataModule(train_files, tokenizer, token_cache=cache, steps_per_epoch=10**6, num_workers=0,
                               **options)  # fmt: skip
    dm.setup("fit")
    sources = dm.train_spec.sources
    wanted = [int((~source.index.text_free[source.units.group]).sum()) for source in sources]
    batches, read = iter(dm.train_dataloader()), 0
    while _covered(sources) != wanted:
        for _ in range(4):
            next(batches)
        read += 4
        assert read < 100_000, "the token cache does not fill"
    dm.teardown("fit")
    return read


def _covered(sources: Any) -> list[int] | None:
    """Units cached per source; ``None`` where a listing met a folder being made (the streams store meanwhile)."""
    try:
        return [source.cache.coverage(source.units).cached for source in sources]
    except OSError:
        return None


def build_datamodule(config: dict[str, Any]) -> pl.LightningDataModule:
    """A D9DDataModule over ``LengthDataset`` (``config["data"]``: ``"d9d"``, ``"d9d_by_process"`` for the broken
    one, ``"d9d_mesh"`` for ``DealtByOwnMesh``), a TextDataModule (``"text"``) or a PretrainingDataModule
    (``"pretraining"``; ``"pretraining_cache_filling"``: ``CacheFillingDataModule``)."""
    options = dict(config.get("options", {}))
    data = config.get("data", "d9d")
    if data in _D9D_KINDS:
        size, val_size = options.pop("size", 200), options.pop("val_size", None)
        options.setdefault("sort_buffer_size", 64)
        return _D9D_KINDS[data](
            LengthDataset(size),
            pad_collate,
            val_dataset=LengthDataset(val_size, seed=1) if val_size else None,
            **options,
        )
    if data == "text":
        return TextDataModule(**options)
    if data == "pretraining_cache_filling":
        return CacheFillingDataModule(record_dir=config["record_dir"], **options)
    return PretrainingDataModule(**options)


def make_strategy(strategy: Any, devices: int) -> Any:
    """``"ddp"``, ``[dp, tp]`` (ModelParallelStrategy, whole-file checkpoints) or the default for ``devices``."""
    if isinstance(strategy, list):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=strategy[0], tensor_parallel_size=strategy[1], save_distributed_checkpoint=False
        )
    return strategy or ("ddp" if devices > 1 else "auto")


def make_trainer(run: dict[str, Any], devices: int = 1, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    """One CPU Trainer (DDP on gloo for ``devices > 1``), without logger or progress bar."""
    callbacks = callbacks or []
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(run.get("strategy"), devices),
        max_epochs=run.get("max_epochs", -1 if "max_steps" in run else 2),
        max_steps=run.get("max_steps", -1),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=run.get("record_dir"),
        **run.get("trainer", {}),
    )


def fit(config: dict[str, Any]) -> None:
    """Run every fit of ``config["runs"]`` in turn.

    ``config``: ``data`` ("d9d", "d9d_by_process", "d9d_mesh", "text" or "pretraining"), ``options`` (the DataModule's
    arguments), ``devices``, ``record_dir``, ``ckpt_dir``, ``packs``, and ``runs``: a list of dicts with ``name``,
    ``max_epochs`` or ``max_steps``, ``ckpt_path``, ``every_n_train_steps``, ``epoch_end_ckpt``, ``save_at``,
    ``estimated``, ``kill_at_step``, ``ckpt_dir``, ``options`` (overrides of the DataModule's arguments for this
    run), ``data`` (another DataModule kind for this run, with all its ``options``), ``strategy``, ``trainer``,
    ``expect_error`` (the run must raise an exception whose message contains this; its type and message are
    written to ``<record_dir>/errors-rank<R>.txt``). The peer check's ``NothingToCompareWarning``s are written to
    ``<record_dir>/warnings-rank<R>.txt``.
    """
    record_dir = config["record_dir"]
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    for run in config["runs"]:
        callbacks: list[pl.Callback] = []
        ckpt_dir = run.get("ckpt_dir", config.get("ckpt_dir"))
        if ckpt_dir and run.get("every_n_train_steps"):
            callbacks.append(
                ModelCheckpoint(
                    dirpath=ckpt_dir,
                    filename="{epoch}-{step}",
                    every_n_train_steps=run["every_n_train_steps"],
                    save_top_k=-1,
                    save_last=True,
                )
            )
        if ckpt_dir and run.get("epoch_end_ckpt"):
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="end-{epoch}", save_top_k=-1))
        if ckpt_dir and run.get("save_at"):
            callbacks.append(SaveAtBatch(ckpt_dir, run["save_at"]))
        # A run of another DataModule kind gives all its options; others override the config's.
        options = {**(config.get("options", {}) if "data" not in run else {}), **run.get("options", {})}
        datamodule = build_datamodule(
            {**config, "data": run.get("data", config.get("data", "d9d")), "options": options}
        )
        module = RecordingModule(
            record_dir,
            run.get("name", ""),
            packs=config.get("packs", False),
            use_estimated_steps=run.get("estimated", False),
            kill_at_step=run.get("kill_at_step"),
        )
        trainer = make_trainer({**run, "record_dir": record_dir}, config.get("devices", 1), callbacks)
        fit_and_record(trainer, module, datamodule, run, record_dir)


def fit_and_record(
    trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any, run: dict[str, Any], record_dir: str
) -> None:
    """One fit of ``fit``: its expected error and the peer check's warnings written down for the test."""
    name = run.get("name", "")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NothingToCompareWarning)
            trainer.fit(module, datamodule=datamodule, ckpt_path=run.get("ckpt_path"))
    except Exception as error:
        if "expect_error" not in run:
            raise
        with open(Path(record_dir) / f"errors-rank{trainer.global_rank}.txt", "a") as file:
            file.write(f"{name}: {type(error).__name__}: {error}\n")
        if run["expect_error"] not in str(error):
            raise
    else:
        if "expect_error" in run:
            raise AssertionError(f"run {name!r} was expected to raise {run['expect_error']!r}")
    with open(Path(record_dir) / f"warnings-rank{trainer.global_rank}.txt", "a") as file:
        file.writelines(
            f"{name}: {w.category.__name__}: {w.message}\n" for w in caught if w.category is NothingToCompareWarning
        )


def fit_in_processes(
    config: dict[str, Any], timeout: int = 300, expect_returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    """``fit(config)`` in a fresh Python process (DDP when ``config["devices"] > 1``: real processes, gloo); returns
    the finished process (its ``stdout``, ``stderr``: Lightning's info lines, e.g. the peer check's)."""
    result = subprocess.run(
        [sys.executable, str(TESTS / "fit_script.py"), json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == expect_returncode, (
        f"exit status {result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-4000:]}"
    )
    return result


# ------------------------------------------------------------------------------------------------ streams
def stream_spec(
    tok: Tokenizer,
    index: Any,
    packing: str,
    streams: int = 2,
    seq_len: int = 24,
    rows: int = 2,
    growth: tuple[int, int] | None = None,
    **options: Any,
) -> StreamSpec:
    """The spec of ``streams`` streams over ``index`` whose steps take ``rows`` rows of each stream (G = rows × K).

    ``options``: ``seed``, ``buffer_size``, ``tokenizer_batch_size``, ``max_document_chars`` (the settings), or
    ``bos_id``, ``shuffle``, ``prefetch``, ``chunk_chars``, ``pad_id`` (the spec); ``growth``: ``(start,
    per_row)`` of a fresh best-fit buffer (default: the settings' default; ``(0, 0)``: full from the first row).
    """
    names = ("seed", "tokenizer_batch_size", "max_document_chars")
    settings = {"seed": 0, "bestfit_buffer_size": options.pop("buffer_size", 16), "tokenizer_batch_size": 8}
    settings.update({name: options.pop(name) for name in names if name in options})
    settings["growth"] = BufferGrowth(*growth) if growth is not None else BufferGrowth()
    bos_id = options.pop("bos_id", tok.token_to_id(BOS))
    spec = {"pad_id": tok.token_to_id("<unk>"), "shuffle": True}
    spec.update(options)
    return StreamSpec(
        StreamSettings(seq_len=seq_len, global_batch_size=rows * streams, packing=packing, num_streams=streams,
                       **settings),
        index, Units.of(index, streams), tok.to_str(), bos_id, **spec,
    )  # fmt: skip


def take(stream: Any, n: int, rows: int = 2) -> list:
    """``n`` blocks of ``rows`` rows of a ``TokenStream`` as ``(input_ids, targets, position_ids, state)``, the
    tensors the loader builds."""
    blocks = stream.blocks(itertools.repeat(rows))
    out = [next(blocks) for _ in range(n)]
    blocks.close()
    return [(*stream.spec.packing.tensors(block, stream.spec.bos_id), state) for block, state in out]


def assert_same_blocks(got: list, want: list) -> None:
    """Identical tensors and identical states (best-fit's buffer included), block by block."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
        sa, sb = flat(a[3].to_dict()), flat(b[3].to_dict())
        assert sa.keys() == sb.keys()
        for key in sa:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


def flat(state: dict, prefix: str = "") -> dict:
    """A nested state as ``{"packing.reader.row": value, ...}``."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def respec(spec: StreamSpec, **changes: Any) -> StreamSpec:
    """``spec`` with ``changes`` to its settings (``seed``, ``buffer_size``, ...) or its own fields."""
    if "buffer_size" in changes:
        changes["bestfit_buffer_size"] = changes.pop("buffer_size")
    setting_names = {f.name for f in dataclasses.fields(StreamSettings)}
    settings = {name: value for name, value in changes.items() if name in setting_names}
    own = {name: value for name, value in changes.items() if name not in setting_names}
    return dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, **settings), **own)


def corpus_spec(spec: StreamSpec, name: str = "train") -> MixtureSpec:
    """A corpus of the one source ``spec`` (every row of every step from it)."""
    return MixtureSpec((name,), (spec,), MixturePlan(MixtureSchedule([name]), spec.settings.global_batch_size))


class RankDataModule(PretrainingDataModule):
    """One data-parallel rank of a simulated world, in this process (its loader is what that rank would run)."""

    def __init__(self, *args: Any, world: int = 1, rank: int = 0, **kwargs: Any):
        topology = DataParallelTopology(dp_rank=rank, dp_size=world, process_rank=rank, world_size=world)
        super().__init__(*args, data_parallel=topology, **kwargs)


def small_corpus(root: Path, docs: list[str | None], row_group_size: int) -> Path:
    """``docs`` as two parquet files under ``root / "train"`` and a BPE trained on them, ``root / "tokenizer.json"``."""
    write_parquet(root / "train", docs, files=2, row_group_size=row_group_size)
    train_tokenizer(docs, root / "tokenizer.json")
    return root


def small_run(corpus: Path, packing: str, steps: int, world: int = 1, rank: int = 0, **options: Any) -> RankDataModule:
    """Rank ``rank`` of ``world`` over a :func:`small_corpus`, set up: K 4, m 2, in this process, small buffers;
    ``options`` (``seq_len`` and ``global_batch_size`` among them) given to the DataModule as well."""
    defaults = dict(
        train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), microbatch_size=2, num_streams=4,
        steps_per_epoch=steps, num_workers=0, bestfit_buffer_size=12, packing=packing, tokenizer_batch_size=8,
    )  # fmt: skip
    dm = RankDataModule(**(defaults | options), world=world, rank=rank)
    dm.setup("fit")
    return dm


def row_digest(batch: Any, i: int) -> str:
    """A digest of row ``i`` of a ``PretrainingBatch`` (its inputs, targets and positions)."""
    return digest([batch.input_ids[i], batch.targets[i], batch.position_ids[i]])


def run_steps(dm: PretrainingDataModule, steps: int) -> list[list[tuple[int, str]]]:
    """``steps`` optimizer steps of this rank: per step, every row as ``(source index, digest)`` in order."""
    batches = iter(dm.train_dataloader())
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(dm.microbatches_per_step):
            batch = next(batches)
            assert batch.sources.dtype == torch.int64 and batch.sources.shape == (len(batch),)
            rows += [(int(batch.sources[i]), row_digest(batch, i)) for i in range(len(batch))]
        out.append(rows)
    batches.close()
    dm.close_loaders()
    return out


def step_rows(dm: PretrainingDataModule, stop: int, start: int = 0) -> list[list[str]]:
    """Per step from ``start`` to ``stop``: this rank's rows as digests, in order, each microbatch checked to be of
    the step's shape (``microbatch_size`` rows of its ``seq_len``)."""
    batches, out = iter(dm.train_dataloader()), []
    for step in range(start, stop):
        rows = []
        for _ in range(dm.microbatches_at(step)):
            batch = next(batches)
            assert batch.input_ids.shape == (dm.microbatch_size, dm.seq_len_at(step)), f"step {step}"
            rows += [row_digest(batch, i) for i in range(len(batch))]
        out.append(rows)
    dm.close_loaders()
    return out


def ranked_rows(per_rank: tuple[list[str], ...] | list[list[str]]) -> list[str]:
    """One step's rows over the data-parallel ranks: rank 0's in order, then rank 1's, ...; every rank must hold the
    same number, so that two layouts' lists are equal only when each row is at the same place of the global batch
    (the rank that trains it included: ``world`` ranks hold its ``len // world`` consecutive rows each)."""
    assert len({len(rows) for rows in per_rank}) == 1, [len(rows) for rows in per_rank]
    return [row for rows in per_rank for row in rows]


def snake_dealt(per_rank: list[list[Any]]) -> list[Any]:
    """One map-style step's microbatches in the global batch's order, rebuilt from each data-parallel rank's
    microbatches in its own order: microbatch k of the step goes to the ranks in a snake (laps 0, 1, …, D-1, then
    D-1, …, 0, …), each rank taking its share in order. Written out here rather than calling the library's dealer,
    so that two layouts' steps are equal only when every microbatch has the same place and went to the rank that
    place names; every rank must hold the same number."""
    assert len({len(microbatches) for microbatches in per_rank}) == 1, [len(m) for m in per_rank]
    world, taken, out = len(per_rank), [0] * len(per_rank), []
    for k in range(world * len(per_rank[0])):
        lap, offset = divmod(k, world)
        owner = offset if lap % 2 == 0 else world - 1 - offset
        out.append(per_rank[owner][taken[owner]])
        taken[owner] += 1
    return out


def per_rank_microbatches(records: list[dict[str, Any]], key: str) -> dict[tuple[int, int], list[list[Any]]]:
    """(epoch, global step) -> per data-parallel rank 0, 1, …: ``record[key]`` of its microbatches in training order
    (records of the lowest process of each rank: its model-parallel peers trained the same)."""
    lowest: dict[int, int] = {}
    for r in records:
        lowest[r["dp_rank"]] = min(lowest.get(r["dp_rank"], r["rank"]), r["rank"])
    steps: dict[tuple[int, int], dict[int, list[tuple[int, Any]]]] = {}
    for r in records:
        if r["rank"] == lowest[r["dp_rank"]]:
            by_rank = steps.setdefault((r["epoch"], r["step"]), {})
            by_rank.setdefault(r["dp_rank"], []).append((r["batch_idx"], r[key]))
    out = {}
    for where, by_rank in steps.items():
        assert sorted(by_rank) == list(range(len(by_rank))), f"step {where}: data-parallel ranks {sorted(by_rank)}"
        # sorted() is stable: the microbatches of one pack (one batch_idx) keep the order they were recorded in.
        out[where] = [[value for _, value in sorted(by_rank[rank], key=lambda x: x[0])] for rank in sorted(by_rank)]
    return out


def planned_global_batches(
    lengths: np.ndarray, global_batch_size: int, sort_buffer_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """A map-style epoch's global batches in training order, written out by brute force from the documented rule,
    independent of the library's ``GlobalBatchOrder``: the epoch's seeded order (its whole global batches) in
    windows of ``sort_buffer_size`` samples; each window sorted by length, ties broken by a seeded draw, cut into
    global batches of neighbours, visited in a seeded order."""
    steps_per_epoch = len(lengths) // global_batch_size
    order = SeededPermutation(len(lengths), (seed, epoch))(np.arange(steps_per_epoch * global_batch_size)).tolist()
    steps = []
    for number, start in enumerate(range(0, len(order), sort_buffer_size)):
        window = order[start : start + sort_buffer_size]
        draws = np.random.default_rng((seed, epoch, number))
        tie_break = draws.random(len(window)).tolist()
        ranked = [i for _, _, i in sorted(zip((int(lengths[i]) for i in window), tie_break, window, strict=True))]
        batches = [ranked[b : b + global_batch_size] for b in range(0, len(ranked), global_batch_size)]
        steps += [batches[b] for b in draws.permutation(len(batches))]
    return steps


def planned_token_steps(
    lengths: np.ndarray,
    microbatch_tokens: int,
    microbatches_per_step: int,
    sort_buffer_size: int | None,
    seed: int,
    epoch: int,
    padding_free: bool = False,
) -> list[list[list[int]]]:
    """A token-budget epoch's steps in training order, each its P microbatches of sample ids, written out by brute
    force from the documented rule, independent of the library's planner (``dm.plan``, which the loader follows):
    the epoch's seeded order in windows of ``sort_buffer_size`` samples, each after the samples carried from the one
    before. A padded window is sorted by length (stably) and cut greedily, each microbatch taking the next samples
    while their count × the longest fits; a padding-free one is filled largest first (each microbatch opened by
    the longest sample left, then the longest that still fits, the earliest of equal lengths). A window's
    under-full tail carries into the next (padded: its last microbatch; padding-free: its last microbatches below
    99 % of the budget, at most a window of samples), except in the epoch's last window. Without sorting
    (``None``), samples in the seeded order, each microbatch taking the following while they fit. The
    microbatches are cut into steps of P, a tail too short for a step left out, and the steps visited in a seeded
    order. Lengths are costs as they stand (no rounding for ``pad_to_multiple_of`` or context parallelism)."""
    from lightning_d9d.mapstyle.plan import PLAN_VERSION

    size = len(lengths)
    order = SeededPermutation(size, (seed, epoch))(np.arange(size)).tolist()
    length = [int(n) for n in lengths]

    def fits(microbatch: list[int], sample: int) -> bool:
        taken = [*microbatch, sample]
        cost = sum(length[i] for i in taken) if padding_free else len(taken) * max(length[i] for i in taken)
        return cost <= microbatch_tokens

    def cut_in_order(samples: list[int]) -> list[list[int]]:
        runs: list[list[int]] = [[]]
        for i in samples:
            if runs[-1] and not fits(runs[-1], i):
                runs.append([])
            runs[-1].append(i)
        return runs

    def largest_first(samples: list[int]) -> list[list[int]]:
        left = sorted(samples, key=lambda i: length[i])  # stable: equal lengths keep their order
        runs = []
        while left:
            run: list[int] = []
            while True:
                room = microbatch_tokens - sum(length[i] for i in run)
                fitting = [i for i in left if length[i] <= room]
                if not fitting:
                    break
                longest = max(length[i] for i in fitting)
                run.append(next(i for i in fitting if length[i] == longest))
                left.remove(run[-1])
            runs.append(run)
        return runs

    window = sort_buffer_size or size
    microbatches: list[list[int]] = []
    carry: list[int] = []
    for start in range(0, size, window):
        samples = carry + order[start : start + window]
        if sort_buffer_size is None:
            runs = cut_in_order(samples)
        elif padding_free:
            runs = largest_first(samples)
        else:
            runs = cut_in_order(sorted(samples, key=lambda i: length[i]))
        carry = []
        if start + window < size:
            if padding_free and sort_buffer_size is not None:
                while runs and sum(length[i] for i in runs[-1]) < 0.99 * microbatch_tokens:
                    if len(carry) + len(runs[-1]) > window:
                        break
                    carry = runs.pop() + carry
            else:
                carry = runs.pop()
        microbatches += runs
    per_step = microbatches_per_step
    steps = [microbatches[s * per_step : (s + 1) * per_step] for s in range(len(microbatches) // per_step)]
    visit = np.random.default_rng((seed, epoch, PLAN_VERSION)).permutation(len(steps))
    return [steps[s] for s in visit]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_server(port: int | None = None) -> Iterator[tuple[Any, str]]:
    """A moto S3 server on 127.0.0.1, yielded with its endpoint URL.

    moto keeps its buckets per process, not per server, so a server started by one test module would otherwise see
    the objects another module left: the state is reset when the server starts and when it stops.
    """
    import requests
    from moto.server import ThreadedMotoServer

    port = free_port() if port is None else port
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    requests.post(f"{endpoint}/moto-api/reset").raise_for_status()
    try:
        yield server, endpoint
    finally:
        requests.post(f"{endpoint}/moto-api/reset").raise_for_status()
        server.stop()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one intra-op thread: a tiny model gains nothing from the pool, and on a loaded 2-core machine the
    pool spins waiting for a busy core (a step went from 25 ms to 1.9 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_llama(attention: str = "sdpa", vocab_size: int = 300, use_cache: bool = False) -> Any:
    """A 2-layer ``LlamaForCausalLM`` built from a config (no download), seeded, in training mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attention,
        use_cache=use_cache,
    )
    return transformers.LlamaForCausalLM(config)
