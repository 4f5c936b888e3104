"""Global batch size and seq_len in phases: the schedule itself, packers carried over to a new row length, and the
streams of a PretrainingDataModule through every boundary (exactly once, the same on any layout, exact resume).

Packer tests give every token a value naming its document and position (as test_bestfit_split does), so every row
can be parsed back into the pieces it holds; stream tests run real text through a real tokenizer.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import (
    make_docs,
    ranked_rows,
    small_corpus,
    small_run,
    step_rows,
)

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.packing.rows import NO_TARGET, START
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.plans.shape import ShapeSchedule, StepValues

PAD = 1
STRIDE = 100_000


def make_doc(i: int, length: int) -> np.ndarray:
    return (10 + i * STRIDE + np.arange(length)).astype(np.int32)


def decode(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (tokens - 10) // STRIDE, (tokens - 10) % STRIDE


# ------------------------------------------------------------------------------------------------ the schedule
def test_a_number_and_phases_by_step() -> None:
    shapes = ShapeSchedule([[0, 8], [100, 16], [250, 32]], [[0, 128], [200, 512]])
    assert shapes.at(0).global_batch_size == 8 and shapes.at(99).global_batch_size == 8
    assert (shapes.at(100).global_batch_size, shapes.at(199).seq_len) == (16, 128)
    assert (shapes.at(200).global_batch_size, shapes.at(200).seq_len) == (16, 512)
    assert shapes.at(10**9).global_batch_size == 32 and shapes.max_seq_len == 512
    assert shapes.boundaries == [0, 100, 200, 250]
    assert shapes.tokens_before(101) == 100 * 8 * 128 + 16 * 128
    assert ShapeSchedule(64, 1024).fixed and not shapes.fixed
    assert ShapeSchedule.from_dict(shapes.to_dict()) == shapes
    assert shapes.describe()[0] == "steps 0-99: global_batch_size 8, seq_len 128"


def test_batch_size_phases_by_tokens_start_at_the_first_step_after_that_many_tokens() -> None:
    # Megatron's spelling: the batch doubles once 1000 positions were trained, again at 5000.
    shapes = ShapeSchedule(
        [{"from_tokens": 0, "value": 4}, {"from_tokens": 1000, "value": 8}, {"from_tokens": 5000, "value": 16}],
        [[0, 10], [30, 20]],
    )
    starts = shapes.global_batch_sizes.starts
    for start, threshold in zip(starts[1:], (1000, 5000)):
        assert shapes.tokens_before(start) >= threshold > shapes.tokens_before(start - 1)
    assert shapes.to_dict()["global_batch_size"] == [[0, 4], [25, 8], [53, 16]]
    # A threshold crossed within a stretch of another seq_len counts that stretch's positions.
    assert shapes.tokens_before(30) == 25 * 40 + 5 * 80


@pytest.mark.parametrize(
    ("global_batch_size", "seq_len", "message"),
    [
        ([[0, 8], [0, 16]], 32, r"strictly increasing from_step: 0 follows 0 \(phases from \[0, 0\]\)"),
        ([[5, 8]], 32, r"global_batch_size: the first phase must start at 0, got 5"),
        ([[0, 8], [10, 0]], 32, r"global_batch_size phase 1 \(from_step 10\): the value 0 must be a positive integer"),
        (8, [[0, 32], [10, -4]], r"seq_len phase 1 \(from_step 10\): the value -4 must be a positive integer"),
        (8, [{"from_tokens": 0, "value": 32}], r"only global_batch_size may use from_tokens"),
        ([[0, 8], {"from_tokens": 100, "value": 16}], 32, r"mix from_step and from_tokens"),
        ([[0, 8], [10]], 32, r"phase 1 of global_batch_size is \[10\]: a phase is \[from_step, value\]"),
        ("eight", 32, r"global_batch_size='eight' is not valid"),
        ([[0, 8], [-3, 16]], 32, r"from_step=-3 must be an integer >= 0"),
        (
            [{"from_tokens": 0, "value": 8}, {"from_tokens": 10, "value": 16}, {"from_tokens": 20, "value": 32}],
            32,
            r"the phase from 20 tokens would start at step 1, where the phase before it starts",
        ),
    ],
)
def test_a_bad_schedule_is_one_error_naming_the_phase(global_batch_size, seq_len, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShapeSchedule(global_batch_size, seq_len)


# ------------------------------------------------------------------------------------------------ packers
def feeder(docs: list[np.ndarray], packer: BestFitPacker, hold: int | None = None):
    cursor = [0]

    def refill() -> None:
        i = cursor[0]
        doc = docs[i]
        if packer.split:
            packer.add(doc, (i, 0))
        else:
            packer.add(doc[: packer.hold], len(doc), (i, 0))
        cursor[0] += 1

    return refill, cursor


def fetcher(docs: list[np.ndarray]):
    return lambda row, need: docs[int(row[2])][int(row[4]) :][:need]


CAPACITIES = [64, 64, 33, 33, 33, 101, 17, 17, 64, 129, 9, 9, 64]


def test_bestfit_split_carries_every_token_over_each_new_row_length_exactly_once() -> None:
    rng = np.random.default_rng(3)
    lengths = np.where(rng.random(4000) < 0.6, rng.integers(1, 70, 4000), rng.integers(70, 400, 4000))
    docs = [make_doc(i, int(n)) for i, n in enumerate(lengths)]
    packer = BestFitSplitPacker(CAPACITIES[0], PAD, 48)
    refill, cursor = feeder(docs, packer)
    seen: Counter = Counter()
    shared = 0  # rows where a piece cut at a shorter length is followed by another piece
    for block, capacity in enumerate(CAPACITIES * 4):
        packer.reshape(capacity)
        tokens, flags = packer.take(int(rng.integers(1, 6)), refill)
        assert tokens.shape[1] == capacity
        for r, row in enumerate(tokens):
            starts, open_end = [*np.flatnonzero(flags[r] & START).tolist(), capacity], False
            for a, b in itertools.pairwise(starts):
                if row[a] == PAD and flags[r, a] & NO_TARGET:
                    assert b == capacity, f"block {block} row {r}: padding inside a row"
                    continue
                doc, pos = decode(row[a:b])
                assert (doc == doc[0]).all() and (np.diff(pos) == 1).all(), f"block {block} row {r}: a torn piece"
                # A piece's first token is the target of the token before it only where that token ends its own
                # document (a whole document's or a final piece's last token predicts the next BOS).
                assert bool(flags[r, a] & NO_TARGET) == bool(pos[0] > 0 or open_end), f"block {block} row {r}"
                assert not (flags[r, a + 1 : b] & (START | NO_TARGET)).any()
                shared += open_end
                open_end = int(pos[-1]) + 1 < len(docs[int(doc[0])])
                seen.update(zip(doc.tolist(), pos.tolist()))
    assert shared > 0, "the test never met a piece cut at a shorter length sharing a longer row"
    assert max(seen.values()) == 1, "a token trained twice"
    buffered = Counter()
    for row in packer.snapshot():
        piece = docs[int(row[2])][int(row[4]) : int(row[4]) + int(row[1])]
        buffered.update(zip(*(part.tolist() for part in decode(piece))))
    added = Counter((i, p) for i in range(cursor[0]) for p in range(len(docs[i])))
    assert seen + buffered == added, "every token of every document added is emitted or still buffered, once"


@pytest.mark.parametrize("split", [False, True])
def test_a_new_row_length_gives_the_rows_a_resume_there_gives(split: bool) -> None:
    """The running packer carried over to a new length (tokens in memory) and a packer restored there from the saved
    rows (tokens fetched) pack the same rows and hold the same buffer afterwards."""
    rng = np.random.default_rng(7)
    docs = [make_doc(i, int(n)) for i, n in enumerate(rng.integers(1, 300, 3000))]
    hold = max(CAPACITIES)

    def packer(capacity: int) -> BestFitPacker:
        return BestFitSplitPacker(capacity, PAD, 24) if split else BestFitPacker(capacity, 24, hold=hold)

    whole = packer(CAPACITIES[0])
    refill, cursor = feeder(docs, whole)
    outputs, states = [], []
    for capacity in CAPACITIES:
        states.append((whole.snapshot(), whole.next_seq, whole.counters.copy(), whole.rows_taken, cursor[0]))
        whole.reshape(capacity)
        outputs.append(whole.take(3, refill))
    for boundary in range(1, len(CAPACITIES)):
        meta, next_seq, counters, rows_taken, at = states[boundary]
        resumed = packer(CAPACITIES[boundary])
        resumed.counters, resumed.rows_taken = counters.copy(), rows_taken
        resumed.reset(meta, next_seq, fetcher(docs))
        again, again_at = feeder(docs, resumed)
        again_at[0] = at
        for later in range(boundary, len(CAPACITIES)):
            resumed.reshape(CAPACITIES[later])
            got = resumed.take(3, again)
            for x, y in zip(got, outputs[later], strict=True):
                np.testing.assert_array_equal(x, y, err_msg=f"resumed at {boundary}, block {later}")
        np.testing.assert_array_equal(resumed.snapshot(), whole.snapshot())
        assert resumed.counters == whole.counters


def test_bestfit_rows_are_document_prefixes_at_every_length() -> None:
    rng = np.random.default_rng(11)
    docs = [make_doc(i, int(n)) for i, n in enumerate(rng.integers(1, 200, 2000))]
    packer = BestFitPacker(CAPACITIES[0], 16, hold=max(CAPACITIES))
    refill, _ = feeder(docs, packer)
    used: Counter = Counter()
    for capacity in CAPACITIES * 3:
        packer.reshape(capacity)
        tokens, _ = packer.take(2, refill)
        for row in tokens:
            doc, pos = decode(row)
            cuts = np.flatnonzero(pos == 0).tolist()
            assert cuts[0] == 0, "a bestfit row starts at a document's BOS"
            for a, b in itertools.pairwise([*cuts, capacity]):
                assert (doc[a:b] == doc[a]).all() and (pos[a:b] == np.arange(b - a)).all()
                used[int(doc[a])] += 1
    assert max(used.values()) == 1, "a document trained twice"


def test_a_packer_refuses_rows_longer_than_what_it_holds() -> None:
    packer = BestFitPacker(16, 4, hold=32)
    with pytest.raises(ValueError, match="rows of 64 tokens need documents' prefixes of as many, this packer keeps 32"):
        packer.reshape(64)
    with pytest.raises(ValueError, match="cp_multiple=4 must divide seq_len=9"):
        BestFitSplitPacker(17, PAD, 4, cp_multiple=4).reshape(10)


# ------------------------------------------------------------------------------------------------ the plan
@st.composite
def ramps(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    weights = {name: draw(st.integers(1, 9)) for name in names}
    starts = sorted(draw(st.sets(st.integers(1, 60), max_size=3)))
    sizes = [draw(st.sampled_from([8, 16, 24, 64])) for _ in range(len(starts) + 1)]
    return MixtureSchedule(names, weights), StepValues((0, *starts), tuple(sizes))


@settings(max_examples=40, deadline=None)
@given(ramps())
def test_a_plan_takes_each_steps_global_batch_and_stays_within_a_row_of_its_targets(case) -> None:
    schedule, sizes = case
    plan = MixturePlan(schedule, sizes)
    for step in range(80):
        quota = plan.rows_of_step(step)
        assert sum(quota) == sizes.at(step) and min(quota) >= 0
        taken = plan.cumulative_rows(step + 1)
        assert all(abs(t - float(w)) < 1 for t, w in zip(taken, plan.target_rows(step + 1), strict=True))
        assert [sum(row) for row in plan.stream_rows_of_step(step, 8)] == [sizes.at(step) // 8] * 8
    assert MixturePlan.from_dict(plan.to_dict()).cumulative_rows(80) == plan.cumulative_rows(80)


# ------------------------------------------------------------------------------------------------ streams
SEQ_LENS = [[0, 16], [3, 32], [6, 8]]
SIZES = [[0, 8], [2, 16], [5, 8]]
STEPS = 9


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus(
        tmp_path_factory.mktemp("shapes"),
        make_docs(300, seed=5, max_words=30, long_every=9, long_words=90),
        row_group_size=20,
    )


def datamodule(corpus: Path, packing: str, world: int = 1, rank: int = 0, **changes) -> PretrainingDataModule:
    shape = dict(seq_len=SEQ_LENS, global_batch_size=SIZES)
    return small_run(corpus, packing, STEPS, world, rank, **(shape | changes))


def global_steps(corpus: Path, packing: str, world: int, start: int = 0, state: dict | None = None, **changes):
    """The rows of every step over ``world`` simulated data-parallel ranks, in order: rank 0's rows, then rank 1's,
    ... (each rank the same number of rows, so a row's place also says which rank trained it)."""
    per_rank = []
    for rank in range(world):
        dm = datamodule(corpus, packing, world, rank, **changes)
        if state is not None:
            dm.load_state_dict(state)
        per_rank.append(step_rows(dm, STEPS, start))
    return [ranked_rows(parts) for parts in zip(*per_rank, strict=True)]


def state_at(corpus: Path, packing: str, step: int, **changes) -> dict:
    dm = datamodule(corpus, packing, **changes)
    batches = iter(dm.train_dataloader())
    for _ in range(dm.step_layout(0).before(step)):
        next(batches)
    state = dm.state_dict()
    dm.close_loaders()
    return state


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_one_two_and_four_ranks_train_the_same_global_batches_through_every_phase(corpus: Path, packing: str) -> None:
    one = global_steps(corpus, packing, 1)
    assert [len(rows) for rows in one] == [8, 8, 16, 16, 16, 8, 8, 8, 8]
    assert global_steps(corpus, packing, 2) == one
    assert global_steps(corpus, packing, 4) == one


@pytest.mark.parametrize(("packing", "cached"), [("concat", False), ("bestfit", False), ("bestfit_split", True)])
def test_a_resume_before_at_and_after_every_boundary_is_exact_on_the_same_and_another_layout(
    corpus: Path, tmp_path: Path, packing: str, cached: bool
) -> None:
    changes = {"token_cache": str(tmp_path / "cache")} if cached else {}
    full = global_steps(corpus, packing, 1, **changes)
    for step in (1, 2, 3, 5, 6, 7):  # before and at the G boundaries 2, 5 and the seq_len boundaries 3, 6
        state = state_at(corpus, packing, step, **changes)
        assert global_steps(corpus, packing, 1, step, state, **changes) == full[step:], step
        assert global_steps(corpus, packing, 2, step, state, **changes) == full[step:], step


def test_a_mixture_switch_and_a_length_change_at_one_step_stay_exact_and_elastic(corpus: Path) -> None:
    mixture = dict(
        train_files={"a": str(corpus / "train" / "part-000.parquet"), "b": str(corpus / "train" / "part-001.parquet")},
        weights=[[0, {"a": 1, "b": 1}], [3, {"a": 1, "b": 3}]],
    )
    full = global_steps(corpus, "bestfit_split", 1, **mixture)
    assert global_steps(corpus, "bestfit_split", 2, **mixture) == full
    for step in (2, 3, 4):
        state = state_at(corpus, "bestfit_split", step, **mixture)
        assert global_steps(corpus, "bestfit_split", 2, step, state, **mixture) == full[step:], step


def full_rows(dm: PretrainingDataModule, stop: int, start: int = 0) -> list[list[np.ndarray]]:
    """Concat's rows of each of the rank's streams (inputs and the last target: the whole packed row), in order."""
    batches, streams = iter(dm.train_dataloader()), [[] for _ in dm.owned_streams]
    for step in range(start, stop):
        rows = []
        for _ in range(dm.microbatches_at(step)):
            batch = next(batches)
            rows += [np.concatenate([batch.input_ids[i, :1].numpy(), batch.targets[i].numpy()]) for i in range(2)]
        per_stream = len(rows) // len(streams)
        for k, stream in enumerate(streams):
            stream.extend(rows[k * per_stream : (k + 1) * per_stream])
    dm.close_loaders()
    return streams


def test_a_streams_row_length_holds_over_the_span_its_spec_gives(corpus: Path) -> None:
    spec = datamodule(corpus, "concat").train_spec
    spans = [spec.capacity_span(step) for step in range(12)]
    assert spans[:7] == [(17, 3), (17, 3), (17, 3), (33, 6), (33, 6), (33, 6), (9, math.inf)]
    assert all(capacity == spec.capacity_at(step) for step, (capacity, _) in enumerate(spans))


def test_concat_cuts_the_same_token_stream_whatever_the_shapes(corpus: Path) -> None:
    """Every stream's rows, joined, are one and the same token sequence at any shapes: nothing is dropped or
    repeated at a boundary, and a partly packed row carries over."""
    scheduled = full_rows(datamodule(corpus, "concat"), STEPS)
    fixed = full_rows(datamodule(corpus, "concat", seq_len=24, global_batch_size=8, steps_per_epoch=12), 12)
    for a, b in zip(scheduled, fixed, strict=True):
        a, b = np.concatenate(a), np.concatenate(b)
        common = min(len(a), len(b))
        assert common > 500
        np.testing.assert_array_equal(a[:common], b[:common])


def test_bad_schedules_in_a_datamodule_name_the_phase_and_what_is_valid(corpus: Path) -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=12 \(the phase from step 4\) is not a multiple of "
                                         r"num_streams=8: .* use num_streams in \[1, 2, 4\]"):  # fmt: skip
        datamodule(corpus, "concat", num_streams=8, global_batch_size=[[0, 8], [4, 12]])
    with pytest.raises(ValueError, match=r"seq_len=12 \(the phase from step 3\) is not a multiple of 2 × "
                                         r"context_parallel_size = 8 \(context_parallel_size=4\)"):  # fmt: skip
        datamodule(corpus, "bestfit_split", context_parallel_size=4, seq_len=[[0, 16], [3, 12]])
    with pytest.raises(ValueError, match=r"global_batch_size phase from step 2: global_batch_size=12 is not "
                                         r"divisible by data-parallel size × microbatch_size = 1 × 8"):  # fmt: skip
        datamodule(corpus, "concat", microbatch_size=8, global_batch_size=[[0, 8], [2, 12]])
    with pytest.raises(ValueError, match=r"global_batch_size phase from step 5: global_batch_size=8 is not "
                                         r"divisible by data-parallel size × microbatch_size = 2 × 8"):  # fmt: skip
        datamodule(corpus, "concat", microbatch_size=8, global_batch_size=[[0, 16], [5, 8]], world=2)
    dm = datamodule(corpus, "concat")
    with pytest.raises(ValueError, match=r"has phases, so the microbatches per step depend on the step"):
        _ = dm.microbatches_per_step


