"""Real Trainer runs of PretrainingDataModule that record a digest of every microbatch they train.

Used in-process (one device) and as a script for DDP (``python tests/pretraining_harness.py '<json>'``),
because Lightning's DDP launcher re-runs the main script in each rank's process. One script run performs a
list of fits in sequence (an uninterrupted run, then resumes from its checkpoints), so DDP start-up is paid once.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_d9d.datamodules.pretraining import PretrainingBatch, PretrainingDataModule


def digest(batch: PretrainingBatch) -> str:
    h = hashlib.sha256()
    for tensor in (batch.inputs, batch.targets, batch.position_ids):
        h.update(tensor.cpu().numpy().tobytes())
    return h.hexdigest()[:20]


class RecordingModule(pl.LightningModule):
    """One weight; appends ``{run, epoch, step, batch_idx, rank, digest}`` per trained microbatch to a file."""

    def __init__(self, record_file: str, run: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.record_file, self.run = record_file, run

    def _write(self, kind: str, batch: PretrainingBatch, batch_idx: int) -> None:
        assert batch.inputs.dtype == torch.int64 and batch.inputs.shape == batch.targets.shape
        line = {
            "run": self.run,
            "kind": kind,
            "epoch": self.current_epoch,
            "step": self.global_step,
            "batch_idx": batch_idx,
            "rank": self.global_rank,
            "digest": digest(batch),
        }
        with open(f"{self.record_file}.rank{self.global_rank}", "a") as file:
            file.write(json.dumps(line) + "\n")

    def training_step(self, batch: PretrainingBatch, batch_idx: int) -> torch.Tensor:
        self._write("train", batch, batch_idx)
        return ((self.weight - batch.inputs.float().mean() / 100.0) ** 2).mean()

    def validation_step(self, batch: PretrainingBatch, batch_idx: int) -> None:
        self._write("val", batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # estimated_stepping_batches probes the loader early (Lightning issue #20550 pattern); must be harmless.
        assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveAtBatch(pl.Callback):
    """Save at given (epoch, batch_idx) points, like a time-based checkpoint would (possibly mid-window)."""

    def __init__(self, dirpath: str, points: list[list[int]]):
        self.dirpath, self.points = dirpath, {tuple(p) for p in points}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) in self.points:
            trainer.save_checkpoint(f"{self.dirpath}/mid-e{trainer.current_epoch}-b{args[-1]}.ckpt")


def fit(config: dict[str, Any], run: dict[str, Any]) -> None:
    """One fit. ``config``: data/module settings; ``run``: name, max_steps, ckpt_path, every_n_steps, save_at."""
    dm = PretrainingDataModule(
        train_files=config["train_files"],
        tokenizer=config["tokenizer"],
        seq_len=config.get("seq_len", 16),
        global_batch_size=config.get("global_batch_size", 8),
        microbatch_size=config.get("microbatch_size", 2),
        val_files=config.get("val_files"),
        packing=config.get("packing", "bestfit"),
        steps_per_epoch=config.get("steps_per_epoch"),
        val_steps=config.get("val_steps"),
        num_workers=config.get("num_workers", 0),
        tokenizer_batch_size=config.get("tokenizer_batch_size", 8),
        bestfit_buffer_size=config.get("bestfit_buffer_size", 40),
        seed=config.get("seed", 0),
    )
    callbacks: list[pl.Callback] = []
    if run.get("every_n_steps"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=config["ckpt_dir"],
                filename="{step}",
                save_top_k=-1,
                every_n_train_steps=run["every_n_steps"],
                save_last=False,
            )
        )
    if run.get("save_at"):
        callbacks.append(SaveAtBatch(config["ckpt_dir"], run["save_at"]))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=config.get("devices", 1),
        strategy="ddp" if config.get("devices", 1) > 1 else "auto",
        max_steps=run["max_steps"],
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        check_val_every_n_epoch=config.get("check_val_every_n_epoch", 1),
    )
    model = RecordingModule(config["record_file"], run["name"])
    trainer.fit(model, datamodule=dm, ckpt_path=run.get("ckpt_path"))


def main(config: dict[str, Any]) -> None:
    for run in config["runs"]:
        fit(config, run)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
