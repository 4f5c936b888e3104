"""Context parallelism: documents padded to 2·cp, rows laid out with positions and labels, the zigzag split of a
row (per sequence and per document, and per document over a microbatch's flattened rows) checked against a plain
index computation, its inverse, batch slicing that never touches metadata, the collator's CP layout, token budgets
that count CP padding, pipeline-stage fields."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from support import LengthDataset, planned_token_steps

from lightning_d9d import D9DDataModule, TextDataModule
from lightning_d9d.mapstyle.plan import TokenBudget, check_lengths_fit
from lightning_d9d.parallel.context_parallel import (
    IGNORE_INDEX,
    cp_shard,
    cp_shard_batch,
    cp_unshard,
    flatten_for_cp,
    pad_documents_for_cp,
)
from lightning_d9d.parallel.pipeline_parallel import pipeline_stage_fields
from lightning_d9d.text.collate import FlatBatch, FlatteningCollator


def reference_indices(bounds: list[int], rank: int, cp: int) -> list[int]:
    """Straightforward: every document split in 2·cp chunks, this rank's chunks rank and 2·cp-1-rank, in order."""
    kept = []
    for start, end in itertools.pairwise(bounds):
        chunk = (end - start) // (2 * cp)
        for piece in (rank, 2 * cp - 1 - rank):
            kept += list(range(start + piece * chunk, start + (piece + 1) * chunk))
    return kept


def test_documents_pad_to_twice_the_cp_size() -> None:
    padded, cu, cu_padded = pad_documents_for_cp([3, 8, 1, 0], 2)
    assert padded.tolist() == [4, 8, 4, 0]
    assert cu.dtype == cu_padded.dtype == np.int32
    assert cu.tolist() == [0, 3, 11, 12, 12] and cu_padded.tolist() == [0, 4, 12, 16, 16]
    assert pad_documents_for_cp([3, 5], 1).padded_lengths.tolist() == [3, 5], "one CP rank: nothing to split"
    assert pad_documents_for_cp([5], 3).padded_lengths.tolist() == [6]
    for bad, message in (([-1], "whole numbers >= 0"), ([1.5], "whole numbers >= 0")):
        with pytest.raises(ValueError, match=message):
            pad_documents_for_cp(bad, 2)
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer, got 0"):
        pad_documents_for_cp([1], 0)


def test_a_row_laid_out_for_cp_has_hugging_face_labels_and_positions_through_the_padding() -> None:
    row = flatten_for_cp([[11, 12, 13], [21, 22, 23, 24, 25]], 2, pad_token_id=0)
    assert row.input_ids.tolist() == [11, 12, 13, 0, 21, 22, 23, 24, 25, 0, 0, 0]
    assert row.labels.tolist() == [-100, 12, 13, -100, -100, 22, 23, 24, 25, -100, -100, -100]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert row.cu_seqlens.tolist() == [0, 3, 8] and row.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert row.max_seqlen == 8
    masked = flatten_for_cp([[1, 2, 3], [4, 5]], 2, labels=[[-100, 2, 3], [-100, -100]])
    assert masked.labels.tolist() == [-100, 2, 3, -100, -100, -100, -100, -100]
    with pytest.raises(ValueError, match="labels must match the documents"):
        flatten_for_cp([[1, 2, 3]], 2, labels=[[1, 2]])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("per_document", [False, True])
