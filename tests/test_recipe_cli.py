"""The recipe config (configs/demo_recipe.yaml): a batch-size ramp, a seq_len warm-up and a long-context phase,
through the lightning-d9d CLI. ``inspect`` prints the phases; a fit crosses a ramp and a length change and, stopped
before them and resumed with ``--ckpt_path last``, trains exactly the microbatches of an uninterrupted fit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support import BatchRecorder

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "demo_recipe.yaml"
# Earlier phases than the shipped recipe's, so a short fit crosses them: G 16 -> 32 at step 3, seq_len 32 -> 64 at 5.
EARLY = ["--data.init_args.global_batch_size=[[0, 16], [3, 32]]", "--data.init_args.seq_len=[[0, 32], [5, 64]]",
         "--data.init_args.weights=[[0, {prose: 0.5, code: 0.5}], [5, {prose: 0.2, code: 0.8}]]"]  # fmt: skip


@pytest.fixture()
def offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_CACHE", str(tmp_path_factory.getbasetemp() / "demo_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def run_cli(args: list[str], workdir: Path | None = None) -> None:
    from lightning_d9d.cli import main

    previous = os.getcwd()
    try:
        if workdir is not None:
            os.chdir(workdir)
        main(args)
    finally:
        os.chdir(previous)


@pytest.mark.slow
def test_inspect_prints_every_phase_of_the_recipe(offline: None, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["inspect", "--config", str(RECIPE), "--steps", "12", "--data.init_args.num_workers=0"])
    report = capsys.readouterr().out
    assert "shapes (60 steps):" in report
    assert "steps 0-9: global_batch_size 16, seq_len 32, 2 microbatch(es) per step per replica" in report
    assert "steps 30-49: global_batch_size 64, seq_len 64, 8 microbatch(es) per step per replica" in report
    assert "steps 50-59: global_batch_size 64, seq_len 128" in report and "81,920 in 10 steps (from 117,760)" in report
    assert "phase steps 50-: prose 30%, code 70%" in report


def recipe_fit(workdir: Path, max_steps: int, extra: list[str] = ()) -> list[dict]:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(workdir / "checkpoints"), "every_n_train_steps": 2, "save_last": True}},
        {"class_path": "support.BatchRecorder"},
    ]  # fmt: skip
    record = workdir / "record.jsonl"
    os.environ[BatchRecorder.ENV] = str(record)
    try:
        run_cli(
            ["fit", "--config", str(RECIPE), *EARLY, "--model.init_args.width=32", "--model.init_args.num_layers=1",
             "--model.init_args.num_heads=2", "--data.init_args.num_workers=0", "--data.init_args.microbatch_size=4",
             f"--trainer.max_steps={max_steps}", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0",
             "--trainer.enable_progress_bar=false", f"--trainer.callbacks={json.dumps(callbacks)}", *extra],
            workdir,
        )  # fmt: skip
    finally:
        del os.environ[BatchRecorder.ENV]
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.slow
def test_the_recipe_fits_across_its_boundaries_and_resumes_exactly(offline: None, tmp_path: Path) -> None:
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    uninterrupted = recipe_fit(whole, 8)
    per_step = [sum(r["step"] == s for r in uninterrupted) for s in range(8)]
    assert per_step == [4, 4, 4, 8, 8, 8, 8, 8], "M follows the ramp (G / microbatch_size)"
    recipe_fit(interrupted, 4)  # stopped after the ramp, before the length change
    resumed = recipe_fit(interrupted, 8, ["--ckpt_path", "last"])
    assert resumed == uninterrupted  # the same microbatches, in the same order, at the same steps
    final = torch.load(whole / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    again = torch.load(interrupted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == again["global_step"] == 8
    for name, tensor in final["state_dict"].items():
        torch.testing.assert_close(again["state_dict"][name], tensor, msg=name)