def test_an_odd_seq_len_without_context_parallelism_trains_rows_that_hold_whole_documents(corpus: Path) -> None:
    """seq_len=9 under a Trainer: every microbatch is 2 rows of 9 inputs, and each stream's rows, joined, are whole
    documents one after another, each as a tokenization of our own gives it (BOS first), none twice."""
    import lightning.pytorch as pl
    import pyarrow.parquet as pq
    from support import RecordingModule
    from tokenizers import Tokenizer

    steps, batches = 20, []

    class Keep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch, index: int) -> None:
            batches.append(batch)

    dm = PretrainingDataModule(
        train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), seq_len=9, global_batch_size=8,
        microbatch_size=2, num_streams=4, steps_per_epoch=steps, num_workers=0, packing="concat",
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Keep()],
    )  # fmt: skip
    trainer.fit(RecordingModule(str(corpus / "odd_records")), datamodule=dm)
    assert len(batches) == steps * 4 and trainer.global_step == steps
    for batch in batches:
        for tensor in (batch.input_ids, batch.targets, batch.position_ids):
            assert tuple(tensor.shape) == (2, 9)
        assert torch.equal(batch.targets[:, :-1], batch.input_ids[:, 1:]), "concat: targets are the next inputs"
    # A step's 4 microbatches are the 4 streams' 2 rows each; a row is its first input and its 9 targets.
    streams: list[list[int]] = [[] for _ in range(4)]
    for index, batch in enumerate(batches):
        rows = torch.cat([batch.input_ids[:, :1], batch.targets], dim=1)
        streams[index % 4] += rows.flatten().tolist()
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|bos|>")
    texts = [t for f in sorted((corpus / "train").glob("*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    encoded = tokenizer.encode_batch([t for t in texts if t is not None], add_special_tokens=False)
    documents = Counter((bos, *e.ids) for e in encoded)
    seen: Counter = Counter()
    for tokens in streams:
        assert len(tokens) == steps * 2 * 10 and tokens[0] == bos
        starts = [i for i, token in enumerate(tokens) if token == bos]
        pieces = [tuple(tokens[a:b]) for a, b in itertools.pairwise([*starts, len(tokens)])]
        seen.update(pieces[:-1])  # the last may go on in the next step
        assert any(doc[: len(pieces[-1])] == pieces[-1] for doc in documents), "the last piece begins a document"
    assert all(piece in documents for piece in seen), "every piece is a whole document"
    assert all(count <= documents[piece] for piece, count in seen.items()), "a document trained twice"
    assert sum(seen.values()) > 40


def test_odd_seq_len_phases_give_rows_of_each_phase_the_same_on_any_layout(corpus: Path) -> None:
    odd = dict(seq_len=[[0, 9], [3, 15], [6, 7]])
    for packing in ("concat", "bestfit", "bestfit_split"):
        dm = datamodule(corpus, packing, **odd)
        assert [dm.seq_len_at(s) for s in range(STEPS)] == [9, 9, 9, 15, 15, 15, 7, 7, 7]
        step_rows(dm, STEPS)  # checks every microbatch's shape: microbatch_size rows of the step's seq_len
        assert global_steps(corpus, packing, 2, **odd) == global_steps(corpus, packing, 1, **odd), packing
    # concat: the same token stream as at a fixed even length, nothing dropped or repeated at the odd boundaries
    scheduled = full_rows(datamodule(corpus, "concat", **odd), STEPS)
    fixed = full_rows(datamodule(corpus, "concat", seq_len=24, global_batch_size=8, steps_per_epoch=12), 12)
    assert len(scheduled) == len(dm.owned_streams) > 0
    for a, b in zip(scheduled, fixed, strict=True):
        a, b = np.concatenate(a), np.concatenate(b)
        common = min(len(a), len(b))
        assert common > 200
        np.testing.assert_array_equal(a[:common], b[:common])


def test_an_odd_seq_len_is_refused_with_context_parallelism_naming_the_multiple(corpus: Path) -> None:
    with pytest.raises(ValueError, match=r"seq_len=9 is not a multiple of 2 × context_parallel_size = 4 "
                                         r"\(context_parallel_size=2\): every row is split into 4 chunks over the CP "
                                         r"ranks; use a multiple of 4, e.g. 12"):  # fmt: skip
        datamodule(corpus, "bestfit_split", context_parallel_size=2, seq_len=9)
    with pytest.raises(ValueError, match=r"seq_len=15 \(the phase from step 3\) is not a multiple of 2 × "
                                         r"context_parallel_size = 4 \(context_parallel_size=2\)"):  # fmt: skip
        datamodule(corpus, "concat", context_parallel_size=2, seq_len=[[0, 8], [3, 15]])


def test_a_resume_under_other_shapes_is_refused_naming_them_or_continues_every_stream(corpus: Path) -> None:
    state = state_at(corpus, "concat", 4)
    with pytest.raises(ValueError, match=r"the shapes differ from the checkpoint's from step 3 .*seq_len: "
                                         r"checkpoint \[\[0, 16\], \[3, 32\], \[6, 8\]\], this run \[\[0, 16\], "
                                         r"\[3, 24\]"):  # fmt: skip
        datamodule(corpus, "concat", seq_len=[[0, 16], [3, 24]]).load_state_dict(state)
    with pytest.raises(ValueError, match=r"global_batch_size: checkpoint \[\[0, 8\], \[2, 16\], \[5, 8\]\], this run "
                                         r"16.*on_mixture_change='continue'"):  # fmt: skip
        datamodule(corpus, "concat", global_batch_size=16).load_state_dict(state)
    # Continued: every stream goes on from where it stopped, in the new shapes (concat: the same token stream).
    before = full_rows(datamodule(corpus, "concat"), 4)
    changed = datamodule(corpus, "concat", seq_len=24, global_batch_size=16, on_mixture_change="continue")
    changed.load_state_dict(state)
    after = full_rows(changed, 8, 4)
    fixed = full_rows(datamodule(corpus, "concat", seq_len=24, global_batch_size=8, steps_per_epoch=14), 14)
    for a, b, c in zip(before, after, fixed, strict=True):
        joined, reference = np.concatenate(a + b), np.concatenate(c)
        common = min(len(joined), len(reference))
        np.testing.assert_array_equal(joined[:common], reference[:common])
        assert all(len(row) == 25 for row in b)


def test_inspect_counts_the_tokens_of_every_seq_len_phase_and_the_runs_total(corpus: Path, tmp_path: Path) -> None:
    """``inspect`` under a ramp and a length warm-up: the expected passes count each phase's rows at its length
    (against our own tokenization of each source), the run's total positions are Σ G·seq_len (by hand, and as a real
    run's microbatches hold), and each phase shows its expected fill and padding."""
    import pyarrow.parquet as pq
    from support import fill_token_cache
    from tokenizers import Tokenizer

    from lightning_d9d.cli import inspect

    files = {"a": str(corpus / "train" / "part-000.parquet"), "b": str(corpus / "train" / "part-001.parquet")}
    cache, mixture = str(tmp_path / "cache"), dict(weights={"a": 1, "b": 1}, num_streams=4)
    fill_token_cache(files, str(corpus / "tokenizer.json"), cache, seq_len=16, global_batch_size=8, **mixture)
    options = dict(mixture, token_cache=cache)  # the passes counted exactly, from the cache
    report = inspect(datamodule(corpus, "concat", train_files=files, **options), None, 4)
    sizes, lengths = [8, 8, 16, 16, 16, 8, 8, 8, 8], [16] * 3 + [32] * 3 + [8] * 3  # SIZES and SEQ_LENS, step by step
    by_hand = sum(g * n for g, n in zip(sizes, lengths))
    assert f"run total ({STEPS} steps): {by_hand:,} positions" in report
    dm = datamodule(corpus, "concat", train_files=files, **options)
    batches = iter(dm.train_dataloader())
    held = sum(next(batches).input_ids.numel() for step in range(STEPS) for _ in range(dm.microbatches_at(step)))
    dm.close_loaders()
    assert held == by_hand, "a real run's microbatches hold the positions inspect counts"
    assert report.count("expected fill 100.00 %, padding 0.00 %") == 5, "concat rows are full in all 5 phases"
    # Concat: a pass over a source is its tokens (a BOS and the document's) cut into rows of seq_len + 1.
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    line = next(line for line in report.splitlines() if "expected passes" in line)
    for name, path in files.items():
        texts = [t for t in pq.read_table(path)["text"].to_pylist() if t]
        tokens = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts, add_special_tokens=False))
        expected = sum(g / 2 * (n + 1) for g, n in zip(sizes, lengths)) / tokens  # half of each step's rows
        shown = float(line.split(f"{name} ")[1].split(",")[0])
        assert shown == pytest.approx(expected, rel=2e-3), (name, line)
