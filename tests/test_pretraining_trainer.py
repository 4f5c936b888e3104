"""PretrainingDataModule under a real Trainer: exact resume (1 device, workers 0/2; 2 DDP ranks on gloo).

Each scenario is one uninterrupted run that saves checkpoints (at step boundaries, mid accumulation window and
at epoch ends), then resumed runs from those checkpoints; every microbatch trained is recorded as a digest of
its inputs/targets/position_ids, and a resumed run must train exactly the uninterrupted run's microbatches.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch
from support import fit, fit_in_processes, make_docs, read_records, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pretraining")
    docs = make_docs(160, seed=5, max_words=20, long_every=9, long_words=80)
    write_parquet(root / "train", docs, files=2, row_group_size=10)
    write_parquet(root / "val", make_docs(60, seed=6), files=1, row_group_size=10)
    train_tokenizer(docs + make_docs(60, seed=6), root / "tokenizer.json")
    return root


def config(data: Path, tmp: Path, runs: list[dict], devices: int = 1, **changes) -> dict:
    options = dict(
        train_files=str(data / "train"),
        val_files=str(data / "val"),
        tokenizer=str(data / "tokenizer.json"),
        seq_len=16,
        global_batch_size=8,
        microbatch_size=2,
        val_steps=2,
        steps_per_epoch=7,
        tokenizer_batch_size=8,
        bestfit_buffer_size=24,
    )
    options.update(changes)
    return {
        "data": "pretraining",
        "options": options,
        "record_dir": str(tmp / "records"),
        "ckpt_dir": str(tmp / "ckpt"),
        "devices": devices,
        "runs": runs,
    }


def all_records(cfg: dict) -> list[dict]:
    return read_records(cfg["record_dir"]) + read_records(cfg["record_dir"], "val")


def saved_state(path: Path) -> dict:
    return torch.load(path, weights_only=True)["PretrainingDataModule"]


def assert_resumes_match(
    records: list[dict], resumed_runs: dict[str, int], max_steps: int, per_step: int, ranks: int = 1
) -> None:
    """Every resumed run trains exactly the uninterrupted run's microbatches from its step to ``max_steps``."""
    key = lambda r: (r["rank"], r["epoch"], r["step"], r["batch_idx"])  # noqa: E731
    full = {key(r): r["digest"] for r in records if r["run"] == "full" and r["kind"] == "train"}
    assert len(full) == max_steps * per_step * ranks
    counts = Counter(r["rank"] for r in records if r["run"] == "full" and r["kind"] == "train")
    assert len(set(counts.values())) == 1  # every rank trained the same number of microbatches
    for run, start_step in resumed_runs.items():
        got = [r for r in records if r["run"] == run and r["kind"] == "train"]
        assert len(got) == (max_steps - start_step) * per_step * ranks, run
        assert min(r["step"] for r in got) == start_step, run
        assert all(full[key(r)] == r["digest"] for r in got), run
    # Validation reads the same microbatches on every run.
    val_runs: dict[tuple, list[str]] = {}
    for r in records:
        if r["kind"] == "val":
            val_runs.setdefault((r["run"], r["rank"], r["epoch"]), []).append(r["digest"])
    for rank in range(ranks):
        sequences = {tuple(v) for (_, rk, _), v in val_runs.items() if rk == rank}
        assert len(sequences) == 1 and len(next(iter(sequences))) == 2


@pytest.mark.parametrize("num_workers, packing", [(0, "bestfit"), (2, "concat")])
def test_single_device_resume_is_exact(data: Path, tmp_path: Path, num_workers: int, packing: str) -> None:
    ckpt = tmp_path / "ckpt"
    # G=8, m=2 -> M=4 microbatches per step; 7 steps (28 microbatches) per epoch.
    runs = [
        dict(name="full", max_steps=24, every_n_train_steps=7, save_at=[[0, 9], [2, 15]]),
        dict(name="epoch_end", max_steps=24, ckpt_path=str(ckpt / "epoch=0-step=7.ckpt")),
        dict(name="mid_window", max_steps=24, ckpt_path=str(ckpt / "mid-e0-b9.ckpt")),  # step 2, 2nd microbatch
        dict(name="later_pass", max_steps=24, ckpt_path=str(ckpt / "mid-e2-b15.ckpt")),  # step 18, window end
    ]
    cfg = config(data, tmp_path, runs, num_workers=num_workers, packing=packing)
    fit(cfg)
    later = saved_state(ckpt / "mid-e2-b15.ckpt")
    assert (later["epoch"], later["step"]) == (2, 4)
    assert max(state["pass"] for state in later["ranks"][0].values()) >= 1, "must resume across a pass boundary"
    mid = saved_state(ckpt / "mid-e0-b9.ckpt")
    assert (mid["epoch"], mid["step"]) == (0, 2)  # the partial window is not saved: resume at its step
    assert_resumes_match(all_records(cfg), {"epoch_end": 7, "mid_window": 2, "later_pass": 18}, 24, 4)


