"""The package's shape: stages that do not import Lightning, and workers that stop when a loop is broken off, at
``teardown`` and when training raises."""

from __future__ import annotations

import ast
import multiprocessing
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from support import TESTS, LengthDataset, RecordingModule, make_docs, pad_collate, train_tokenizer, write_parquet

from lightning_d9d import D9DDataModule, PretrainingDataModule

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "lightning_d9d"
# The Lightning layer: the DataModules (one of them the demo's), the CLI and the demo model. Every other module
# is a stage and must import without Lightning.
LIGHTNING_LAYER = ("datamodules", "cli", "demo.model", "demo.pretraining")
STAGES = sorted(
    "lightning_d9d." + ".".join(path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
    for path in PACKAGE_ROOT.rglob("*.py")
    if path.name != "__init__.py"
    and not ".".join(path.relative_to(PACKAGE_ROOT).with_suffix("").parts).startswith(LIGHTNING_LAYER)
)


def run_python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=TESTS,
    )


def test_no_stage_imports_lightning() -> None:
    done = run_python(
        f"""
        import importlib, sys
        for name in {STAGES!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ shutdown
@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shutdown")
    docs = make_docs(400, seed=3)
    write_parquet(root / "train", docs, files=2, row_group_size=25)
    train_tokenizer(docs, root / "tokenizer.json")
    return root


@pytest.mark.slow
def test_breaking_out_of_loops_stops_workers_without_the_garbage_collector(parquet: Path) -> None:
    """With the garbage collector off, a loop broken off must still stop its workers at once (nothing may wait
    for a collection, which could otherwise run inside a later loader's forked worker and fail there)."""
    done = run_python(
        f"""
        import gc, multiprocessing, time
        from support import LengthDataset, pad_collate
        from lightning_d9d import D9DDataModule, PretrainingDataModule

        gc.disable()

        def streaming():
            dm = PretrainingDataModule(train_files={str(parquet / "train")!r},
                                       tokenizer={str(parquet / "tokenizer.json")!r}, seq_len=32,
                                       global_batch_size=8, microbatch_size=4, num_workers=2, steps_per_epoch=20,
                                       num_streams=4)
            dm.setup("fit")
            return dm

        def mapstyle():
            dm = D9DDataModule(LengthDataset(400), pad_collate, global_batch_size=16, microbatch_size=4,
                               num_workers=2)
            dm.setup("fit")
            return dm

        for make in (streaming, streaming, mapstyle, mapstyle, streaming):
            for number, batch in enumerate(make().train_dataloader()):
                if number == 2:
                    break
            deadline = time.monotonic() + 10
            while multiprocessing.active_children() and time.monotonic() < deadline:
                time.sleep(0.05)
            print(make.__name__, "workers left:", len(multiprocessing.active_children()))
        gc.enable()
        gc.collect()
        """,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("workers left: 0") == 5, done.stdout
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def live_workers(seconds: float = 5.0) -> list:
    """DataLoader worker processes still alive after giving them ``seconds`` to exit."""
    deadline = time.monotonic() + seconds
    while (children := multiprocessing.active_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return children


@pytest.mark.parametrize("kind", ["mapstyle", "streaming"])
def test_teardown_stops_the_workers_of_a_loop_broken_off(parquet: Path, kind: str) -> None:
    if kind == "mapstyle":
        dm = D9DDataModule(LengthDataset(400), pad_collate, global_batch_size=16, microbatch_size=4, num_workers=2)
    else:
        dm = PretrainingDataModule(
            train_files=str(parquet / "train"),
            tokenizer=str(parquet / "tokenizer.json"),
            seq_len=32,
            global_batch_size=8,
            microbatch_size=4,
            num_workers=2,
            steps_per_epoch=20,
            num_streams=4,
        )
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    assert multiprocessing.active_children(), "the workers run while the loop is live"
    dm.teardown("fit")
    assert live_workers() == []


class FailingModule(RecordingModule):
    def training_step(self, batch, batch_idx):  # type: ignore[override]
        if batch_idx == 3:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_training_stops_the_workers(tmp_path: Path) -> None:
    dm = D9DDataModule(LengthDataset(400), pad_collate, global_batch_size=16, microbatch_size=4, num_workers=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(FailingModule(str(tmp_path)), datamodule=dm)
    assert live_workers() == []


# ------------------------------------------------------------------------------------------------ sizes
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 250
# Known to be over the limits, to be split; shrink this set, never grow it. The DataModules' constructors (and so
# PretrainingDataModule's class) are over because their ~45 documented arguments are the public surface that
# LightningCLI reads from the signature and docstring; their logic lives in parts. Next step: one config per part.
OVERSIZED: set[str] = {
    "datamodules/pretraining/datamodule.py::PretrainingDataModule",
    "datamodules/pretraining/datamodule.py::PretrainingDataModule.__init__",
    "datamodules/text.py::TextDataModule.__init__",
}


def oversized() -> set[str]:
    """Every function over ``MAX_FUNCTION_LINES`` lines and class over ``MAX_CLASS_LINES`` in the package."""
    found = set()

    def visit(node: ast.AST, prefix: str, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if child.end_lineno - child.lineno + 1 > limit:
                    found.add(f"{where}::{name}")
                visit(child, f"{name}.", where)
            else:
                visit(child, prefix, where)

    for path in PACKAGE_ROOT.rglob("*.py"):
        visit(ast.parse(path.read_text()), "", path.relative_to(PACKAGE_ROOT).as_posix())
    return found


def test_no_function_over_60_lines_and_no_class_over_250_but_the_known_ones() -> None:
    found = oversized()
    assert found - OVERSIZED == set(), "new oversized functions or classes"
    assert OVERSIZED - found == set(), "no longer oversized: remove them from OVERSIZED"


@pytest.mark.parametrize("kind", ["mapstyle", "streaming"])
def test_teardown_stops_the_workers_of_a_validation_loop_broken_off(parquet: Path, kind: str) -> None:
    if kind == "mapstyle":
        dm = D9DDataModule(
            LengthDataset(400), pad_collate, global_batch_size=16, microbatch_size=4, num_workers=2,
            val_dataset=LengthDataset(200, seed=1),
        )  # fmt: skip
    else:
        dm = PretrainingDataModule(
            train_files=str(parquet / "train"), val_files=str(parquet / "train"),
            tokenizer=str(parquet / "tokenizer.json"), seq_len=32, global_batch_size=8, microbatch_size=4,
            num_workers=2, steps_per_epoch=20, val_steps=4, num_streams=4,
        )  # fmt: skip
    dm.setup("fit")
    batches = iter(dm.val_dataloader())
    next(batches)
    assert multiprocessing.active_children(), "the workers run while the loop is live"
    dm.teardown("fit")
    assert live_workers() == []
