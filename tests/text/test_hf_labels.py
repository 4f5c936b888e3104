"""Hugging Face causal LMs train on our batches as they are: a tiny ``LlamaForCausalLM`` built from a
``LlamaConfig`` (no hub) computes exactly the per-document loss on flattened rows and on padded batches, with
``num_items_in_batch=step_label_tokens`` its losses add up to the step's per-token mean, and it trains from a
TextDataModule's padded and padding-free batches under a Lightning Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import make_texts, one_torch_thread, tiny_llama, train_tokenizer

from lightning_d9d import TextDataModule
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    with one_torch_thread():
        yield


def documents(count: int = 5, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 300, size=int(n))} for n in rng.integers(2, 40, size=count)]


def alone_loss(model: Any, samples: list[dict[str, np.ndarray]]) -> torch.Tensor:
    """Per-token mean over the documents, each run on its own (HF shifts the labels)."""
    total = torch.zeros(())
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"])[None]
        total = total + model(input_ids=ids, labels=ids).loss * (ids.shape[1] - 1)
    return total / sum(len(sample["input_ids"]) - 1 for sample in samples)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llama_computes_the_per_document_loss_on_flattened_and_padded_batches(attention: str) -> None:
    model = tiny_llama(attention).eval()
    samples = documents()
    expected = alone_loss(model, samples)
    flat = FlatteningCollator()(samples)
    with torch.no_grad():
        flat_loss = model(
            input_ids=flat.input_ids,
            position_ids=flat.position_ids,
            labels=flat.labels,
            num_items_in_batch=flat.step_label_tokens,
        ).loss
        torch.testing.assert_close(flat_loss, expected, rtol=1e-5, atol=1e-5)
        for side in ("right", "left"):
            padded = CausalLMCollator(padding_side=side)(samples)
            position_ids = (padded.attention_mask.cumsum(1) - 1).clamp(min=0)
            loss = model(
                input_ids=padded.input_ids,
                attention_mask=padded.attention_mask,
                position_ids=position_ids,
                labels=padded.labels,
            ).loss
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_num_items_in_batch_adds_microbatch_losses_up_to_the_steps_mean() -> None:
    model = tiny_llama().eval()
    samples = documents(9, seed=1)
    microbatches = [samples[:2], samples[2:7], samples[7:]]  # of different token counts
    step_label_tokens = sum(len(sample["input_ids"]) - 1 for sample in samples)
    with torch.no_grad():
        summed = sum(
            model(
                input_ids=(batch := FlatteningCollator()(part)).input_ids,
                position_ids=batch.position_ids,
                labels=batch.labels,
                num_items_in_batch=step_label_tokens,
            ).loss
            for part in microbatches
        )
    torch.testing.assert_close(summed, alone_loss(model, samples), rtol=1e-5, atol=1e-5)


class LlamaModule(pl.LightningModule):
    """A tiny Llama trained from TextBatch/FlatBatch: the step's mean through ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = {"input_ids": batch.input_ids, "labels": batch.labels}
        if hasattr(batch, "position_ids"):
            inputs["position_ids"] = batch.position_ids
        else:
            inputs["attention_mask"] = batch.attention_mask
        loss = self.model(**inputs, num_items_in_batch=batch.step_label_tokens).loss
        self.losses.append(float(loss.detach()))  # this microbatch's share of the step's per-token mean
        return loss * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_corpus")
    texts = make_texts(400, seed=5)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts}), root / "parquet" / "train.parquet")
    train_tokenizer(texts, root / "tokenizer.json", kind="bpe")
    return {"parquet": root / "parquet", "tokenizer": root / "tokenizer.json", "cache": root / "cache"}


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_a_tiny_llama_trains_from_the_batches(corpus: dict, tmp_path: Path, padding_free: bool) -> None:
    dm = TextDataModule(
        dataset=str(corpus["parquet"]),
        tokenizer=str(corpus["tokenizer"]),
        max_length=64,
        global_batch_tokens=1024,
        microbatch_tokens=256,
        padding_free=padding_free,
        sort_buffer_size=128,
        num_workers=0,
        cache_dir=str(corpus["cache"]),
    )
    module = LlamaModule()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    per_step = np.add.reduceat(module.losses, np.arange(0, len(module.losses), 4))  # each step's per-token mean
    assert len(per_step) == trainer.global_step > 12
    assert per_step[-5:].mean() < 0.7 * per_step[:3].mean(), per_step
