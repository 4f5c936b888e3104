"""configs/sft.yaml trains the demo model on the demo conversations under the CLI (no download) and resumes from
``last`` with the same batches and weights; a changed loss_on is refused at resume, naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support import BatchRecorder

SFT = Path(__file__).resolve().parents[2] / "configs" / "sft.yaml"


def sft_fit(workdir: Path, record: Path, max_steps: int, extra: list[str] = ()) -> None:
    from lightning_d9d.cli import main

    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(workdir / "checkpoints"), "every_n_train_steps": 3, "save_last": True},
        },
        {"class_path": "support.BatchRecorder"},
    ]
    args = [
        "fit",
        "--config",
        str(SFT),
        "--model.init_args.width=32",
        "--model.init_args.num_layers=1",
        "--model.init_args.num_heads=2",
        "--data.init_args.global_batch_tokens=1280",
        "--data.init_args.microbatch_tokens=320",
        "--data.init_args.num_workers=0",
        "--data.init_args.sort_buffer_size=256",
        f"--trainer.max_steps={max_steps}",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        *extra,
    ]
    previous = os.getcwd()
    os.environ[BatchRecorder.ENV] = str(record)
    try:
        os.chdir(workdir)
        main(args)
    finally:
        os.chdir(previous)
        del os.environ[BatchRecorder.ENV]


def records(path: Path) -> list[tuple[int, int, str]]:
    return [(r["step"], r["epoch"], r["sha"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow
def test_the_sft_config_fits_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LIGHTNING_D9D_CACHE", str(tmp_path / "demo_cache"))
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    sft_fit(whole, whole / "r.jsonl", 6)
    sft_fit(interrupted, interrupted / "r.jsonl", 3)
    with pytest.raises(SystemExit) as refused:  # the CLI prints the one-line error and exits
        sft_fit(interrupted, tmp_path / "refused.jsonl", 6, ["--ckpt_path", "last", "--data.init_args.loss_on=all"])
    assert refused.value.code != 0
    assert "loss_on: checkpoint 'assistant', this run 'all'" in capsys.readouterr().err
    sft_fit(interrupted, interrupted / "r.jsonl", 6, ["--ckpt_path", "last"])
    assert records(interrupted / "r.jsonl") == records(whole / "r.jsonl")
    assert len(records(whole / "r.jsonl")) == 6 * 4
    final_whole = torch.load(whole / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    final_resumed = torch.load(interrupted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    for name, tensor in final_whole["state_dict"].items():
        torch.testing.assert_close(final_resumed["state_dict"][name], tensor, msg=name)
