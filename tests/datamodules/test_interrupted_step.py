"""An optimizer step interrupted in flight is trained again on resume, never skipped.

Each case runs a real Trainer that is interrupted at microbatch ``j`` of accumulation window ``k`` — by an
exception (saved by Lightning's ``OnExceptionCheckpoint``), by ``SIGINT`` (Ctrl+C) or by ``SIGTERM`` (both sent
to the process with ``os.kill``) — then resumes from the checkpoint written at the interrupt. The microbatches
of the interrupted run's finished optimizer steps followed by everything the resumed run trains must be exactly
the uninterrupted run's microbatches, step by step, for every ``j`` of the window.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from support import (
    LengthDataset,
    digest,
    make_docs,
    make_texts,
    pad_collate,
    tensors_of,
    train_tokenizer,
    write_parquet,
)

from lightning_d9d import D9DDataModule, PretrainingDataModule, TextDataModule

M, STEPS, EPOCHS = 3, 3, 2  # microbatches per window, optimizer steps per epoch, epochs


class Interrupt(RuntimeError):
    """The fault raised inside ``training_step`` (as a CUDA OOM or a bug would be)."""


class InterruptingModule(pl.LightningModule):
    """Records ``(epoch, global step, digest)`` of every microbatch it trains; interrupts once if told to.

    Args:
        fault: ``None``, ``"exception"``, ``"sigint"`` or ``"sigterm"``.
        at: ``(k, j)``: global step (window) ``k`` of epoch 0, its microbatch ``j``.
    """

    def __init__(self, fault: str | None = None, at: tuple[int, int] = (0, 0), packs: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.fault, self.at = fault, at
        self.automatic_optimization = not packs
        self.trained: list[tuple[int, int, str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.automatic_optimization:
            return self._microbatch(batch, batch_idx % M)
        optimizer = self.optimizers()
        for j, microbatch in enumerate(batch):  # a pack: the M microbatches of one optimizer step
            self.manual_backward(self._microbatch(microbatch, j) / len(batch))
        optimizer.step()
        optimizer.zero_grad()
        return None

    def _microbatch(self, batch: Any, j: int) -> torch.Tensor:
        if self.fault is not None and (self.current_epoch, self.global_step, j) == (0, *self.at):
            fault, self.fault = self.fault, None
            if fault == "exception":
                raise Interrupt(f"interrupted at {self.at}")
            # SIGINT raises KeyboardInterrupt right here; Lightning's SIGTERM handler lets this microbatch finish
            os.kill(os.getpid(), signal.SIGINT if fault == "sigint" else signal.SIGTERM)
        self.trained.append((self.current_epoch, self.global_step, digest(batch)))
        scale = sum(float(t.float().sum()) for t in tensors_of(batch)) / 1e4
        return ((self.weight - scale) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("interrupted")
    docs = make_docs(60, seed=3, max_words=20, long_every=9, long_words=60)
    write_parquet(root / "train", docs, files=2, row_group_size=10)
    train_tokenizer(docs, root / "tokenizer.json")
    (root / "text").mkdir()
    pq.write_table(pa.table({"text": make_texts(60, seed=2)}), root / "text" / "train.parquet")
    train_tokenizer(make_texts(60, seed=2), root / "bpe.json", kind="bpe")
    return root


def make_datamodule(kind: str, num_workers: int, parquet: Path) -> pl.LightningDataModule:
    if kind in ("d9d", "d9d-packs"):
        return D9DDataModule(
            LengthDataset(STEPS * 12 + 5),
            pad_collate,
            global_batch_size=12,
            microbatch_size=12 // M,
            sort_buffer_size=24,
            num_workers=num_workers,
            yield_packs=kind == "d9d-packs",
        )
    if kind == "text":  # token budgets, padding-free: P = 3 microbatches of at most 64 tokens a step
        return TextDataModule(
            dataset=str(parquet / "text"),
            tokenizer=str(parquet / "bpe.json"),
            max_length=32,
            global_batch_tokens=M * 64,
            microbatch_tokens=64,
            padding_free=True,
            sort_buffer_size=32,
            num_workers=num_workers,
            cache_dir=str(parquet / "hf_cache"),
        )
    return PretrainingDataModule(
        train_files=str(parquet / "train"),
        tokenizer=str(parquet / "tokenizer.json"),
        seq_len=8,
        global_batch_size=12,
        microbatch_size=12 // M,
        num_streams=4,
        steps_per_epoch=STEPS,
        tokenizer_batch_size=8,
        bestfit_buffer_size=16,
        num_workers=num_workers,
    )


def train(
    kind: str, num_workers: int, parquet: Path, root: Path, module: InterruptingModule, ckpt_path: str | None = None
) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        callbacks=[OnExceptionCheckpoint(root)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    trainer.fit(module, datamodule=make_datamodule(kind, num_workers, parquet), ckpt_path=ckpt_path)


@pytest.fixture
def restore_sigint():
    """Python's default SIGINT handler during the test and after it: Lightning ignores SIGINT after a
    KeyboardInterrupt (so a second Ctrl+C cannot break its shutdown), and a test that sends SIGINT must not depend on
    what ran before it in the same process."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupted_then_resumed(
    kind: str, num_workers: int, fault: str, at: tuple[int, int], parquet: Path, root: Path
) -> tuple[list[tuple[int, int, str]], int]:
    """What an interrupted run's finished steps and its resumed run trained, and the checkpoint's global step."""
    interrupted = InterruptingModule(fault, at, packs=kind == "d9d-packs")
    expected = {"exception": Interrupt, "sigint": SystemExit, "sigterm": SIGTERMException}[fault]
    with pytest.raises(expected):
        train(kind, num_workers, parquet, root, interrupted)
    ckpt = root / "on_exception.ckpt"
    global_step = torch.load(ckpt, weights_only=False)["global_step"]
    resumed = InterruptingModule(packs=kind == "d9d-packs")
    train(kind, num_workers, parquet, root, resumed, ckpt_path=str(ckpt))
    # Gradients of a step not finished are not in the checkpoint: only finished steps count as trained.
    finished = [record for record in interrupted.trained if record[1] < global_step]
    return finished + resumed.trained, global_step


