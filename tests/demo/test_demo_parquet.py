"""The demo corpus as parquet: shards written deterministically and once, demo file specs, and a short fit of
``configs/demo_pretraining.yaml`` (the streaming demo) through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lightning_d9d.core.digest import Hasher
from lightning_d9d.demo_data.parquet import DemoParquet, build_demo_parquet, resolve_demo_files, write_shards

pytestmark = pytest.mark.slow  # builds the demo corpus and trains its tokenizer, and fits through the CLI

REPO = Path(__file__).resolve().parents[2]
DEMO_PRETRAINING = REPO / "configs" / "demo_pretraining.yaml"


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo_cache")


@pytest.fixture(scope="module")
def built(demo_cache: Path) -> DemoParquet:
    return build_demo_parquet(demo_cache)


def digest(paths: list[str]) -> str:
    return Hasher().add(*(Path(p).read_bytes() for p in paths)).hexdigest()


def test_the_shards_hold_two_sources_in_several_row_groups(built: DemoParquet) -> None:
    from lightning_d9d.demo_data.corpus import demo_texts

    train, validation = demo_texts()
    for name, expected in (("prose", train), ("validation", validation)):
        texts = [t for path in built.files[name] for t in pq.read_table(path).column("text").to_pylist()]
        assert texts == expected
    code = [t for path in built.files["code"] for t in pq.read_table(path).column("text").to_pylist()]
    assert len(code) > 500 and all(code) and any("def " in text for text in code)
    for name in ("prose", "code"):
        groups = [pq.ParquetFile(path).metadata.num_row_groups for path in built.files[name]]
        assert len(groups) == 4 and min(groups) >= 2, (name, groups)


def test_the_shards_are_written_once_and_the_same_bytes_every_time(built: DemoParquet, tmp_path: Path) -> None:
    before = {path: os.stat(path).st_mtime_ns for paths in built.files.values() for path in paths}
    again = build_demo_parquet(Path(built.tokenizer_path).parents[1])
    assert again == built
    assert before == {path: os.stat(path).st_mtime_ns for paths in again.files.values() for path in paths}
    prose = [t for path in built.files["prose"] for t in pq.read_table(path).column("text").to_pylist()]
    rewritten = write_shards(prose, tmp_path / "prose", "prose")
    assert digest(rewritten) == digest(built.files["prose"])


def test_demo_specs_resolve_anywhere_in_a_file_spec(built: DemoParquet) -> None:
    prose, code = built.files["prose"], built.files["code"]
    assert resolve_demo_files("demo", built) == prose + code
    assert resolve_demo_files(["demo:code", "x/*.parquet"], built) == [*code, "x/*.parquet"]
    assert resolve_demo_files({"prose": "demo:prose", "code": {"files": "demo:code"}}, built) == {
        "prose": prose,
        "code": {"files": code},
    }
    assert resolve_demo_files("data/*.parquet", built) == "data/*.parquet"
    with pytest.raises(ValueError, match=r"'demo:math' is not a demo source: use 'demo' or one of \['demo:prose'"):
        resolve_demo_files("demo:math", built)


@pytest.mark.slow
def test_the_streaming_demo_config_fits(demo_cache: Path, built: DemoParquet, tmp_path: Path, monkeypatch) -> None:
    """``lightning-d9d fit --config configs/demo_pretraining.yaml`` with a smaller model and a few steps."""
    from lightning_d9d.cli import main

    monkeypatch.setenv("LIGHTNING_D9D_CACHE", str(demo_cache))
    monkeypatch.chdir(tmp_path)
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True},
        }
    ]
    main(
        [
            "fit",
            "--config",
            str(DEMO_PRETRAINING),
            "--model.init_args.width=32",
            "--model.init_args.num_layers=1",
            "--model.init_args.num_heads=2",
            "--data.init_args.steps_per_epoch=3",
            "--data.init_args.val_steps=1",
            "--trainer.max_epochs=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            f"--trainer.callbacks={json.dumps(callbacks)}",
        ]
    )
    import torch

    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3
    assert "val/loss" in (tmp_path / "lightning_logs" / "demo_pretraining").rglob("metrics.csv").__next__().read_text()


def test_the_streaming_demo_refuses_a_model_vocabulary_smaller_than_its_tokenizers(
    demo_cache: Path, built: DemoParquet, monkeypatch
) -> None:
    """TinyGPT checks the DataModule's vocabulary at fit start; the demo pretraining DataModule must declare it."""
    import lightning.pytorch as pl

    from lightning_d9d.demo.model import TinyGPT
    from lightning_d9d.demo.pretraining import DemoPretrainingDataModule

    monkeypatch.setenv("LIGHTNING_D9D_CACHE", str(demo_cache))
    dm = DemoPretrainingDataModule(seq_len=16, global_batch_size=4, microbatch_size=2, num_workers=0, num_streams=2,
                                   steps_per_epoch=1)  # fmt: skip
    assert dm.vocab_size > 64
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = TinyGPT(vocab_size=64, max_positions=16, width=16, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=rf"the tokenizer has {dm.vocab_size} tokens but TinyGPT\(vocab_size=64\)"):
        trainer.fit(model, datamodule=dm)
