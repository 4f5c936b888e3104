"""``python tests/spike_script.py '<json config>'``: one fit (DDP on gloo for ``devices > 1``) of a model whose loss
is 20 times larger on a microbatch holding ``spike_token``, watched by ``LossSpikeProvenance``.

Every rank appends the token rows it trained (``records-rank<R>.jsonl``: step, rank, rows); rank 0 writes the
warnings it raised to ``warnings.txt``. Config: ``data`` (PretrainingDataModule arguments), ``record_dir``,
``spike_dir``, ``ckpt_dir``, ``spike_token``, ``devices``, ``max_steps``, ``ckpt_path``.
"""

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_d9d import PretrainingDataModule
from lightning_d9d.datamodules.loss_spike import LossSpikeProvenance


class SpikeModule(pl.LightningModule):
    def __init__(self, record_dir: str, spike_token: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.record_dir, self.spike_token = record_dir, spike_token

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rows = batch.input_ids
        line = {"step": self.global_step, "rank": self.global_rank, "rows": rows.tolist()}
        with open(Path(self.record_dir) / f"records-rank{self.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")
        loss = 20.0 if bool((rows == self.spike_token).any()) else 1.0
        return (self.weight**2).sum() + loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(config: dict[str, Any]) -> None:
    Path(config["record_dir"]).mkdir(parents=True, exist_ok=True)
    spikes = LossSpikeProvenance(factor=3.0, window=20, steps=3, min_steps=5, cooldown=50, dirpath=config["spike_dir"])
    checkpoints = ModelCheckpoint(dirpath=config["ckpt_dir"], every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=config["devices"], strategy="ddp" if config["devices"] > 1 else
                         "auto", max_steps=config["max_steps"], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=config["record_dir"],
                         callbacks=[spikes, checkpoints])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SpikeModule(config["record_dir"], config["spike_token"]),
                    datamodule=PretrainingDataModule(**config["data"]), ckpt_path=config.get("ckpt_path"))  # fmt: skip
    if trainer.is_global_zero:
        with open(Path(config["record_dir"]) / "warnings.txt", "w") as file:
            file.writelines(f"{w.message}\n" for w in caught if "loss spike" in str(w.message))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
