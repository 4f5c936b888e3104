"""The streaming stages' state contract: checkpoints of earlier versions still resume exactly, and a corrupted,
stale or foreign data state is one clear error naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support import digest

from lightning_d9d import PretrainingDataModule

FIXTURE = Path(__file__).resolve().parent / "data" / "stream_state_v2"
OPTIONS = dict(seq_len=24, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=4,
               steps_per_epoch=40, bestfit_buffer_size=12, tokenizer_batch_size=8)  # fmt: skip
SAVED_AT, FOLLOWING = 7, 12


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("v2")
    shutil.copytree(FIXTURE / "data", root / "data")
    shutil.copy(FIXTURE / "tokenizer.json", root / "tokenizer.json")
    return {"root": root, "saved": torch.load(FIXTURE / "states.pt", weights_only=True)}


def datamodule(v2: dict, packing: str) -> PretrainingDataModule:
    root = v2["root"]
    dm = PretrainingDataModule(
        train_files=str(root / "data"), tokenizer=str(root / "tokenizer.json"), packing=packing, **OPTIONS
    )
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_a_version_2_checkpoint_resumes_onto_the_same_batches(v2: dict, packing: str) -> None:
    """The fixture's states and the batches after them were written by the code of state version 2."""
    saved = v2["saved"][packing]
    uninterrupted = datamodule(v2, packing)
    batches = iter(uninterrupted.train_dataloader())
    for _ in range(SAVED_AT * uninterrupted.microbatches_per_step):
        next(batches)
    want = [digest(next(batches)) for _ in range(FOLLOWING)]
    batches.close()
    assert want == saved["following"]

    resumed = datamodule(v2, packing)
    resumed.load_state_dict(saved["state"])
    batches = iter(resumed.train_dataloader())
    assert [digest(next(batches)) for _ in range(FOLLOWING)] == want
    batches.close()
    # and the state it saves now resumes the same way
    again = datamodule(v2, packing)
    again.load_state_dict(resumed_state(v2, packing, saved["state"]))
    batches = iter(again.train_dataloader())
    assert [digest(next(batches)) for _ in range(FOLLOWING)] == want
    batches.close()


def resumed_state(v2: dict, packing: str, old: dict) -> dict:
    """The state a run resumed from ``old`` saves before its first step (the same position, today's format)."""
    dm = datamodule(v2, packing)
    dm.load_state_dict(old)
    return dm.state_dict()
