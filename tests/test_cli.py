"""The lightning-d9d CLI: every shipped config parses, inspect reports, bad values fail at parse time, and the demo
trains in a subprocess, writes checkpoints and resumes from ``--ckpt_path last`` exactly (same batches, same
weights as an uninterrupted run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import BatchRecorder

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DEMO = REPO / "configs" / "demo.yaml"
PADDING_FREE_DEMO = REPO / "configs" / "demo_padding_free.yaml"


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo_cache")


@pytest.fixture()
def offline_env(demo_cache: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"LIGHTNING_D9D_CACHE": str(demo_cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def run_cli(args: list[str]) -> None:
    from lightning_d9d.cli import main

    main(args)


# ---------------------------------------------------------------------------------------------------- parsing
def test_the_shipped_configs_include_the_three_of_this_issue() -> None:
    assert {"demo.yaml", "d9d.yaml", "text.yaml", "demo_padding_free.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=[path.name for path in CONFIGS])
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path" in printed and "trainer:" in printed


@pytest.mark.parametrize(
    "override, field",
    [
        ("--data.init_args.microbatch_size=0", "microbatch_size"),
        ("--data.init_args.global_batch_size=-8", "global_batch_size"),
        ("--data.init_args.max_length=0", "max_length"),
        ("--data.init_args.sort_buffer_size=-1", "sort_buffer_size"),
        ("--data.init_args.padding_side=middle", "padding_side"),
        ("--model.init_args.width=0", "width"),
    ],
)
def test_bad_values_are_rejected_at_parse_time(override: str, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(DEMO), override, "--print_config"])
    assert exit_info.value.code not in (0, None)
    assert field in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- inspect
def test_inspect_the_demo(offline_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["inspect", "--config", str(DEMO), "--steps", "3", "--data.init_args.num_workers=0"])
    report = capsys.readouterr().out
    assert "steps per epoch: " in report
    assert "microbatches per step per rank: 4" in report
    assert "tokens per step" in report and "padding: " in report
    assert "batch.input_ids: (8, " in report and "batch.labels: (8, " in report


def test_inspect_the_padding_free_demo_reports_its_plan(
    offline_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli(["inspect", "--config", str(PADDING_FREE_DEMO), "--data.init_args.num_workers=0"])
    report = capsys.readouterr().out
    assert "steps per epoch: " in report and "microbatches per step per rank: 4" in report
    assert "samples per step: " in report and "tokens per step: " in report and "of 4,096" in report
    fill = float(report.split("fill: ")[1].split(" %")[0])
    assert 98.0 <= fill <= 100.0
    assert "padding: 0.00 % (padding-free)" in report
    assert "batch.input_ids: (1, " in report and "batch.cu_seqlens: (" in report and "int32" in report


def test_padding_free_demo_fits_and_resumes_exactly(offline_env: dict[str, str], tmp_path: Path) -> None:
    """The padding-free config trains in process and resumes from ``last`` with the same batches and weights."""
    shrink = ["--data.init_args.global_batch_tokens=1024", "--data.init_args.microbatch_tokens=256"]
    shrink.append("--data.init_args.num_workers=0")
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    demo_fit(whole, offline_env, whole / "record.jsonl", 6, shrink, in_process=True, config=PADDING_FREE_DEMO)
    demo_fit(interrupted, offline_env, interrupted / "r.jsonl", 3, shrink, in_process=True, config=PADDING_FREE_DEMO)
    demo_fit(
        interrupted,
        offline_env,
        interrupted / "r.jsonl",
        6,
        [*shrink, "--ckpt_path", "last"],
        in_process=True,
        config=PADDING_FREE_DEMO,
    )
    assert read_records(interrupted / "r.jsonl") == read_records(whole / "record.jsonl")
    assert len(read_records(whole / "record.jsonl")) == 6 * 4
    final_whole = torch.load(whole / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    final_resumed = torch.load(interrupted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    for name, tensor in final_whole["state_dict"].items():
        torch.testing.assert_close(final_resumed["state_dict"][name], tensor, msg=name)


def test_inspect_the_plain_d9d_config(capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["inspect", "--config", str(REPO / "configs" / "d9d.yaml"), "--steps", "2", "--trainer.devices=1"])
    report = capsys.readouterr().out
    assert "steps per epoch: 64" in report  # 4096 samples / global batch 64
    assert "microbatches per step per rank: 4" in report
    assert "batch.input_ids: (16, " in report


def test_inspect_with_packs_reads_whole_steps(capsys: pytest.CaptureFixture[str]) -> None:
    config = ["--config", str(REPO / "configs" / "d9d.yaml"), "--steps", "2", "--trainer.devices=1"]
    run_cli(["inspect", *config])
    plain = capsys.readouterr().out
    run_cli(["inspect", *config, "--data.init_args.yield_packs=true"])
    packed = capsys.readouterr().out
    tokens = [line for line in plain.splitlines() if line.startswith(("tokens per step", "padding"))]
    assert tokens and tokens == [
        line for line in packed.splitlines() if line.startswith(("tokens per step", "padding"))
    ]
    assert "batch.input_ids: (16, " in packed


# ---------------------------------------------------------------------------------------------------- demo run
def demo_fit(
    workdir: Path,
    env: dict[str, str],
    record: Path,
    max_steps: int,
    extra: list[str] = (),
    in_process: bool = False,
    config: Path = DEMO,
) -> None:
    """``lightning-d9d fit --config configs/demo.yaml`` with a smaller model and batch, so the test takes seconds."""
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(workdir / "checkpoints"), "every_n_train_steps": 3, "save_last": True},
        },
        {"class_path": "support.BatchRecorder"},
    ]
    sizes = ["--data.init_args.global_batch_size=8", "--data.init_args.microbatch_size=4"] if config == DEMO else []
    args = [
        "fit",
        "--config",
        str(config),
        "--model.init_args.width=32",
        "--model.init_args.num_layers=1",
        "--model.init_args.num_heads=2",
        "--data.init_args.max_length=32",
        *sizes,
        "--data.init_args.sort_buffer_size=64",
        f"--trainer.max_steps={max_steps}",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        *extra,
    ]
    if in_process:  # the same code path without another interpreter start (imports cost seconds on 2 cores)
        previous = os.getcwd()
        os.environ[BatchRecorder.ENV] = str(record)
        try:
            os.chdir(workdir)
            run_cli(args)
        finally:
            os.chdir(previous)
            del os.environ[BatchRecorder.ENV]
        return
    python_path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "lightning_d9d.cli", *args],
        cwd=workdir,
        env={**os.environ, **env, BatchRecorder.ENV: str(record), "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def read_records(path: Path) -> list[tuple[int, int, str]]:
    return [(r["step"], r["epoch"], r["sha"]) for r in map(json.loads, path.read_text().splitlines())]


def test_demo_fit_writes_checkpoints_and_resumes_exactly(offline_env: dict[str, str], tmp_path: Path) -> None:
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    demo_fit(whole, offline_env, whole / "record.jsonl", max_steps=6, in_process=True)
    # The interrupted run and its resumption are real `lightning-d9d` processes.
    demo_fit(interrupted, offline_env, interrupted / "record.jsonl", max_steps=3)
    assert (interrupted / "checkpoints" / "last.ckpt").exists()
    demo_fit(interrupted, offline_env, interrupted / "record.jsonl", max_steps=6, extra=["--ckpt_path", "last"])

    uninterrupted = read_records(whole / "record.jsonl")
    resumed = read_records(interrupted / "record.jsonl")
    assert len(uninterrupted) == 6 * 2  # 6 steps of 2 microbatches (global batch 8 = 2 x 4)
    assert resumed == uninterrupted  # the same microbatches, in the same order, at the same steps

    # The weights after resuming equal the uninterrupted run's: optimizer, scheduler and data all continued.
    final_whole = torch.load(whole / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    final_resumed = torch.load(interrupted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final_whole["global_step"] == final_resumed["global_step"] == 6
    for name, tensor in final_whole["state_dict"].items():
        torch.testing.assert_close(final_resumed["state_dict"][name], tensor, msg=name)

    # `validate` re-parses the checkpoint's hyperparameters (class_path included) and evaluates its weights.
    previous = os.getcwd()
    try:
        os.chdir(whole)
        run_cli(
            [
                "validate",
                "--config",
                str(DEMO),
                "--ckpt_path",
                str(whole / "checkpoints" / "last.ckpt"),
                "--model.init_args.width=32",
                "--model.init_args.num_layers=1",
                "--model.init_args.num_heads=2",
                "--data.init_args.max_length=32",
                "--data.init_args.global_batch_size=8",
                "--data.init_args.microbatch_size=4",
                "--data.init_args.sort_buffer_size=64",
                "--data.init_args.num_workers=0",
                "--trainer.enable_progress_bar=false",
                "--trainer.limit_val_batches=4",
            ]
        )
    finally:
        os.chdir(previous)


@pytest.mark.parametrize(
    "override, field",
    [
        ("--data.init_args.global_batch_size=0", "global_batch_size"),
        ("--data.init_args.microbatch_size=-2", "microbatch_size"),
        ("--data.init_args.num_workers=-1", "num_workers"),
        ("--data.init_args.on_order_mismatch=ignore", "on_order_mismatch"),
    ],
)
def test_d9d_config_rejects_bad_values_at_parse_time(
    override: str, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(REPO / "configs" / "d9d.yaml"), override, "--print_config"])
    assert exit_info.value.code not in (0, None)
    assert field in capsys.readouterr().err
