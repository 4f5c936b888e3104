"""Token-budget epochs under a real Lightning Trainer: each epoch trains exactly its plan although epochs differ in
length (the plan written out by brute force here from the documented rule, not the planner the loader follows;
every step's microbatches compared in order, rebuilt from the ranks' shares), exact resume in a later epoch and
inside an accumulation window, real 2-process DDP on gloo and elastic resume both ways; and the loss factor
``world_size × accumulate_grad_batches`` over ``step_label_tokens`` gives exactly the gradient of the step's
per-token mean (1 process with accumulation, and 2-process DDP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from support import (
    TESTS,
    LengthDataset,
    RecordingModule,
    fit,
    fit_in_processes,
    pad_collate,
    per_rank_microbatches,
    planned_token_steps,
    read_records,
    snake_dealt,
)
from token_grad_script import make_datamodule, make_model

from lightning_d9d import D9DDataModule
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator

OPTIONS = {"size": 400, "global_batch_tokens": 2048, "microbatch_tokens": 512, "sort_buffer_size": 64, "seed": 0}
EPOCHS = 3
PER_STEP = 4  # P = 2048 / 512 microbatches per step over all ranks


def datamodule(**overrides: Any) -> D9DDataModule:
    options = {**OPTIONS, **overrides}
    options.pop("size")
    return D9DDataModule(LengthDataset(OPTIONS["size"]), pad_collate, **options)


@pytest.fixture(scope="module")
def plan() -> dict[str, Any]:
    """What every run must train, written out by brute force from the documented rule, not the planner the loader
    follows (:func:`support.planned_token_steps`): per (epoch, step in epoch), the step's P microbatches of sample ids
    in order; each epoch's step count, and the samples it leaves out."""
    lengths = LengthDataset(OPTIONS["size"]).lengths
    windowed = (OPTIONS["microbatch_tokens"], PER_STEP, OPTIONS["sort_buffer_size"], OPTIONS["seed"])
    epochs = [planned_token_steps(lengths, *windowed, epoch) for epoch in range(EPOCHS)]
    per_step = {(epoch, step): mbs for epoch, steps in enumerate(epochs) for step, mbs in enumerate(steps)}
    everything = set(range(OPTIONS["size"]))
    left_out = [everything - {i for mbs in steps for mb in mbs for i in mb} for steps in epochs]
    return {"steps": [len(steps) for steps in epochs], "per_step": per_step, "left_out": left_out}


def run(
    record_dir: Path,
    devices: int = 1,
    ckpt_dir: Path | None = None,
    options: dict | None = None,
    packs: bool = False,
    **fit_options: Any,
) -> list[dict]:
    config = {
        "data": "d9d",
        "options": {**OPTIONS, "yield_packs": packs, **(options or {})},
        "record_dir": str(record_dir),
        "ckpt_dir": str(ckpt_dir) if ckpt_dir else None,
        "devices": devices,
        "packs": packs,
        "runs": [{"max_epochs": EPOCHS, **fit_options}],
    }
    if devices > 1:
        fit_in_processes(config)
    else:
        fit(config)
    return read_records(record_dir)


def by_step(records: list[dict], steps: list[int]) -> dict[tuple[int, int], list[list[int]]]:
    """(epoch, step in epoch) -> the step's microbatches of sample ids in the plan's order, rebuilt from the ranks'
    microbatches (:func:`support.snake_dealt`)."""
    first_of_epoch = np.concatenate([[0], np.cumsum(steps)])
    return {
        (epoch, step - int(first_of_epoch[epoch])): snake_dealt(per_rank)
        for (epoch, step), per_rank in per_rank_microbatches(records, "ids").items()
    }


