"""Best-fit buffers that grow to their size as a fresh stream starts: what they pull before the first row, rows
that do not depend on how they are grouped or hosted, and exact resume during the growth."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from support import assert_same_blocks, corpus_spec, make_docs, respec, take, train_tokenizer, write_parquet
from test_pretraining_stream import spec_for

from lightning_d9d.streaming.loading.loader import rank_blocks
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.packing.bestfit_stage import BestFitState
from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream

BEST_FIT = ["bestfit", "bestfit_split"]
GROWING = dict(buffer_size=64, growth=(4, 4))  # full after 15 rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(480, seed=3)
    write_parquet(root / "data", docs, files=3, row_group_size=20)
    tok = train_tokenizer(docs, root / "tokenizer.json")
    return {"root": root, "docs": docs, "tok": tok, "index": RowGroupIndex.scan(resolve_files(str(root)), "text")}


def documents(n: int, seed: int = 0, longest: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([[1], rng.integers(2, 50, int(k))]).astype(np.int32) for k in rng.integers(1, longest, n)]


def packer_of(packing: str, growth: BufferGrowth):
    return BestFitPacker(16, 40, growth) if packing == "bestfit" else BestFitSplitPacker(16, 0, 40, growth)


def feeder(packer, docs: list[np.ndarray]):
    it = iter(enumerate(docs))

    def refill() -> None:
        i, doc = next(it)
        if isinstance(packer, BestFitSplitPacker):
            packer.add(doc, (0, i))
        else:
            packer.add(doc[: packer.capacity], len(doc), (0, i))

    return refill


def rows_of(result) -> np.ndarray:
    """A take's tokens, and its flags beside them where it has any."""
    return np.concatenate([part for part in result if part is not None], axis=1)


@pytest.mark.parametrize("packing", BEST_FIT)
def test_the_buffer_grows_from_its_start_size_by_its_growth_per_row(packing: str) -> None:
    docs = documents(400, longest=15)  # each document one piece: the buffer counts documents
    packer = packer_of(packing, BufferGrowth(3, 2))
    refill, sizes = feeder(packer, docs), []
    for _ in range(30):
        packer.take(1, refill)
        sizes.append(len(packer))
    # Before each pick of row r the buffer is topped up to exactly min(40, 3 + 2 r) documents; the row ends
    # with a pick (one fewer left) or, best-fit-split's, with padding (none taken after the top-up).
    targets = [min(40, 3 + 2 * r) for r in range(30)]
    assert all(t - 1 <= size <= t for size, t in zip(sizes, targets, strict=True)), sizes
    if packing == "bestfit":  # every row ends with a pick
        assert sizes == [t - 1 for t in targets]
    full = packer_of(packing, FULL_BUFFER)
    full.take(1, feeder(full, docs))
    assert len(full) >= 39  # the full buffer was topped up to 40 before the first row's picks


@pytest.mark.parametrize("packing", BEST_FIT)
def test_growing_rows_do_not_depend_on_how_rows_are_grouped_and_differ_from_a_full_buffer(packing: str) -> None:
    docs, growth = documents(600, seed=1, longest=15), BufferGrowth(4, 3)
    one = packer_of(packing, growth)
    whole = rows_of(one.take(40, feeder(one, docs)))
    grouped = packer_of(packing, growth)
    refill = feeder(grouped, docs)
    parts = [rows_of(grouped.take(n, refill)) for n in (1, 3, 7, 2, 27)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    full = packer_of(packing, FULL_BUFFER)
    assert not np.array_equal(rows_of(full.take(40, feeder(full, docs))), whole)


@pytest.mark.parametrize("packing", BEST_FIT)
def test_a_fresh_growing_stream_tokenizes_few_documents_before_its_first_block(corpus: dict, packing: str) -> None:
    growing = spec_for(corpus, packing, streams=2, seq_len=40, **GROWING)
    full = respec(growing, growth=FULL_BUFFER)
    first_growing = take(TokenStream(growing, 0), 1)[0][3]
    first_full = take(TokenStream(full, 0), 1)[0][3]
    # Two rows: the full buffer was topped up to 64 pieces before them, the growing one to 4 and 8.
    assert len(first_full.packing.buffer) >= 63 and len(first_growing.packing.buffer) <= 8 + 8
    assert 2 * first_growing.counters.docs < first_full.counters.docs
    grown = take(TokenStream(growing, 0), 20)[-1][3]  # 40 rows: grown to 64 pieces since row 15
    assert len(grown.packing.buffer) >= 60


@pytest.mark.parametrize("packing", BEST_FIT)
def test_resume_during_the_growth_is_exact_and_keeps_the_saved_growth(corpus: dict, packing: str) -> None:
    spec = spec_for(corpus, packing, streams=2, seq_len=40, **GROWING)
    full = take(TokenStream(spec, 1), 30)
    assert full[0][3].packing.growth == BufferGrowth(4, 4)
    # A checkpoint's stream resumes with the growth it started with, whatever the spec says now.
    other = respec(spec, growth=BufferGrowth(32, 1))
    for cut in [0, 1, 3, 6, 9, 20]:
        saved = pickle.loads(pickle.dumps(full[cut][3].to_dict()))
        for resumed_spec in (spec, other):
            state = StreamState.from_dict(saved, resumed_spec)
            assert_same_blocks(take(TokenStream(resumed_spec, 1, state), 30 - cut - 1), full[cut + 1 :])


@pytest.mark.parametrize("packing", BEST_FIT)
def test_growing_rows_are_the_same_in_process_and_in_workers(corpus: dict, packing: str) -> None:
    spec = spec_for(corpus, packing, streams=4, seq_len=40, **GROWING)
    rows = {}
    for workers in (0, 2):
        blocks = rank_blocks(corpus_spec(spec), [0, 1, 2, 3], num_workers=workers, states={})
        got = [next(blocks) for _ in range(40)]
        del blocks
        rows[workers] = {sid: np.concatenate([b.tokens for s, b, _ in got if s == sid]) for sid in range(4)}
    for sid in range(4):
        np.testing.assert_array_equal(rows[0][sid], rows[2][sid])
    alone = take(TokenStream(spec, 2), 10)  # one stream on its own: its rows do not depend on its neighbours
    np.testing.assert_array_equal(rows[0][2][:, :-1], np.concatenate([inputs.numpy() for inputs, *_ in alone]))


def test_a_growing_state_without_a_start_size_names_the_field(corpus: dict) -> None:
    state = BestFitState(kind="bestfit", growth=BufferGrowth(4, 4)).to_dict()
    state["buffer_start"] = 0
    with pytest.raises(ValueError, match=r"buffer_start = 0: .*a growing buffer must start at >= 1"):
        BestFitState.from_dict(state, "packing", "bestfit")


@pytest.mark.parametrize(("start", "per_row"), [(16, -1), (0, 2), (-1, 0)])
def test_a_bad_growth_names_the_values(start: int, per_row: int) -> None:
    with pytest.raises(ValueError, match=rf"buffer growth start={start}, per_row={per_row}"):
        BufferGrowth(start, per_row)
