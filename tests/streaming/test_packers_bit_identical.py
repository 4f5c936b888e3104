"""The best-fit packers give the same bytes as the packers recorded in ``golden/packers.json``, for many settings.

Each configuration feeds generated documents to a packer (``bestfit`` or ``bestfit_split``; CP multiple 1, 4, 8; a
full or a growing buffer; short or long documents; int32 or int64 ids; a row length changed mid-run; documents added
one per refill or several), takes blocks of rows, and digests every block's tokens and flags, the pieces it
recorded for provenance, its counters and its buffer's rows (both as a snapshot and as the chain of changes a stream
keeps), then restores a second packer from a mid-run snapshot and digests the rows it continues with. The golden
digests were recorded from the packers before their loop was compiled, so a change to how they pack that alters a
single byte fails here. Regenerate only for an intended change of the rows: ``D9D_WRITE_GOLDEN=1 pytest <this file>``.
The digests prove the packers unchanged, not correct: correctness is the reference scans' (below, and in
``test_packers_match_their_references.py`` and ``test_bestfit_split.py``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import support

from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker, recorded_pieces
from lightning_d9d.streaming.packing.bestfit_loop import crc32_int32
from lightning_d9d.streaming.packing.rows import CP_PAD, NO_TARGET, START
from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream

GOLDEN = Path(__file__).parent / "golden" / "packers.json"
PAD = 3
STRIDE = 10_000  # token = 10 + document * STRIDE + position (the documents here stay below STRIDE tokens)

CONFIGS = {
    f"{packing}-cp{cp}-{growth}-{docs}-{dtype}-{reshape}-{feed}": dict(
        packing=packing, cp=cp, growth=growth, docs=docs, dtype=dtype, reshape=reshape, feed=feed
    )
    for packing, cp, growth, docs, dtype, reshape, feed in itertools.product(
        ["bestfit", "bestfit_split"],
        [1, 4, 8],
        ["full", "grow"],
        ["short", "long"],
        ["int32", "int64"],
        ["fixed", "reshape"],
        ["one", "batch"],
    )
}


@functools.cache
def _docs(kind: str, dtype: str, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    longest = 40 if kind == "short" else 400
    lengths = rng.integers(1, longest, 800)
    edges = rng.random(800) < 0.05
    lengths[edges] = rng.choice([1, 2, 32, 33, 64, 65, 128, 129], edges.sum())
    return tuple((10 + i * STRIDE + np.arange(n)).astype(dtype) for i, n in enumerate(lengths.tolist()))


def make_docs(kind: str, dtype: str, seed: int) -> list[np.ndarray]:
    """800 documents of 1 to 39 (``short``) or 399 (``long``) tokens, row lengths and their neighbours among them."""
    return list(_docs(kind, dtype, seed))


def capacities(config: dict) -> tuple[int, int]:
    """The row length before and after the reshape (``seq_len`` a multiple of every CP multiple here)."""
    first = 65
    if config["reshape"] == "fixed":
        return first, first
    return first, (33 if config["packing"] == "bestfit_split" else 97)  # bestfit holds prefixes of 97


def make_packer(config: dict, capacity: int):
    growth = FULL_BUFFER if config["growth"] == "full" else BufferGrowth(3, 2)
    if config["packing"] == "bestfit_split":
        return BestFitSplitPacker(capacity, PAD, 24, growth, cp_multiple=config["cp"])
    return BestFitPacker(capacity, 24, growth, cp_multiple=config["cp"], pad_id=PAD, hold=97)


class Feed:
    """Documents added one per ``refill()`` (``one``) or a few at a time (``batch``), keyed like (row group, row)."""

    def __init__(self, docs: list[np.ndarray], packer, batch: int, cursor: int = 0) -> None:
        self.docs, self.packer, self.batch, self.cursor = docs, packer, batch, cursor

    def add(self, i: int) -> None:
        doc, key = self.docs[i], (i // 5, i % 5)
        if isinstance(self.packer, BestFitSplitPacker):
            self.packer.add(doc, key)
        else:
            self.packer.add(doc[: self.packer.hold], len(doc), key)

    def refill(self) -> None:
        for i in range(self.cursor, self.cursor + self.batch):
            self.add(i)
        self.cursor += self.batch

    def fetch(self, row: np.ndarray, need: int) -> np.ndarray:
        _seq, _length, key0, key1, offset, _final, _hash, _hashed = row.tolist()
        return self.docs[5 * key0 + key1][offset : offset + need]


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"none")
            continue
        a = np.asarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


TAKES = [1, 3, 2, 1, 4, 2, 1, 3, 2, 2, 1, 4]  # rows per block
RESHAPE_AT, RESUME_AT = 5, 7  # the block before which the row length changes; the snapshot a second packer resumes


def run(config: dict) -> dict[str, str]:
    """Every block's digests, and the resumed packer's."""
    docs = make_docs(config["docs"], config["dtype"], seed=len(config["packing"]) + config["cp"])
    first, second = capacities(config)
    packer = make_packer(config, first)
    packer.record = []
    feed = Feed(docs, packer, 1 if config["feed"] == "one" else 3)
    out, rows, saved = {}, None, None
    for block, n in enumerate(TAKES):
        if block == RESHAPE_AT:
            packer.reshape(second)
        tokens, flags = packer.take(n, feed.refill)
        rows = packer._buffer.rows(rows)
        pieces = recorded_pieces(packer.record)[:, :6]
        counters = np.asarray(list(packer.counters.to_dict().values()), np.int64)
        out[f"block{block}"] = digest(tokens, flags, pieces, counters, packer.snapshot(), rows.table(),
                                      np.asarray([packer.next_seq, len(packer)]))  # fmt: skip
        if block == RESUME_AT:
            saved = (packer.snapshot(), packer.next_seq, packer.counters.copy(), feed.cursor, packer.capacity)
    snapshot, next_seq, counters, cursor, capacity = saved
    growth = FULL_BUFFER if config["growth"] == "full" else BufferGrowth(3, 2)
    if config["packing"] == "bestfit_split":
        resumed = BestFitSplitPacker(capacity, PAD, 24, growth, counters, config["cp"])
    else:
        resumed = BestFitPacker(capacity, 24, growth, counters, config["cp"], PAD, hold=97)
    resumed.rows_taken = sum(TAKES[: RESUME_AT + 1])
    again = Feed(docs, resumed, feed.batch, cursor)
    resumed.reset(snapshot, next_seq, again.fetch)
    for block, n in enumerate(TAKES[RESUME_AT + 1 :], RESUME_AT + 1):
        tokens, flags = resumed.take(n, again.refill)
        out[f"resumed{block}"] = digest(tokens, flags, resumed.snapshot())
        assert out[f"resumed{block}"] == digest(*packer_rows(config, block)), f"resumed block {block} differs"
    return out


_FIRST_RUN: dict[str, dict] = {}


def packer_rows(config: dict, block: int):
    """The uninterrupted run's block ``block`` (its tokens, flags and snapshot), computed once per configuration."""
    key = json.dumps(config, sort_keys=True)
    if key not in _FIRST_RUN:
        docs = make_docs(config["docs"], config["dtype"], seed=len(config["packing"]) + config["cp"])
        first, second = capacities(config)
        packer = make_packer(config, first)
        feed = Feed(docs, packer, 1 if config["feed"] == "one" else 3)
        blocks = []
        for b, n in enumerate(TAKES):
            if b == RESHAPE_AT:
                packer.reshape(second)
            tokens, flags = packer.take(n, feed.refill)
            blocks.append((tokens, flags, packer.snapshot()))
        _FIRST_RUN[key] = blocks
    return _FIRST_RUN[key][block]


def golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packer_bytes_match_the_recorded_digests(name: str) -> None:
    got = run(CONFIGS[name])
    if os.environ.get("D9D_WRITE_GOLDEN"):
        recorded = golden()
        recorded[name] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
        return
    assert got == golden()[name]


def test_every_configuration_has_golden_digests() -> None:
    assert sorted(golden()) == sorted([*CONFIGS, *(f"stream-{name}" for name in STREAM_CONFIGS)])


# ------------------------------------------------------------------------------------------------ the reference
def reference(docs: list[np.ndarray], capacity: int, rows: int, buffer_size: int, cp: int, split: bool):
    """Best-fit as stated, with a Python scan of the buffer per pick and flags set token by token: the largest piece
    that fits (the oldest of equal length), CP padding to a multiple of ``cp`` after each piece unless the row ends
    within one token; where none fits, ``bestfit`` crops the shortest, ``bestfit_split`` pads the rest."""
    source = iter(docs)
    buffer: list[tuple[np.ndarray, bool, bool, int]] = []  # (tokens, continuation, non-final, full length)
    tokens, flags = [], []
    for _ in range(rows):
        row: list[int] = []
        row_flags: list[int] = []
        open_end = blocked = False  # the piece before ends inside its document; CP padding ends just before
        while len(row) < capacity:
            while len(buffer) < buffer_size:
                doc = next(source)
                if split:
                    for k in range(0, len(doc), capacity):
                        buffer.append((doc[k : k + capacity], k > 0, k + capacity < len(doc), 0))
                else:
                    buffer.append((doc[:capacity], False, len(doc) > capacity, len(doc)))
            size = [len(p) if split else n for p, _, _, n in buffer]
            space = capacity - len(row)
            best = -1
            for j in range(len(buffer)):
                if size[j] <= space and (best < 0 or size[j] > size[best]):
                    best = j
            if best < 0 and not split:  # crop the shortest
                shortest = min(range(len(buffer)), key=lambda j: size[j])
                piece = buffer.pop(shortest)[0][:space]
                row += piece.tolist()
                row_flags += [START | (NO_TARGET if blocked else 0)] + [0] * (len(piece) - 1)
                break
            if best < 0:
                row += [PAD] * space
                row_flags += [START | NO_TARGET] + [NO_TARGET] * (space - 1)
                break
            piece, continuation, non_final, _ = buffer.pop(best)
            row += piece.tolist()
            row_flags += [START | (NO_TARGET if continuation or open_end or blocked else 0)] + [0] * (len(piece) - 1)
            open_end, blocked = non_final, False
            stop = -(-len(row) // cp) * cp
            if stop >= capacity - 1:
                stop = capacity
            if cp > 1 and stop > len(row):
                row_flags += [CP_PAD | NO_TARGET] * (stop - len(row))
                row += [PAD] * (stop - len(row))
                blocked = stop < capacity
        tokens.append(row)
        flags.append(row_flags)
    return np.array(tokens, np.int64), np.array(flags, np.uint8)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("cp", [1, 4, 8])
@pytest.mark.parametrize("kind", ["short", "long"])
def test_the_packers_pick_what_a_python_scan_picks(split: bool, cp: int, kind: str) -> None:
    docs, capacity, buffer_size, rows = make_docs(kind, "int32", seed=cp), 65, 24, 60
    packer = BestFitSplitPacker(capacity, PAD, buffer_size, cp_multiple=cp) if split else (
        BestFitPacker(capacity, buffer_size, cp_multiple=cp, pad_id=PAD))  # fmt: skip
    feed = Feed(docs, packer, 1)
    if not split:
        feed.add = lambda i: packer.add(docs[i][:capacity], len(docs[i]), (i // 5, i % 5))  # type: ignore[method-assign]
    got = [packer.take(n, feed.refill) for n in [1, 5, 2, 30, 22]]
    tokens = np.concatenate([t for t, _ in got])
    expected_tokens, expected_flags = reference(docs, capacity, rows, buffer_size, cp, split)
    np.testing.assert_array_equal(tokens, expected_tokens)
    if split or cp > 1:
        np.testing.assert_array_equal(np.concatenate([f for _, f in got]), expected_flags)
    assert len(tokens) == rows


# ------------------------------------------------------------------------------------------------ whole streams
STREAM_CONFIGS = {
    **{
        f"{packing}-cp{cp}": dict(packing=packing, cp=cp)
        for packing, cp in itertools.product(["bestfit", "bestfit_split"], [1, 2])
    },
    "concat-cp1": dict(packing="concat", cp=1),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    docs = support.make_docs(300, seed=5)
    support.write_parquet(root / "data", docs, files=2, row_group_size=20)
    tok = support.train_tokenizer(docs, root / "tokenizer.json")
    return {"tok": tok, "index": RowGroupIndex.scan(resolve_files(str(root / "data")), "text")}


def stream_digests(corpus: dict, config: dict) -> dict[str, str]:
    """A stream's blocks (tokens, flags, provenance pieces, state) as a packing stage makes them from real text,
    with the buffer growing, then a stream resumed from a mid-run state (its blocks must be the same)."""
    spec = support.stream_spec(corpus["tok"], corpus["index"], config["packing"], 2, 48, buffer_size=20,
                               growth=(4, 2), record_pieces=True)  # fmt: skip
    if config["cp"] > 1:
        spec = support.respec(spec, context_parallel_size=config["cp"])
    blocks = TokenStream(spec, 1).blocks(itertools.repeat(2))
    got = [next(blocks) for _ in range(14)]
    blocks.close()
    out = {}
    for i, (block, state) in enumerate(got):
        out[f"block{i}"] = digest(block.tokens, block.flags, block.pieces, state.packing.buffer,
                                  np.asarray(list(state.counters.to_dict().values())))  # fmt: skip
    resumed = TokenStream(spec, 1, StreamState.from_dict(got[4][1].to_dict(), spec)).blocks(itertools.repeat(2))
    again = [next(resumed) for _ in range(9)]
    resumed.close()
    assert [digest(b.tokens, b.flags, b.pieces) for b, _ in again] == [
        digest(b.tokens, b.flags, b.pieces) for b, _ in got[5:]
    ]
    return out


@pytest.mark.parametrize("name", sorted(STREAM_CONFIGS))
def test_stream_blocks_match_the_recorded_digests(corpus: dict, name: str) -> None:
    got = stream_digests(corpus, STREAM_CONFIGS[name])
    key = f"stream-{name}"
    if os.environ.get("D9D_WRITE_GOLDEN"):
        recorded = golden()
        recorded[key] = got
        GOLDEN.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
        return
    assert got == golden()[key]


def test_the_compiled_checksum_is_zlibs_crc32() -> None:
    rng = np.random.default_rng(7)
    for n in [0, 1, 2, 3, 8, 1025, 4097]:
        tokens = rng.integers(-(2**31), 2**31 - 1, n + 3, dtype=np.int64).astype(np.int32)
        for start in range(3):
            assert crc32_int32(tokens, start, start + n) == zlib.crc32(tokens[start : start + n].tobytes()), (n, start)


@pytest.mark.parametrize(
    ("starts", "lengths", "message"),
    [([0, 5], [5, 0], r"a document must have tokens, got lengths \[0\]"),
     ([0, 8], [5, 5], r"document 1 needs tokens \[8, 13\) of the 10 fed")],
)  # fmt: skip
def test_a_feed_that_does_not_hold_its_documents_is_refused(starts, lengths, message) -> None:
    packer = BestFitSplitPacker(8, PAD, 4)
    with pytest.raises(ValueError, match=message):
        packer.feed(np.arange(10, dtype=np.int32), np.array(starts), np.array(lengths), 0, np.arange(2))


def test_fed_documents_give_the_rows_that_one_per_refill_gives() -> None:
    docs = make_docs("long", "int32", seed=11)
    flat, sizes = np.concatenate(docs), np.array([len(d) for d in docs])
    fed = BestFitSplitPacker(65, PAD, 24, cp_multiple=4)
    chunks = iter(range(0, len(docs), 7))

    def feed() -> None:
        first = next(chunks)
        stop = min(first + 7, len(docs))
        fed.feed(flat, (np.cumsum(sizes) - sizes)[first:stop], sizes[first:stop], first // 5, np.arange(first, stop))

    one = BestFitSplitPacker(65, PAD, 24, cp_multiple=4)
    by_one = Feed(docs, one, 1)
    by_one.add = lambda i: one.add(docs[i], ((i // 7) * 7 // 5, i))  # type: ignore[method-assign]
    for n in [1, 4, 2, 9, 3]:
        tokens, flags = fed.take(n, feed)
        expected_tokens, expected_flags = one.take(n, by_one.refill)
        np.testing.assert_array_equal(tokens, expected_tokens)
        np.testing.assert_array_equal(flags, expected_flags)
        np.testing.assert_array_equal(fed.snapshot(), one.snapshot())
    assert fed.counters == one.counters
