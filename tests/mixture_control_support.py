"""What the mixture-controller Trainer tests share: two sources (one easy, one hard), a tiny language model whose
``training_step`` returns per-token losses, and a fit that records every step's rows (``(source, digest)`` per row).
``tests/mixture_control_script.py`` runs ``fit_and_save`` as a script for multi-process DDP (Lightning's launcher
re-runs the main script in each rank's process)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import WORDS, make_docs, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.core.digest import digest
from lightning_d9d.mixtures import DoReMi, LossProportional, WeightsFile

G, K = 8, 4
CONTROLLERS = {"LossProportional": LossProportional, "DoReMi": DoReMi, "WeightsFile": WeightsFile}


def write_data(root: Path) -> Path:
    """``easy``: a few phrases repeated (learnable in a few steps); ``hard``: words drawn at random."""
    if (root / "tokenizer.json").exists():
        return root
    rng = random.Random(5)
    phrases = [" ".join(WORDS[i : i + 4]) for i in range(0, 24, 4)]
    easy = [" ".join(rng.choice(phrases) for _ in range(rng.randint(3, 8))) for _ in range(120)]
    hard = make_docs(200, seed=7, max_words=30)
    write_parquet(root / "easy", easy, files=1, row_group_size=10)
    write_parquet(root / "hard", hard, files=2, row_group_size=10)
    write_parquet(root / "val_hard", make_docs(30, seed=8), files=1, row_group_size=10)
    train_tokenizer(easy + hard, root / "tokenizer.json")
    return root


class TinyLM(pl.LightningModule):
    """A bigram language model (embedding → logits) that returns ``{"loss", "token_losses"}``; records its rows."""

    def __init__(self, vocab: int = 600, record: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab)
        self.rows: list[tuple[int, list[tuple[int, str]]]] = []
        self.record = record

    def _losses(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.out(self.emb(batch.input_ids))
        flat = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten().clamp(min=0), reduction="none"
        )
        token_losses = flat.view_as(batch.targets)
        mask = batch.targets != -100
        return (token_losses * mask).sum() / mask.sum().clamp(min=1), token_losses

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        rows = [(int(batch.sources[i]), digest(batch.input_ids[i].numpy().tobytes())) for i in range(len(batch))]
        self.rows.append((self.global_step, rows))
        if self.record is not None:
            with open(Path(self.record) / f"rows-rank{self.global_rank}.jsonl", "a") as file:
                file.write(json.dumps([self.global_step, rows]) + "\n")
        loss, token_losses = self._losses(batch)
        return {"loss": loss, "token_losses": token_losses}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        loss, token_losses = self._losses(batch)
        return {"loss": loss, "token_losses": token_losses}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def datamodule(root: Path, controller: Any, **changes: Any) -> PretrainingDataModule:
    options = dict(
        train_files={"easy": str(root / "easy"), "hard": str(root / "hard")}, tokenizer=str(root / "tokenizer.json"),
        seq_len=16, global_batch_size=G, microbatch_size=2, num_streams=K, num_workers=0, steps_per_epoch=9,
        tokenizer_batch_size=8, bestfit_buffer_size=8, packing="bestfit_split", mixture_controller=controller,
    )  # fmt: skip
    options.update(changes)
    return PretrainingDataModule(**options)


def fit(root: Path, tmp: Path, controller: Any, max_steps: int, ckpt_path: str | None = None, devices: int = 1,
        record: str | None = None, ckpt_every: int = 4, trainer: dict | None = None,
        **changes: Any) -> tuple[TinyLM, PretrainingDataModule]:  # fmt: skip
    module, dm = TinyLM(record=record), datamodule(root, controller, **changes)
    trainer = dict(trainer or {})
    callbacks = [ModelCheckpoint(dirpath=str(tmp / "ckpt"), filename="{step}", every_n_train_steps=ckpt_every,
                                 save_top_k=-1), *trainer.pop("callbacks", [])]  # fmt: skip
    pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=max_steps,
        logger=trainer.pop("logger", False), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(tmp), callbacks=callbacks, **trainer,
    ).fit(module, datamodule=dm, ckpt_path=ckpt_path)  # fmt: skip
    return module, dm


def steps_of(module: TinyLM) -> dict[int, list[tuple[int, str]]]:
    """Every step's rows, in training order."""
    steps: dict[int, list[tuple[int, str]]] = {}
    for step, rows in module.rows:
        steps.setdefault(step, []).extend(rows)
    return steps


def fit_and_save(config: dict[str, Any]) -> None:
    """``fit`` from a JSON-able config; each rank writes its journal (``journal-rank<R>.json``) and rows."""
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    kind, args = config["controller"]
    module, dm = fit(Path(config["root"]), out, CONTROLLERS[kind](**args), config["max_steps"],
                     config.get("ckpt_path"), config.get("devices", 1), record=str(out))  # fmt: skip
    with open(out / f"journal-rank{module.global_rank}.json", "w") as file:
        json.dump(dm.mixture_journal, file)
