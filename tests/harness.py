"""A real training run that records every microbatch it trains: (epoch, global step, rank, batch_idx, sample ids).

Used in-process for one device and as a script (``python tests/harness.py '<json>'``) for multi-process DDP,
because Lightning's DDP launcher re-runs the main script in each child process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_d9d import D9DDataModule


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


class RecordingModule(pl.LightningModule):
    """Trains a single weight and appends one JSON line per trained microbatch to ``records-rank{R}.jsonl``."""

    def __init__(
        self,
        record_dir: str,
        use_estimated_steps: bool = False,
        packs: bool = False,
        kill_at_step: int | None = None,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.record_dir, self.use_estimated_steps, self.packs = record_dir, use_estimated_steps, packs
        self.kill_at_step = kill_at_step
        self.automatic_optimization = not packs
        self.val_ids: list[int] = []

    def _record(self, kind: str, batch_idx: int, ids: list[int]) -> None:
        path = Path(self.record_dir) / f"{kind}-rank{self.global_rank}.jsonl"
        line = {
            "epoch": self.current_epoch,
            "step": self.global_step,
            "rank": self.global_rank,
            "batch_idx": batch_idx,
            "ids": ids,
        }
        with path.open("a") as file:
            file.write(json.dumps(line) + "\n")

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((self.weight - batch["tokens"].sum(1).float().mean() / 100.0) ** 2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.kill_at_step is not None and self.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # die like a preempted job: no cleanup, no final checkpoint
        if not self.packs:
            self._record("train", batch_idx, batch["ids"].tolist())
            return self._loss(batch)
        optimizer = self.optimizers()
        for microbatch in batch:
            self._record("train", batch_idx, microbatch["ids"].tolist())
            self.manual_backward(self._loss(microbatch) / len(batch))
        optimizer.step()
        optimizer.zero_grad()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("val", batch_idx, batch["ids"].tolist())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.use_estimated_steps:
            # Lightning issue #20550: this used to make Lightning skip loading the loader's state.
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveAtBatch(pl.Callback):
    """Saves a checkpoint at given (epoch, batch_idx) points, like a time-based checkpoint would, mid-window."""

    def __init__(self, dirpath: str, points: list[list[int]]):
        self.dirpath, self.points = dirpath, {tuple(point) for point in points}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch_idx = args[-1]
        if (trainer.current_epoch, batch_idx) in self.points:
            trainer.save_checkpoint(f"{self.dirpath}/mid-e{trainer.current_epoch}-b{batch_idx}.ckpt")


def run_training(config: dict[str, Any]) -> None:
    """Fit once. Keys: record_dir, ckpt_dir, size, global_batch_size, microbatch_size, sort_buffer_size,
    num_workers, devices, max_epochs, max_steps, every_n_train_steps, epoch_end_ckpt, save_at, ckpt_path,
    estimated, packs, val_size, kill_at_step, seed."""
    Path(config["record_dir"]).mkdir(parents=True, exist_ok=True)
    dm = D9DDataModule(
        LengthDataset(config.get("size", 200)),
        pad_collate,
        global_batch_size=config.get("global_batch_size", 16),
        microbatch_size=config.get("microbatch_size", 2),
        sort_buffer_size=config.get("sort_buffer_size", 64),
        val_dataset=LengthDataset(config["val_size"], seed=1) if config.get("val_size") else None,
        seed=config.get("seed", 0),
        num_workers=config.get("num_workers", 0),
        yield_packs=config.get("packs", False),
    )
    model = RecordingModule(
        config["record_dir"], config.get("estimated", False), config.get("packs", False), config.get("kill_at_step")
    )
    callbacks: list[pl.Callback] = []
    ckpt_dir = config.get("ckpt_dir")
    if ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="{epoch}-{step}",
                every_n_train_steps=config.get("every_n_train_steps"),
                save_top_k=-1,
                save_last=True,
            )
        )
        if config.get("epoch_end_ckpt"):
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="end-{epoch}", save_top_k=-1))
        if config.get("save_at"):
            callbacks.append(SaveAtBatch(ckpt_dir, config["save_at"]))
    devices = config.get("devices", 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=config.get("max_epochs", 2),
        max_steps=config.get("max_steps", -1),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=config["record_dir"],
    )
    trainer.fit(model, datamodule=dm, ckpt_path=config.get("ckpt_path"))


def read_records(record_dir: str | Path, kind: str = "train") -> list[dict[str, Any]]:
    records = []
    for path in sorted(Path(record_dir).glob(f"{kind}-rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(records, key=lambda r: (r["epoch"], r["step"], r["rank"], r["batch_idx"]))


def samples_per_step(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    """(epoch, global step) -> sorted sample ids trained in that optimizer step, over all ranks."""
    steps: dict[tuple[int, int], list[int]] = {}
    for record in records:
        steps.setdefault((record["epoch"], record["step"]), []).extend(record["ids"])
    return {key: sorted(ids) for key, ids in steps.items()}


if __name__ == "__main__":
    run_training(json.loads(sys.argv[1]))
