"""Provenance: the pieces ``dm.provenance(step)`` names, re-tokenized from their documents and placed at their
columns, rebuild the step's rows bit for bit — every packing, a mixture, a CP layout, with and without the token
cache, on 1 and 2 ranks, after a resume and an elastic resume, answered from the ledger's records. Excluded
documents never come back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support import make_docs, small_corpus, small_run

from lightning_d9d import PretrainingDataModule

STEPS = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus(
        tmp_path_factory.mktemp("provenance"),
        make_docs(400, seed=9, max_words=30, long_every=7, long_words=120),
        row_group_size=25,
    )


def datamodule(corpus: Path, packing: str, world: int = 1, rank: int = 0, **changes) -> PretrainingDataModule:
    shape = dict(seq_len=[[0, 16], [5, 32]], global_batch_size=[[0, 8], [3, 16]])
    return small_run(corpus, packing, STEPS, world, rank, **(shape | changes))


def trained_rows(dms: list[PretrainingDataModule], start: int, stop: int) -> dict[int, np.ndarray]:
    """Per step, the inputs of the global batch in rank order (rank 0's microbatches, then rank 1's, ...)."""
    per_rank = []
    for dm in dms:
        batches, steps = iter(dm.train_dataloader()), {}
        for step in range(start, stop):
            parts = [next(batches).input_ids.numpy() for _ in range(dm.microbatches_at(step))]
            steps[step] = np.concatenate(parts)
        per_rank.append(steps)
        dm.close_loaders()
    return {step: np.concatenate([steps[step] for steps in per_rank]) for step in range(start, stop)}


def rebuilt_rows(dm: PretrainingDataModule, steps: range) -> dict[int, np.ndarray]:
    """The inputs of each step rebuilt from its provenance alone: every named span re-tokenized and placed."""
    pad = dm.train_spec.sources[0].pad_id
    out, documents = {}, {}
    pieces = dm.provenance(steps, untrained=True)  # rows rebuilt beside a loader, no run
    for step in steps:
        rows = np.full((dm.global_batch_size_at(step), dm.seq_len_at(step) + 1), pad, np.int64)
        for piece in (p for p in pieces if p.step == step):
            key = (piece.source, piece.file, piece.row_group, piece.document_row)
            if key not in documents:
                documents[key] = dm.document(piece)["tokens"]
            rows[piece.batch_row, piece.column : piece.column + piece.length] = documents[key][piece.start : piece.stop]
        out[step] = rows[:, :-1]
    return out


def assert_rebuilt(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for step in want:
        np.testing.assert_array_equal(got[step], want[step], err_msg=f"step {step}")


CASES = {
    "concat": {"packing": "concat"},
    "bestfit": {"packing": "bestfit"},
    "bestfit_split": {"packing": "bestfit_split"},
    "context_parallel": {"packing": "bestfit_split", "context_parallel_size": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pieces_rebuild_every_row_exactly_on_one_and_two_ranks(corpus: Path, case: str) -> None:
    options = CASES[case]
    want = trained_rows([datamodule(corpus, **options)], 0, STEPS)
    dm = datamodule(corpus, **options)
    assert_rebuilt(rebuilt_rows(dm, range(STEPS)), want)
    two = trained_rows([datamodule(corpus, world=2, rank=r, **options) for r in range(2)], 0, STEPS)
    assert_rebuilt(two, want)  # the global rows do not depend on the layout, nor does batch_row


def test_a_mixture_names_each_rows_source(corpus: Path) -> None:
    mixture = {"train_files": {"a": str(corpus / "train" / "part-000.parquet"),
                               "b": str(corpus / "train" / "part-001.parquet")},
               "weights": [[0, {"a": 3, "b": 1}], [4, {"a": 1, "b": 3}]]}  # fmt: skip
    want = trained_rows([datamodule(corpus, "bestfit_split", **mixture)], 0, STEPS)
    dm = datamodule(corpus, "bestfit_split", **mixture)
    assert_rebuilt(rebuilt_rows(dm, range(STEPS)), want)
    sources = {piece.source for piece in dm.provenance(range(STEPS), untrained=True)}
    assert sources == {"a", "b"}


@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_the_ledger_answers_a_step_by_a_short_replay_with_the_cache_and_after_an_elastic_resume(
    corpus: Path, tmp_path: Path, packing: str
) -> None:
    options = {"packing": packing, "token_cache": str(tmp_path / "cache"), "provenance_dir": str(tmp_path / "ledger"),
               "provenance_every": 3}  # fmt: skip
    first = datamodule(corpus, **options)
    batches = iter(first.train_dataloader())
    for _ in range(first.step_layout(0).before(4)):
        next(batches)
    state = first.state_dict()
    first.close_loaders()
    # A resume on two ranks from step 4: the ledger gets records at the resume and every 3 steps.
    resumed = [datamodule(corpus, world=2, rank=r, **options) for r in range(2)]
    for dm in resumed:
        dm.load_state_dict(state)
    want = trained_rows(resumed, 4, STEPS)
    records = sorted(int(path.name) for path in (tmp_path / "ledger").iterdir())
    assert records == [3, 4, 6, 9], records  # every 3 steps, and at the resume (step 0 is no record: the start)
    asker = datamodule(corpus, **options)
    starts = asker.ledger.replay_starts(8, asker.train_spec, asker.position)
    assert {first for first, _ in starts.values()} == {6}, "every stream replays from the record at step 6"
    assert_rebuilt(rebuilt_rows(asker, range(4, STEPS)), want)


def test_excluded_documents_never_come_back_and_only_their_streams_change(corpus: Path, tmp_path: Path) -> None:
    dm = datamodule(corpus, "bestfit_split")
    full = trained_rows([dm], 0, STEPS)
    pieces = datamodule(corpus, "bestfit_split").provenance(range(2, 6), untrained=True)
    # Exclude the documents of one stream's rows of step 4 (stream 0: rows 0..3 of G=16).
    chosen = sorted(
        {(p.source, p.file, p.row_group, p.document_row) for p in pieces if p.step == 4 and p.batch_row < 4}
    )
    refs = tmp_path / "exclude.jsonl"
    refs.write_text("".join(json.dumps(list(ref)) + "\n" for ref in chosen))
    first = datamodule(corpus, "bestfit_split")
    batches = iter(first.train_dataloader())
    for _ in range(first.step_layout(0).before(2)):
        next(batches)
    state = first.state_dict()
    first.close_loaders()
    resumed = datamodule(corpus, "bestfit_split", exclude_documents=str(refs))
    resumed.load_state_dict(state)
    after = trained_rows([resumed], 2, STEPS)
    seen = {(p.source, p.file, p.row_group, p.document_row) for p in resumed.provenance(range(2, STEPS))}
    assert not seen & set(chosen), "an excluded document is trained again"
    assert resumed.stream_stats()["excluded"] >= len(chosen) - 1
    assert resumed.source_stats()["train"]["excluded"] == resumed.stream_stats()["excluded"]
    # Before the resume the documents were trained: the provenance of those steps names them as it did.
    before = [p for p in resumed.provenance(range(0, 5)) if p.step < 2]
    assert before == [p for p in datamodule(corpus, "bestfit_split").provenance(range(0, 2), untrained=True)]
    # Replayed from the start, the exclusion applies where the run resumed: the rows after it rebuild exactly.
    replayed = datamodule(corpus, "bestfit_split", exclude_documents=str(refs))
    replayed.edits = resumed.edits
    assert_rebuilt(rebuilt_rows(replayed, range(2, 6)), {step: after[step] for step in range(2, 6)})
    rows_per_stream = {step: len(full[step]) // 4 for step in full}
    for step in range(2, STEPS):  # streams 1..3 held none of them: their rows are the uninterrupted run's
        r = rows_per_stream[step]
        np.testing.assert_array_equal(after[step][r:], full[step][r:], err_msg=f"step {step}")
    assert any(not np.array_equal(after[s][: rows_per_stream[s]], full[s][: rows_per_stream[s]]) for s in range(4, 8))


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        (["nope", "part-000.parquet", 0, 0], r"no source 'nope' \(the sources: \['train'\]\)"),
        (["train", "part-009.parquet", 0, 0], r"source 'train' holds no file 'part-009.parquet'"),
        (["train", "part-000.parquet", 99, 0], r"'part-000.parquet' has 8 row groups \(0..7\)"),
        (["train", "part-000.parquet", 0, 999], r"row group 0 of 'part-000.parquet' has 25 rows \(0..24\)"),
        (["train", "part-000.parquet", -1, 0], r"exclude_documents\[0\] = .* is not a document reference"),
    ],
)
def test_a_bad_reference_is_one_clear_error(corpus: Path, reference: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        datamodule(corpus, "concat", exclude_documents=[reference])


def test_provenance_of_a_negative_step_or_a_replay_too_long_is_refused(corpus: Path) -> None:
    dm = datamodule(corpus, "concat")
    with pytest.raises(ValueError, match=r"steps=-1: -1 is not a step; give global optimizer steps, integers >= 0"):
        dm.provenance(-1, untrained=True)
    with pytest.raises(ValueError, match=r"would replay 7 steps \(more than max_replay=5\)"):
        dm.provenance(7, max_replay=5, untrained=True)
    assert dm.provenance(0, untrained=True)[0].start == 0


@pytest.mark.parametrize("bad", [True, np.bool_(True), torch.tensor(True), 1.5, "3", [2, False], []])
def test_a_step_that_is_no_integer_is_refused(corpus: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=r"steps=.*(is not a step|no steps given); give global optimizer steps"):
        datamodule(corpus, "concat").provenance(bad, untrained=True)


def test_any_integer_type_names_the_same_step_and_untrained_steps_need_asking(corpus: Path) -> None:
    dm = datamodule(corpus, "concat")
    want = trained_rows([datamodule(corpus, "concat")], 0, 4)
    batches = iter(dm.train_dataloader())
    for _ in range(dm.step_layout(0).before(3)):
        next(batches)
    dm.close_loaders()
    assert dm.trained_until() == 3
    plain = dm.provenance(2)
    assert plain and {p.step for p in plain} == {2}
    for same in (np.int64(2), np.int32(2), torch.tensor(2), [np.uint8(2)], range(2, 3), torch.tensor([2])):
        assert dm.provenance(same) == plain, same
    with pytest.raises(ValueError, match=r"step 3 is past what this DataModule knows the run trained \(steps before 3"):
        dm.provenance(range(2, 4))
    # Asked for explicitly, a step not trained yet is the one the loader goes on to give.
    assert_rebuilt(rebuilt_rows(dm, range(2, 4)), {step: want[step] for step in (2, 3)})


def _spoil(path: Path, how: str, other: Path) -> None:
    payload = path.read_bytes()
    if how == "truncated":
        path.write_bytes(payload[: len(payload) // 2])
    elif how == "bit_flipped":
        middle = len(payload) // 3  # inside the compressed data of a member: the zip's CRC no longer matches
        path.write_bytes(payload[:middle] + bytes([payload[middle] ^ 0x10]) + payload[middle + 1 :])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # another step's record of the same stream copied over this one
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("how", ["truncated", "bit_flipped", "empty", "copied"])
def test_a_spoiled_ledger_record_is_passed_over_like_a_missing_one(corpus: Path, tmp_path: Path, how: str) -> None:
    options = {"packing": "bestfit_split", "provenance_dir": str(tmp_path / "ledger"), "provenance_every": 3}
    dm = datamodule(corpus, **options)
    want = trained_rows([dm], 0, STEPS)  # records at steps 3, 6, 9
    record = tmp_path / "ledger" / f"{6:012d}" / "0.npz"
    _spoil(record, how, tmp_path / "ledger" / f"{3:012d}" / "0.npz")
    asker = datamodule(corpus, **options)
    starts = asker.ledger.replay_starts(7, asker.train_spec, asker.position)
    assert starts[0][0] == 3 and {starts[s][0] for s in (1, 2, 3)} == {6}, "stream 0 replays from step 3 instead"
    assert_rebuilt(rebuilt_rows(asker, range(7, 9)), {step: want[step] for step in (7, 8)})
    assert asker.trained_until() == 9


def test_a_datamodule_without_the_runs_edits_refuses_and_one_with_its_checkpoint_answers(
    corpus: Path, tmp_path: Path
) -> None:
    options = {"packing": "bestfit_split", "provenance_dir": str(tmp_path / "ledger"), "provenance_every": 3}
    first = datamodule(corpus, **options)
    batches = iter(first.train_dataloader())
    for _ in range(first.step_layout(0).before(2)):
        next(batches)
    state = first.state_dict()
    first.close_loaders()
    resumed = datamodule(corpus, skip_data=[[2, 4]], **options)
    resumed.load_state_dict(state)
    want = trained_rows([resumed], 2, STEPS)
    checkpoint = resumed.state_dict()
    # Built without the run's skip_data, no checkpoint: the records of step 2 on are of other edits.
    plain = datamodule(corpus, **options)
    assert len(plain.provenance(1, untrained=True)) > 0, "before the skip, records of its edits are not needed"
    with pytest.raises(
        ValueError,
        match=r"ledger record of step \d+ was written under other data edits \(skip: "
        r"step 2 trains what step 4 would have.*\) than this DataModule's \(none\).*--ckpt_path",
    ):
        plain.provenance(5)
    # With the run's checkpoint (its edits and position), the answer is the rows the run trained.
    restored = datamodule(corpus, **options)
    restored.load_state_dict(checkpoint)
    assert_rebuilt(rebuilt_rows(restored, range(2, STEPS)), want)


def test_exclude_documents_takes_the_commands_parquet_and_the_pieces_and_refuses_an_unreadable_file(
    corpus: Path, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pieces = datamodule(corpus, "concat").provenance(range(0, 2), untrained=True)
    named = {(p.source, p.file, p.row_group, p.document_row) for p in pieces}
    parquet = tmp_path / "steps.parquet"
    pq.write_table(pa.Table.from_pylist([p.to_dict() for p in pieces]), parquet)
    for given in (str(parquet), pieces, [p.to_dict() for p in pieces]):
        dm = datamodule(corpus, "concat", exclude_documents=given)
        dm.setup("fit")
        assert {tuple(ref.to_list()) for ref in dm.edits.excluded()} == named
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "bad.parquet").write_text("not parquet")
    for path in (tmp_path / "binary.jsonl", tmp_path / "bad.parquet", tmp_path / "missing.jsonl"):
        with pytest.raises(ValueError, match=rf"exclude_documents='{path}': cannot read it"):
            datamodule(corpus, "concat", exclude_documents=str(path)).setup("fit")


def test_a_ledger_record_round_trips_a_state_of_several_arrays() -> None:
    from lightning_d9d.streaming.provenance.ledger import decode, encode

    state = {"step": 7, "sources": {"a": {"buffer": np.arange(12).reshape(3, 4), "next": 3},
                                    "b": {"buffer": np.zeros((0, 8), np.int64), "kind": "bestfit"}}}  # fmt: skip
    back, lineage = decode(encode(state, "abc"))
    assert lineage == "abc" and back["step"] == 7 and back["sources"]["b"]["kind"] == "bestfit"
    np.testing.assert_array_equal(back["sources"]["a"]["buffer"], state["sources"]["a"]["buffer"])
    assert back["sources"]["b"]["buffer"].shape == (0, 8)
    with pytest.raises(ValueError, match="not a stream ledger record"):
        decode(b"not an npz")


def test_after_a_rollback_under_other_batch_phases_queries_answer_the_continuation_not_the_abandoned_run(
    corpus: Path, tmp_path: Path
) -> None:
    ledger = {"packing": "bestfit_split", "provenance_dir": str(tmp_path / "ledger"), "provenance_every": 3}
    abandoned = datamodule(corpus, **ledger)
    batches = iter(abandoned.train_dataloader())
    for _ in range(abandoned.step_layout(0).before(4)):
        next(batches)
    state = abandoned.state_dict()  # the checkpoint the run is rolled back to
    abandoned.close_loaders()
    abandoned_rows = trained_rows([datamodule(corpus, "bestfit_split")], 0, STEPS)
    abandoned = datamodule(corpus, **ledger)
    trained_rows([abandoned], 0, STEPS)  # the abandoned run goes on to step 10: records at 3, 6 and 9
    # The continuation resumes at step 4 with another batch ramp, under on_mixture_change="continue".
    changed = {"global_batch_size": [[0, 8], [3, 16], [6, 8]], "on_mixture_change": "continue"}
    reference = datamodule(corpus, "bestfit_split", **changed)  # no ledger: the continuation's own rows
    reference.load_state_dict(state)
    want = trained_rows([reference], 4, STEPS)
    continuation = datamodule(corpus, **(ledger | changed))
    continuation.load_state_dict(state)
    batches = iter(continuation.train_dataloader())
    for step in range(4, 7):  # trains to step 7: records at 4 (the resume) and 6 replace the abandoned ones
        for _ in range(continuation.microbatches_at(step)):
            next(batches)
    continuation.close_loaders()
    assert sorted(int(p.name) for p in (tmp_path / "ledger").iterdir()) == [3, 4, 6, 9]
    assert continuation.trained_until() == 7, "the abandoned run's record of step 9 is not this run's"
    assert_rebuilt(rebuilt_rows(continuation, range(4, STEPS)), want)  # step 9 not from the abandoned record
    with pytest.raises(ValueError, match=r"step 2 was trained before this run resumed at step 4 with other weights"):
        continuation.provenance(2)
    # The abandoned run's own DataModule still answers its steps, from its own records where they remain.
    assert_rebuilt(rebuilt_rows(abandoned, range(6, STEPS)), {s: abandoned_rows[s] for s in range(6, STEPS)})
