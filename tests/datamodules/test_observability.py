"""The pipeline's speed under a real Trainer: ``data/`` metrics per optimizer step in a CSVLogger's file, the wait
for data growing with slow data (and the warning naming its fraction), tokens counted exactly, a pretraining
mixture's fill and source shares, and ``data_wait_warning`` checked at construction."""

from __future__ import annotations

import csv
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from support import LengthDataset, RecordingModule, make_docs, read_records, train_tokenizer, write_parquet

from lightning_d9d import D9DDataModule, PretrainingDataModule, TextDataModule
from lightning_d9d.datamodules.observability import WARMUP_STEPS, WINDOW_STEPS, DataWaitWarning

G, M_SIZE = 8, 4  # two microbatches per optimizer step
STEPS = WARMUP_STEPS + WINDOW_STEPS + 2
STEP_SLEEP = 0.04  # the training step's own time, so that fast data is a small share of it


class SlowDataset(LengthDataset):
    """``LengthDataset`` whose ``__getitem__`` sleeps ``delay`` seconds (a slow decode, a slow disk)."""

    def __init__(self, size: int, delay: float):
        super().__init__(size)
        self.delay = delay

    def __getitem__(self, index: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return super().__getitem__(index)


def mask_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` with an ``attention_mask``: the batch's real tokens are the samples' lengths."""
    longest = max(len(sample["tokens"]) for sample in samples)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, sample in enumerate(samples):
        mask[row, : len(sample["tokens"])] = 1
    return {
        "ids": torch.tensor([sample["id"] for sample in samples]),
        "input_ids": mask.clone(),
        "attention_mask": mask,
    }


class SlowStepModule(RecordingModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        time.sleep(STEP_SLEEP)
        return super().training_step(batch, batch_idx)


def read_metrics(root: Path) -> list[dict[str, str]]:
    """The rows of the CSVLogger's ``metrics.csv`` that hold the data metrics."""
    (path,) = root.rglob("metrics.csv")
    with open(path) as file:
        return [row for row in csv.DictReader(file) if row.get("data/wait_ms")]


def fit(root: Path, datamodule: pl.LightningDataModule, module: pl.LightningModule, steps: int) -> list[Any]:
    """Fit ``steps`` optimizer steps with a CSVLogger writing every step; the warnings raised."""
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=CSVLogger(str(root / "logs")), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(root),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=datamodule)
    return [w for w in caught if issubclass(w.category, DataWaitWarning)]


def mapstyle_run(root: Path, delay: float) -> tuple[list[dict[str, str]], list[Any], LengthDataset]:
    dataset = SlowDataset(400, delay)
    dm = D9DDataModule(dataset, mask_collate, global_batch_size=G, microbatch_size=M_SIZE, num_workers=0)
    taken, take = [], dm.take_host_counts
    dm.take_host_counts = lambda: taken.append(take()) or taken[-1]  # type: ignore[method-assign]
    caught = fit(root, dm, SlowStepModule(str(root / "records")), STEPS)
    # Every training microbatch was counted on the host, before its copy to the device.
    assert len(taken) == 2 * STEPS and all(counts is not None for counts in taken)
    return read_metrics(root), caught, dataset


def test_fast_data_logs_every_step_counts_tokens_exactly_and_does_not_warn(tmp_path: Path) -> None:
    rows, caught, dataset = mapstyle_run(tmp_path, delay=0.0)
    assert [int(row["step"]) for row in rows] == list(range(STEPS)), "one row per optimizer step"
    assert caught == [], [str(w.message) for w in caught]
    tokens_per_step: dict[int, int] = defaultdict(int)
    for record in read_records(tmp_path / "records"):
        tokens_per_step[record["step"]] += int(sum(dataset.lengths[i] for i in record["ids"]))
    for row in rows:
        step, wait_ms, step_ms = int(row["step"]), float(row["data/wait_ms"]), float(row["data/step_ms"])
        assert 0 <= wait_ms <= step_ms
        assert step_ms >= 1000 * 2 * STEP_SLEEP  # both microbatches' training steps are in it
        assert float(row["data/tokens"]) == tokens_per_step[step]
        assert float(row["data/tokens_per_s"]) == pytest.approx(tokens_per_step[step] / (step_ms / 1000), rel=1e-4)
    later = [float(row["data/wait_ms"]) / float(row["data/step_ms"]) for row in rows[WARMUP_STEPS:]]
    assert sorted(later)[len(later) // 2] < 0.2


def test_slow_data_shows_in_wait_ms_and_warns_once_naming_the_fraction(tmp_path: Path) -> None:
    delay = 0.01
    rows, caught, _ = mapstyle_run(tmp_path, delay=delay)
    # Each step's gaps fetch two microbatches of M_SIZE samples (the fetcher's lookahead: the next ones).
    waits = sorted(float(row["data/wait_ms"]) for row in rows[1:])
    assert waits[len(waits) // 2] >= 0.9 * 1000 * delay * 2 * M_SIZE
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "waited for data" in message and "data_wait_warning=0.2" in message
    fraction = float(message.split("waited for data ")[1].split("%")[0])
    assert 20 < fraction <= 100


def test_validation_inside_the_epoch_is_not_counted_as_waiting(tmp_path: Path) -> None:
    delay, samples = 0.02, 16  # each validation run sleeps 0.32 s
    dm = D9DDataModule(
        LengthDataset(400), mask_collate, global_batch_size=G, microbatch_size=M_SIZE, num_workers=0,
        val_dataset=SlowDataset(samples, delay),
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, logger=CSVLogger(str(tmp_path / "logs")), log_every_n_steps=1,
        val_check_interval=4, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(RecordingModule(str(tmp_path / "records")), datamodule=dm)
    rows = read_metrics(tmp_path)
    assert len(rows) == 6
    assert max(float(row["data/wait_ms"]) for row in rows[1:]) < 1000 * delay * samples / 2
    assert max(float(row["data/step_ms"]) for row in rows[1:]) < 1000 * delay * samples


def test_a_disabled_warning_and_no_logger_leave_a_slow_run_alone(tmp_path: Path) -> None:
    dm = D9DDataModule(
        SlowDataset(400, 0.01), mask_collate, global_batch_size=G, microbatch_size=M_SIZE, num_workers=0,
        data_wait_warning=None,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RecordingModule(str(tmp_path)), datamodule=dm)
    assert not [w for w in caught if issubclass(w.category, DataWaitWarning)]
    assert not [key for key in trainer.callback_metrics if key.startswith("data/")]


def test_a_pretraining_mixture_logs_tokens_fill_and_source_shares(tmp_path: Path) -> None:
    web, code = make_docs(200, seed=1, max_words=20), [d.upper() if d else d for d in make_docs(60, seed=2)]
    write_parquet(tmp_path / "web", web, files=2, row_group_size=10)
    write_parquet(tmp_path / "code", code, files=1, row_group_size=10)
    train_tokenizer(web + code, tmp_path / "tokenizer.json")
    dm = PretrainingDataModule(
        train_files={"web": str(tmp_path / "web"), "code": str(tmp_path / "code")}, weights={"web": 3, "code": 1},
        tokenizer=str(tmp_path / "tokenizer.json"), seq_len=16, global_batch_size=G, microbatch_size=2,
        num_streams=4, num_workers=0, steps_per_epoch=20, packing="bestfit_split", bestfit_buffer_size=8,
    )  # fmt: skip
    module = BatchTally()
    fit(tmp_path, dm, module, steps=4)
    rows = read_metrics(tmp_path)
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    for row in rows:
        step = int(row["step"])
        assert float(row["data/tokens"]) == module.tokens[step]
        sources = module.sources[step]
        assert float(row["data/share/web"]) == pytest.approx(sources[0] / G)
        assert float(row["data/share/code"]) == pytest.approx(sources[1] / G)
        assert 0 < float(row["data/fill"]) <= 1 and float(row["data/cropped"]) == 0  # bestfit_split never crops
    stats = dm.stream_stats()  # a step or so past the last logged one: the loader hands out ahead of training
    assert float(rows[-1]["data/fill"]) == pytest.approx(stats["emitted"] / (stats["emitted"] + stats["padding"]), 0.05)


def test_each_steps_global_batch_size_seq_len_and_accumulation_are_logged(tmp_path: Path) -> None:
    """Under a batch ramp and a seq_len warm-up, every step's logged shape is that of the microbatches trained."""
    docs = make_docs(300, seed=4, max_words=20)
    write_parquet(tmp_path / "web", docs, files=2, row_group_size=10)
    train_tokenizer(docs, tmp_path / "tokenizer.json")
    dm = PretrainingDataModule(
        train_files=str(tmp_path / "web"), tokenizer=str(tmp_path / "tokenizer.json"), seq_len=[[0, 8], [2, 16]],
        global_batch_size=[[0, 4], [3, 8]], microbatch_size=2, num_streams=4, num_workers=0, steps_per_epoch=20,
    )  # fmt: skip
    module = BatchTally()
    fit(tmp_path, dm, module, steps=5)
    rows = read_metrics(tmp_path)
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        shapes = module.shapes[int(row["step"])]
        assert float(row["data/accumulation"]) == len(shapes)
        assert float(row["data/global_batch_size"]) == sum(rows_ for rows_, _ in shapes)
        assert {float(row["data/seq_len"])} == {float(length) for _, length in shapes}
    assert [float(row["data/global_batch_size"]) for row in rows] == [4, 4, 4, 8, 8], "the ramp is what is tested"
    assert [float(row["data/seq_len"]) for row in rows] == [8, 8, 16, 16, 16]


class BatchTally(pl.LightningModule):
    """Counts, per optimizer step, the trained targets and the rows per source of the microbatches it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokens: dict[int, int] = defaultdict(int)
        self.sources: dict[int, Counter[int]] = defaultdict(Counter)
        self.shapes: dict[int, list[tuple[int, int]]] = defaultdict(list)  # per step: each microbatch's shape

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.tokens[self.global_step] += int((batch.targets != -100).sum())
        self.sources[self.global_step].update(batch.sources.tolist())
        self.shapes[self.global_step].append(tuple(batch.input_ids.shape))
        return ((self.weight - batch.input_ids.float().mean() / 100) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("value", [1.5, -0.1, "high", True])
def test_an_invalid_data_wait_warning_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"data_wait_warning must be a fraction .* got {value!r}"):
        D9DDataModule(LengthDataset(40), global_batch_size=G, microbatch_size=M_SIZE, data_wait_warning=value)


def test_every_datamodule_has_data_wait_warning(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data_wait_warning must be a fraction .* got 2"):
        TextDataModule(global_batch_size=G, microbatch_size=M_SIZE, data_wait_warning=2)
    with pytest.raises(ValueError, match="data_wait_warning must be a fraction .* got 1.01"):
        PretrainingDataModule(train_files=str(tmp_path), tokenizer="unused.json", data_wait_warning=1.01)
    dm = D9DDataModule(LengthDataset(40), global_batch_size=G, microbatch_size=M_SIZE)
    assert dm.data_wait_warning == 0.2
    dm.data_wait_warning = 0
    assert dm.data_wait_warning is None
