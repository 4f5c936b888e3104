"""``python tests/global_loss_script.py '<json config>'``: the demo model trains ``steps`` steps (learning rate 0, so
every step sees the initial weights) over a PretrainingDataModule, and each process writes the ``train/global_loss``
it logged after every optimizer step — run under 2-process DDP by ``tests/datamodules/test_global_loss.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_d9d import PretrainingDataModule
from lightning_d9d.demo.model import TinyGPT

MODEL = {"vocab_size": 256, "max_positions": 32, "width": 16, "num_layers": 1, "num_heads": 2, "learning_rate": 0.0}


def make_model() -> TinyGPT:
    """Initial weights with peaked logits, so token losses differ widely (near-uniform logits would give every
    token about log(vocab_size), and every weighting of them nearly the same mean)."""
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    with torch.no_grad():
        model.token_embedding.weight.mul_(100.0)
    return model


def make_datamodule(options: dict[str, Any]) -> PretrainingDataModule:
    return PretrainingDataModule(**options)


class RecordGlobalLoss(pl.Callback):
    """The value logged at each optimizer step (read once the step's last microbatch has ended)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if (idx + 1) % trainer.accumulate_grad_batches == 0:
            self.values.append(float(trainer.callback_metrics["train/global_loss"]))


def run(config: dict[str, Any]) -> None:
    record = RecordGlobalLoss()
    trainer = pl.Trainer(
        accelerator="cpu", devices=config["devices"], strategy="ddp" if config["devices"] > 1 else "auto",
        max_steps=config["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[record], default_root_dir=config["out"],
    )  # fmt: skip
    trainer.fit(make_model(), datamodule=make_datamodule(config["options"]))
    (Path(config["out"]) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.values))


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
