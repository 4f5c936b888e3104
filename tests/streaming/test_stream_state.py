"""The streaming stages' state contract: checkpoints of earlier versions still resume exactly, and a corrupted,
stale or foreign data state is one clear error naming the field."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support import BOS, digest, make_docs, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.packing import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.reader import ReadPosition, TextReader
from lightning_d9d.streaming.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.state import InvalidDataState
from lightning_d9d.streaming.stream import StreamSpec, StreamState, TokenStream

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "stream_state_v2"
OPTIONS = dict(seq_len=24, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=4,
               steps_per_epoch=40, bestfit_buffer_size=12, tokenizer_batch_size=8)  # fmt: skip
SAVED_AT, FOLLOWING = 7, 12


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("v2")
    shutil.copytree(FIXTURE / "data", root / "data")
    shutil.copy(FIXTURE / "tokenizer.json", root / "tokenizer.json")
    return {"root": root, "saved": torch.load(FIXTURE / "states.pt", weights_only=True)}


def datamodule(v2: dict, packing: str, full_buffers: bool = False) -> PretrainingDataModule:
    root = v2["root"]
    dm = PretrainingDataModule(
        train_files=str(root / "data"), tokenizer=str(root / "tokenizer.json"), packing=packing, **OPTIONS
    )
    dm.setup("fit")
    if full_buffers:  # as version 2 ran: best-fit buffers full from a fresh stream's first row
        dm.train_spec = dataclasses.replace(dm.train_spec, buffer_growth=0)
    return dm


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_a_version_2_checkpoint_resumes_onto_the_same_batches(v2: dict, packing: str) -> None:
    """The fixture's states and the batches after them were written by the code of state version 2."""
    saved = v2["saved"][packing]
    want = saved["following"]
    # Today's code, run fresh as version 2 ran (today a fresh best-fit buffer grows), trains the same batches.
    uninterrupted = datamodule(v2, packing, full_buffers=True)
    batches = iter(uninterrupted.train_dataloader())
    for _ in range(SAVED_AT * uninterrupted.microbatches_per_step):
        next(batches)
    assert [digest(next(batches)) for _ in range(FOLLOWING)] == want
    batches.close()

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


# ------------------------------------------------------------------------------------------------ validation
def saved_state(v2: dict, packing: str) -> dict:
    """A data state of today's format, two steps in."""
    dm = datamodule(v2, packing)
    batches = iter(dm.train_dataloader())
    for _ in range(2 * dm.microbatches_per_step):
        next(batches)
    batches.close()
    return dm.state_dict()


@pytest.fixture(scope="module")
def states(v2: dict) -> dict:
    return {packing: saved_state(v2, packing) for packing in ("concat", "bestfit", "bestfit_split")}


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
NESTED = [
    ("concat", "streams.0.packing.reader.slot", -1, ">= 0", "slot = -1"),
    ("bestfit", "streams.1.packing.reader.row", 10**9, "holds rows", "row = 1000000000"),
    ("concat", "streams.2.packing.reader.pass", -3, ">= 0", "pass = -3"),
    ("bestfit_split", "streams.0.packing.reader.slot", 10**6, "units per pass", "slot = 1000000"),
    ("concat", "streams.0.packing.reader.slot", "1", "expected an integer", "slot = '1'"),
    ("bestfit", "streams.3.packing.next_seq", 1.5, "expected an integer", "next_seq = 1.5"),
    ("concat", "streams.0.counters.docs", -1, ">= 0", "docs = -1"),
    ("bestfit", "streams.2.counters.tokens", DELETE, "must hold 'tokens'", "tokens = <missing>"),
    ("concat", "streams.1.packing.reader", DELETE, "must hold 'reader'", "reader = <missing>"),
    ("bestfit", "streams.0.blocks", None, "expected an integer", "blocks = None"),
    ("bestfit", "streams.0.packing.kind", "zigzag", "expected one of", "kind = 'zigzag'"),
    ("concat", "streams.0.packing.kind", "bestfit", "this stream packs 'concat'", "kind = 'bestfit'"),
    ("bestfit", "streams.0.version", 99, "reads versions", "version = 99"),
    ("concat", "streams.0.packing.version", 0, "reads versions", "version = 0"),
    ("concat", "streams.3", [1, 2], "expected a dict", "3 = [1, 2]"),
]


@pytest.mark.parametrize(("packing", "path", "value", "valid", "shown"), NESTED)
def test_a_bad_field_is_one_error_naming_it(v2: dict, states: dict, packing: str, path, value, valid, shown) -> None:
    state = copy.deepcopy(states[packing])
    set_at(state, path, value)
    dm = datamodule(v2, packing)
    with pytest.raises(InvalidDataState) as error:
        dm.load_state_dict(state)
    message = str(error.value)
    assert message.startswith("the checkpoint's data state is invalid: "), message
    assert f"{path.rsplit('.', 1)[0]}.{shown}" in message and valid in message, message


def with_buffer(state: dict, stream: int, change) -> dict:
    state = copy.deepcopy(state)
    packing = state["streams"][stream]["packing"]
    packing["buffer"] = change(packing["buffer"].clone())
    return state


def set_cell(buffer: torch.Tensor, row: int, column: int, value: int) -> torch.Tensor:
    buffer[row, column] = value
    return buffer


