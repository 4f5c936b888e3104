"""Provenance under a real Trainer and from the command line: a loss spike writes the provenance of the steps before
it, the ``lightning-d9d provenance`` command names a step's documents from a run's checkpoint and records, and a
map-style DataModule names the samples of any step."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import (
    BOS,
    LengthDataset,
    RecordingModule,
    make_docs,
    pad_collate,
    planned_global_batches,
    small_corpus,
    snake_dealt,
)
from tokenizers import Tokenizer

from lightning_d9d import D9DDataModule, PretrainingDataModule
from lightning_d9d.datamodules.loss_spike import LossSpikeProvenance

SPIKE_AT = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("provenance_trainer")
    (root / "docs.json").write_text(json.dumps(make_docs(200, seed=4, max_words=20, long_every=9, long_words=60)))
    return small_corpus(root, json.loads((root / "docs.json").read_text()), row_group_size=10)


def datamodule(data: Path, tmp: Path, **changes: Any) -> PretrainingDataModule:
    options = dict(train_files=str(data / "train"), tokenizer=str(data / "tokenizer.json"), seq_len=16,
                   global_batch_size=8, microbatch_size=4, num_streams=4, steps_per_epoch=40, num_workers=0,
                   packing="bestfit_split", provenance_dir=str(tmp / "ledger"), provenance_every=10)  # fmt: skip
    options.update(changes)
    return PretrainingDataModule(**options)


def own_tokens(data: Path) -> dict[tuple[str, int, int], np.ndarray]:
    """Every document of the corpus, BOS first, tokenized here from the texts the test wrote (not by the
    DataModule), keyed by (file name, row group, row) as write_parquet laid them out: 2 files, row groups of 10."""
    docs = json.loads((data / "docs.json").read_text())
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    per_file = -(-len(docs) // 2)
    out = {}
    for i, doc in enumerate(docs):
        ids = tokenizer.encode(doc or "", add_special_tokens=False).ids
        key = (f"part-{i // per_file:03d}.parquet", i % per_file // 10, i % 10)
        out[key] = np.asarray([tokenizer.token_to_id(BOS), *ids])
    return out


def assert_pieces_are_what_trained(pieces: list[dict], trained: dict[int, np.ndarray], data: Path) -> None:
    """Each piece's tokens, from the test's own tokenization, sit where it says in the inputs the model trained
    (a piece is ``seq_len + 1`` wide: its last column is only a target)."""
    tokens = own_tokens(data)
    assert pieces
    for piece in pieces:
        rows = trained[piece["step"]]
        span = tokens[(Path(piece["file"]).name, piece["row_group"], piece["document_row"])][
            piece["start"] : piece["stop"]
        ]
        got = rows[piece["batch_row"], piece["column"] : piece["column"] + piece["length"]]
        np.testing.assert_array_equal(got, span[: len(got)], err_msg=str(piece))


class Spiking(RecordingModule):
    """A steady loss, ten times larger at one step; keeps the inputs of every step it trained."""

    def __init__(self, record_dir: str) -> None:
        super().__init__(record_dir)
        self.inputs: dict[int, list[np.ndarray]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inputs.setdefault(self.global_step, []).append(batch.input_ids.numpy().copy())
        loss = super().training_step(batch, batch_idx) * 0 + 1.0 + 0.01 * (batch_idx % 3)
        return loss * 10 if self.global_step == SPIKE_AT else loss


def test_a_loss_spike_writes_the_provenance_of_the_steps_before_it(data: Path, tmp_path: Path) -> None:
    spikes = LossSpikeProvenance(factor=3.0, window=20, steps=5, min_steps=10, dirpath=str(tmp_path / "spikes"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[spikes])  # fmt: skip
    dm, module = datamodule(data, tmp_path), Spiking(str(tmp_path / "records"))
    with pytest.warns(UserWarning, match=rf"loss spike at step {SPIKE_AT}: .* exclude_documents=.* skip_data=\[\["):
        trainer.fit(module, datamodule=dm)
    assert [step for step, _ in spikes.spikes] == [SPIKE_AT]
    lines = [json.loads(line) for line in Path(spikes.spikes[0][1]).read_text().splitlines()]
    window = range(SPIKE_AT - 4, SPIKE_AT + 1)
    assert {line["step"] for line in lines} >= set(window)
    assert {line["batch_row"] for line in lines if line["step"] in window} == set(range(8))
    # Checked against the inputs the model trained, tokenized here: every piece, the window's and those of the same
    # documents in later steps (known before they trained).
    trained = {step: np.concatenate(parts) for step, parts in module.inputs.items()}
    assert sorted(trained) == list(range(40)) and all(len(rows) == 8 for rows in trained.values())
    assert_pieces_are_what_trained([line for line in lines if line["step"] in trained], trained, data)
    # A document's tail waiting in the best-fit buffer trains after the run's last step: named all the same.
    assert all(line["step"] >= 40 for line in lines if line["step"] not in trained)
    # Every token of the window's rows is a piece the file names (padding aside): no row left out.
    pad = dm.train_spec.sources[0].pad_id
    for step in window:
        covered = np.zeros_like(trained[step], bool)
        for line in (line for line in lines if line["step"] == step):
            covered[line["batch_row"], line["column"] : line["column"] + line["length"]] = True
        assert (covered | (trained[step] == pad)).all(), step
    again = datamodule(data, tmp_path, exclude_documents=spikes.spikes[0][1])
    again.setup("fit")
    assert len(again.edits.excluded()) == len({(x["file"], x["row_group"], x["document_row"]) for x in lines})


class Hyper(Spiking):
    """A model whose hyperparameters pickle what ``torch.load(weights_only=True)`` refuses (a Namespace, a path)."""

    def __init__(self, record_dir: str, options: argparse.Namespace, where: Path) -> None:
        super().__init__(record_dir)
        self.save_hyperparameters()


def test_the_provenance_command_names_a_steps_documents_from_the_last_checkpoint_of_any_fit(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_d9d.cli import main

    # A plain Trainer.fit script (no CLI): checkpoints under <default_root_dir>/checkpoints, the ledger beside them.
    module = Hyper(str(tmp_path / "records"), argparse.Namespace(lr=0.1), tmp_path)
    trainer = pl.Trainer(accelerator="cpu", max_steps=24, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(every_n_train_steps=12, save_top_k=-1)])  # fmt: skip
    trainer.fit(module, datamodule=datamodule(data, tmp_path, provenance_dir=None, packing="concat"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch=0-step=12.ckpt",
                                                                          "epoch=0-step=24.ckpt"]  # fmt: skip
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(tmp_path / "checkpoints" / "epoch=0-step=24.ckpt", weights_only=True)
    trained = {step: np.concatenate(parts) for step, parts in module.inputs.items()}
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path)},
        "data": {"class_path": "lightning_d9d.PretrainingDataModule",
                 "init_args": {"train_files": str(data / "train"), "tokenizer": str(data / "tokenizer.json"),
                               "seq_len": 16, "global_batch_size": 8, "microbatch_size": 4, "num_streams": 4,
                               "steps_per_epoch": 40, "num_workers": 0, "packing": "concat",
                               "provenance_every": 10}},
    }))  # fmt: skip
    out = tmp_path / "steps.jsonl"
    main(["provenance", "--config", str(config), "--ckpt_path", "last", "--steps", "21:24", "--text", "--output",
          str(out)])  # fmt: skip
    assert "wrote" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {line["step"] for line in lines} == {21, 22, 23}
    assert_pieces_are_what_trained(lines, trained, data)
    docs = json.loads((data / "docs.json").read_text())
    per_file = -(-len(docs) // 2)
    for line in lines:  # the text is the document the test wrote there, the count its tokens with BOS
        index = int(Path(line["file"]).name[5:8]) * per_file + line["row_group"] * 10 + line["document_row"]
        assert line["text"] == (docs[index] or "")[:80]
        assert line["document_tokens"] == len(own_tokens(data)[(Path(line["file"]).name, line["row_group"],
                                                                line["document_row"])])  # fmt: skip
    # Printed, with the text under each piece; a folder of checkpoints works as 'last' does.
    main(["provenance", "--config", str(config), "--ckpt_path", str(tmp_path / "checkpoints"), "--steps", "22",
          "--text"])  # fmt: skip
    printed = capsys.readouterr().out
    first = next(line for line in lines if line["step"] == 22)
    assert f"step 22 row {first['batch_row']}:" in printed
    assert f"{first['document_tokens']} tokens: {json.dumps(first['text'])}" in printed
    # Past the checkpoint: refused unless asked for, and then said so.
    with pytest.raises(SystemExit):
        main(["provenance", "--config", str(config), "--ckpt_path", "last", "--steps", "23:26"])
    assert "step 25 is past what this DataModule knows the run trained" in capsys.readouterr().err
    main(["provenance", "--config", str(config), "--ckpt_path", "last", "--steps", "23:26", "--untrained"])
    assert "steps 24-25 are not trained yet" in capsys.readouterr().out
    for bad in (["--steps", "9:3"], ["--ckpt_path", str(tmp_path / "records"), "--steps", "3"]):
        with pytest.raises(SystemExit):
            main(["provenance", "--config", str(config), *bad])
    assert "no .ckpt file in" in capsys.readouterr().err


def test_a_map_style_datamodule_names_the_samples_of_any_step_on_any_layout() -> None:
    dm = D9DDataModule(LengthDataset(200), pad_collate, global_batch_size=16, microbatch_size=2, sort_buffer_size=64)
    dm.setup("fit")
    planned = planned_global_batches(LengthDataset(200).lengths, 16, 64, 0, 0)  # written out in the test
    for step in (0, 5, 11):
        named = dm.provenance(step)
        assert [len(batch) for batch in named] == [2] * 8
        assert [i for batch in named for i in batch] == planned[step], step
        for size in (1, 2, 4):
            per_rank = []
            for rank in range(size):
                batches = iter(dm.train_dataloader_for_rank(rank, size))
                for _ in range(step * 8 // size):
                    next(batches)
                per_rank.append([next(batches)["ids"].tolist() for _ in range(8 // size)])
            assert snake_dealt(per_rank) == named, (step, size)  # each microbatch in its place, on its rank
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
    assert dm.state_dict()["plan"]["edits"]["skips"] == [[7, 2]]


# ------------------------------------------------------------------------------------------------ a planted spike
PLANTED_AT = 12
SPIKE_WORD = "spikeword"


def _spike_options(corpus: Path, root: Path, **changes: Any) -> dict[str, Any]:
    options = dict(train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), seq_len=16,
                   global_batch_size=8, microbatch_size=2, num_streams=4, steps_per_epoch=40, num_workers=0,
                   packing="concat", provenance_dir=str(root / "ledger"), provenance_every=5)  # fmt: skip
    return options | changes


def _run_spike_script(config: dict[str, Any]) -> None:
    script = Path(__file__).parents[1] / "spike_script.py"
    result = subprocess.run([sys.executable, str(script), json.dumps(config)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]


def _where(piece: Any) -> tuple[str, int, int]:
    return Path(piece.file).name, piece.row_group, piece.document_row


def _trained(record_dir: Path) -> dict[int, list[tuple[int, list[list[int]]]]]:
    """Per step, the (rank, token rows) of every microbatch the model trained."""
    out: dict[int, list] = {}
    for path in sorted(record_dir.glob("records-rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], []).append((record["rank"], record["rows"]))
    return out


@pytest.mark.slow
def test_a_spike_on_rank_1_is_seen_and_its_advice_file_removes_the_planted_documents_from_every_step(
    tmp_path: Path,
) -> None:
    docs = make_docs(240, seed=11, max_words=20, long_every=9, long_words=40, empties=False)
    plain = small_corpus(tmp_path / "plain", docs, row_group_size=10)
    # Choose the documents to plant: those rank 1's rows (4..7 of 8) hold at step 12, trained in no earlier step.
    asker = PretrainingDataModule(**_spike_options(plain, tmp_path / "dry"))
    asker.setup("fit")
    pieces = asker.provenance(range(PLANTED_AT + 1), untrained=True)
    earlier = {_where(p) for p in pieces if p.step < PLANTED_AT}
    at_spike = [p for p in pieces if p.step == PLANTED_AT]
    on_rank_0 = {_where(p) for p in at_spike if p.batch_row < 4}
    chosen = {_where(p) for p in at_spike if p.batch_row >= 4} - earlier - on_rank_0
    assert chosen, "no document starts in rank 1's rows at the step chosen"
    # The corpus's own layout (write_parquet: 2 files of 120 rows, row groups of 10) names each chosen document.
    planted = [int(file[5:8]) * 120 + group * 10 + row for file, group, row in chosen]
    # Words become the spike word one for one: a word-level tokenizer gives every document its length, so packing
    # and every row's layout are unchanged, and the spike word's token marks the planted documents' tokens.
    docs = [" ".join([SPIKE_WORD] * len(doc.split())) if i in planted else doc for i, doc in enumerate(docs)]
    corpus = small_corpus(tmp_path / "corpus", docs, row_group_size=10)
    token = Tokenizer.from_file(str(corpus / "tokenizer.json")).token_to_id(SPIKE_WORD)
    assert token is not None

    first = {"record_dir": str(tmp_path / "first"), "spike_dir": str(tmp_path / "spikes"), "spike_token": token,
             "ckpt_dir": str(tmp_path / "ckpt"), "devices": 2, "max_steps": 16,
             "data": _spike_options(corpus, tmp_path)}  # fmt: skip
    _run_spike_script(first)
    trained = _trained(tmp_path / "first")
    assert sorted(trained) == list(range(16)) and all(len(trained[s]) == 4 for s in trained)
    holding = {(step, rank) for step, microbatches in trained.items() for rank, rows in microbatches
               if token in np.asarray(rows)}  # fmt: skip
    assert min(step for step, _ in holding) == PLANTED_AT
    assert {rank for step, rank in holding if step == PLANTED_AT} == {1}, "the spike is in rank 1's microbatches"
    # One file, for the spike at step 12, naming every planted document by its place in the corpus.
    files = sorted(Path(first["spike_dir"]).iterdir())
    assert [file.name for file in files] == [f"loss-spike-step-{PLANTED_AT}.jsonl"]
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    named = {_where(SimpleNamespace(**line)) for line in lines}
    assert chosen <= named
    advice = (tmp_path / "first" / "warnings.txt").read_text()
    assert advice.index("exclude_documents=") < advice.index("skip_data="), "the surgical remedy comes first"
    skip = [int(n) for n in re.search(r"skip_data=\[\[(\d+), (\d+)\]\]", advice).groups()]
    # Every step that trained a planted token lies in the range suggested (chunks after the spike included).
    assert all(skip[0] <= step < skip[1] for step, _ in holding), (skip, sorted(holding))

    # Resumed on one process from the last checkpoint before the first step the advice names, with each remedy: no
    # step trains a planted token.
    resume_at = skip[0] // 5 * 5
    assert resume_at > 0
    for name, edit in (("excluded", {"exclude_documents": str(files[0])}), ("skipped", {"skip_data": [skip]})):
        rerun = {**first, "record_dir": str(tmp_path / name), "devices": 1, "max_steps": 16,
                 "ckpt_path": str(tmp_path / "ckpt" / f"epoch=0-step={resume_at}.ckpt"),
                 "ckpt_dir": str(tmp_path / f"{name}-ckpt"), "spike_dir": str(tmp_path / f"{name}-spikes"),
                 "data": _spike_options(corpus, tmp_path, **edit)}  # fmt: skip
        _run_spike_script(rerun)
        again = _trained(tmp_path / name)
        assert sorted(again) == list(range(resume_at, 16)) and all(len(again[s]) == 4 for s in again), name
        assert not any(token in np.asarray(rows) for microbatches in again.values() for _, rows in microbatches), name
        assert not Path(rerun["spike_dir"]).exists(), f"{name}: no spike"
