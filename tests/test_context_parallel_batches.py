"""``cp_shard_batch`` on the real batches of ``TextDataModule``: every per-position field of a padded ``TextBatch``
(left and right padding) and of a padding-free ``FlatBatch`` sliced, positions and shifted labels handed out, and
the loss summed over the CP ranks' slices equal to the loss of the whole batch; what cannot be sliced refused."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import make_texts, train_tokenizer

from lightning_d9d import TextDataModule
from lightning_d9d.cli import describe_batch
from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.parallel.context_parallel import cp_shard_batch, cp_unshard
from lightning_d9d.text.collate import CPTextBatch, FlatBatch, TextBatch

VOCAB, POSITIONS = 300, 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp_text")
    texts = make_texts(80, seed=11)
    (root / "data").mkdir()
    pq.write_table(pa.table({"text": texts}), root / "data" / "train.parquet")
    train_tokenizer(texts, root / "tokenizer.json", kind="bpe", vocab_size=VOCAB)
    return {"dataset": str(root / "data"), "tokenizer": str(root / "tokenizer.json"), "cache_dir": str(root / "hf")}


def real_batches(corpus: dict[str, str], **options: Any) -> list[Any]:
    dm = TextDataModule(**corpus, max_length=40, num_workers=0, sort_buffer_size=16, **options)
    dm.prepare_data()
    dm.setup("fit")
    return list(itertools.islice(dm.train_dataloader(), 3))


class PositionalModel(torch.nn.Module):
    """Logits from each token and its position alone: a sum over positions is the same however they are split,
    so the loss of the CP slices must add up to the whole batch's exactly when positions and targets are right."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randn(VOCAB, VOCAB, generator=generator)
        self.positions = torch.randn(POSITIONS, VOCAB, generator=generator)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens[input_ids] + self.positions[position_ids]


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def whole_batch_loss(model: PositionalModel, batch: Any) -> torch.Tensor:
    """What a Hugging Face model computes without CP: the labels shifted inside each row."""
    positions = getattr(batch, "position_ids", None)
    if positions is None:
        positions = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
    logits = model(batch.input_ids, positions)
    return summed_loss(logits[:, :-1], batch.labels[:, 1:])


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_text_batch_is_sliced_in_every_per_position_field(corpus: dict, cp: int, side: str) -> None:
    model = PositionalModel()
    for batch in real_batches(
        corpus, global_batch_size=8, microbatch_size=4, pad_to_multiple_of=8, padding_side=side,
        context_parallel_size=cp,
    ):  # fmt: skip
        assert isinstance(batch, TextBatch) and batch.input_ids.shape[1] % (2 * cp) == 0
        parts = [cp_shard_batch(batch, rank, cp) for rank in range(cp)]
        rows, width = batch.input_ids.shape
        for part in parts:
            assert isinstance(part, CPTextBatch) and part.step_label_tokens == batch.step_label_tokens
            for name in ("input_ids", "attention_mask", "labels", "position_ids", "shift_labels"):
                assert getattr(part, name).shape == (rows, width // cp), name
        whole = {name: cp_unshard([getattr(p, name) for p in parts], cp) for name in ("input_ids", "attention_mask")}
        assert torch.equal(whole["input_ids"], batch.input_ids)
        assert torch.equal(whole["attention_mask"], batch.attention_mask), "the padding mask sliced, not left whole"
        positions = cp_unshard([p.position_ids for p in parts], cp)
        assert torch.equal(positions, torch.arange(width).expand(rows, width))
        shifted = cp_unshard([p.shift_labels for p in parts], cp)
        assert torch.equal(shifted[:, :-1], batch.labels[:, 1:]) and (shifted[:, -1] == IGNORE_INDEX).all()
        # The loss of every rank's slice (each with its own positions and next labels) adds up to the batch's.
        sliced = sum(summed_loss(model(p.input_ids, p.position_ids), p.shift_labels) for p in parts)
        torch.testing.assert_close(sliced, whole_batch_loss(model, batch))
        assert sum(int((p.shift_labels != IGNORE_INDEX).sum()) for p in parts) == batch.label_tokens
        # What a shift inside each slice (the sliced labels alone) would train instead: other pairs of tokens.
        inside = sum(summed_loss(model(p.input_ids, p.position_ids)[:, :-1], p.labels[:, 1:]) for p in parts)
        assert not torch.isclose(inside, sliced)


def test_a_padding_free_batch_gets_next_labels_that_stop_at_every_document(corpus: dict) -> None:
    model = PositionalModel()
    for batch in real_batches(
        corpus, global_batch_tokens=512, microbatch_tokens=128, padding_free=True, context_parallel_size=2
    ):
        assert isinstance(batch, FlatBatch) and batch.num_documents > 1
        parts = [cp_shard_batch(batch, rank, 2) for rank in range(2)]
        assert all(type(p) is FlatBatch and p.cu_seqlens is batch.cu_seqlens for p in parts)
        bounds = batch.cu_seqlens_padded
        shifted = cp_unshard([p.shift_labels for p in parts], 2, cu_seqlens_padded=bounds)
        expected = torch.cat([batch.labels[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        expected[0, bounds[1:].long() - 1] = IGNORE_INDEX  # the end of each padded document predicts nothing
        assert torch.equal(shifted, expected)
        sliced = sum(summed_loss(model(p.input_ids, p.position_ids), p.shift_labels) for p in parts)
        torch.testing.assert_close(sliced, whole_batch_loss(model, batch))


@dataclasses.dataclass
class Plain:
    input_ids: torch.Tensor
    labels: torch.Tensor


def test_what_cannot_be_sliced_is_one_clear_error() -> None:
    ids = torch.arange(16).reshape(2, 8)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 1, 8, 8\), which cannot be sliced like "):
        cp_shard_batch({"input_ids": ids, "attention_mask": torch.ones(2, 1, 8, 8)}, 0, 2)
    with pytest.raises(ValueError, match=r"dict.token_type_ids has the shape of input_ids \(2, 8\), so it looks "):
        cp_shard_batch({"input_ids": ids, "token_type_ids": torch.zeros(2, 8)}, 0, 2)
    with pytest.raises(ValueError, match=r"hand out \['position_ids', 'shift_labels'\] with the slices of a Plain"):
        cp_shard_batch(Plain(ids, ids.clone()), 0, 2)
    with pytest.raises(ValueError, match=r"Plain.labels has the shape of input_ids \(2, 8\), so it looks per-position"):
        cp_shard_batch(Plain(ids, ids.clone()), 1, 2, fields=("input_ids",))  # labels left whole: refused
    plain = cp_shard_batch(Plain(ids, ids.clone()), 1, 2, fields=("input_ids", "labels"))  # chosen: no positions
    assert plain.input_ids.tolist() == plain.labels.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    sliced = cp_shard_batch({"input_ids": ids, "labels": ids.clone()}, 0, 2)
    assert sliced["position_ids"].tolist() == [[0, 1, 6, 7]] * 2
    assert sliced["shift_labels"].tolist() == [[1, 2, 7, IGNORE_INDEX], [9, 10, 15, IGNORE_INDEX]]
    assert cp_shard_batch({"input_ids": ids}, 0, 1) == {"input_ids": ids}, "one CP rank: the batch as it is"


def test_a_cp_text_batch_is_a_text_batch_and_plain_text_batches_stay_as_they_were(corpus: dict) -> None:
    assert issubclass(CPTextBatch, TextBatch)
    assert list(TextBatch.__dataclass_fields__) == ["input_ids", "attention_mask", "labels", "step_label_tokens"]
    batch = real_batches(corpus, global_batch_size=8, microbatch_size=4, context_parallel_size=2)[0]
    rows, width = batch.input_ids.shape
    assert describe_batch(batch) == [
        f"batch.input_ids: ({rows}, {width}) int64", f"batch.attention_mask: ({rows}, {width}) int64",
        f"batch.labels: ({rows}, {width}) int64", "batch.step_label_tokens: int",
    ]  # fmt: skip
    assert f"batch.position_ids: ({rows}, {width // 2}) int64" in describe_batch(cp_shard_batch(batch, 0, 2))
