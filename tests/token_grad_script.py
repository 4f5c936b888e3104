"""``python tests/token_grad_script.py '<json config>'``: one SGD step of the demo model on token-budget batches,
saving the weights after it (rank 0), for each fit of ``config["runs"]`` — run under DDP by the gradient tests
(Lightning's DDP launcher re-runs this script in every rank's process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_d9d import D9DDataModule
from lightning_d9d.demo.model import TinyGPT
from lightning_d9d.demo.synthetic import SyntheticTokenDataset
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator

MODEL = {"vocab_size": 64, "max_positions": 32, "width": 16, "num_layers": 1, "num_heads": 2}
DATA = {"num_samples": 96, "vocab_size": 64, "max_length": 32, "median_length": 10, "seed": 0}


class SGDTinyGPT(TinyGPT):
    """TinyGPT with plain SGD (lr 1, no momentum or decay): after one step, weights = initial - gradient."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def make_model() -> SGDTinyGPT:
    torch.manual_seed(0)
    return SGDTinyGPT(**MODEL)


def make_datamodule(padding_free: bool) -> D9DDataModule:
    return D9DDataModule(
        SyntheticTokenDataset(**DATA),
        FlatteningCollator() if padding_free else CausalLMCollator(pad_to_multiple_of=1),
        global_batch_tokens=4 * 64,
        microbatch_tokens=64,
        padding_free=padding_free,
        sort_buffer_size=32,
    )


def run(config: dict[str, Any]) -> None:
    for fit in config["runs"]:
        model = make_model()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=config["devices"],
            strategy="ddp" if config["devices"] > 1 else "auto",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=fit["out"] + ".root",
        )
        trainer.fit(model, datamodule=make_datamodule(fit["padding_free"]))
        if trainer.global_rank == 0:
            torch.save({name: value.detach().clone() for name, value in model.state_dict().items()}, fit["out"])


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
