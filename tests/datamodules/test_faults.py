"""Faults and bad input on the map-style and text paths: one clear error, never a silently wrong epoch.

Real parts only: real Trainer runs and checkpoints, real ``datasets`` and ``tokenizers`` files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import LengthDataset, RecordingModule, make_texts, pad_collate, read_records, train_tokenizer

from lightning_d9d import D9DDataModule, TextDataModule
from lightning_d9d.mapstyle.loader import DataLoadingError

SIZE, GLOBAL_BATCH, MICROBATCH = 96, 16, 4  # 6 steps of 4 microbatches per epoch


def make_dm(dataset: Any = None, **options: Any) -> D9DDataModule:
    settings = dict(global_batch_size=GLOBAL_BATCH, microbatch_size=MICROBATCH, sort_buffer_size=32)
    settings.update(options)
    return D9DDataModule(dataset if dataset is not None else LengthDataset(SIZE), pad_collate, **settings)


def trainer_for(root: Path, every_n_train_steps: int | None = None, max_epochs: int = 1) -> pl.Trainer:
    callbacks = []
    if every_n_train_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=root / "ckpt", filename="{step}", every_n_train_steps=every_n_train_steps, save_top_k=-1
            )
        )
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )


# ------------------------------------------------------------------- a checkpoint without the data state
class PlainLoaderModule(RecordingModule):
    """A run of the kind a user had before lightning_d9d: a plain DataLoader, accumulation set by hand."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(LengthDataset(SIZE), batch_size=MICROBATCH, collate_fn=pad_collate)


class RenamedDataModule(D9DDataModule):
    """The same DataModule under another class name: Lightning stores its state under that name."""


def checkpoint_of(root: Path, source: str) -> Path:
    """A mid-epoch checkpoint (after step 2 of 6) without a ``D9DDataModule`` entry."""
    trainer = trainer_for(root, every_n_train_steps=2)
    if source == "plain DataLoader":
        trainer.accumulate_grad_batches = GLOBAL_BATCH // MICROBATCH
        trainer.fit(PlainLoaderModule(str(root)), ckpt_path=None)
    else:
        trainer.fit(
            RecordingModule(str(root)),
            datamodule=RenamedDataModule(
                LengthDataset(SIZE), pad_collate, global_batch_size=GLOBAL_BATCH, microbatch_size=MICROBATCH
            ),
        )
    checkpoint = root / "ckpt" / "step=2.ckpt"
    assert checkpoint.exists()
    keys = torch.load(checkpoint, weights_only=False).keys()
    assert "D9DDataModule" not in keys
    return checkpoint


@pytest.mark.parametrize("source", ["plain DataLoader", "another class name"])
def test_a_mid_epoch_checkpoint_without_the_data_state_is_one_clear_error(tmp_path: Path, source: str) -> None:
    checkpoint = checkpoint_of(tmp_path / "saved", source)
    expected_key = "'RenamedDataModule'" if source == "another class name" else "'loops'"
    with pytest.raises(ValueError, match=rf"resumes epoch 0 mid-way.*'D9DDataModule'.*{expected_key}.*restart_epoch"):
        trainer_for(tmp_path / "resumed").fit(
            RecordingModule(str(tmp_path / "resumed")), datamodule=make_dm(), ckpt_path=str(checkpoint)
        )
    assert not read_records(tmp_path / "resumed"), "nothing may be trained before the error"


def test_restart_epoch_opt_in_trains_the_whole_epoch_once(tmp_path: Path) -> None:
    checkpoint = checkpoint_of(tmp_path / "saved", "plain DataLoader")
    with pytest.warns(UserWarning, match="no 'D9DDataModule' data state.*restarting epoch 0"):
        trainer_for(tmp_path / "resumed").fit(
            RecordingModule(str(tmp_path / "resumed")),
            datamodule=make_dm(on_order_mismatch="restart_epoch"),
            ckpt_path=str(checkpoint),
        )
    ids = [i for record in read_records(tmp_path / "resumed") for i in record["ids"]]
    assert len(ids) == len(set(ids)) == SIZE // GLOBAL_BATCH * GLOBAL_BATCH  # every step of epoch 0, each sample once


def test_setup_leaves_the_process_warning_filters_alone(tmp_path: Path) -> None:
    before = list(warnings.filters)
    trainer = trainer_for(tmp_path)
    trainer.fit(RecordingModule(str(tmp_path)), datamodule=make_dm())
    assert warnings.filters == before