def assert_budgets_kept_and_samples_once(records: list[dict], plan: dict, microbatches: bool = True) -> None:
    """From the dataset's lengths and arithmetic: each microbatch costs (samples × its longest, as ``pad_collate``
    pads) at most ``microbatch_tokens`` and each step's samples at most ``global_batch_tokens``; an epoch trains
    every sample once except exactly the tail the written-out rule leaves (``plan["left_out"]``: the samples of the
    fewer than P microbatches after its last whole step, so under (P - 1) × ``microbatch_tokens`` tokens)."""
    lengths = LengthDataset(OPTIONS["size"]).lengths
    per_epoch: dict[int, list[int]] = {}
    per_step: dict[int, list[int]] = {}
    for record in records:
        ids = record["ids"]
        assert ids, f"an empty microbatch: {record}"
        if microbatches:
            cost = len(ids) * int(lengths[ids].max())
            assert cost <= OPTIONS["microbatch_tokens"], f"step {record['step']}: {len(ids)} samples cost {cost}"
        per_epoch.setdefault(record["epoch"], []).extend(ids)
        per_step.setdefault(record["step"], []).extend(ids)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} trains a sample twice"
        left_out = set(range(OPTIONS["size"])) - set(ids)
        assert left_out == plan["left_out"][epoch], f"epoch {epoch} left out {sorted(left_out)}"
        left_tokens = int(lengths[sorted(left_out)].sum())
        assert left_tokens < (PER_STEP - 1) * OPTIONS["microbatch_tokens"], f"epoch {epoch} left out {left_out}"
    for step, ids in per_step.items():
        assert int(lengths[ids].sum()) <= OPTIONS["global_batch_tokens"], f"step {step} over its budget"


def trained(records: list[dict]) -> list[tuple]:
    return [(r["epoch"], r["step"], r["rank"], r["batch_idx"], r["ids"]) for r in records]


def before_step(records: list[dict], step: int) -> list[dict]:
    return [r for r in records if r["step"] < step]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("token_reference")
    records = run(
        root / "records",
        ckpt_dir=root / "ckpt",
        every_n_train_steps=1,
        epoch_end_ckpt=True,
        save_at=[[2, 9]],  # epoch 2, batch_idx 9: microbatch 2 of 4 of its step 2, inside an accumulation window
    )
    return {"records": records, "ckpt": root / "ckpt"}


def test_each_epoch_trains_exactly_its_plan_though_epochs_differ_in_length(reference: dict, plan: dict) -> None:
    assert plan["steps"] == [9, 9, 10], "the data must give epochs of different lengths for this test to mean much"
    records = reference["records"]
    assert_budgets_kept_and_samples_once(records, plan)
    assert by_step(records, plan["steps"]) == plan["per_step"]
    assert set(Counter((r["epoch"], r["step"]) for r in records).values()) == {PER_STEP}, "M microbatches a step"
    assert max(r["step"] for r in records) == sum(plan["steps"]) - 1
    for epoch in range(EPOCHS):  # accumulation windows start at the epoch's first microbatch
        idx = [r["batch_idx"] for r in records if r["epoch"] == epoch]
        assert idx == list(range(plan["steps"][epoch] * PER_STEP))


@pytest.mark.parametrize(
    ("checkpoint", "covered_steps", "num_workers", "estimated"),
    [
        pytest.param("epoch=1-step=13.ckpt", 13, 0, False, id="mid-epoch-1"),
        pytest.param("end-epoch=1.ckpt", 18, 2, True, id="end-of-epoch-1-workers-estimated"),
        pytest.param("mid-e2-b9.ckpt", 20, 2, False, id="inside-a-window-of-the-longer-epoch-2-workers"),
        pytest.param("epoch=2-step=25.ckpt", 25, 0, True, id="late-in-epoch-2-estimated"),
    ],
)
def test_resume_in_a_later_epoch_continues_with_exactly_the_uninterrupted_batches(
    reference: dict, tmp_path: Path, checkpoint: str, covered_steps: int, num_workers: int, estimated: bool
) -> None:
    resumed = run(
        tmp_path,
        options={"num_workers": num_workers},
        ckpt_path=str(reference["ckpt"] / checkpoint),
        estimated=estimated,
    )
    assert trained(before_step(reference["records"], covered_steps) + resumed) == trained(reference["records"])


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("token_ddp")
    # Every 3 steps: among them 9 and 18, the last batches of epochs 0 and 1.
    records = run(root / "records", devices=2, ckpt_dir=root / "ckpt", every_n_train_steps=3)
    return {"records": records, "ckpt": root / "ckpt"}


