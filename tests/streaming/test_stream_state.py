"""The streaming stages' state contract: every stage continues from its ``get_state`` through ``reset``, and a
corrupted, stale or foreign data state is one clear error naming the field."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from support import make_docs, stream_spec, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits, TextReader
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream

OPTIONS = dict(seq_len=24, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=4,
               steps_per_epoch=40, bestfit_buffer_size=12, tokenizer_batch_size=8)  # fmt: skip
PACKINGS = ("concat", "bestfit", "bestfit_split")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(300, seed=5, max_words=40, long_every=9, long_words=120)
    write_parquet(root / "data", docs, files=2, row_group_size=25)
    train_tokenizer(docs, root / "tokenizer.json")
    return root


def datamodule(root: Path, packing: str) -> PretrainingDataModule:
    dm = PretrainingDataModule(
        train_files=str(root / "data"), tokenizer=str(root / "tokenizer.json"), packing=packing, **OPTIONS
    )
    dm.setup("fit")
    return dm


# ------------------------------------------------------------------------------------------------ validation
def saved_state(root: Path, packing: str) -> dict:
    """A data state two steps in."""
    dm = datamodule(root, packing)
    batches = iter(dm.train_dataloader())
    for _ in range(2 * dm.microbatches_per_step):
        next(batches)
    batches.close()
    return dm.state_dict()


@pytest.fixture(scope="module")
def states(corpus: Path) -> dict:
    return {packing: saved_state(corpus, packing) for packing in PACKINGS}


def set_at(state: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        state = state[int(key) if key.isdigit() else key]
    key = int(last) if last.isdigit() else last
    if value is DELETE:
        del state[key]
    else:
        state[key] = value


DELETE = object()
S = "streams.{}.sources.train."
NESTED = [
    ("concat", S.format(0) + "packing.reader.slot", -1, ">= 0", "slot = -1"),
    ("bestfit", S.format(1) + "packing.reader.row", 10**9, "holds rows", "row = 1000000000"),
    ("concat", S.format(2) + "packing.reader.pass", -3, ">= 0", "pass = -3"),
    ("bestfit_split", S.format(0) + "packing.reader.slot", 10**6, "units per pass", "slot = 1000000"),
    ("concat", S.format(0) + "packing.reader.slot", "1", "expected an integer", "slot = '1'"),
    ("bestfit", S.format(3) + "packing.next_seq", 1.5, "expected an integer", "next_seq = 1.5"),
    ("concat", S.format(0) + "counters.docs", -1, ">= 0", "docs = -1"),
    ("bestfit", S.format(2) + "counters.tokens", DELETE, "must hold 'tokens'", "tokens = <missing>"),
    ("concat", S.format(1) + "packing.reader", DELETE, "must hold 'reader'", "reader = <missing>"),
    ("bestfit", S.format(0) + "blocks", None, "expected an integer", "blocks = None"),
    ("bestfit", S.format(0) + "packing.kind", "zigzag", "this stream packs 'bestfit'", "kind = 'zigzag'"),
    ("concat", S.format(0) + "packing.kind", "bestfit", "this stream packs 'concat'", "kind = 'bestfit'"),
    ("concat", "streams.3", [1, 2], "expected a dict", "3 = [1, 2]"),
    ("bestfit", "streams.1.step", -2, ">= 0", "step = -2"),
    ("bestfit", "streams.1.sources", DELETE, "must hold 'sources'", "sources = <missing>"),
]


@pytest.mark.parametrize(("packing", "path", "value", "valid", "shown"), NESTED)
def test_a_bad_field_is_one_error_naming_it(
    corpus: Path, states: dict, packing: str, path, value, valid, shown
) -> None:
    state = copy.deepcopy(states[packing])
    set_at(state, path, value)
    dm = datamodule(corpus, packing)
    with pytest.raises(InvalidDataState) as error:
        dm.load_state_dict(state)
    message = str(error.value)
    assert message.startswith("the checkpoint's data state is invalid: "), message
    assert f"{path.rsplit('.', 1)[0]}.{shown}" in message and valid in message, message


def with_buffer(state: dict, stream: int, change) -> dict:
    state = copy.deepcopy(state)
    packing = state["streams"][stream]["sources"]["train"]["packing"]
    packing["buffer"] = change(packing["buffer"].clone())
    return state


def set_cell(buffer: torch.Tensor, row: int, column: int, value: int) -> torch.Tensor:
    buffer[row, column] = value
    return buffer


BUFFERS = [
    ("bestfit", lambda b: b[:, :3], "buffer = array(shape=", "(rows, 8)"),
    ("bestfit_split", lambda b: b.reshape(-1)[:-2], "buffer = array(shape=", "(rows, 8)"),
    ("bestfit", lambda b: b.float(), "buffer = array(shape=", "integer array"),
    ("bestfit", lambda b: set_cell(b, 0, 2, 10**6), "buffer[0].key0 (row group) = 1000000", "expected 0.."),
    ("bestfit", lambda b: set_cell(b, 1, 3, 10**9), "buffer[1].key1 (row) = 1000000000", "expected 0.."),
    ("bestfit_split", lambda b: set_cell(b, 0, 1, 0), "buffer[0].length = 0", "expected 1.."),
    ("bestfit", lambda b: set_cell(b, 0, 4, 3), "buffer[0].offset = 3", "expected 0..0"),
    ("bestfit_split", lambda b: set_cell(b, 0, 7, -1), "buffer[0].hashed = -1", "expected 0.."),
    ("bestfit", lambda b: set_cell(b, 0, 0, 10**6), "buffer[0].seq = 1000000", "expected 0.."),
    ("bestfit_split", lambda b: set_cell(b, 0, 5, 7), "buffer[0].final = 7", "expected 0..1"),
]


@pytest.mark.parametrize(("packing", "change", "named", "valid"), BUFFERS)
def test_a_bad_buffer_is_one_error_naming_it(corpus: Path, states: dict, packing: str, change, named, valid) -> None:
    state = with_buffer(states[packing], 1, change)
    with pytest.raises(InvalidDataState) as error:
        datamodule(corpus, packing).load_state_dict(state)
    message = str(error.value)
    assert f"streams.1.sources.train.packing.{named}" in message and valid in message, message


def test_a_state_of_another_version_is_one_error_naming_it(corpus: Path, states: dict) -> None:
    state = {**states["concat"], "version": 99}
    with pytest.raises(ValueError, match=r"state version 99 \(this version reads 1, 2 and 3\)"):
        datamodule(corpus, "concat").load_state_dict(state)


def as_version_2(state: dict) -> dict:
    """``state`` as version 2 wrote it: the plan's keys flat beside the streams."""
    old = copy.deepcopy(state)
    return {**old, **old.pop("plan"), "version": 2}


