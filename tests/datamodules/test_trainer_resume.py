"""Exactly-once epochs and exact resume under a real Lightning Trainer: 1 process, 2-process DDP, elastic.

Every trained microbatch is recorded as (epoch, global step, rank, batch_idx, sample ids). A resumed run's
records appended to the records before the checkpoint must equal the uninterrupted run's records.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from support import (
    LengthDataset,
    RecordingModule,
    fit,
    fit_in_processes,
    pad_collate,
    per_rank_microbatches,
    planned_global_batches,
    read_records,
    snake_dealt,
)

from lightning_d9d import D9DDataModule

SIZE, GLOBAL_BATCH, MICROBATCH = 200, 16, 2
STEPS_PER_EPOCH = SIZE // GLOBAL_BATCH  # 12
OPTIONS = {"size": SIZE, "global_batch_size": GLOBAL_BATCH, "microbatch_size": MICROBATCH}


def run(
    record_dir: Path | str,
    devices: int = 1,
    ckpt_dir: Path | None = None,
    packs: bool = False,
    options: dict | None = None,
    **fit_options: Any,
) -> list[dict]:
    """One fit of the D9DDataModule over ``LengthDataset``; returns its training records."""
    config = {
        "data": "d9d",
        "options": {**OPTIONS, "yield_packs": packs, **(options or {})},
        "record_dir": str(record_dir),
        "ckpt_dir": str(ckpt_dir) if ckpt_dir else None,
        "devices": devices,
        "packs": packs,
        "runs": [{"max_epochs": 2, **fit_options}],
    }
    if devices > 1 or "kill_at_step" in fit_options:
        fit_in_processes(config, expect_returncode=-9 if "kill_at_step" in fit_options else 0)
    else:
        fit(config)
    return read_records(record_dir)


def samples_per_step(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    """(epoch, global step) -> the sample ids of that optimizer step's global batch in order, rebuilt from the ranks'
    microbatches (:func:`support.snake_dealt`): equal across layouts only if every sample has the same place in its
    step and went to the rank that place names."""
    return {
        where: [i for microbatch in snake_dealt(per_rank) for i in microbatch]
        for where, per_rank in per_rank_microbatches(records, "ids").items()
    }


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
    records = run(
        root / "records",
        ckpt_dir=root / "ckpt",
        options={"val_size": 37},
        every_n_train_steps=1,
        epoch_end_ckpt=True,
        save_at=[[0, 43]],  # batch_idx 43 is microbatch 4 of 8 in step 5: a save inside an accumulation window
    )
    return {"records": records, "ckpt": root / "ckpt", "root": root}


def test_uninterrupted_epochs_are_exactly_once_with_m_microbatches_per_step(reference: dict) -> None:
    records = reference["records"]
    assert_exactly_once_per_epoch(records)
    per_step = Counter((r["epoch"], r["step"]) for r in records)
    assert set(per_step.values()) == {GLOBAL_BATCH // MICROBATCH}, "accumulate_grad_batches = M, no partial window"
    assert max(r["step"] for r in records) == 2 * STEPS_PER_EPOCH - 1
    lengths = LengthDataset(SIZE).lengths
    planned = [batch for epoch in (0, 1) for batch in planned_global_batches(lengths, GLOBAL_BATCH, 64, 0, epoch)]
    steps = samples_per_step(records)
    assert [steps[(step // STEPS_PER_EPOCH, step)] for step in range(2 * STEPS_PER_EPOCH)] == planned
    assert len(steps) == len(planned)
    val = read_records(reference["root"] / "records", "val")
    for epoch in (0, 1):
        assert sorted(i for r in val if r["epoch"] == epoch for i in r["ids"]) == list(range(37))


def test_worker_count_does_not_change_what_is_trained(reference: dict, tmp_path: Path) -> None:
    assert trained(run(tmp_path, options={"num_workers": 2})) == trained(reference["records"])


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
    resumed = run(
        tmp_path,
        options={"num_workers": num_workers},
        ckpt_path=str(reference["ckpt"] / checkpoint),
        estimated=estimated,
    )
    assert trained(before_step(reference["records"], covered_steps) + resumed) == trained(reference["records"])


def test_yield_packs_resume_is_exact(tmp_path: Path) -> None:
    full = run(tmp_path / "full", ckpt_dir=tmp_path / "ckpt", packs=True, every_n_train_steps=7)
    assert_exactly_once_per_epoch(full)
    assert {r["batch_idx"] for r in full if r["epoch"] == 0} == set(range(STEPS_PER_EPOCH)), "one batch per step"
    resumed = run(tmp_path / "resumed", packs=True, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=7.ckpt"))
    assert trained(before_step(full, 7) + resumed) == trained(full)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_from_last_trains_every_sample_once(reference: dict, tmp_path: Path) -> None:
    killed = run(tmp_path / "killed", ckpt_dir=tmp_path / "ckpt", every_n_train_steps=3, kill_at_step=8)
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    resumed = run(tmp_path / "resumed", ckpt_dir=tmp_path / "ckpt", every_n_train_steps=3, ckpt_path="last")
    combined = before_step(killed, 6) + resumed  # last.ckpt was written after step 6
    assert_exactly_once_per_epoch(combined)
    assert trained(combined) == trained(reference["records"])


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ddp")
    records = run(root / "records", devices=2, ckpt_dir=root / "ckpt", options={"val_size": 37}, every_n_train_steps=5)
    return {"records": records, "ckpt": root / "ckpt", "root": root}


@pytest.mark.slow
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


@pytest.mark.slow
def test_ddp_resume_is_exact_on_every_rank(ddp_reference: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, devices=2, ckpt_path=str(ddp_reference["ckpt"] / "epoch=0-step=5.ckpt"), estimated=True)
    combined = before_step(ddp_reference["records"], 5) + resumed
    order = sorted(combined, key=lambda r: (r["epoch"], r["step"], r["rank"], r["batch_idx"]))
    assert trained(order) == trained(ddp_reference["records"])


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_one(ddp_reference: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, ckpt_path=str(ddp_reference["ckpt"] / "epoch=1-step=15.ckpt"))
    combined = before_step(ddp_reference["records"], 15) + resumed
    assert samples_per_step(combined) == samples_per_step(ddp_reference["records"])
    assert_exactly_once_per_epoch(combined)


@pytest.mark.slow
def test_elastic_resume_one_rank_to_two(reference: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, devices=2, ckpt_path=str(reference["ckpt"] / "mid-e0-b43.ckpt"))
    combined = before_step(reference["records"], 5) + resumed
    assert samples_per_step(combined) == samples_per_step(reference["records"])
    assert_exactly_once_per_epoch(combined)


def test_elastic_resume_with_another_microbatch_size(reference: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, options={"microbatch_size": 4}, ckpt_path=str(reference["ckpt"] / "mid-e0-b43.ckpt"))
    assert {len(r["ids"]) for r in resumed} == {4}
    combined = before_step(reference["records"], 5) + resumed
    assert samples_per_step(combined) == samples_per_step(reference["records"])


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


def test_validate_from_a_checkpoint_of_another_order_is_not_refused(reference: dict, tmp_path: Path) -> None:
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
