"""Streaming rows laid out for context parallelism (``context_parallel_size`` c): every sequence of a best-fit
row spans a multiple of 2·c with its padding training nothing, ``cu_seqlens``/``cu_seqlens_padded`` as an
independent walk over the rows gives them, CP shards of a streaming batch put back together are the batch, concat
rows are split whole, the CP padding is counted (in the stream stats and the pass estimate), resume is exact, and
bad settings are one clear error each."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import digest, make_docs, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.datamodules.pretraining import PretrainingBatch
from lightning_d9d.parallel.context_parallel import cp_shard_batch, cp_unshard
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.packing.rows import CP_PAD, NO_TARGET, START, StreamCounters

OPTIONS = dict(seq_len=32, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=2,
               steps_per_epoch=1000, bestfit_buffer_size=8, tokenizer_batch_size=4, pin_memory=False)  # fmt: skip
BEST_FIT = ("bestfit", "bestfit_split")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cp_rows")
    docs = make_docs(120, seed=11, max_words=20, long_every=9, long_words=60)
    write_parquet(root / "data", docs, files=2, row_group_size=20)
    train_tokenizer(docs, root / "tok.json")
    return root


def datamodule(corpus: Path, packing: str, cp: int, **changes: Any) -> PretrainingDataModule:
    options = {**OPTIONS, "packing": packing, "context_parallel_size": cp, **changes}
    dm = PretrainingDataModule(str(corpus / "data"), str(corpus / "tok.json"), **options)
    dm.setup("fit")
    return dm


def batches_of(dm: PretrainingDataModule, n: int) -> list[PretrainingBatch]:
    loader = iter(dm.train_dataloader())
    out = list(itertools.islice(loader, n))
    loader.close()
    return out


def reference_sequences(batch: PretrainingBatch, pad_id: int) -> tuple[list[int], list[int], list[tuple]]:
    """Walk the rows: a sequence starts where ``position_ids`` is 0; its CP padding is the pad ids after its first
    token (a sequence that starts with the pad id is a padding run, all of it counted as its length).

    Returns:
        the flat offsets of the sequences (size last), the cumulative real lengths, and per sequence
        ``(row, start, span, real)``.
    """
    offsets, real_cumulative, sequences, total = [], [0], [], 0
    width = batch.input_ids.shape[1]
    for r, (ids, positions) in enumerate(zip(batch.input_ids.tolist(), batch.position_ids.tolist())):
        starts = [c for c, p in enumerate(positions) if p == 0] + [width]
        for start, stop in itertools.pairwise(starts):
            run = ids[start:stop]
            real = len(run) if run[0] == pad_id else sum(1 for token in run if token != pad_id)
            offsets.append(r * width + start)
            total += real
            real_cumulative.append(total)
            sequences.append((r, start, stop - start, real))
    return [*offsets, batch.input_ids.numel()], real_cumulative, sequences


@pytest.mark.parametrize(("packing", "cp"), [(p, c) for p in BEST_FIT for c in (2, 4)])
def test_every_best_fit_sequence_spans_a_multiple_of_2c_and_its_cp_padding_trains_nothing(
    corpus: Path, packing: str, cp: int
) -> None:
    dm = datamodule(corpus, packing, cp)
    pad_id, m = dm.train_spec.sources[0].pad_id, 2 * cp
    padded_somewhere = 0
    for batch in batches_of(dm, 12):
        offsets, real_cumulative, sequences = reference_sequences(batch, pad_id)
        assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
        assert batch.cu_seqlens_padded.tolist() == offsets
        assert batch.cu_seqlens.tolist() == real_cumulative
        assert batch.max_seqlen == max(span for _, _, span, _ in sequences)
        for r, start, span, real in sequences:
            ids, targets = batch.input_ids[r, start : start + span], batch.targets[r, start : start + span]
            assert span % m == 0 and span == -(-real // m) * m, (r, start, span, real)
            assert batch.position_ids[r, start : start + span].tolist() == list(range(span)), "positions continue"
            assert ids[0] == pad_id or ((ids[real:] == pad_id).all() and (ids[:real] != pad_id).all())
            if real < span:  # CP padding: it and the token before it predict nothing
                padded_somewhere += 1
                assert (targets[real - 1 :] == IGNORE_INDEX).all()
            inner = targets[: max(0, real - 1)]
            assert ((inner == ids[1:real]) | (inner == IGNORE_INDEX)).all(), "inside a piece: the next token"
            if packing == "bestfit" and real > 1:
                assert torch.equal(inner, ids[1:real]), "bestfit masks nothing inside a document"
    assert padded_somewhere > 10


@pytest.mark.parametrize("packing", [*BEST_FIT, "concat"])
def test_cp_shards_of_a_streaming_batch_put_back_together_are_the_batch(corpus: Path, packing: str) -> None:
    cp = 2
    for batch in batches_of(datamodule(corpus, packing, cp), 6):
        bounds = batch.cu_seqlens_padded.long()
        shards = [cp_shard_batch(batch, rank, cp) for rank in range(cp)]
        for rank, shard in enumerate(shards):
            assert shard.input_ids.shape == (len(batch), OPTIONS["seq_len"] // cp)
            assert torch.equal(shard.cu_seqlens, batch.cu_seqlens) and shard.max_seqlen == batch.max_seqlen
            assert torch.equal(shard.sources, batch.sources), "metadata is never sliced"
            # The zigzag rule on the flattened microbatch: chunks rank and 2·cp - 1 - rank of every sequence.
            keep = []
            for start, stop in itertools.pairwise(bounds.tolist()):
                chunk = (stop - start) // (2 * cp)
                for piece in (rank, 2 * cp - 1 - rank):
                    keep += range(start + piece * chunk, start + (piece + 1) * chunk)
            assert torch.equal(shard.position_ids.reshape(-1), batch.position_ids.reshape(-1)[keep])
        for name in ("input_ids", "targets", "position_ids"):
            whole = cp_unshard([getattr(shard, name) for shard in shards], cp, -1, batch.cu_seqlens_padded)
            assert torch.equal(whole, getattr(batch, name)), name


def test_concat_rows_are_the_same_under_cp_and_each_row_is_one_sequence(corpus: Path) -> None:
    plain, split = batches_of(datamodule(corpus, "concat", 1), 6), batches_of(datamodule(corpus, "concat", 4), 6)
    for a, b in zip(plain, split, strict=True):
        for name in ("input_ids", "targets", "position_ids", "sources"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        rows = torch.arange(0, b.input_ids.numel() + 1, OPTIONS["seq_len"], dtype=torch.int32)
        assert torch.equal(b.cu_seqlens, rows) and torch.equal(b.cu_seqlens_padded, rows)
        assert b.max_seqlen == OPTIONS["seq_len"]
        assert torch.equal(a.cu_seqlens_padded, a.cu_seqlens) and len(a.cu_seqlens) > len(rows), "c = 1: documents"


@pytest.mark.parametrize("packing", BEST_FIT)
def test_cp_padding_is_counted_in_the_stream_stats(corpus: Path, packing: str) -> None:
    plain, dm = datamodule(corpus, packing, 1), datamodule(corpus, packing, 4)
    in_inputs = sum(int(b.cu_seqlens_padded[-1] - b.cu_seqlens[-1]) for b in batches_of(dm, 20))
    rows = 20 * OPTIONS["microbatch_size"]
    stats = dm.stream_stats()
    assert stats["rows"] == rows and stats["emitted"] + stats["padding"] == rows * (OPTIONS["seq_len"] + 1)
    # Padding on a row's last token (a target only) is not in the inputs: at most one per row.
    assert in_inputs <= stats["cp_padding"] <= in_inputs + rows and stats["cp_padding"] <= stats["padding"]
    batches_of(plain, 20)
    assert plain.stream_stats()["cp_padding"] == 0
    if packing == "bestfit":
        assert stats["padding"] == stats["cp_padding"], "bestfit pads only for CP"


@pytest.mark.parametrize("packing", [*BEST_FIT, "concat"])
def test_resume_with_cp_is_exact(corpus: Path, packing: str) -> None:
    uninterrupted = datamodule(corpus, packing, 2)
    m = uninterrupted.microbatches_per_step
    loader = iter(uninterrupted.train_dataloader())
    for _ in range(3 * m):
        next(loader)
    state = uninterrupted.state_dict()
    want = [digest(next(loader)) for _ in range(12 * m)]
    loader.close()
    resumed = datamodule(corpus, packing, 2, num_workers=2)  # rows and flags cross from worker processes
    resumed.load_state_dict(state)
    assert [digest(batch) for batch in batches_of(resumed, 12 * m)] == want
    assert resumed.stream_stats() == uninterrupted.stream_stats()


def test_a_checkpoint_resumes_only_with_its_cp_size(corpus: Path) -> None:
    saved = datamodule(corpus, "bestfit", 1)
    batches_of(saved, 4)
    state = saved.state_dict()
    with pytest.raises(ValueError, match="context_parallel_size: checkpoint 1, this run 2"):
        datamodule(corpus, "bestfit", 2).load_state_dict(state)
    # No reading of states older than the field (0.1.0 has no such checkpoints): one error naming it.
    del state["fingerprint"]["context_parallel_size"]
    with pytest.raises(ValueError, match="context_parallel_size: checkpoint <missing>, this run 1"):
        datamodule(corpus, "bestfit", 1).load_state_dict(state)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq_len": 30, "context_parallel_size": 4}, r"seq_len=30 is not a multiple of 2 × context_parallel_size = 8 "
         r"\(context_parallel_size=4\).* e\.g\. 32"),
        ({"context_parallel_size": 0}, "context_parallel_size must be a positive integer, got 0"),
        ({"context_parallel_size": 1.5}, "context_parallel_size must be a positive integer, got 1.5"),
    ],
)  # fmt: skip
def test_bad_cp_settings_are_one_clear_error(corpus: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PretrainingDataModule(str(corpus / "data"), str(corpus / "tok.json"), **{**OPTIONS, **changes})


@pytest.mark.parametrize("split", [False, True])
def test_the_packer_flags_exactly_the_cp_padding_it_counts(split: bool) -> None:
    capacity, multiple, pad = 33, 8, 999
    rng = np.random.default_rng(4)
    counters = StreamCounters()
    packer = (
        BestFitSplitPacker(capacity, pad, 8, counters=counters, cp_multiple=multiple)
        if split
        else BestFitPacker(capacity, 8, counters=counters, cp_multiple=multiple, pad_id=pad)
    )
    documents = iter([np.concatenate([[1], rng.integers(10, 90, size=n)]) for n in rng.integers(1, 60, size=400)])

    def refill() -> None:
        tokens = next(documents)
        packer.add(tokens, (0, 0)) if split else packer.add(tokens[:capacity], len(tokens), (0, 0))

    tokens, flags = packer.take(60, refill)
    cp_pad = (flags & CP_PAD) != 0
    assert int(cp_pad.sum()) == counters.cp_padding > 0
    assert (
        (tokens[cp_pad] == pad).all() and ((flags[cp_pad] & NO_TARGET) != 0).all() and not (flags[cp_pad] & START).any()
    )
    starts = [np.flatnonzero(row[:-1] & START) for row in flags]
    assert all(row[0] == 0 and (row % multiple == 0).all() for row in starts), "every sequence starts at 2·c"


def test_the_pass_estimate_counts_cp_padding(corpus: Path) -> None:
    for packing in BEST_FIT:
        plain, split = (datamodule(corpus, packing, cp, steps_per_epoch=None) for cp in (1, 4))
        assert split.steps_per_epoch > plain.steps_per_epoch, packing
    concat = [datamodule(corpus, "concat", cp, steps_per_epoch=None).steps_per_epoch for cp in (1, 4)]
    assert concat[0] == concat[1]
