"""The training progress bar counts optimizer steps: Lightning's TQDM and Rich bars under real fits (M = 4
microbatches a step), a resumed fit, ``max_steps``; the step walk when steps differ in size; a bar of the user's
own left alone."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from support import LengthDataset, RecordingModule, pad_collate

from lightning_d9d import D9DDataModule
from lightning_d9d.datamodules.progress_bar import StepRichProgressBar, StepTQDMProgressBar, StepWalk

STEPS, M = 6, 4  # 48 samples, global batch 8 in microbatches of 2


def datamodule() -> D9DDataModule:
    return D9DDataModule(LengthDataset(48), pad_collate, global_batch_size=8, microbatch_size=2, sort_buffer_size=16)


def position(bar: Any) -> tuple[int, int]:
    """The training bar's position and total."""
    if isinstance(bar, TQDMProgressBar):
        return bar.train_progress_bar.n, bar.train_progress_bar.total
    task = bar.progress.tasks[bar.train_progress_bar_id]
    return int(task.completed), int(task.total)


class Positions(pl.Callback):
    """The training bar's position and total after every microbatch (listed after the bar: its hook runs first)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.append(position(trainer.progress_bar_callback))


def fit(tmp_path: Path, bar: pl.Callback | None, **trainer: Any) -> tuple[pl.Trainer, Positions]:
    positions = Positions()
    callbacks = [c for c in (bar, positions) if c is not None] + trainer.pop("callbacks", [])
    run = pl.Trainer(
        accelerator="cpu", max_epochs=trainer.pop("max_epochs", 1), logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=callbacks, **{k: v for k, v in trainer.items() if k != "ckpt"},
    )  # fmt: skip
    run.fit(RecordingModule(str(tmp_path), "bar"), datamodule=datamodule(), ckpt_path=trainer.get("ckpt"))
    return run, positions


@pytest.mark.parametrize(
    ("given", "swapped"), [(TQDMProgressBar, StepTQDMProgressBar), (RichProgressBar, StepRichProgressBar)]
)
def test_lightnings_bars_count_optimizer_steps(tmp_path: Path, given: type, swapped: type) -> None:
    trainer, positions = fit(tmp_path, given())
    assert type(trainer.progress_bar_callback) is swapped
    # After each microbatch: the steps completed so far, of the epoch's 6 (not 24 microbatches).
    assert positions.seen == [((i + 1) // M, STEPS) for i in range(STEPS * M)]
    if given is TQDMProgressBar:
        assert trainer.progress_bar_callback.train_progress_bar.desc.startswith("Epoch 0 (optimizer steps)")
    else:
        assert trainer.progress_bar_callback._get_train_description(0).endswith("(optimizer steps)")


def test_the_default_bar_counts_steps_and_a_bar_of_ones_own_is_left_alone(tmp_path: Path) -> None:
    trainer, _ = fit(tmp_path / "default", None)
    assert isinstance(trainer.progress_bar_callback, (StepTQDMProgressBar, StepRichProgressBar))
    assert position(trainer.progress_bar_callback) == (STEPS, STEPS)

    class Mine(TQDMProgressBar):
        pass

    trainer, _ = fit(tmp_path / "mine", Mine())
    assert type(trainer.progress_bar_callback) is Mine
    assert position(trainer.progress_bar_callback) == (STEPS * M, STEPS * M), "its own count: microbatches"


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar])
def test_a_resumed_fit_and_max_steps_count_the_epochs_steps(tmp_path: Path, bar: type) -> None:
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path, bar(), max_steps=2, callbacks=[saving])
    _, positions = fit(tmp_path, bar(), ckpt=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert positions.seen == [((i + 1) // M, STEPS) for i in range(2 * M, STEPS * M)], "from step 2 of 6"
    trainer, positions = fit(tmp_path / "short", bar(), max_steps=3, max_epochs=-1)
    assert positions.seen[-1] == (3, 3), "max_steps bounds the total in steps"
    if bar is RichProgressBar:  # Lightning's own would say "Epoch 0/-2": an epoch count that does not exist
        assert trainer.progress_bar_callback._get_train_description(0).split() == ["Epoch", "0", "(optimizer", "steps)"]


def test_the_walk_follows_steps_of_different_sizes() -> None:
    sizes = {0: 4, 1: 2, 2: 2, 3: 6, 4: 1, 5: 3}
    walk = StepWalk(sizes.__getitem__, 0)
    after = {n: walk.steps_after(n) for n in (0, 3, 4, 5, 6, 8, 13, 14, 15)}
    assert after == {0: 0, 3: 0, 4: 1, 5: 1, 6: 2, 8: 3, 13: 3, 14: 4, 15: 5}
    resumed = StepWalk(sizes.__getitem__, 2)  # an epoch (or a resume) whose first step is 2
    assert [resumed.steps_after(n) for n in (1, 2, 7, 8, 9)] == [0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="optimizer step 0 has 0 microbatches; every step has at least 1"):
        StepWalk(lambda step: 0, 0).steps_after(1)


def test_an_integer_val_check_interval_is_said_to_count_microbatches(tmp_path: Path) -> None:
    """Lightning counts ``val_check_interval=N`` in training batches: with M = 4 microbatches per step, 8 of them
    are 2 optimizer steps, which one warning says with the value that would mean 8 steps."""
    with pytest.warns(UserWarning, match=r"val_check_interval=8\) counts training batches") as caught:
        fit(tmp_path / "int", None, val_check_interval=8)
    (message,) = [str(w.message) for w in caught if "val_check_interval" in str(w.message)]
    assert "every 8 microbatches, 2 optimizer steps" in message and "val_check_interval=32 validates every 8" in message
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*val_check_interval.*")
        fit(tmp_path / "float", None, val_check_interval=0.5)  # a fraction of the epoch: no warning