BUFFERS = [
    ("bestfit", lambda b: b[:, :3], "buffer = array(shape=", "(rows, 5)"),
    ("bestfit_split", lambda b: b.reshape(-1)[:-2], "buffer = array(shape=", "(rows, 7)"),
    ("bestfit", lambda b: b.float(), "buffer = array(shape=", "integer array"),
    ("bestfit", lambda b: set_cell(b, 0, 2, 10**6), "buffer[0].key0 (row group) = 1000000", "expected 0.."),
    ("bestfit", lambda b: set_cell(b, 1, 3, 10**9), "buffer[1].key1 (row) = 1000000000", "expected 0.."),
    ("bestfit_split", lambda b: set_cell(b, 0, 1, 10**4), "buffer[0].length = 10000", "expected 1..25"),
    ("bestfit", lambda b: set_cell(b, 0, 0, 10**6), "buffer[0].seq = 1000000", "expected 0.."),
    ("bestfit_split", lambda b: set_cell(b, 0, 5, 7), "buffer[0].final = 7", "expected 0..1"),
]


@pytest.mark.parametrize(("packing", "change", "named", "valid"), BUFFERS)
def test_a_bad_buffer_is_one_error_naming_it(v2: dict, states: dict, packing: str, change, named, valid) -> None:
    state = with_buffer(states[packing], 1, change)
    with pytest.raises(InvalidDataState) as error:
        datamodule(v2, packing).load_state_dict(state)
    message = str(error.value)
    assert f"streams.1.packing.{named}" in message and valid in message, message


@pytest.mark.parametrize(("field", "value", "shown"), [("slot", -1, "slot = -1"), ("row", 10**9, "row = 10")])
def test_a_bad_version_2_position_is_one_error_naming_it(v2: dict, field: str, value: int, shown: str) -> None:
    state = copy.deepcopy(v2["saved"]["bestfit"]["state"])
    state["streams"][2]["read"][field] = value
    with pytest.raises(InvalidDataState, match=rf"streams\.2\.read\.{shown}"):
        datamodule(v2, "bestfit").load_state_dict(state)


def test_a_concat_offset_past_its_document_is_an_error_naming_it(v2: dict, states: dict) -> None:
    state = copy.deepcopy(states["concat"])
    set_at(state, "streams.0.packing.offset", 10**6)
    dm = datamodule(v2, "concat")
    dm.load_state_dict(state)  # the document's length is known only once it is tokenized
    batches = iter(dm.train_dataloader())
    with pytest.raises(InvalidDataState, match=r"packing\.offset = 1000000: the document there holds \d+ tokens"):
        next(batches)
    batches.close()


def test_the_state_saved_now_is_versioned_nested_and_tagged(states: dict) -> None:
    for packing, state in states.items():
        stream = state["streams"][0]
        assert stream["version"] == StreamState.VERSION and set(stream) == {"version", "packing", "counters", "blocks"}
        assert stream["packing"]["kind"] == packing and stream["packing"]["reader"]["version"] == 1
        assert ("offset" in stream["packing"]) == (packing == "concat")


# ------------------------------------------------------------------------------------------------ get_state/reset
def test_every_stage_continues_from_its_get_state_through_reset(v2: dict) -> None:
    """Reader, best-fit packers and stream: ``reset(get_state())`` on a new stage continues exactly."""
    dm = datamodule(v2, "bestfit_split")
    spec = dm.train_spec
    units = spec.stream_units(1)
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
    blocks = iter(stream)
    first = [next(blocks)[0].tokens for _ in range(3)]
    blocks.close()
    state = stream.get_state()
    assert state.blocks == 3
    resumed = TokenStream(spec, 2)
    resumed.reset(StreamState.from_dict(state.to_dict(), "bestfit_split"))
    blocks = iter(resumed)
    after = [next(blocks)[0].tokens for _ in range(3)]
    blocks.close()
    blocks = iter(TokenStream(spec, 2))
    want = [next(blocks)[0].tokens for _ in range(6)]
    blocks.close()
    np.testing.assert_array_equal(np.concatenate(first + after), np.concatenate(want))


@pytest.mark.parametrize("split", [False, True])
def test_best_fit_packers_continue_from_get_state_through_reset(split: bool) -> None:
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[0], rng.integers(1, 50, n)]).astype(np.int32) for n in rng.integers(1, 40, 400)]

    def packer():
        return BestFitSplitPacker(16, 99, 12) if split else BestFitPacker(16, 12)

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
    state = first.get_state()
    assert state.counters == first.counters and state.next_seq == first.next_seq
    second = packer()
    second.reset(
        state, lambda row: docs[int(row[2])][int(row[4]) * 16 :][: int(row[1])] if split else docs[int(row[2])][:16]
    )
    refill, _ = feeder(second, at[0])
    got += [second.take(3, refill) for _ in range(6)]
    for a, b in zip(got, want):
        for x, y in zip(a if split else [a], b if split else [b]):
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
    spec = StreamSpec(index=index, units=Units.of(index, 4), tokenizer_json=tok.to_str(), bos_id=tok.token_to_id(BOS),
                      seq_len=16, rows_per_block=2, packing=packing, seed=0, shuffle=True, num_streams=4,
                      buffer_size=8, tokenizer_batch_size=4)  # fmt: skip
    assert len(spec.units) == 4 and int(spec.units.start[1]) > 0
    for stream in range(4):
        blocks = iter(TokenStream(spec, stream))
        states = [next(blocks)[1] for _ in range(60)]
        blocks.close()
        assert len({state.packing.read.pass_index for state in states}) > 1, "the run crosses a pass boundary"
        for state in states:
            StreamState.from_dict(state.to_dict(), packing, f"streams.{stream}").check(
                spec, stream, f"streams.{stream}"
            )
