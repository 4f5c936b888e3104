"""What crosses from a worker to the training process: a step's items cross unchanged (rows, flags, sources and
every state, best-fit buffers chained from their changes), and the rows a best-fit stage reports after each block,
built whenever they are read, are the buffer it held then."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import corpus_spec, flat, make_docs, respec, stream_spec, train_tokenizer, write_parquet

from lightning_d9d.streaming.loading.loader import WireFormat
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.packing.bestfit_stage import BestFitState
from lightning_d9d.streaming.packing.buffer_rows import LINKS, WIDTH, BufferRows
from lightning_d9d.streaming.packing.rows import kept_rows
from lightning_d9d.streaming.plans.packings import BufferGrowth
from lightning_d9d.streaming.sources.reader import ReadPosition
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.mixture_stream import mixture_streams


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("wire")
    docs = make_docs(300, seed=5, long_every=7, long_words=80)
    write_parquet(root / "data", docs, files=2, row_group_size=20)
    tok = train_tokenizer(docs, root / "tokenizer.json")
    return {"tok": tok, "index": RowGroupIndex.scan(resolve_files(str(root / "data")), "text")}


def assert_same_items(got: list, want: list) -> None:
    assert [sid for sid, _, _ in got] == [sid for sid, _, _ in want]
    for (_, block, state), (_, expected, expected_state) in zip(got, want, strict=True):
        for name in ("tokens", "flags", "sources"):
            value, wanted = getattr(block, name), getattr(expected, name)
            assert (value is None) == (wanted is None), name
            if value is not None:
                np.testing.assert_array_equal(value, wanted, err_msg=name)
        assert block.tokens.dtype in (np.uint16, np.int32)
        a, b = flat(state.to_dict()), flat(expected_state.to_dict())
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_a_workers_steps_cross_unchanged(corpus: dict, packing: str, cp: int) -> None:
    """A worker hosting streams 0 and 2 of 4: each step's items, encoded, pickled and decoded step after step (the
    buffers crossing as their changes), equal the items themselves."""
    spec = stream_spec(corpus["tok"], corpus["index"], packing, streams=4, seq_len=24, rows=3, buffer_size=12)
    spec = respec(spec, context_parallel_size=cp)
    hosted = [0, 2]
    streams = [iter(stream) for stream in mixture_streams(corpus_spec(spec), hosted, {})]
    sender, receiver = WireFormat(), WireFormat()
    try:
        for _ in range(80):
            items = [(sid, *next(stream)) for sid, stream in zip(hosted, streams)]
            message = pickle.loads(pickle.dumps(sender.encode(items), protocol=pickle.HIGHEST_PROTOCOL))
            assert_same_items(receiver.decode(message), items)
    finally:
        for stream in streams:
            stream.close()


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=400, max_size=400),
    split=st.booleans(),
    buffer_size=st.integers(1, 30),
    takes=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([33, 33, 33, 21, 47])), min_size=1, max_size=90),
    read_at=st.sets(st.integers(0, 89), max_size=6),
)
def test_the_rows_after_each_block_are_the_buffer_held_then(lengths, split, buffer_size, takes, read_at) -> None:
    """A block's rows, read at the end (or some of them at once, which builds part of a chain), equal the buffer
    the packer held right after that block: pieces pushed and popped within one block (a split document's chunks)
    never appear, the rest stay in order; a new row length (a re-cut) starts a fresh table; chains longer than
    ``LINKS`` blocks are built on the way."""
    docs = iter([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])
    if split:
        packer = BestFitSplitPacker(33, 0, buffer_size, BufferGrowth(2, 1))

        def refill() -> None:
            packer.add(next(docs), (0, 0))
    else:
        packer = BestFitPacker(33, buffer_size, BufferGrowth(2, 1), hold=47)

        def refill() -> None:
            doc = next(docs)
            packer.add(doc[:47], len(doc), (0, 0))

    rows, held = packer._buffer.rows(None), []
    for block, (count, capacity) in enumerate(takes):
        packer.reshape(capacity)
        packer.take(count, refill)
        rows = packer._buffer.rows(rows)
        held.append((rows, packer.snapshot()))
        if block in read_at:
            np.testing.assert_array_equal(rows.table(), held[-1][1])
    for rows, snapshot in reversed(held):
        np.testing.assert_array_equal(rows.table(), snapshot)


def test_a_chain_of_rows_is_built_once_every_links_blocks() -> None:
    """Blocks whose rows nobody reads build a table once every ``LINKS`` blocks, not at every block, and every
    block's rows read later are still its own."""
    rows, chain, want = BufferRows.empty(), [], []
    table = np.zeros((0, WIDTH), np.int64)
    for block in range(5 * LINKS + 3):
        pushed = np.full((2, WIDTH), block, np.int64)
        pushed[:, 0] = [2 * block, 2 * block + 1]
        popped = table[:1, 0]  # the oldest piece leaves
        rows = rows.after(pushed, popped)
        table = np.concatenate([table[1:], pushed])
        chain.append(rows)
        want.append(table)
    assert sum(link.built for link in chain) == len(chain) // LINKS
    for link, table in zip(chain, want, strict=True):
        np.testing.assert_array_equal(link.table(), table)


def test_best_fit_states_compare_and_pickle_their_buffers_by_value() -> None:
    """A state whose rows are a chain equals one given the same table, survives pickling (as its table) and to_dict /
    from_dict, and differs from a state whose buffer differs in one value."""
    table = np.arange(3 * WIDTH, dtype=np.int64).reshape(3, WIDTH)
    table[:, 0] = [0, 1, 2]
    chained = BufferRows.of(table[:2]).after(table[2:], np.zeros(0, np.int64))
    state = BestFitState("bestfit_split", ReadPosition(0, 1, 2), chained, 3)
    same = BestFitState("bestfit_split", ReadPosition(0, 1, 2), table.copy(), 3)
    assert not chained.built
    assert state == same
    assert pickle.loads(pickle.dumps(state)) == state
    assert BestFitState.from_dict(state.to_dict(), "packing", "bestfit_split") == state
    other = table.copy()
    other[1, 6] += 1
    assert state != BestFitState("bestfit_split", ReadPosition(0, 1, 2), other, 3)
    assert state != BestFitState("bestfit_split", ReadPosition(0, 1, 2), table, 4)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 30), added=st.integers(0, 5), width=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_kept_rows_is_a_masked_copy_then_the_added_rows(rows, added, width, seed) -> None:
    rng = np.random.default_rng(seed)
    table = rng.integers(-(2**40), 2**40, (rows, width))
    extra = rng.integers(-(2**40), 2**40, (added, width))
    keep = rng.random(rows) < 0.7
    got = kept_rows(table[:, ::-1][:, ::-1], keep, extra)  # a strided view as well
    np.testing.assert_array_equal(got, np.concatenate([table[keep], extra]))
    assert got.dtype == np.int64 and got.flags.c_contiguous