@pytest.mark.slow
def test_ddp_ranks_train_equal_shares_of_the_same_steps(ddp_reference: dict, plan: dict) -> None:
    records = ddp_reference["records"]
    assert_budgets_kept_and_samples_once(records, plan)
    assert by_step(records, plan["steps"]) == plan["per_step"]
    per_rank = Counter(r["rank"] for r in records)
    assert per_rank[0] == per_rank[1] == sum(plan["steps"]) * PER_STEP // 2


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_one_in_a_later_epoch(ddp_reference: dict, plan: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, ckpt_path=str(ddp_reference["ckpt"] / "epoch=1-step=15.ckpt"))
    combined = before_step(ddp_reference["records"], 15) + resumed
    assert_budgets_kept_and_samples_once(combined, plan)
    assert by_step(combined, plan["steps"]) == plan["per_step"]
    assert len(combined) == sum(plan["steps"]) * PER_STEP  # every planned microbatch once


@pytest.mark.slow
@pytest.mark.parametrize("end", [9, 18], ids=["end-of-epoch-0", "end-of-epoch-1-before-a-longer-epoch"])
def test_elastic_resume_from_an_epochs_last_batch_trains_the_uninterrupted_microbatches(
    reference: dict, ddp_reference: dict, plan: dict, tmp_path: Path, end: int
) -> None:
    # Saved on the epoch's last batch, Lightning's restored counters are the saving layout's microbatches of the
    # finished epoch: 2 → 1 they are fewer than the next epoch has here, which must start at its first microbatch.
    assert sum(plan["steps"][: 1 + (end == 18)]) == end
    epoch = end // 9 - 1
    resumed = run(tmp_path / "one", ckpt_path=str(ddp_reference["ckpt"] / f"epoch={epoch}-step={end}.ckpt"))
    assert len(resumed) == (sum(plan["steps"]) - end) * PER_STEP
    assert trained(before_step(reference["records"], end) + resumed) == trained(reference["records"])
    resumed = run(tmp_path / "two", devices=2, ckpt_path=str(reference["ckpt"] / f"epoch={epoch}-step={end}.ckpt"))
    assert len(resumed) == (sum(plan["steps"]) - end) * PER_STEP
    assert trained(before_step(ddp_reference["records"], end) + resumed) == trained(ddp_reference["records"])


@pytest.mark.slow
def test_elastic_resume_one_rank_to_two_inside_a_window(reference: dict, plan: dict, tmp_path: Path) -> None:
    resumed = run(tmp_path, devices=2, ckpt_path=str(reference["ckpt"] / "mid-e2-b9.ckpt"))
    combined = before_step(reference["records"], 20) + resumed
    assert_budgets_kept_and_samples_once(combined, plan)
    assert len(combined) == sum(plan["steps"]) * PER_STEP  # every planned microbatch once
    assert by_step(combined, plan["steps"]) == plan["per_step"]