def as_version_1(state: dict, capacity: int) -> dict:
    """``state`` as version 1 wrote it: one shape, in the fingerprint; pieces by chunk number of that row length;
    the shares beside the streams, no edits and no epoch length."""
    old = copy.deepcopy(state)
    plan = old.pop("plan")
    shapes, old["mixture"] = plan["shapes"], plan["mixture"]
    old["version"] = 1
    old["fingerprint"].update(seq_len=shapes["seq_len"][0][1], global_batch_size=shapes["global_batch_size"][0][1])
    for stream in old["streams"].values():
        packing = stream["sources"]["train"]["packing"]
        if "buffer" in packing:
            rows = packing["buffer"].clone()
            rows[:, 4] //= capacity
            packing["buffer"] = rows[:, :7]
    return old


@pytest.mark.parametrize("packing", ["bestfit", "bestfit_split"])
def test_version_1_and_2_states_resume_as_their_version_3_twin(corpus: Path, states: dict, packing: str) -> None:
    state = states[packing]
    assert any(len(s["sources"]["train"]["packing"]["buffer"]) for s in state["streams"].values())
    runs = []
    for saved in (state, as_version_2(state), as_version_1(state, OPTIONS["seq_len"] + 1)):
        dm = datamodule(corpus, packing)
        dm.load_state_dict(saved)
        batches = iter(dm.train_dataloader())
        runs.append([next(batches) for _ in range(3 * dm.microbatches_per_step)])
        batches.close()
    assert len(runs[0]) == len(runs[1]) == len(runs[2]) == 3 * 2  # 3 steps of M = 8 / 4
    for a, b, c in zip(*runs, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.input_ids, c.input_ids) and torch.equal(a.targets, c.targets)
    with pytest.raises(InvalidDataState, match="a version-1 state holds seq_len and global_batch_size"):
        old = as_version_1(state, OPTIONS["seq_len"] + 1)
        del old["fingerprint"]["seq_len"]
        datamodule(corpus, packing).load_state_dict(old)


def test_a_concat_offset_past_its_document_is_an_error_naming_it(corpus: Path, states: dict) -> None:
    state = copy.deepcopy(states["concat"])
    set_at(state, "streams.0.sources.train.packing.offset", 10**6)
    dm = datamodule(corpus, "concat")
    dm.load_state_dict(state)  # the document's length is known only once it is tokenized
    batches = iter(dm.train_dataloader())
    with pytest.raises(InvalidDataState, match=r"packing\.offset = 1000000: the document there holds \d+ tokens"):
        next(batches)
    batches.close()


