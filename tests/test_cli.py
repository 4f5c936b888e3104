"""The lightning-d9d CLI: every shipped config parses, inspect reports, bad values fail at parse time, and the demo
trains in a subprocess, writes checkpoints and resumes from ``--ckpt_path last`` exactly (same batches, same
weights as an uninterrupted run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import BOS, BatchRecorder, make_docs, train_tokenizer, write_parquet

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
def test_the_shipped_configs_include_every_datamodule_path() -> None:
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
@pytest.mark.slow
def test_inspect_the_demo(offline_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["inspect", "--config", str(DEMO), "--steps", "3", "--data.init_args.num_workers=0"])
    report = capsys.readouterr().out
    assert "steps per epoch: " in report
    assert "microbatches per step per rank: 4" in report
    assert "tokens per step" in report and "padding: " in report
    assert "batch.input_ids: (8, " in report and "batch.labels: (8, " in report


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_demo_fit_writes_checkpoints_and_resumes_exactly(offline_env: dict[str, str], tmp_path: Path) -> None:
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    whole.mkdir()
    interrupted.mkdir()
    demo_fit(whole, offline_env, whole / "record.jsonl", max_steps=6, in_process=True)
    demo_fit(interrupted, offline_env, interrupted / "record.jsonl", max_steps=3, in_process=True)
    assert (interrupted / "checkpoints" / "last.ckpt").exists()
    # The resumption is a real `lightning-d9d` process: it has nothing but the checkpoint and the config (no state
    # of the interrupted run's process, which the in-process runs could share). One launch: imports cost seconds.
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


# ---------------------------------------------------------------------------------------------------- errors
# A misconfiguration ends with one short message naming the key and what would be valid, exit code != 0.
# (name, config edit, extra flags, exit code, what the message must name)
MISCONFIGURATIONS = [
    ("unknown_key", {"seq_lenn": 32}, [], 2, ["data.init_args.seq_lenn", "did you mean 'seq_len'"]),
    ("unknown_flag", {}, ["--trainer.max_stepz=3"], 2, ["--trainer.max_stepz", "--trainer.max_steps"]),
    ("wrong_type", {}, ["--data.init_args.seq_len=abc"], 2, ["data.init_args.seq_len", "integer > 0", "abc"]),
    ("bad_value", {}, ["--data.init_args.seq_len=-5", "--print_config"], 2, ["data.init_args.seq_len", "> 0"]),
    ("bad_choice", {}, ["--data.init_args.packing=best"], 2, ["packing", "'bestfit_split'", "'concat'"]),
    ("missing_config", {}, ["--config", "no_such.yaml"], 2, ["config", "no_such.yaml", "does not exist"]),
    (
        "class_path",
        {"class_path": "lightning_d9d.PretrainingDataModul"},
        [],
        2,
        ["data.class_path", "lightning_d9d.PretrainingDataModule"],
    ),
    ("missing_files", {"train_files": "no_such_dir"}, [], 1, ["train_files='no_such_dir'", "a glob"]),
    ("missing_tokenizer", {"tokenizer": "no_such.json"}, [], 1, ["no_such.json", "tokenizer.json"]),
    ("stream_layout", {"num_workers": 3}, [], 1, ["num_workers=3", "[0, 1, 2, 4]"]),
    ("indivisible_batch", {"global_batch_size": 6}, [], 1, ["global_batch_size=6", "multiple of 4"]),
    ("missing_checkpoint", {}, ["--ckpt_path", "no_such.ckpt"], 1, ["--ckpt_path 'no_such.ckpt'", "'last'"]),
    ("accumulation", {}, ["--trainer.accumulate_grad_batches=3"], 1, ["accumulate_grad_batches=3", "leave it at 1"]),
]


@pytest.fixture(scope="module")
def pretraining_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with parquet files, a tokenizer and a small valid pretraining config (``base.yaml``)."""
    root = tmp_path_factory.mktemp("misconfigured")
    docs = make_docs(120, seed=5)
    write_parquet(root / "train", docs, files=2)
    train_tokenizer(docs, root / "tokenizer.json")
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False},
        "model": {"class_path": "lightning_d9d.demo.model.TinyGPT", "init_args": {"vocab_size": 512}},
        "data": {
            "class_path": "lightning_d9d.PretrainingDataModule",
            "init_args": {
                "train_files": "train",
                "tokenizer": "tokenizer.json",
                "seq_len": 32,
                "global_batch_size": 8,
                "microbatch_size": 4,
                "num_streams": 4,
                "num_workers": 0,
            },
        },
    }
    (root / "base.yaml").write_text(yaml.safe_dump(config))
    return root


