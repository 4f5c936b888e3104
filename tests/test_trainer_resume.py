"""Exactly-once epochs and exact resume under a real Lightning Trainer: 1 process, 2-process DDP, elastic.

Every trained microbatch is recorded as (epoch, global step, rank, batch_idx, sample ids). A resumed run's
records appended to the records before the checkpoint must equal the uninterrupted run's records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import read_records, run_training, samples_per_step

HARNESS = Path(__file__).with_name("harness.py")
SIZE, GLOBAL_BATCH, MICROBATCH = 200, 16, 2
STEPS_PER_EPOCH = SIZE // GLOBAL_BATCH  # 12
BASE = {"size": SIZE, "global_batch_size": GLOBAL_BATCH, "microbatch_size": MICROBATCH, "max_epochs": 2}


def run_ddp(config: dict[str, Any], timeout: int = 240) -> None:
    """Fit in real processes (Lightning's DDP launcher re-runs the script for rank 1), gloo on CPU."""
    result = subprocess.run(
        [sys.executable, str(HARNESS), json.dumps({**config, "devices": 2})],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-4000:]


def trained(records: list[dict]) -> list[tuple]:
    return [(r["epoch"], r["step"], r["rank"], r["batch_idx"], r["ids"]) for r in records]


def before_step(records: list[dict], step: int) -> list[dict]:
    """Records of optimizer steps a checkpoint taken after ``step`` optimizer steps covers."""
    return [r for r in records if r["step"] < step]


def assert_exactly_once_per_epoch(records: list[dict]) -> None:
    for epoch in sorted({r["epoch"] for r in records}):
        ids = [i for r in records if r["epoch"] == epoch for i in r["ids"]]
        assert len(ids) == STEPS_PER_EPOCH * GLOBAL_BATCH, f"epoch {epoch}: {len(ids)} samples trained"
        assert len(set(ids)) == len(ids), f"epoch {epoch}: duplicates"
        steps = {r["step"] for r in records if r["epoch"] == epoch}
        assert len(steps) == STEPS_PER_EPOCH, f"epoch {epoch}: {len(steps)} optimizer steps"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted 2-epoch run, checkpointing after every optimizer step, at epoch ends and mid-window."""
    root = tmp_path_factory.mktemp("reference")
    config = {
        **BASE,
        "record_dir": str(root / "records"),
        "ckpt_dir": str(root / "ckpt"),
        "every_n_train_steps": 1,
        "epoch_end_ckpt": True,
        # batch_idx 43 is microbatch 4 of 8 in step 5: a save inside an accumulation window.
        "save_at": [[0, 43]],
        "val_size": 37,
    }
    run_training(config)
    return {"records": read_records(root / "records"), "ckpt": root / "ckpt", "root": root}


def test_uninterrupted_epochs_are_exactly_once_with_m_microbatches_per_step(reference: dict) -> None:
    records = reference["records"]
    assert_exactly_once_per_epoch(records)
    per_step = Counter((r["epoch"], r["step"]) for r in records)
    assert set(per_step.values()) == {GLOBAL_BATCH // MICROBATCH}, "accumulate_grad_batches = M, no partial window"
    assert max(r["step"] for r in records) == 2 * STEPS_PER_EPOCH - 1
    val = read_records(reference["root"] / "records", "val")
    for epoch in (0, 1):
        assert sorted(i for r in val if r["epoch"] == epoch for i in r["ids"]) == list(range(37))


def test_worker_count_does_not_change_what_is_trained(reference: dict, tmp_path: Path) -> None:
    run_training({**BASE, "record_dir": str(tmp_path), "num_workers": 2})
    assert trained(read_records(tmp_path)) == trained(reference["records"])


@pytest.mark.parametrize(
    ("checkpoint", "covered_steps", "num_workers", "estimated"),
    [
        pytest.param("epoch=0-step=5.ckpt", 5, 0, False, id="mid-epoch"),
        pytest.param("mid-e0-b43.ckpt", 5, 2, True, id="inside-accumulation-window-other-workers-estimated"),
        pytest.param("epoch=0-step=12.ckpt", 12, 0, True, id="last-step-of-epoch-estimated"),
        pytest.param("end-epoch=0.ckpt", 12, 2, False, id="epoch-end-other-workers"),
        pytest.param("epoch=1-step=13.ckpt", 13, 0, False, id="first-step-of-next-epoch"),
    ],
)
def test_resume_continues_with_exactly_the_uninterrupted_batches(
    reference: dict, tmp_path: Path, checkpoint: str, covered_steps: int, num_workers: int, estimated: bool
) -> None:
    run_training(
        {
            **BASE,
            "record_dir": str(tmp_path),
            "ckpt_path": str(reference["ckpt"] / checkpoint),
            "num_workers": num_workers,
            "estimated": estimated,
        }
    )
    resumed = read_records(tmp_path)
    assert trained(before_step(reference["records"], covered_steps) + resumed) == trained(reference["records"])


def test_yield_packs_resume_is_exact(tmp_path: Path) -> None:
    config = {**BASE, "packs": True, "ckpt_dir": str(tmp_path / "ckpt"), "every_n_train_steps": 7}
    run_training({**config, "record_dir": str(tmp_path / "full")})
    full = read_records(tmp_path / "full")
    assert_exactly_once_per_epoch(full)
    assert {r["batch_idx"] for r in full if r["epoch"] == 0} == set(range(STEPS_PER_EPOCH)), "one batch per step"
    run_training(
        {
            **BASE,
            "packs": True,
            "record_dir": str(tmp_path / "resumed"),
            "ckpt_path": str(tmp_path / "ckpt" / "epoch=0-step=7.ckpt"),
        }
    )
    assert trained(before_step(full, 7) + read_records(tmp_path / "resumed")) == trained(full)


def test_sigkill_mid_epoch_then_resume_from_last_trains_every_sample_once(reference: dict, tmp_path: Path) -> None:
    config = {
        **BASE,
        "record_dir": str(tmp_path / "killed"),
        "ckpt_dir": str(tmp_path / "ckpt"),
        "every_n_train_steps": 3,
    }
    killed = subprocess.run(
        [sys.executable, str(HARNESS), json.dumps({**config, "kill_at_step": 8})], capture_output=True, timeout=240
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            json.dumps({**config, "record_dir": str(tmp_path / "resumed"), "ckpt_path": "last"}),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    before = before_step(read_records(tmp_path / "killed"), 6)  # last.ckpt was written after step 6
    combined = before + read_records(tmp_path / "resumed")
    assert_exactly_once_per_epoch(combined)
    assert trained(combined) == trained(reference["records"])


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ddp")
    config = {
        **BASE,
        "record_dir": str(root / "records"),
        "ckpt_dir": str(root / "ckpt"),
        "every_n_train_steps": 5,
        "val_size": 37,
    }
    run_ddp(config)
    return {"records": read_records(root / "records"), "ckpt": root / "ckpt", "root": root}


def test_ddp_ranks_train_disjoint_equal_shares_of_the_same_global_batches(ddp_reference: dict, reference: dict) -> None:
    records = ddp_reference["records"]
    assert_exactly_once_per_epoch(records)
    per_rank = Counter(r["rank"] for r in records)
    assert per_rank[0] == per_rank[1] == 2 * STEPS_PER_EPOCH * GLOBAL_BATCH // (2 * MICROBATCH)
    # The order does not depend on world size: each optimizer step trains the same samples as on 1 process.
    assert samples_per_step(records) == samples_per_step(reference["records"])
    val = read_records(ddp_reference["root"] / "records", "val")
    for epoch in (0, 1):
        ids = [i for r in val if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(37)), "validation: every sample once across ranks"
        assert {r["rank"] for r in val if r["epoch"] == epoch} == {0, 1}


def test_ddp_resume_is_exact_on_every_rank(ddp_reference: dict, tmp_path: Path) -> None:
    run_ddp(
        {
            **BASE,
            "record_dir": str(tmp_path),
            "ckpt_path": str(ddp_reference["ckpt"] / "epoch=0-step=5.ckpt"),
            "estimated": True,
        }
    )
    combined = before_step(ddp_reference["records"], 5) + read_records(tmp_path)
    assert trained(sorted(combined, key=lambda r: (r["epoch"], r["step"], r["rank"], r["batch_idx"]))) == trained(
        ddp_reference["records"]
    )


def test_elastic_resume_two_ranks_to_one(ddp_reference: dict, tmp_path: Path) -> None:
    run_training(
        {**BASE, "record_dir": str(tmp_path), "ckpt_path": str(ddp_reference["ckpt"] / "epoch=1-step=15.ckpt")}
    )
    combined = before_step(ddp_reference["records"], 15) + read_records(tmp_path)
    assert samples_per_step(combined) == samples_per_step(ddp_reference["records"])
    assert_exactly_once_per_epoch(combined)


def test_elastic_resume_one_rank_to_two(reference: dict, tmp_path: Path) -> None:
    run_ddp({**BASE, "record_dir": str(tmp_path), "ckpt_path": str(reference["ckpt"] / "mid-e0-b43.ckpt")})
    combined = before_step(reference["records"], 5) + read_records(tmp_path)
    assert samples_per_step(combined) == samples_per_step(reference["records"])
    assert_exactly_once_per_epoch(combined)


@pytest.mark.parametrize(
    ("microbatch_size", "packs", "accumulate", "message"),
    [
        (2, False, 3, r"accumulate_grad_batches=3\) disagrees with the data: .* give 8 microbatches per step"),
        (16, False, 3, r"accumulate_grad_batches=3\) disagrees with the data: .* give 1 microbatches per step"),
        (2, True, 8, r"accumulate_grad_batches=8\) disagrees with the data: yield_packs=True hands out one whole"),
    ],
)
def test_accumulate_grad_batches_that_disagrees_is_rejected(
    tmp_path: Path, microbatch_size: int, packs: bool, accumulate: int, message: str
) -> None:
    import lightning.pytorch as pl
    from harness import LengthDataset, RecordingModule, pad_collate

    from lightning_d9d import D9DDataModule

    dm = D9DDataModule(
        LengthDataset(64), pad_collate, global_batch_size=16, microbatch_size=microbatch_size, yield_packs=packs
    )
    module = RecordingModule(str(tmp_path))  # automatic optimization, even with packs: the error must say why
    trainer = pl.Trainer(
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=dm)


def test_elastic_resume_with_another_microbatch_size(reference: dict, tmp_path: Path) -> None:
    run_training(
        {
            **BASE,
            "microbatch_size": 4,
            "record_dir": str(tmp_path),
            "ckpt_path": str(reference["ckpt"] / "mid-e0-b43.ckpt"),
        }
    )
    resumed = read_records(tmp_path)
    assert {len(r["ids"]) for r in resumed} == {4}
    combined = before_step(reference["records"], 5) + resumed
    assert samples_per_step(combined) == samples_per_step(reference["records"])


def test_validate_from_a_checkpoint_of_another_order_is_not_refused(reference: dict, tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from harness import LengthDataset, RecordingModule, pad_collate

    from lightning_d9d import D9DDataModule

    checkpoint = str(reference["ckpt"] / "epoch=0-step=5.ckpt")
    other_seed = D9DDataModule(
        LengthDataset(SIZE),
        pad_collate,
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICROBATCH,
        sort_buffer_size=64,
        seed=99,
        val_dataset=LengthDataset(37, seed=1),
    )
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.validate(RecordingModule(str(tmp_path)), datamodule=other_seed, ckpt_path=checkpoint)
    assert sorted(i for r in read_records(tmp_path, "val") for i in r["ids"]) == list(range(37))
    with pytest.raises(ValueError, match="seed: checkpoint 0, this run 99"):
        pl.Trainer(accelerator="cpu", logger=False, max_epochs=2, default_root_dir=str(tmp_path)).fit(
            RecordingModule(str(tmp_path)), datamodule=other_seed, ckpt_path=checkpoint
        )