# ------------------------------------------------------------------- errors with their context
class FailingDataset(LengthDataset):
    def __init__(self, size: int, bad: int, error: BaseException):
        super().__init__(size)
        self.bad, self.error = bad, error

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.bad:
            raise self.error
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_raises_stop_iteration_fails_the_fit_instead_of_ending_the_epoch(
    tmp_path: Path, num_workers: int
) -> None:
    dm = make_dm(FailingDataset(SIZE, bad=37, error=StopIteration()), num_workers=num_workers)
    with pytest.raises(
        Exception,
        match=r"dataset\[37\] of microbatch \[.*37.*\] \(epoch 0, step \d+, dp rank 0\) "
        r"failed: StopIteration",
    ):
        trainer_for(tmp_path).fit(RecordingModule(str(tmp_path)), datamodule=dm)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_sample_names_its_index_microbatch_and_place(num_workers: int) -> None:
    dm = make_dm(FailingDataset(SIZE, bad=11, error=KeyError("missing field 'tokens'")), num_workers=num_workers)
    dm.setup("fit")
    with pytest.raises(
        Exception,
        match=r"dataset\[11\] of microbatch \[.*\] \(epoch 0, step \d+, dp rank 0\) failed: "
        r"KeyError: .missing field 'tokens'.",
    ) as caught:
        list(dm.train_dataloader())
    if num_workers == 0:
        assert isinstance(caught.value, DataLoadingError) and isinstance(caught.value.__cause__, KeyError)


def broken_collate(samples: list[dict[str, Any]]) -> Any:
    if any(sample["id"] == 5 for sample in samples):
        raise ValueError("cannot stack ragged rows")
    return pad_collate(samples)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_collate_fn_names_the_microbatch_and_place(num_workers: int) -> None:
    dm = D9DDataModule(
        LengthDataset(SIZE),
        broken_collate,
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICROBATCH,
        num_workers=num_workers,
    )
    dm.setup("fit")
    with pytest.raises(
        Exception,
        match=r"collate_fn failed on microbatch \[.*\b5\b.*\] \(epoch 0, step \d+, dp rank 0\): "
        r"ValueError: cannot stack ragged rows",
    ) as caught:
        list(dm.train_dataloader())
    if num_workers == 0:
        assert isinstance(caught.value.__cause__, ValueError)


class LateNoneKey(LengthDataset):
    """A None sort key at one sample that the set-up probe does not reach; found when its window is sorted."""

    def sort_key(self, index: int) -> int | None:
        return None if index == 1001 else super().sort_key(index)


def test_a_none_sort_key_found_mid_epoch_names_the_sample_and_key() -> None:
    dm = make_dm(LateNoneKey(4000), global_batch_size=16, sort_buffer_size=64, shuffle=False)
    dm.setup("fit")  # the probe of 256 spread samples does not include sample 1001
    with pytest.raises(TypeError, match=r"sample 1001 has sort key None"):
        list(dm.train_dataloader())


# ------------------------------------------------------------------- TextDataModule's inputs
@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(make_texts(100), path, kind="bpe")
    return path