def test_two_ddp_ranks_resume_exactly(data: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # 2 ranks x 2 workers = 4 streams; G=8, m=2 -> M=2 per rank; 5 steps (10 microbatches) per epoch.
    runs = [
        dict(name="full", max_steps=14, every_n_train_steps=4, save_at=[[1, 2]]),
        dict(name="mid_epoch", max_steps=14, ckpt_path=str(ckpt / "epoch=0-step=4.ckpt")),
        dict(name="mid_window", max_steps=14, ckpt_path=str(ckpt / "mid-e1-b2.ckpt")),  # step 6, 1st microbatch
        dict(name="later_pass", max_steps=14, ckpt_path=str(ckpt / "epoch=2-step=12.ckpt")),
    ]
    cfg = config(data, tmp_path, runs, devices=2, num_workers=2, packing="bestfit", steps_per_epoch=5)
    fit_in_processes(cfg)
    state = saved_state(ckpt / "epoch=2-step=12.ckpt")
    assert state["layout"] == {"world_size": 2, "num_workers": 2, "microbatch_size": 2}
    assert [sorted(rank) for rank in state["ranks"]] == [[0, 1], [2, 3]]  # rank 0's file holds every stream
    assert max(s["pass"] for rank in state["ranks"] for s in rank.values()) >= 1
    assert len(pickle.dumps(state)) < 2 * (1 << 20)  # < 1 MiB per rank
    assert_resumes_match(all_records(cfg), {"mid_epoch": 4, "mid_window": 6, "later_pass": 12}, 14, 2, ranks=2)


# ------------------------------------------------------------------------------------ without a Trainer
def make_dm(data: Path, **changes) -> PretrainingDataModule:
    options = dict(
        train_files=str(data / "train"),
        tokenizer=str(data / "tokenizer.json"),
        seq_len=16,
        global_batch_size=4,
        microbatch_size=2,
        num_workers=0,
        tokenizer_batch_size=8,
        bestfit_buffer_size=24,
    )
    options.update(changes)
    dm = PretrainingDataModule(**options)
    dm.setup("fit")
    return dm


def test_epochs_are_step_counts_and_the_stream_continues_across_them(data: Path) -> None:
    dm = make_dm(data, steps_per_epoch=3)
    loader = dm.train_dataloader()
    assert len(loader) == 3 * 2
    first, second = list(loader), list(loader)
    assert len(first) == len(second) == 6
    assert dm.position.committed[:2] == (1, 3)
    stats = dm.stream_stats()  # best-fit reports its crops
    assert stats["crops"] > 0 and stats["emitted"] == 12 * 2 * 17 and stats["tokens"] > stats["emitted"]
    assert not any(torch.equal(a.inputs, b.inputs) for a in first for b in second)
    # The default epoch is one pass's worth, estimated from footers and a sample.
    estimated = make_dm(data, steps_per_epoch=None, packing="concat")
    assert estimated.steps_per_epoch == int(estimated.estimated_pass_tokens / 17 // 4)


def test_a_state_from_other_settings_names_both_values(data: Path) -> None:
    dm = make_dm(data, steps_per_epoch=3)
    list(dm.train_dataloader())
    state = dm.state_dict()
    with pytest.raises(ValueError, match="seed: checkpoint 0, this run 1"):
        make_dm(data, seed=1, steps_per_epoch=3).load_state_dict(state)
    with pytest.raises(
        ValueError, match="seq_len: checkpoint 16, this run 32.*packing: checkpoint 'bestfit', this run 'concat'"
    ):
        make_dm(data, seq_len=32, packing="concat", steps_per_epoch=3).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size: checkpoint 4, this run 8"):
        make_dm(data, global_batch_size=8, steps_per_epoch=3).load_state_dict(state)
    with pytest.raises(ValueError, match="files: checkpoint '2 files.*this run '1 files"):
        make_dm(data, train_files=str(data / "train" / "part-000.parquet"), steps_per_epoch=3).load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers: checkpoint 0, this run 2.*elastic resume is not supported"):
        make_dm(data, num_workers=2, steps_per_epoch=3).load_state_dict(state)
    resumed = make_dm(data, steps_per_epoch=3)
    resumed.load_state_dict(state)
    assert len(list(resumed.train_dataloader())) == 6  # epoch-end state rolls into the next epoch