def test_shard_matches_a_plain_index_computation_and_unshard_inverts_it(cp: int, per_document: bool) -> None:
    rng = np.random.default_rng(cp)
    for _ in range(20):
        lengths = rng.integers(0, 40, size=rng.integers(1, 6))
        if per_document:
            bounds = pad_documents_for_cp(lengths, cp).cu_seqlens_padded
        else:
            bounds = np.array([0, int(rng.integers(1, 6)) * 2 * cp])
        length = int(bounds[-1])
        row = torch.randint(0, 1000, (3, length))
        given = torch.from_numpy(bounds) if per_document else None
        slices = [cp_shard(row, rank, cp, seq_dim=1, cu_seqlens_padded=given) for rank in range(cp)]
        assert {s.shape[1] for s in slices} == {length // cp}, "equal work per CP rank"
        if cp > 1:
            for rank, part in enumerate(slices):
                assert part.tolist() == row[:, reference_indices(bounds.tolist(), rank, cp)].tolist()
        assert torch.equal(cp_unshard(slices, cp, seq_dim=1, cu_seqlens_padded=given), row)
        flat = row[0].numpy()
        numpy_slices = [
            cp_shard(flat, rank, cp, cu_seqlens_padded=bounds if per_document else None) for rank in range(cp)
        ]
        assert np.array_equal(cp_unshard(numpy_slices, cp, cu_seqlens_padded=bounds if per_document else None), flat)


def test_a_row_that_does_not_split_evenly_is_one_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"a sequence of 10 positions does not split into 2 × context_parallel_size = 4"
    ):
        cp_shard(torch.arange(10), 0, 2)
    with pytest.raises(
        ValueError, match=r"document 1 spans 6 positions, not a multiple of 2 × context_parallel_size = 4"
    ):
        cp_shard(torch.arange(10), 0, 2, cu_seqlens_padded=[0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must rise from 0 to the sequence's 8 positions"):
        cp_shard(torch.arange(8), 0, 2, cu_seqlens_padded=[0, 4])
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        cp_shard(torch.arange(8), 2, 2)
    with pytest.raises(ValueError, match="one slice per CP rank: 2 expected, got 1"):
        cp_unshard([torch.arange(4)], 2)


def test_bounds_over_a_microbatch_of_rows_split_each_row_and_must_start_every_row() -> None:
    rows = torch.arange(24).reshape(2, 12)  # row 0: sequences of 4 and 8; row 1: one of 12 (flat offsets)
    bounds = torch.tensor([0, 4, 12, 24], dtype=torch.int32)
    parts = [cp_shard(rows, rank, 2, cu_seqlens_padded=bounds) for rank in range(2)]
    flat = rows.reshape(-1).tolist()
    for rank, part in enumerate(parts):
        assert part.shape == (2, 6)
        assert part.reshape(-1).tolist() == [flat[i] for i in reference_indices([0, 4, 12, 24], rank, 2)]
    assert torch.equal(cp_unshard(parts, 2, cu_seqlens_padded=bounds), rows)
    with pytest.raises(ValueError, match="spans 2 rows of 12 positions but has no bound at row start 12"):
        cp_shard(rows, 0, 2, cu_seqlens_padded=[0, 8, 24])


def test_sharding_a_batch_slices_sequence_fields_and_never_the_metadata() -> None:
    batch = FlatteningCollator(context_parallel_size=2)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}])
    parts = [cp_shard_batch(batch, rank, 2) for rank in range(2)]
    for part in parts:
        assert isinstance(part, FlatBatch) and part.input_ids.shape == (1, 6)
        assert part.cu_seqlens is batch.cu_seqlens and part.cu_seqlens_padded is batch.cu_seqlens_padded
        assert part.max_seqlen == batch.max_seqlen and part.step_label_tokens == batch.step_label_tokens
    bounds = batch.cu_seqlens_padded
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(
            cp_unshard([getattr(p, name) for p in parts], 2, cu_seqlens_padded=bounds), getattr(batch, name)
        )
    assert parts[0].position_ids.tolist() == [[0, 3, 0, 1, 6, 7]], "positions stay global (for rotary embeddings)"
    as_dict = cp_shard_batch(dataclasses.asdict(batch), 1, 2)
    assert torch.equal(as_dict["input_ids"], parts[1].input_ids) and as_dict["cu_seqlens"] is not None
    rows = {"inputs": torch.arange(16).reshape(2, 8), "targets": torch.arange(16).reshape(2, 8), "sources": [0, 1]}
    sliced = cp_shard_batch(rows, 0, 2, per_document=False)
    assert sliced["inputs"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]] and sliced["sources"] == [0, 1]
    with pytest.raises(TypeError, match="dataclass or a dict"):
        cp_shard_batch([torch.arange(4)], 0, 2)


def test_the_collator_with_one_cp_rank_is_todays_row_and_with_more_pads_each_document() -> None:
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4, 5]}]
    plain = FlatteningCollator()(samples)
    assert plain.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5]]
    assert plain.labels.tolist() == [[-100, 6, 7, -100, 9, -100, 2, 3, 4, 5]]
    assert plain.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]
    assert plain.cu_seqlens.tolist() == plain.cu_seqlens_padded.tolist() == [0, 3, 5, 10]
    assert plain.max_seqlen == 5 and plain.num_tokens == 10 and plain.step_label_tokens == 7
    cp = FlatteningCollator(context_parallel_size=2, pad_token_id=99)(samples)
    assert cp.input_ids.tolist() == [[5, 6, 7, 99, 8, 9, 99, 99, 1, 2, 3, 4, 5, 99, 99, 99]]
    assert cp.cu_seqlens.tolist() == [0, 3, 5, 10] and cp.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert cp.num_tokens == 10 and cp.label_tokens == plain.label_tokens == cp.step_label_tokens == 7
    assert cp.flash_attention_kwargs()["cu_seq_lens_q"] is cp.cu_seqlens_padded
    assert int((cp.labels != IGNORE_INDEX).sum()) == int((plain.labels != IGNORE_INDEX).sum())
    with pytest.raises(ValueError, match="context_parallel_size must be a positive integer"):
        FlatteningCollator(context_parallel_size=0)