def misconfigured_args(root: Path, edit: dict, flags: list[str], name: str) -> list[str]:
    config = yaml.safe_load((root / "base.yaml").read_text())
    if "class_path" in edit:
        config["data"]["class_path"] = edit["class_path"]
    else:
        config["data"]["init_args"].update(edit)
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    config_args = [] if "--config" in flags else ["--config", f"{name}.yaml"]
    return ["fit", *config_args, *flags]


def assert_readable(stderr: str, expected: list[str]) -> None:
    error_lines = [line for line in stderr.splitlines() if ": error: " in line]
    assert "Traceback" not in stderr, stderr
    assert len(error_lines) == 1, stderr
    for text in expected:
        assert text in error_lines[0], (text, error_lines[0])
    assert "LIGHTNING_D9D_TRACEBACK=1" in stderr  # the way to the full message is named


@pytest.mark.parametrize("name, edit, flags, code, expected", MISCONFIGURATIONS, ids=[c[0] for c in MISCONFIGURATIONS])
def test_a_misconfiguration_ends_in_one_line_naming_the_key(
    name: str,
    edit: dict,
    flags: list[str],
    code: int,
    expected: list[str],
    pretraining_config: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(pretraining_config)
    monkeypatch.delenv("LIGHTNING_D9D_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(misconfigured_args(pretraining_config, edit, flags, name))
    assert exit_info.value.code == code
    assert_readable(capsys.readouterr().err, expected)


def entry_point() -> list[str]:
    """The installed ``lightning-d9d`` console script (PYTHONPATH puts this checkout's package first)."""
    script = Path(sys.executable).parent / "lightning-d9d"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lightning_d9d.cli"]


# One case of each way an error ends the real command (every case of the table runs in-process above, through
# the same entry function): a parse error (exit code 2) and an error raised inside ``fit`` (exit code 1). Each is
# a process start that pays the imports (seconds on 2 cores), so only these two.
THROUGH_THE_COMMAND = ("unknown_key", "missing_files")


@pytest.mark.slow
def test_misconfigurations_through_the_lightning_d9d_command(pretraining_config: Path) -> None:
    """Cases of the table as real ``lightning-d9d`` processes: short stderr, no traceback, exit code != 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("LIGHTNING_D9D_TRACEBACK", None)
    processes = {}
    cases = [case for case in MISCONFIGURATIONS if case[0] in THROUGH_THE_COMMAND]
    assert len(cases) == len(THROUGH_THE_COMMAND)
    for name, edit, flags, code, expected in cases:  # started together: each pays the imports
        args = misconfigured_args(pretraining_config, edit, flags, name)
        processes[name] = (
            subprocess.Popen(
                [*entry_point(), *args],
                cwd=pretraining_config,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            code,
            expected,
        )
    for name, (process, code, expected) in processes.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == code, (name, stderr[-3000:])
        assert len(stderr.splitlines()) < 15, (name, stderr)
        assert_readable(stderr, expected)


def test_the_traceback_variable_shows_the_full_error(
    pretraining_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(pretraining_config)
    monkeypatch.setenv("LIGHTNING_D9D_TRACEBACK", "1")
    with pytest.raises(ValueError, match="num_workers=3"):  # the exception itself, for its traceback
        run_cli(misconfigured_args(pretraining_config, {"num_workers": 3}, [], "layout_traceback"))
    with pytest.raises(SystemExit):
        run_cli(misconfigured_args(pretraining_config, {}, ["--data.init_args.seq_len=abc"], "parse_traceback"))
    assert "Does not validate against any of the Union subtypes" in capsys.readouterr().err  # jsonargparse's own


@pytest.mark.parametrize(
    "override, field",
    [
        ("--data.init_args.seq_len=-5", "seq_len"),
        ("--data.init_args.num_streams=0", "num_streams"),
        ("--data.init_args.num_workers=-1", "num_workers"),
        ("--data.init_args.steps_per_epoch=0", "steps_per_epoch"),
        ("--data.init_args.tokenizer_batch_size=0", "tokenizer_batch_size"),
        ("--data.init_args.bestfit_buffer_size=-3", "bestfit_buffer_size"),
    ],
)
def test_pretraining_config_rejects_bad_values_at_parse_time(
    override: str, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = REPO / "configs" / "pretraining.yaml"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(DEMO), "--config", str(config), override, "--print_config"])
    assert exit_info.value.code == 2
    assert f"data.init_args.{field}: must be an integer" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- checkpoints
def config_callbacks(config: Path, dirpath: Path, every: int) -> list[dict]:
    """The config's own callbacks, writing to ``dirpath`` and saving every ``every`` steps, plus a BatchRecorder."""
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    for callback in callbacks:
        callback["init_args"]["dirpath"] = str(dirpath)
        if "every_n_train_steps" in callback["init_args"]:
            callback["init_args"]["every_n_train_steps"] = every
    return [*callbacks, {"class_path": "support.BatchRecorder"}]


STEPPED_CONFIGS = [
    path for path in CONFIGS if "every_n_train_steps" in json.dumps(yaml.safe_load(path.read_text()).get("trainer"))
]


@pytest.mark.parametrize("config", STEPPED_CONFIGS, ids=[path.name for path in STEPPED_CONFIGS])
def test_a_config_that_saves_every_n_steps_also_saves_each_epochs_end_as_last(config: Path) -> None:
    """Saving only every N steps leaves last.ckpt short of the end (step 100 of 132): a resume trains again."""
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    checkpoints = [c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
    at_the_end = [c for c in checkpoints if not c.get("every_n_train_steps") and c.get("save_last")]
    assert at_the_end and all(c["dirpath"] == checkpoints[0]["dirpath"] for c in checkpoints)
    assert at_the_end[0].get("enable_version_counter") is False, "one last.ckpt, not last-v1.ckpt"


@pytest.mark.slow
def test_the_demo_saves_the_trained_model_and_resuming_a_finished_run_trains_nothing(
    offline_env: dict[str, str], tmp_path: Path
) -> None:
    """configs/demo_pretraining.yaml with its own checkpoint callbacks (every 2 steps here) over a 5-step epoch."""
    config = REPO / "configs" / "demo_pretraining.yaml"
    args = [
        "fit", "--config", str(config), "--model.init_args.width=32", "--model.init_args.num_layers=1",
        "--model.init_args.num_heads=2", "--data.init_args.steps_per_epoch=5", "--data.init_args.num_workers=0",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        f"--trainer.callbacks={json.dumps(config_callbacks(config, tmp_path / 'checkpoints', 2))}",
    ]  # fmt: skip
    record = tmp_path / "record.jsonl"
    previous = os.getcwd()
    os.environ[BatchRecorder.ENV] = str(record)
    try:
        os.chdir(tmp_path)
        run_cli(args)
        trained = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert trained["global_step"] == 5, "last.ckpt is the end of the run, not step 4"
        assert len(read_records(record)) == 5 * 4
        run_cli([*args, "--ckpt_path", "last"])
    finally:
        os.chdir(previous)
        del os.environ[BatchRecorder.ENV]
    assert len(read_records(record)) == 5 * 4, "the finished run resumed: no step trained again"
    again = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert again["global_step"] == 5
    for name, tensor in trained["state_dict"].items():
        torch.testing.assert_close(again["state_dict"][name], tensor, msg=name)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt",
    ]  # fmt: skip


def test_inspect_needs_no_model(pretraining_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """``inspect --config configs/pretraining.yaml``: a data section alone (it reads data, never the model)."""
    monkeypatch.chdir(pretraining_config)
    data = {"train_files": "train", "tokenizer": "tokenizer.json", "bos_token": BOS, "seq_len": 32,
            "global_batch_size": 8, "microbatch_size": 4, "num_streams": 4, "num_workers": 0,
            "steps_per_epoch": 3, "tokenizer_backend": "auto"}  # fmt: skip
    overrides = [f"--data.init_args.{key}={value}" for key, value in data.items()]
    run_cli(["inspect", "--config", str(REPO / "configs" / "pretraining.yaml"), *overrides, "--steps", "2"])
    report = capsys.readouterr().out
    assert "data: lightning_d9d.datamodules.pretraining.PretrainingDataModule" in report
    assert "steps per epoch: 3" in report and "batch.input_ids: (4, 32)" in report
    # The backend in use and why (this WordLevel tokenizer is one no fast backend serves).
    assert re.search(r"^tokenizer backend: tokenizers \(auto: .+\)$", report, re.MULTILINE), report