def test_yield_packs_hand_out_each_planned_step_whole_and_resume_exactly(plan: dict, tmp_path: Path) -> None:
    full = run(tmp_path / "full", ckpt_dir=tmp_path / "ckpt", packs=True, every_n_train_steps=11)
    assert_budgets_kept_and_samples_once(full, plan, microbatches=False)  # a record is a whole step's pack
    assert by_step(full, plan["steps"]) == plan["per_step"]
    assert {r["batch_idx"] for r in full if r["epoch"] == 2} == set(range(plan["steps"][2])), "one batch per step"
    resumed = run(tmp_path / "resumed", packs=True, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=11.ckpt"))
    assert trained(before_step(full, 11) + resumed) == trained(full)


class EstimatingModule(RecordingModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimated = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_estimated_stepping_batches_is_the_first_epochs_steps_times_max_epochs(
    tmp_path: Path, padding_free: bool
) -> None:
    dm = datamodule(padding_free=padding_free, seed=1)
    module = EstimatingModule(str(tmp_path))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    steps = [dm.steps_in_epoch(epoch) for epoch in range(EPOCHS)]
    assert module.estimated == steps[0] * EPOCHS
    assert trainer.global_step == sum(steps)
    assert abs(module.estimated - sum(steps)) <= EPOCHS


# ------------------------------------------------------------------------------------------------ loss factor
def reference_weights(padding_free: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights after one SGD step (lr 1) on the step's per-token mean over all its samples in one batch, and
    after the naive mean of microbatch means (what a loss without ``step_label_tokens`` would give)."""
    dm = make_datamodule(padding_free)
    dm.setup("fit")
    plan = dm.plan.epoch(0)
    microbatches = [[dm.train_dataset[int(i)] for i in plan.microbatch(0, k)] for k in range(4)]
    results = []
    for naive in (False, True):
        model = make_model()
        if naive:
            losses = []
            for samples in microbatches:
                loss_sum, count, _ = model._loss(FlatteningCollator()(samples))
                losses.append(loss_sum / count)
            loss = torch.stack(losses).mean()
        else:
            everything = CausalLMCollator(pad_to_multiple_of=1)([s for samples in microbatches for s in samples])
            loss_sum, count, _ = model._loss(everything)
            assert int(count) == int(plan.step_label_tokens[0])
            loss = loss_sum / count
        loss.backward()
        results.append({name: (p - p.grad).detach() for name, p in model.named_parameters()})
    return results[0], results[1]


def assert_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("grad_ddp")
    runs = [{"padding_free": free, "out": str(root / f"free{free}.pt")} for free in (False, True)]
    done = subprocess.run(
        [sys.executable, str(TESTS / "token_grad_script.py"), json.dumps({"devices": 2, "runs": runs})],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {run["padding_free"]: torch.load(run["out"], weights_only=True) for run in runs}


@pytest.mark.slow
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_the_loss_factor_gives_the_steps_per_token_mean_gradient(
    padding_free: bool, ddp_weights: dict, tmp_path: Path
) -> None:
    expected, naive = reference_weights(padding_free)
    # The test can tell a per-token mean from a mean of microbatch means (the microbatches differ in tokens).
    assert max(float((expected[n] - naive[n]).abs().max()) for n in expected) > 1e-3
    # One process, Lightning accumulating M = 4 microbatches (it divides each microbatch's loss by 4).
    model = make_model()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model, datamodule=make_datamodule(padding_free))
    assert trainer.accumulate_grad_batches == 4
    assert_weights(dict(model.named_parameters()), expected)
    # Two processes (DDP on gloo averages gradients over W = 2), each accumulating M = 2.
    assert_weights(ddp_weights[padding_free], expected)


def test_the_demo_model_gives_the_same_loss_padded_and_padding_free() -> None:
    torch.manual_seed(0)
    model = make_model().eval()
    dm = make_datamodule(True)
    dm.setup("fit")
    samples = [dm.train_dataset[int(i)] for i in dm.plan.epoch(0).microbatch(0, 0)]
    assert len(samples) > 2
    padded = [model._loss(CausalLMCollator(padding_side=side)(samples)) for side in ("right", "left")]
    flat_sum, flat_count, _ = model._loss(FlatteningCollator()(samples))
    for loss_sum, count, _ in padded:
        torch.testing.assert_close(loss_sum, flat_sum, rtol=1e-5, atol=1e-5)
        assert int(count) == int(flat_count) == sum(len(s["input_ids"]) - 1 for s in samples)
