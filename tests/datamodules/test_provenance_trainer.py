"""Provenance under a real Trainer and from the command line: a loss spike writes the provenance of the steps before
it, the ``lightning-d9d provenance`` command names a step's documents from a run's checkpoint and records, and a
map-style DataModule names the samples of any step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import LengthDataset, RecordingModule, make_docs, pad_collate, small_corpus

from lightning_d9d import D9DDataModule, PretrainingDataModule
from lightning_d9d.datamodules.loss_spike import LossSpikeProvenance

SPIKE_AT = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    docs = make_docs(200, seed=4, max_words=20, long_every=9, long_words=60)
    return small_corpus(tmp_path_factory.mktemp("provenance_trainer"), docs, row_group_size=10)


def datamodule(data: Path, tmp: Path, **changes: Any) -> PretrainingDataModule:
    options = dict(train_files=str(data / "train"), tokenizer=str(data / "tokenizer.json"), seq_len=16,
                   global_batch_size=8, microbatch_size=4, num_streams=4, steps_per_epoch=40, num_workers=0,
                   packing="bestfit_split", provenance_dir=str(tmp / "ledger"), provenance_every=10)  # fmt: skip
    options.update(changes)
    return PretrainingDataModule(**options)


class Spiking(RecordingModule):
    """A steady loss, ten times larger at one step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx) * 0 + 1.0 + 0.01 * (batch_idx % 3)
        return loss * 10 if self.global_step == SPIKE_AT else loss


def test_a_loss_spike_writes_the_provenance_of_the_steps_before_it(data: Path, tmp_path: Path) -> None:
    spikes = LossSpikeProvenance(factor=3.0, window=20, steps=5, min_steps=10, dirpath=str(tmp_path / "spikes"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=36, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[spikes])  # fmt: skip
    dm = datamodule(data, tmp_path)
    with pytest.warns(UserWarning, match=rf"loss spike at step {SPIKE_AT}: .* skip_data=\[\[26, 31\]\]"):
        trainer.fit(Spiking(str(tmp_path / "records")), datamodule=dm)
    assert [step for step, _ in spikes.spikes] == [SPIKE_AT]
    lines = [json.loads(line) for line in Path(spikes.spikes[0][1]).read_text().splitlines()]
    assert sorted({line["step"] for line in lines}) == list(range(SPIKE_AT - 4, SPIKE_AT + 1))
    assert {line["batch_row"] for line in lines} == set(range(8))
    # The file is what dm.provenance says of those steps, and lists documents exclude_documents takes as it is.
    fresh = datamodule(data, tmp_path)
    fresh.setup("fit")
    assert lines == [piece.to_dict() for piece in fresh.provenance(range(SPIKE_AT - 4, SPIKE_AT + 1))]
    again = datamodule(data, tmp_path, exclude_documents=spikes.spikes[0][1])
    again.setup("fit")
    assert len(again.edits.excluded()) == len({(x["file"], x["row_group"], x["document_row"]) for x in lines})


@pytest.mark.slow
def test_the_provenance_command_names_a_steps_documents_from_a_checkpoint(data: Path, tmp_path: Path) -> None:
    from lightning_d9d.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "trainer": {"accelerator": "cpu", "max_steps": 25, "logger": False, "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path)},
        "model": {"class_path": "support.RecordingModule", "init_args": {"record_dir": str(tmp_path / "records")}},
        "data": {"class_path": "lightning_d9d.PretrainingDataModule",
                 "init_args": {"train_files": str(data / "train"), "tokenizer": str(data / "tokenizer.json"),
                               "seq_len": 16, "global_batch_size": 8, "microbatch_size": 4, "num_streams": 4,
                               "steps_per_epoch": 40, "num_workers": 0, "packing": "concat",
                               "provenance_every": 10}},
    }))  # fmt: skip
    callbacks = json.dumps(
        [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 25},
            }
        ]
    )
    main(["fit", "--config", str(config), f"--trainer.callbacks={callbacks}"])
    assert sorted(p.name for p in (tmp_path / "data_provenance").iterdir()) == ["000000000010", "000000000020"]
    out = tmp_path / "steps.jsonl"
    main(["provenance", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "epoch=0-step=25.ckpt"),
          "--steps", "12:15", "--output", str(out)])  # fmt: skip
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    fresh = PretrainingDataModule(train_files=str(data / "train"), tokenizer=str(data / "tokenizer.json"), seq_len=16,
                                  global_batch_size=8, microbatch_size=4, num_streams=4, steps_per_epoch=40,
                                  num_workers=0, packing="concat")  # fmt: skip
    fresh.setup("fit")
    assert lines == [piece.to_dict() for piece in fresh.provenance(range(12, 15))]
    with pytest.raises(SystemExit):
        main(["provenance", "--config", str(config), "--steps", "9:3"])


def test_a_map_style_datamodule_names_the_samples_of_any_step_on_any_layout() -> None:
    dm = D9DDataModule(LengthDataset(200), pad_collate, global_batch_size=16, microbatch_size=2, sort_buffer_size=64)
    dm.setup("fit")
    for step in (0, 5, 11):
        named = dm.provenance(step)
        assert [len(batch) for batch in named] == [2] * 8
        for size in (1, 2, 4):
            got = []
            for rank in range(size):
                batches = iter(dm.train_dataloader_for_rank(rank, size))
                for _ in range(step * 8 // size):
                    next(batches)
                got += [next(batches)["ids"].tolist() for _ in range(8 // size)]
            assert sorted(map(sorted, got)) == sorted(map(sorted, named)), (step, size)
    with pytest.raises(ValueError, match=r"step=12 is not a step of epoch 0, which has 12 \(0..11\)"):
        dm.provenance(12)
    assert np.unique(np.concatenate([np.concatenate(dm.provenance(s)) for s in range(12)])).size == 12 * 16


def test_checkpoints_of_a_run_keep_its_edits_and_the_ledger_records_its_resume(data: Path, tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[checkpoints])  # fmt: skip
    trainer.fit(RecordingModule(str(tmp_path / "records")), datamodule=datamodule(data, tmp_path))
    resumed = pl.Trainer(accelerator="cpu", max_steps=14, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    dm = datamodule(data, tmp_path, skip_data=[[7, 9]])
    resumed.fit(RecordingModule(str(tmp_path / "records")), datamodule=dm,
                ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=5.ckpt"))  # fmt: skip
    records = sorted(p.name for p in (tmp_path / "ledger").iterdir())
    assert records == ["000000000005", "000000000010"], "the resume and every 10 steps"
    assert dm.state_dict()["edits"]["skips"] == [[7, 2]]
