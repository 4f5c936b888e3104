"""Token and source counts of a batch, shared by ``inspect`` and the data metrics."""

from __future__ import annotations

import torch

from lightning_d9d.core.batches import count_tokens, row_sources


def test_padded_packed_and_packs_of_batches_are_counted() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert count_tokens({"input_ids": torch.zeros(2, 3), "attention_mask": mask}) == (3, 6)
    targets = torch.tensor([[5, -100, 7, 8], [-100, -100, 1, 2]])
    packed = {"input_ids": torch.zeros(2, 4), "targets": targets, "sources": torch.tensor([1, 0])}
    assert count_tokens(packed) == (5, 8)
    assert count_tokens({"input_ids": torch.zeros(1, 9)}) == (9, 9)
    assert count_tokens([packed, packed]) == (10, 16)
    assert row_sources([packed, packed]) == [1, 0, 1, 0]
    assert count_tokens({"tokens": torch.zeros(2, 3)}) is None
    assert count_tokens([packed, {"tokens": torch.zeros(2)}]) is None
    assert row_sources({"tokens": torch.zeros(2)}) == []
