"""Skipping data: resumed before ``a`` with ``skip_data=[[a, b]]``, step ``a`` trains what step ``b`` would have,
every other step the uninterrupted run's (shifted), on any layout; the skip is recorded, so later resumes keep it;
bad ranges are one clear error each."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import (
    make_docs,
    ranked_rows,
    small_corpus,
    small_run,
    step_rows,
)

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.plans.edits import DataEdits, DocumentRef

STEPS = 14


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus(
        tmp_path_factory.mktemp("skip"),
        make_docs(300, seed=8, max_words=30, long_every=9, long_words=90),
        row_group_size=20,
    )


def datamodule(corpus: Path, packing: str, world: int = 1, rank: int = 0, **changes) -> PretrainingDataModule:
    shape = dict(seq_len=[[0, 16], [6, 24]], global_batch_size=[[0, 8], [4, 16]])
    return small_run(corpus, packing, STEPS, world, rank, **(shape | changes))


def global_run(corpus: Path, packing: str, world: int, start: int, stop: int, state=None, **changes):
    parts = []
    for rank in range(world):
        dm = datamodule(corpus, packing, world, rank, **changes)
        if state is not None:
            dm.load_state_dict(state)
        parts.append(step_rows(dm, stop, start))
    return [ranked_rows(rows) for rows in zip(*parts, strict=True)], dm


def state_at(corpus: Path, packing: str, step: int, **changes) -> dict:
    dm = datamodule(corpus, packing, **changes)
    batches = iter(dm.train_dataloader())
    for _ in range(dm.step_layout(0).before(step)):
        next(batches)
    state = dm.state_dict()
    dm.close_loaders()
    return state


@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_a_skipped_range_is_never_trained_and_every_later_step_is_shifted(corpus: Path, packing: str) -> None:
    full, _ = global_run(corpus, packing, 1, 0, STEPS)
    state = state_at(corpus, packing, 2)
    # Skip the data of steps 3-4 (G changes at 4, seq_len at 6: the shifted steps take their data step's shape).
    for world in (1, 2):
        got, dm = global_run(corpus, packing, world, 2, 10, state, skip_data=[[3, 5]])
        assert got[0] == full[2], "the step before the skip is the uninterrupted run's"
        assert got[1:] == full[5:12], f"step 3 onward trains what step 5 onward would have ({world} ranks)"
        assert dm.data_step(3) == 5 and dm.global_batch_size_at(3) == 16 and dm.seq_len_at(4) == 24
    # The skip is recorded: a later resume (another layout, without the setting) keeps it.
    later = state_at(corpus, packing, 6, skip_data=[[3, 5]]) if packing == "concat" else None
    if later is not None:
        assert later["plan"]["edits"]["skips"] == [[3, 2]]
        again, _ = global_run(corpus, packing, 2, 6, 9, later)
        assert again == full[8:11]


def test_two_skips_and_one_asked_again_on_a_later_resume(corpus: Path) -> None:
    full, _ = global_run(corpus, "concat", 1, 0, STEPS)
    first = state_at(corpus, "concat", 1)
    dm = datamodule(corpus, "concat", skip_data=[[2, 3], [5, 7]])
    dm.load_state_dict(first)
    assert [dm.data_step(s) for s in range(8)] == [0, 1, 3, 4, 5, 8, 9, 10]
    got = step_rows(dm, 8, 1)
    assert got == [full[d] for d in (1, 3, 4, 5, 8, 9, 10)]
    state = dm.state_dict()
    assert state["plan"]["edits"]["skips"] == [[2, 1], [5, 2]]
    resumed = datamodule(corpus, "concat", skip_data=[[2, 3], [5, 7]])  # asked again: recorded already, no change
    resumed.load_state_dict(state)
    assert resumed.edits == dm.edits


@pytest.mark.parametrize(
    ("skip_data", "message"),
    [
        ([[5, 5]], r"skip_data\[0\] = \[5, 5\] is not a range of optimizer steps: give \[start, stop\)"),
        ([[-1, 3]], r"skip_data\[0\] = \[-1, 3\] is not a range"),
        ([[2, 4], [3, 6]], r"skip_data ranges \[2, 4\] and \[3, 6\] overlap"),
        ("3:5", r"skip_data='3:5' is not valid: give ranges"),
        ([[1, 3]], r"skip_data range \[1, 3\) starts before the resumed step 2: its data was trained already"),
    ],
)
def test_a_bad_skip_is_one_clear_error(corpus: Path, skip_data, message: str) -> None:
    state = state_at(corpus, "concat", 2)
    with pytest.raises(ValueError, match=message):
        datamodule(corpus, "concat", skip_data=skip_data).load_state_dict(state)


def test_edits_round_trip_and_name_their_lineage() -> None:
    ref = DocumentRef("web", "a.parquet", 2, 7)
    edits = DataEdits().with_new(0, [[10, 15]], []).with_new(12, [[20, 25]], [ref])
    assert edits.skips == ((10, 5), (20, 5)) and edits.data_step(21) == 31
    assert edits.skipped_data() == ((10, 15), (25, 30))
    assert DataEdits.from_dict(edits.to_dict()) == edits
    assert edits.lineage(9) == DataEdits().lineage(9) != edits.lineage(10) != edits.lineage(12)
    assert edits.excluded(11) == frozenset() and edits.excluded(12) == {ref}
    with pytest.raises(ValueError, match=r"exclude_documents\[0\] = \['web', 'a.parquet', -1, 7\] is not a document"):
        DocumentRef.of(["web", "a.parquet", -1, 7])


def test_a_skip_past_the_runs_end_is_refused_at_fit_start(corpus: Path, tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from support import RecordingModule

    dm = PretrainingDataModule(
        train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), seq_len=16,
        global_batch_size=8, microbatch_size=4, num_streams=4, steps_per_epoch=10, num_workers=0,
        skip_data=[[6, 9]], provenance_dir=str(tmp_path / "ledger"),
    )  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"skip_data range \[6, 9\) starts at or after the run's last step \(5\)"):
        trainer.fit(RecordingModule(str(tmp_path / "records")), datamodule=dm)