def test_a_text_column_of_lists_is_an_error_naming_the_column_and_its_type(tmp_path: Path, tokenizer_file: Path):
    table = pa.table({"text": [["alpha beta", "gamma"], ["delta"]] * 20})
    pq.write_table(table, tmp_path / "lists.parquet")
    dm = TextDataModule(
        dataset=str(tmp_path / "lists.parquet"),
        tokenizer=str(tokenizer_file),
        global_batch_size=4,
        microbatch_size=2,
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(
        ValueError, match=r"text_column 'text' .* has type List\(Value\('string'\)\).*must hold strings"
    ):
        dm.prepare_data()


def test_a_tokenizer_file_that_is_not_json_names_the_file_before_any_map(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": make_texts(40)}), tmp_path / "docs.parquet")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("this is not json")
    dm = TextDataModule(
        dataset=str(tmp_path / "docs.parquet"),
        tokenizer=str(bad),
        global_batch_size=4,
        microbatch_size=2,
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match=rf"tokenizer='{bad}' is not a valid tokenizers JSON file"):
        dm.prepare_data()
    assert not list((tmp_path / "cache").rglob("cache-*.arrow")), "no map may have run"


# ------------------------------------------------------------------- a data state that is malformed or contradicts
def saved_state(**changes: Any) -> dict:
    dm = make_dm()
    dm.setup("fit")
    state = dm.state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (lambda: ["epoch", 0], r"state = \['epoch', 0\]: the dict a lightning_d9d DataModule's state_dict\(\) writes"),
        (lambda: {"step": 0, "fingerprint": {}}, r"epoch = <missing>: present \(the state holds the keys \['finger"),
        (lambda: saved_state(step=True), r"step = True: a whole number >= 0"),
        (lambda: saved_state(epoch=-1), r"epoch = -1: a whole number >= 0"),
        (lambda: saved_state(step="2"), r"step = '2': a whole number >= 0"),
        (lambda: saved_state(fingerprint=[1]), r"fingerprint = \[1\]: a dict of the fields that decide the data"),
        (lambda: saved_state(step=99), r"step = 99: at most this run's 6 steps in epoch 0"),
    ],
    ids=["not-a-dict", "missing-epoch", "bool-step", "negative-epoch", "string-step", "list-fingerprint", "beyond"],
)
def test_a_malformed_data_state_is_one_error_naming_the_field(state: Any, message: str) -> None:
    dm = make_dm()
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"the checkpoint's data state is invalid: " + message):
        dm.load_state_dict(state())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch": 1}, r"epoch = 1: the checkpoint's loops are in epoch 0, so the data must be in epoch 0"),
        ({"step": 3}, r"step = 3: the checkpoint's loops completed 2 optimizer steps of epoch 0 \(global step 2\)"),
        ({"step": 1}, r"step = 1: the checkpoint's loops completed 2 optimizer steps"),
    ],
)
def test_a_data_state_contradicting_the_checkpoints_loops_is_refused(tmp_path: Path, change: dict, message: str):
    trainer_for(tmp_path / "saved", every_n_train_steps=2).fit(RecordingModule(str(tmp_path / "saved")), make_dm())
    checkpoint = torch.load(tmp_path / "saved" / "ckpt" / "step=2.ckpt", weights_only=False)
    assert (checkpoint["D9DDataModule"]["epoch"], checkpoint["D9DDataModule"]["step"]) == (0, 2)
    checkpoint["D9DDataModule"].update(change)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    with pytest.raises(ValueError, match=r"the checkpoint's data state is invalid: " + message):
        trainer_for(tmp_path / "resumed").fit(
            RecordingModule(str(tmp_path / "resumed")), datamodule=make_dm(), ckpt_path=str(tmp_path / "edited.ckpt")
        )
    assert not read_records(tmp_path / "resumed"), "nothing may be trained before the error"


def test_a_foreign_fingerprint_names_the_missing_fields_not_their_length() -> None:
    from lightning_d9d.streaming.plans.spec import CorpusFingerprint

    fingerprint = CorpusFingerprint(
        tokenizer="0", bos_id=1, packing="bestfit", seed=0, num_streams=4,
        bestfit_buffer_size=16, max_document_chars=None,
        sources=(("train", "2 files, 40 rows, sha256 0", (1, 2), "text"),),
    )  # fmt: skip
    differences = fingerprint.mismatches({"seed": 0})
    assert "packing: checkpoint <missing>, this run 'bestfit'" in differences
    assert "sources: checkpoint <missing>, this run ['train']" in differences
    assert not any("9 files" in difference for difference in differences)


@pytest.mark.parametrize("streams", [None, "not a dict", {sid: "not a stream state" for sid in range(4)}])
def test_a_malformed_part_of_a_subclass_state_is_one_error_naming_it(tmp_path: Path, streams: Any) -> None:
    from support import make_docs, write_parquet

    from lightning_d9d import PretrainingDataModule

    docs = make_docs(40, seed=1, max_words=10, long_every=9, long_words=30)
    write_parquet(tmp_path / "train", docs, files=1, row_group_size=10)
    train_tokenizer(docs, tmp_path / "tokenizer.json")

    def datamodule() -> PretrainingDataModule:
        dm = PretrainingDataModule(
            train_files=str(tmp_path / "train"), tokenizer=str(tmp_path / "tokenizer.json"), seq_len=8,
            global_batch_size=8, microbatch_size=4, num_streams=4, steps_per_epoch=3, num_workers=0,
        )  # fmt: skip
        dm.setup("fit")
        return dm

    state = {**datamodule().state_dict(), "step": 1}
    if streams is None:
        del state["streams"]
    else:
        state["streams"] = streams
    with pytest.raises(ValueError, match=r"data state is invalid: streams(\.0)? = .*: expected a dict"):
        datamodule().load_state_dict(state)