def check_every_position_of_the_window(
    kind: str, num_workers: int, fault: str, windows: tuple[int, ...], parquet: Path, root: Path
) -> None:
    reference = InterruptingModule(packs=kind == "d9d-packs")
    train(kind, num_workers, parquet, root / "reference", reference)
    if kind != "text":  # token-budget epochs have as many steps as their plan packs
        assert len(reference.trained) == EPOCHS * STEPS * M
    assert len(reference.trained) >= EPOCHS * STEPS * M
    for k in windows:
        for j in range(M):
            trained, global_step = interrupted_then_resumed(
                kind, num_workers, fault, (k, j), parquet, root / f"k{k}-j{j}"
            )
            # SIGTERM is handled after the microbatch: the step in flight finishes when j is its last microbatch.
            assert global_step == (k + 1 if fault == "sigterm" and j == M - 1 else k), (k, j)
            assert trained == reference.trained, f"interrupted at microbatch {j} of window {k} ({fault})"


@pytest.mark.parametrize("kind", ["d9d", "d9d-packs", "text", "pretraining"])
def test_an_exception_at_any_microbatch_of_a_window_resumes_exactly(kind: str, parquet: Path, tmp_path: Path) -> None:
    check_every_position_of_the_window(kind, 0, "exception", (1, STEPS - 1), parquet, tmp_path)


@pytest.mark.parametrize("fault", ["sigint", "sigterm"])
@pytest.mark.parametrize("kind", ["d9d", "pretraining"])
def test_a_signal_at_any_microbatch_of_a_window_resumes_exactly(
    kind: str, fault: str, parquet: Path, tmp_path: Path, restore_sigint: None
) -> None:
    check_every_position_of_the_window(kind, 0, fault, (1,), parquet, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["exception", "sigint", "sigterm"])
@pytest.mark.parametrize("kind", ["d9d", "pretraining"])
def test_with_two_workers_an_interrupt_at_any_microbatch_resumes_exactly(
    kind: str, fault: str, parquet: Path, tmp_path: Path, restore_sigint: None
) -> None:
    check_every_position_of_the_window(kind, 2, fault, (STEPS - 1,), parquet, tmp_path)