def test_the_state_saved_nests_each_stages_state_and_tags_the_packing(states: dict) -> None:
    for packing, state in states.items():
        assert state["version"] == 3 and set(state["streams"]) == {0, 1, 2, 3}
        assert set(state) == {"epoch", "step", "fingerprint", "version", "streams", "plan"}
        assert set(state["plan"]) == {"mixture", "shapes", "edits", "steps_per_epoch"}
        assert state["plan"]["shapes"] == {"global_batch_size": [[0, 8]], "seq_len": [[0, 24]]}
        stream = state["streams"][0]["sources"]["train"]
        assert set(stream) == {"packing", "counters", "blocks"}
        assert stream["packing"]["kind"] == packing and set(stream["packing"]["reader"]) == {"pass", "slot", "row"}
        assert ("offset" in stream["packing"]) == (packing == "concat")


# ------------------------------------------------------------------------------------------------ get_state/reset
def test_every_stage_continues_from_its_get_state_through_reset(corpus: Path) -> None:
    """Reader, best-fit packers and stream: ``reset(get_state())`` on a new stage continues exactly."""
    dm = datamodule(corpus, "bestfit_split")
    spec = dm.train_spec.sources[0]
    units = StreamUnits.of_spec(spec, 1)
    reader = TextReader(units, ReadPosition(), 4)
    chunks = iter(reader)
    head = [next(chunks) for _ in range(5)]
    again = TextReader(units, ReadPosition(), 4)
    again.reset(reader.get_state())
    rest = list(itertools.islice(iter(again), 6))
    whole = list(itertools.islice(iter(TextReader(units, ReadPosition(), 4)), 40))
    texts = [t for chunk in head + rest for t in chunk.texts]
    assert texts == [t for chunk in whole for t in chunk.texts][: len(texts)]

    stream = TokenStream(spec, 2)
    blocks = stream.blocks(itertools.repeat(2))
    first = [next(blocks)[0].tokens for _ in range(3)]
    blocks.close()
    state = stream.get_state()
    assert state.blocks == 3
    resumed = TokenStream(spec, 2)
    resumed.reset(StreamState.from_dict(state.to_dict(), spec))
    blocks = resumed.blocks(itertools.repeat(2))
    after = [next(blocks)[0].tokens for _ in range(3)]
    blocks.close()
    blocks = TokenStream(spec, 2).blocks(itertools.repeat(2))
    want = [next(blocks)[0].tokens for _ in range(6)]
    blocks.close()
    np.testing.assert_array_equal(np.concatenate(first + after), np.concatenate(want))


@pytest.mark.parametrize("split", [False, True])
def test_best_fit_packers_continue_from_get_state_through_reset(split: bool) -> None:
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[0], rng.integers(1, 50, n)]).astype(np.int32) for n in rng.integers(1, 40, 400)]

    def packer(counters=None):
        return BestFitSplitPacker(16, 99, 12, counters=counters) if split else BestFitPacker(16, 12, counters=counters)

    def feeder(target, start: int):
        at = [start]

        def refill() -> None:
            doc = docs[at[0]]
            if split:
                target.add(doc, (at[0], 0))
            else:
                target.add(doc[:16], len(doc), (at[0], 0))
            at[0] += 1

        return refill, at

    whole = packer()
    refill, _ = feeder(whole, 0)
    want = [whole.take(3, refill) for _ in range(10)]
    first = packer()
    refill, at = feeder(first, 0)
    got = [first.take(3, refill) for _ in range(4)]
    buffer, next_seq, counters = first.snapshot(), first.next_seq, first.counters.copy()
    second = packer(counters)
    second.rows_taken = first.rows_taken
    second.reset(
        buffer,
        next_seq,
        lambda row, need: docs[int(row[2])][int(row[4]) :][:need],
    )
    refill, _ = feeder(second, at[0])
    got += [second.take(3, refill) for _ in range(6)]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert second.counters == whole.counters


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_every_state_a_stream_yields_passes_validation_also_in_parts_of_row_groups(
    tmp_path: Path, packing: str
) -> None:
    """No false alarm: with fewer row groups than streams (units are row ranges), every state of every block of
    every stream is read back and checked without an error."""
    docs = make_docs(90, seed=2)
    write_parquet(tmp_path / "data", docs, files=1, row_group_size=90)
    tok = train_tokenizer(docs)
    index = RowGroupIndex.scan(resolve_files(str(tmp_path / "data")), "text")
    spec = stream_spec(tok, index, packing, streams=4, seq_len=16, buffer_size=8, tokenizer_batch_size=4)
    assert len(spec.units) == 4 and int(spec.units.start[1]) > 0
    for stream in range(4):
        blocks = TokenStream(spec, stream).blocks(itertools.repeat(2))
        states = [next(blocks)[1] for _ in range(60)]
        blocks.close()
        assert len({state.packing.read.pass_index for state in states}) > 1, "the run crosses a pass boundary"
        for state in states:
            StreamState.from_dict(state.to_dict(), spec, f"streams.{stream}").check(spec, stream, f"streams.{stream}")
