"""Masked samples through the collators: every sample's mask intact, -100 at each packed sample's first token,
positions restarting per sample, step_label_tokens counting trained targets; a tiny LlamaForCausalLM gives the
same loss sum on padded and padding-free batches as on the samples one by one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_d9d.text.collate import IGNORE_INDEX, CausalLMCollator, FlatteningCollator

transformers = pytest.importorskip("transformers")


def masked_samples(count: int = 6, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Samples with a masked prompt, a trained answer and (sometimes) a trained token at position 0."""
    rng = np.random.default_rng(seed)
    samples = []
    for number, length in enumerate(rng.integers(4, 30, size=count)):
        ids = rng.integers(0, 300, size=int(length))
        trained = np.zeros(len(ids), dtype=bool)
        trained[rng.integers(1, len(ids)) :] = True
        trained[0] = number % 2 == 0  # loss_on="all"-like: position 0 labelled, but never a target
        samples.append({"input_ids": ids, "labels": np.where(trained, ids, IGNORE_INDEX)})
    return samples


def trained_targets(samples: list[dict[str, np.ndarray]]) -> int:
    return int(sum((sample["labels"][1:] != IGNORE_INDEX).sum() for sample in samples))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padded_batches_keep_each_samples_mask(padding_side: str) -> None:
    samples = masked_samples()
    batch = CausalLMCollator(pad_to_multiple_of=8, padding_side=padding_side)(samples)
    for row, sample in enumerate(samples):
        real = batch.attention_mask[row].bool()
        labels = batch.labels[row][real].numpy()
        expected = sample["labels"].copy()
        if padding_side == "left":
            expected[0] = IGNORE_INDEX  # would be predicted from padding
        assert np.array_equal(labels[1:], sample["labels"][1:])  # every target of the sample, unchanged
        assert labels[0] in (expected[0], IGNORE_INDEX)
        assert (batch.labels[row][~real] == IGNORE_INDEX).all()
    assert batch.step_label_tokens == batch.label_tokens == trained_targets(samples)


def test_flattened_rows_keep_masks_and_restart_positions() -> None:
    samples = masked_samples()
    batch = FlatteningCollator()(samples)
    starts = batch.cu_seqlens[:-1].long()
    assert (batch.labels[0, starts] == IGNORE_INDEX).all()
    assert (batch.position_ids[0, starts] == 0).all()
    for number, sample in enumerate(samples):
        begin, end = int(batch.cu_seqlens[number]), int(batch.cu_seqlens[number + 1])
        assert np.array_equal(batch.labels[0, begin + 1 : end].numpy(), sample["labels"][1:])
        assert batch.position_ids[0, begin:end].tolist() == list(range(end - begin))
    assert batch.step_label_tokens == batch.label_tokens == trained_targets(samples)


def test_text_samples_collate_as_before() -> None:
    texts = [{"input_ids": sample["input_ids"]} for sample in masked_samples()]
    as_labels = [{**sample, "labels": sample["input_ids"]} for sample in texts]
    for collate in (CausalLMCollator(), CausalLMCollator(padding_side="left"), FlatteningCollator()):
        plain, labelled = collate(texts), collate(as_labels)
        assert torch.equal(plain.labels, labelled.labels) and torch.equal(plain.input_ids, labelled.input_ids)
        assert plain.step_label_tokens == labelled.step_label_tokens == sum(len(s["input_ids"]) - 1 for s in texts)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """A model this small gains nothing from intra-op threads on a shared machine (see test_hf_labels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(attention: str) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attention,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tiny_llama_gives_the_same_loss_sum_packed_padded_and_alone(attention: str) -> None:
    model = tiny_llama(attention)
    samples = masked_samples(7, seed=3)
    with torch.no_grad():
        alone = sum(
            model(
                input_ids=torch.as_tensor(sample["input_ids"])[None],
                labels=torch.as_tensor(sample["labels"])[None],
                num_items_in_batch=1,  # the loss is then the sum over the sample's targets
            ).loss
            for sample in samples
        )
        flat = FlatteningCollator()(samples)
        flat_sum = model(
            input_ids=flat.input_ids, position_ids=flat.position_ids, labels=flat.labels, num_items_in_batch=1
        ).loss
        padded = CausalLMCollator(padding_side="right")(samples)
        padded_sum = model(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            labels=padded.labels,
            num_items_in_batch=1,
        ).loss
        mean = model(
            input_ids=flat.input_ids,
            position_ids=flat.position_ids,
            labels=flat.labels,
            num_items_in_batch=flat.step_label_tokens,
        ).loss
    torch.testing.assert_close(flat_sum, alone, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(padded_sum, alone, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mean, alone / trained_targets(samples), rtol=1e-5, atol=1e-5)