def test_token_budgets_count_each_document_padded_for_cp() -> None:
    dataset = LengthDataset(600)

    def collate(samples: list) -> FlatBatch:
        return FlatteningCollator(context_parallel_size=2)([{"input_ids": s["tokens"].long()} for s in samples])

    collate.flattens, collate.context_parallel_size = True, 2  # what the planner reads from FlatteningCollator
    dm = D9DDataModule(dataset, collate, global_batch_tokens=4096, microbatch_tokens=1024, padding_free=True,
                       sort_buffer_size=256)  # fmt: skip
    dm.setup("fit")
    seen, per_microbatch = [], []
    for batch in dm.train_dataloader_for_rank(0, 1):
        row = int(batch.cu_seqlens_padded[-1])
        assert row == batch.input_ids.shape[1] <= 1024 and row % 4 == 0, "a row within the budget, split evenly"
        seen += batch.cu_seqlens.diff().tolist()
        per_microbatch.append(sorted(batch.cu_seqlens.diff().tolist()))
    assert sum(seen) == sum(dm.plan.epoch(0).tokens.tolist()), "real tokens as planned"
    # The rule written out in the test, each document costing its length rounded up to 2·c = 4: every microbatch
    # holds exactly the planned documents' real lengths, in the planned order of microbatches.
    rounded = -(-dataset.lengths.astype(np.int64) // 4) * 4
    planned = planned_token_steps(rounded, 1024, 4, 256, 0, 0, padding_free=True)
    expected = [sorted(int(dataset.lengths[i]) for i in mb) for step in planned for mb in step]
    assert len(per_microbatch) == len(expected) and per_microbatch == expected
    figures = dm.plan.describe(0)
    assert figures["budget_used"] > figures["fill"], "CP padding counts against the budget, not as real tokens"
    assert dm.fingerprint.document_multiple == 4
    assert TokenBudget(4096, 1024, True).document_multiple == 1


def test_a_cp_size_that_makes_the_budget_unusable_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"microbatch_tokens=1022 is not a multiple of 2 × context_parallel_size = 4"):
        TokenBudget(4088, 1022, True, 1, 2)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=6 is not a multiple of 2 × context_parallel_size = 4"):
        TokenBudget(4096, 1024, False, 6, 2)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=6 is not a multiple of 2 × context_parallel_size = 4.*"
                                         r"use pad_to_multiple_of=12"):  # fmt: skip
        TextDataModule(global_batch_size=8, pad_to_multiple_of=6, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"microbatch_tokens=100 is not a multiple of 2 × context_parallel_size = 8"):
        TextDataModule(global_batch_tokens=400, microbatch_tokens=100, padding_free=True, context_parallel_size=4)
    lengths = np.array([5, 1021, 7])
    with pytest.raises(ValueError, match=r"sample 1 has 1021 tokens \(padded to a multiple of 4 = 2 × "
                                         r"context_parallel_size=2: 1024\)"):  # fmt: skip
        check_lengths_fit(lengths, TokenBudget(4080, 1020, True, 1, 2))


def test_each_pipeline_stage_keeps_its_fields_and_the_metadata() -> None:
    batch = FlatteningCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    first = pipeline_stage_fields(batch, first=True, last=False)
    middle = pipeline_stage_fields(batch, first=False, last=False)
    last = pipeline_stage_fields(batch, first=False, last=True)
    only = pipeline_stage_fields(batch, first=True, last=True)
    assert first.input_ids is batch.input_ids and first.position_ids is batch.position_ids and first.labels is None
    assert middle.input_ids is None and middle.labels is None and middle.position_ids is None
    assert last.labels is batch.labels and last.input_ids is None
    for stage in (first, middle, last, only):
        assert stage.cu_seqlens is batch.cu_seqlens and stage.max_seqlen == batch.max_seqlen
    assert only.input_ids is batch.input_ids and only.labels is batch.labels
    rows = {"inputs": 1, "targets": 2, "position_ids": 3, "cu_seqlens": 4}
    assert pipeline_stage_fields(rows, first=False, last=True) == {"targets": 2, "cu_seqlens": 4}
    sliced = cp_shard_batch(FlatteningCollator(context_parallel_size=2)([{"input_ids": [1, 2, 3]}]), 0, 2)
    assert pipeline_stage_fields(sliced, first=False, last=True).shift_labels is sliced.shift_labels is not None
    assert pipeline_stage_fields(sliced, first=True, last=False).shift_labels is None, "the loss's: last stage only"
    with pytest.raises(TypeError, match="dataclass or a dict"):
        pipeline_stage_fields([1], True, True)
