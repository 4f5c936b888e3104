"""Checkpoint fixtures: Lightning checkpoints written mid-epoch by the code of their day, and the batches that followed.

``write_fixtures()`` (``make_row_digests.py --write-checkpoints``) runs ``Trainer.fit`` with a one-weight module over
a PretrainingDataModule (a two-source JSONL mixture, a token cache, ``bestfit_split``) and over a D9DDataModule,
saves a checkpoint at a step boundary mid-epoch, trains on across the epoch's end, and writes the checkpoint and
the digests of every microbatch after it. ``tests/test_golden_rows.py`` resumes each with ``Trainer.fit(ckpt_path=...)``
and must get exactly those microbatches: a checkpoint users hold keeps resuming after the code is reorganised.

The fixtures are written once and kept; a change of the saved state must still read them (or say, in one clear
error, why not). The data is JSONL (a file's digest is of its bytes, which this script decides) made by
``make_row_digests``'s generators, which therefore must not change. Trade-off: a tiny corpus and model keep the
files a few KB, so only a few steps of state (best-fit buffers, mixture counts, cache) are exercised.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from make_row_digests import HERE, Lengths, digest_batches, documents, pad_collate, tokenizer, write_jsonl  # isort: skip

from lightning_d9d import D9DDataModule, PretrainingDataModule

FIXTURES = HERE / "checkpoints"
SAVE_AT, MAX_STEPS = 3, 8  # the checkpoint after 3 optimizer steps; 8 in all (epochs of 5: across an epoch end)


def pretraining_data(root: Path) -> dict[str, Any]:
    """The fixture's corpus under ``root`` and the PretrainingDataModule's arguments over it."""
    tokenizer().save(str(root / "tokenizer.json"))
    write_jsonl(root / "a", documents(90, seed=11, short=30, long=120, long_every=5))
    write_jsonl(root / "b", documents(60, seed=12, short=15, long_every=None), files=1)
    return dict(
        train_files={"a": str(root / "a"), "b": str(root / "b")}, tokenizer=str(root / "tokenizer.json"),
        weights={"a": 0.6, "b": 0.4}, packing="bestfit_split", seq_len=32, global_batch_size=8, microbatch_size=2,
        num_streams=4, num_workers=0, steps_per_epoch=5, bestfit_buffer_size=12, tokenizer_batch_size=8,
        token_cache=str(root / "cache"), data_wait_warning=None, pin_memory=False,
    )  # fmt: skip


def d9d_options() -> dict[str, Any]:
    return dict(global_batch_size=8, microbatch_size=2, sort_buffer_size=32, num_workers=0, data_wait_warning=None,
                pin_memory=False)  # fmt: skip


def pretraining_datamodule(root: Path) -> PretrainingDataModule:
    return PretrainingDataModule(**pretraining_data(root))


def d9d_datamodule(root: Path) -> D9DDataModule:
    return D9DDataModule(Lengths(44, seed=3), pad_collate, **d9d_options())  # 44 samples: 5 steps of 8 and 4 left


KINDS = {
    "pretraining": (pretraining_datamodule, "pretraining_state_v2"),  # the DataModule state's "version"
    "pretraining_v3": (pretraining_datamodule, "pretraining_state_v3"),  # the plan nested under "plan"
    "d9d": (d9d_datamodule, "d9d_state"),
}


class OneWeight(pl.LightningModule):
    """Trains one weight; records the digest of every training microbatch in order (``self.seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(digest_batches([batch])["sha256"])
        return (self.weight - 1.0).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveAfterStep(pl.Callback):
    """Saves ``path`` when optimizer step ``step`` has just finished (mid-epoch, at a step boundary)."""

    def __init__(self, path: Path, step: int):
        self.path, self.step, self.saved_after = path, step, None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and self.saved_after is None:
            trainer.save_checkpoint(self.path)
            self.saved_after = len(module.seen)


def fit(datamodule: pl.LightningDataModule, root: Path, ckpt_path: Path | None = None, save: Path | None = None):
    """One CPU fit to ``MAX_STEPS``: the module (its ``seen`` digests) and the saving callback, if any."""
    module, callbacks = OneWeight(), [SaveAfterStep(save, SAVE_AT)] if save else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=MAX_STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        default_root_dir=str(root),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=datamodule, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module, (callbacks[0] if callbacks else None)


def resume(kind: str, root: Path) -> list[str]:
    """The digests of the microbatches a fit resumed from ``kind``'s fixture trains."""
    make, name = KINDS[kind]
    module, _ = fit(make(root), root, ckpt_path=FIXTURES / f"{name}.ckpt")
    return module.seen


def expected(kind: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{KINDS[kind][1]}.json").read_text())


def write_fixtures() -> None:
    """Writes every fixture that does not exist yet (delete one on purpose to write it again)."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for make, name in KINDS.values():
        ckpt = FIXTURES / f"{name}.ckpt"
        if ckpt.exists():
            print(f"{ckpt.name} exists: kept (a fixture is written once)")
            continue
        with tempfile.TemporaryDirectory(prefix="golden-ckpt-") as tmp:
            datamodule = make(Path(tmp))
            module, saver = fit(datamodule, Path(tmp), save=ckpt)
        assert saver.saved_after is not None, "the checkpoint was not written"
        record = {
            "note": "batches after the checkpoint in the uninterrupted run; written once, never regenerated",
            "state_version": torch.load(ckpt, weights_only=True)[type(datamodule).__qualname__].get("version"),
            "lightning": pl.__version__,
            "saved_after_step": SAVE_AT,
            "max_steps": MAX_STEPS,
            "before": len(module.seen[: saver.saved_after]),
            "after": module.seen[saver.saved_after :],
        }
        (FIXTURES / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {ckpt.name} ({ckpt.stat().st_size} bytes), {len(record['after'])} microbatches after it")
