"""PretrainingDataModule under a real Trainer: exact resume, and the same global batches on any layout.

Each scenario is one uninterrupted run that saves checkpoints (at step boundaries, mid accumulation window, at
epoch ends, past a pass boundary), then resumed runs from those checkpoints — on the same layout, or with
another world size (real 2-process DDP on gloo), ``num_workers`` or ``microbatch_size``. Every row trained is
recorded as a digest; a resumed run must train, step by step, exactly the rows of the uninterrupted one.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import fit, fit_in_processes, make_docs, ranked_rows, read_records, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule

G, K, STEPS_PER_EPOCH = 8, 4, 5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretraining")
    docs = make_docs(100, seed=5, max_words=20, long_every=9, long_words=60)
    write_parquet(root / "train", docs, files=2, row_group_size=10)
    write_parquet(root / "val", make_docs(60, seed=6), files=1, row_group_size=10)
    train_tokenizer(docs + make_docs(60, seed=6), root / "tokenizer.json")
    return root


def options(data: Path, **changes: Any) -> dict:
    base = dict(
        train_files=str(data / "train"),
        val_files=str(data / "val"),
        tokenizer=str(data / "tokenizer.json"),
        seq_len=16,
        global_batch_size=G,
        microbatch_size=2,
        num_streams=K,
        val_steps=2,
        steps_per_epoch=STEPS_PER_EPOCH,
        tokenizer_batch_size=8,
        bestfit_buffer_size=24,
        num_workers=0,
    )
    base.update(changes)
    return base


def run(tmp: Path, data: Path, runs: list[dict], devices: int = 1, **changes: Any) -> list[dict]:
    config = {
        "data": "pretraining",
        "options": options(data, **changes),
        "record_dir": str(tmp / "records"),
        "ckpt_dir": str(tmp / "ckpt"),
        "devices": devices,
        "runs": runs,
    }
    if devices > 1:
        fit_in_processes(config)
    else:
        fit(config)
    return read_records(tmp / "records") + read_records(tmp / "records", "val")


def rows_per_step(records: list[dict], run: str) -> dict[tuple[int, int], list[str]]:
    """(epoch, global step) -> the digests of every row trained in that step, in order over all ranks: rank 0's
    microbatches in order, then rank 1's (each rank the same number of rows, so a row's place also says which rank
    trained it)."""
    steps: dict[tuple[int, int], dict[int, list[tuple[int, list[str]]]]] = {}
    for r in records:
        if r["run"] == run and r["kind"] == "train":
            by_rank = steps.setdefault((r["epoch"], r["step"]), {})
            by_rank.setdefault(r["dp_rank"], []).append((r["batch_idx"], r["rows"]))
    return {
        key: ranked_rows([[row for _, rows in sorted(by_rank[rank]) for row in rows] for rank in sorted(by_rank)])
        for key, by_rank in steps.items()
    }


def assert_resumed_runs_match(records: list[dict], full: dict, resumed: dict[str, int]) -> None:
    """Every resumed run trains, step by step, exactly the rows of the uninterrupted run from its step on."""
    for name, start in resumed.items():
        got = rows_per_step(records, name)
        assert got, name
        assert min(step for _, step in got) == start, name
        assert got == {key: rows for key, rows in full.items() if key[1] >= start}, name


def saved_state(path: Path) -> dict:
    return torch.load(path, weights_only=True)["PretrainingDataModule"]


def assert_validation_is_the_same_every_run(records: list[dict]) -> None:
    """Every validation run of a microbatch size reads the same microbatches (val_steps=2 of them)."""
    runs: dict[tuple, list[str]] = {}
    for r in records:
        if r["kind"] == "val":
            runs.setdefault((len(r["rows"]), r["run"], r["rank"], r["epoch"]), []).append(r["digest"])
    for size in {key[0] for key in runs}:
        same_size = [tuple(v) for key, v in runs.items() if key[0] == size]
        assert len(set(same_size)) == 1 and len(same_size[0]) == 2, size


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["bestfit", "concat", "bestfit_split"])
def test_resume_on_one_device_is_exact_with_other_workers_and_microbatch_sizes(
    data: Path, tmp_path: Path, packing: str
) -> None:
    ckpt = tmp_path / "ckpt"
    # G=8, m=2 -> M=4 microbatches per step; 5 steps per epoch; 4 streams of 2 rows per step each.
    records = run(
        tmp_path,
        data,
        [
            dict(name="full", max_steps=16, every_n_train_steps=5, save_at=[[0, 9], [2, 15]]),
            dict(name="epoch_end", max_steps=16, ckpt_path=str(ckpt / "epoch=0-step=5.ckpt")),
            dict(name="mid_window", max_steps=16, ckpt_path=str(ckpt / "mid-e0-b9.ckpt"), options={"num_workers": 2}),
            dict(
                name="later_pass",
                max_steps=16,
                ckpt_path=str(ckpt / "mid-e2-b15.ckpt"),
                options={"microbatch_size": 4, "num_workers": 1},
            ),
        ],
        packing=packing,
    )
    full = rows_per_step(records, "full")
    assert len(full) == 16 and all(len(rows) == G for rows in full.values())
    later = saved_state(ckpt / "mid-e2-b15.ckpt")
    assert (later["epoch"], later["step"]) == (2, 4)  # after the last microbatch of global step 13
    passes = [int(state["sources"]["train"]["packing"]["reader"]["pass"]) for state in later["streams"].values()]
    assert max(passes) >= 1, "past a pass boundary"
    mid = saved_state(ckpt / "mid-e0-b9.ckpt")
    assert (mid["epoch"], mid["step"]) == (0, 2)  # the partial window is not saved: resume at its step
    assert sorted(later["streams"]) == list(range(K))
    for state in later["streams"].values():
        assert len(pickle.dumps(state)) < 64 * 1024
    assert_resumed_runs_match(records, full, {"epoch_end": 5, "mid_window": 2, "later_pass": 14})
    assert_validation_is_the_same_every_run(records)


@pytest.mark.slow
def test_the_same_global_batches_on_one_and_two_ranks_and_elastic_resume(data: Path, tmp_path: Path) -> None:
    # Real DDP for the packing whose state holds most (buffers); every packing's rows on any rank layout, and
    # their resume there, are compared in tests/streaming/test_pretraining_stream.py.
    packing = "bestfit"
    ckpt1, ckpt2 = tmp_path / "one" / "ckpt", tmp_path / "two" / "ckpt"
    # One rank: an uninterrupted run with checkpoints mid-epoch (step 3), mid-window and across a pass (step 12).
    one = run(
        tmp_path / "one",
        data,
        [dict(name="full", max_steps=14, every_n_train_steps=3, save_at=[[1, 6]])],
        packing=packing,
    )
    # Two ranks (2 streams each): uninterrupted, then resumed from one-rank checkpoints with 2 workers and m=1.
    two = run(
        tmp_path / "two",
        data,
        [
            dict(name="full", max_steps=14, every_n_train_steps=4),
            dict(name="from_one_mid_epoch", max_steps=14, ckpt_path=str(ckpt1 / "epoch=0-step=3.ckpt")),
            dict(
                name="from_one_mid_window",
                max_steps=14,
                ckpt_path=str(ckpt1 / "mid-e1-b6.ckpt"),
                options={"num_workers": 2, "microbatch_size": 1},
            ),
            dict(name="from_one_later_pass", max_steps=14, ckpt_path=str(ckpt1 / "epoch=2-step=12.ckpt")),
        ],
        devices=2,
        packing=packing,
    )
    full = rows_per_step(one, "full")
    assert len(full) == 14
    assert rows_per_step(two, "full") == full, "1 and 2 ranks train the same rows in every step"
    counts = Counter(r["rank"] for r in two if r["run"] == "full" and r["kind"] == "train")
    assert counts[0] == counts[1] == 14 * 2  # M = 8 / (2 x 2) microbatches per rank per step
    streams = saved_state(ckpt1 / "epoch=2-step=12.ckpt")["streams"].values()
    assert max(int(s["sources"]["train"]["packing"]["reader"]["pass"]) for s in streams) >= 1
    assert_resumed_runs_match(two, full, {"from_one_mid_epoch": 3, "from_one_mid_window": 6, "from_one_later_pass": 12})
    # Two ranks -> one, with 2 workers and another microbatch size.
    back = run(
        tmp_path / "back",
        data,
        [
            dict(name="from_two_mid_epoch", max_steps=14, ckpt_path=str(ckpt2 / "epoch=0-step=4.ckpt")),
            dict(
                name="from_two_later_pass",
                max_steps=14,
                ckpt_path=str(ckpt2 / "epoch=2-step=12.ckpt"),
                options={"num_workers": 2, "microbatch_size": 4},
            ),
        ],
        packing=packing,
    )
    assert_resumed_runs_match(back, full, {"from_two_mid_epoch": 4, "from_two_later_pass": 12})


# ------------------------------------------------------------------------------------ without a Trainer
def make_dm(data: Path, **changes: Any) -> PretrainingDataModule:
    settings = options(data, global_batch_size=4, num_streams=2, val_files=None, steps_per_epoch=3)
    settings.update(changes)
    dm = PretrainingDataModule(**settings)
    dm.setup("fit")
    return dm


def test_epochs_are_step_counts_and_the_stream_continues_across_them(data: Path) -> None:
    dm = make_dm(data, packing="bestfit")
    loader = dm.train_dataloader()
    assert len(loader) == 3 * 2
    first, second = list(loader), list(loader)
    assert len(first) == len(second) == 6
    assert dm.position.committed[:2] == (1, 3)
    stats = dm.stream_stats()  # best-fit reports its crops
    assert stats["crops"] > 0 and stats["emitted"] == 12 * 2 * 17 and stats["tokens"] > stats["emitted"]
    assert not any(torch.equal(a.input_ids, b.input_ids) for a in first for b in second)
    # The default epoch is one pass's worth, estimated from footers and a sample.
    estimated = make_dm(data, steps_per_epoch=None, packing="concat")
    assert estimated.steps_per_epoch == int(estimated.estimated_pass_tokens / 17 // 4)


def test_a_state_from_other_settings_names_both_values(data: Path) -> None:
    dm = make_dm(data)
    list(dm.train_dataloader())
    state = dm.state_dict()
    with pytest.raises(ValueError, match="seed: checkpoint 0, this run 1"):
        make_dm(data, seed=1).load_state_dict(state)
    with pytest.raises(
        ValueError, match="seq_len: checkpoint 16, this run 32.*packing: checkpoint 'bestfit', this run 'concat'"
    ):
        make_dm(data, seq_len=32, packing="concat").load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size: checkpoint 4, this run 8"):
        make_dm(data, global_batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_streams: checkpoint 2, this run 4"):
        make_dm(data, num_streams=4).load_state_dict(state)
    with pytest.raises(ValueError, match="files: checkpoint '2 files.*this run '1 files"):
        make_dm(data, train_files=str(data / "train" / "part-000.parquet")).load_state_dict(state)
    resumed = make_dm(data)
    resumed.load_state_dict(state)
    assert len(list(resumed.train_dataloader())) == 6  # epoch-end state rolls into the next epoch


def test_restart_epoch_accepts_a_state_from_other_settings(data: Path) -> None:
    dm = make_dm(data)
    list(dm.train_dataloader())  # epoch 0
    iterator = iter(dm.train_dataloader())
    for _ in range(4):
        next(iterator)
    state = dm.state_dict()
    assert (state["epoch"], state["step"]) == (1, 2)
    other = make_dm(data, seed=1, on_order_mismatch="restart_epoch")
    with pytest.warns(UserWarning, match="seed: checkpoint 0, this run 1.*restarting epoch 1 from its first step"):
        other.load_state_dict(state)
    assert (other.state_dict()["epoch"], other.state_dict()["step"]) == (1, 0)
    # The other settings' streams start afresh: epoch 1's 3 steps are what a fresh run of them trains first.
    restarted = list(other.train_dataloader())
    assert (other.state_dict()["epoch"], other.state_dict()["step"]) == (1, 3)  # the end of epoch 1
    fresh = list(make_dm(data, seed=1).train_dataloader())
    assert len(restarted) == len(fresh) == 3 * 2
    for a, b in zip(restarted, fresh, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
    assert not torch.equal(restarted[0].input_ids, next(iter(make_dm(data).train_dataloader())).input_ids)  # seed 1


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_a_stream_resumes_exactly_after_changing_the_tokenizer_batch_size(data: Path, packing: str) -> None:
    dm = make_dm(data, packing=packing, tokenizer_batch_size=8, steps_per_epoch=12)
    iterator = iter(dm.train_dataloader())
    for _ in range(10):  # 5 steps of 2 microbatches
        next(iterator)
    state = dm.state_dict()
    expected = [next(iterator) for _ in range(14)]
    resumed = make_dm(data, packing=packing, tokenizer_batch_size=1, steps_per_epoch=12)
    resumed.load_state_dict(state)
    got = list(resumed.train_dataloader())
    assert len(got) == 14
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)


def test_a_file_edited_in_place_is_named_at_resume(data: Path, tmp_path: Path) -> None:
    docs = make_docs(80, seed=9, max_words=20, long_every=9, long_words=60)
    write_parquet(tmp_path / "train", docs, files=2, row_group_size=10)
    dm = make_dm(data, train_files=str(tmp_path / "train"), packing="concat")
    list(dm.train_dataloader())
    state = dm.state_dict()
    # The same rows, other words in one document: counts and sizes of the row groups stay as they were.
    table = pq.read_table(tmp_path / "train" / "part-001.parquet")
    texts = table.column("text").to_pylist()
    texts[3] = " ".join(reversed(texts[3].split())) if texts[3] else "wa wb"
    pq.write_table(table.set_column(0, "text", pa.array(texts, pa.string())), tmp_path / "train" / "part-001.parquet",
                   row_group_size=10)  # fmt: skip
    edited = make_dm(data, train_files=str(tmp_path / "train"), packing="concat")
    with pytest.raises(ValueError, match=r"files: 1 of 2 changed since the checkpoint \('part-001.parquet'\)"):
        edited.load_state_dict(state)
