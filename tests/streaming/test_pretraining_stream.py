"""Parquet source and token streams, without Lightning: dealing, exact stream content, resume, bad input."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import (
    BOS,
    WORDS,
    RankDataModule,
    assert_same_blocks,
    corpus_spec,
    make_docs,
    respec,
    stream_spec,
    take,
    train_tokenizer,
    write_parquet,
)

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.loading.loader import rank_blocks, rank_streams
from lightning_d9d.streaming.packing.rows import bos_tensors, flagged_tensors
from lightning_d9d.streaming.plans.packings import PACKINGS
from lightning_d9d.streaming.plans.spec import StreamSpec
from lightning_d9d.streaming.sources.reader import ReadPosition, StreamUnits, TextChunk
from lightning_d9d.streaming.sources.source import RowGroupIndex, Units, deal, pass_order, resolve_files
from lightning_d9d.streaming.streams.estimate import estimate_pass
from lightning_d9d.streaming.streams.mixture_stream import MixtureState
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream
from lightning_d9d.streaming.tokens import tokenize
from lightning_d9d.tokenization.backends import HuggingFaceBackend


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(480, seed=3)
    write_parquet(root / "data", docs, files=3, row_group_size=20)
    tok = train_tokenizer(docs, root / "tokenizer.json")
    files = resolve_files(str(root / "data"))
    return {"root": root, "docs": docs, "tok": tok, "index": RowGroupIndex.scan(files, "text")}


def spec_for(corpus: dict, packing: str, streams: int = 2, seq_len: int = 24, **kw) -> StreamSpec:
    return stream_spec(corpus["tok"], kw.pop("index", corpus["index"]), packing, streams, seq_len, **kw)


def unit_text(spec: StreamSpec, stream: int, read: ReadPosition) -> str | None:
    """The text a position points at ("(end)" past its unit)."""
    unit = int(StreamUnits.of_spec(spec, stream).of_pass(read.pass_index)[read.slot])
    texts = spec.index.read_texts(int(spec.units.group[unit]))
    return texts[read.row] if read.row < int(spec.units.stop[unit]) else "(end)"


# ---------------------------------------------------------------------------------------------- source
def test_files_resolve_from_directory_glob_list_and_file_url(corpus: dict) -> None:
    data = corpus["root"] / "data"
    by_dir = resolve_files(str(data))
    assert len(by_dir) == 3 and by_dir == sorted(by_dir)
    assert resolve_files(str(data / "*.parquet")) == by_dir
    assert resolve_files(str(corpus["root"] / "**" / "part-00[12].parquet")) == by_dir[1:]
    assert resolve_files([by_dir[2], by_dir[0], by_dir[2]]) == [by_dir[2], by_dir[0]]
    url = resolve_files(f"file://{data}/*.parquet")
    assert [u.removeprefix("file://") for u in url] == by_dir
    index = RowGroupIndex.scan(url, "text")
    assert index.read_texts(0) == corpus["docs"][:20]


@pytest.mark.parametrize("streams", [1, 2, 3, 8, 24, 40])
def test_each_pass_deals_every_unit_to_exactly_one_stream(corpus: dict, streams: int) -> None:
    index = corpus["index"]  # 24 row groups of 20 rows
    units = Units.of(index, streams)
    assert len(units) >= streams
    # Units cover every row of every row group exactly once.
    covered = sorted((g, r) for g, a, b in zip(units.group, units.start, units.stop) for r in range(a, b))
    assert covered == [(g, r) for g in range(len(index)) for r in range(int(index.num_rows[g]))]
    for pass_index in range(3):
        order = pass_order(len(units), 7, pass_index)
        dealt = [deal(order, s, streams) for s in range(streams)]
        assert sorted(np.concatenate(dealt).tolist()) == list(range(len(units)))  # each once, none missing
        assert max(map(len, dealt)) - min(map(len, dealt)) <= 1 and min(map(len, dealt)) >= 1
    assert not np.array_equal(pass_order(len(units), 7, 0), pass_order(len(units), 7, 1))  # reshuffled
    np.testing.assert_array_equal(pass_order(len(units), 7, 1), pass_order(len(units), 7, 1))


def test_fewer_rows_than_streams_is_an_error_naming_both(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path, ["wa wb"] * 5, files=1, row_group_size=5)
    index = RowGroupIndex.scan(resolve_files(str(tmp_path)), "text")
    with pytest.raises(ValueError, match="the files hold 5 rows, fewer than num_streams=8"):
        Units.of(index, 8)


def test_streams_read_their_dealt_units_in_order_and_cycle_passes(corpus: dict) -> None:
    spec = spec_for(corpus, "bestfit", streams=3, buffer_size=4)
    read: list[int] = []
    original = spec.index.read_keyed
    spec.index.read_keyed = lambda group, *rest: (read.append(group), original(group, *rest))[1]  # type: ignore
    try:
        take(TokenStream(spec, 1), 60)
    finally:
        del spec.index.read_keyed
    expected = np.concatenate([StreamUnits.of_spec(spec, 1).of_pass(p) for p in range(4)]).tolist()
    assert read == expected[: len(read)] and len(read) > len(spec.index) // 3  # went past a pass boundary


# ---------------------------------------------------------------------------------------------- content
def test_concat_rows_decode_back_to_the_documents_in_stream_order(corpus: dict) -> None:
    spec, tok = spec_for(corpus, "concat", streams=2), corpus["tok"]
    out = take(TokenStream(spec, 0), 150)
    rows = torch.cat([torch.cat([inputs, targets[:, -1:]], dim=1) for inputs, targets, _, _ in out]).numpy()
    for inputs, targets, _, _ in out:
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    tokens = rows.ravel()
    bos = tok.token_to_id(BOS)
    pieces = np.split(tokens, np.flatnonzero(tokens == bos))[1:]  # the stream starts at a BOS
    order = np.concatenate([StreamUnits.of_spec(spec, 0).of_pass(p) for p in range(3)])
    expected = [t for unit in order for t in spec.index.read_texts(int(spec.units.group[unit])) if t]
    decoded = [tok.decode(piece[1:].tolist()) for piece in pieces]
    assert decoded[:-1] == expected[: len(decoded) - 1]
    assert expected[len(decoded) - 1].startswith(decoded[-1])  # the last document is cut by the last row
    counters = out[-1][3].counters
    assert counters.empty > 0 and counters.docs == len(decoded)
    # tokens counts the documents begun, the one inside which the position stands included
    assert counters.tokens == sum(len(tok.encode(text).ids) + 1 for text in expected[: len(decoded)])
    assert counters.emitted == 150 * 2 * 25 and counters.tokens >= counters.emitted


@pytest.mark.parametrize("packing", PACKINGS)
def test_tokenizer_post_processor_truncation_and_padding_do_not_reach_the_rows(corpus: dict, packing: str) -> None:
    # A tokenizer.json as found in the wild: a template that adds BOS itself (Llama-style "<s> $A"), and
    # truncation and padding saved on. The stream must still put exactly one BOS per document, whole and unpadded.
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    plain = corpus["tok"]
    dressed = Tokenizer.from_str(plain.to_str())
    bos = plain.token_to_id(BOS)
    dressed.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    dressed.enable_truncation(5)
    dressed.enable_padding(length=40, pad_id=0, pad_token="<unk>")
    assert dressed.encode("wa" + " wb" * 9).ids[0] == bos and len(dressed.encode("wa").ids) == 40  # really dressed
    rows = {}
    for name, tok in (("plain", plain), ("dressed", dressed)):
        spec = respec(spec_for(corpus, packing, streams=2), tokenizer_json=tok.to_str())
        rows[name] = [inputs for inputs, _, _, _ in take(TokenStream(spec, 0), 40)]
    for a, b in zip(rows["plain"], rows["dressed"], strict=True):
        assert torch.equal(a, b)
    inputs = torch.cat(rows["plain"])
    assert (inputs == bos).any()
    assert not ((inputs[:, 1:] == bos) & (inputs[:, :-1] == bos)).any()  # every document has words: never BOS, BOS


def test_bestfit_rows_start_at_bos_and_positions_restart_there(corpus: dict) -> None:
    spec = spec_for(corpus, "bestfit")
    out = take(TokenStream(spec, 1), 80)
    bos = spec.bos_id
    for inputs, targets, positions, _ in out:
        assert (inputs[:, 0] == bos).all()
        assert inputs.dtype == targets.dtype == positions.dtype == torch.int64
        assert ((positions == 0) == ((inputs == bos) | (torch.arange(inputs.shape[1]) == 0))).all()
        assert (positions[:, 1:][inputs[:, 1:] != bos] == positions[:, :-1][inputs[:, 1:] != bos] + 1).all()
    counters = out[-1][3].counters
    assert counters.crops > 0 and counters.cropped > 0
    assert counters.emitted == 80 * 2 * 25
    buffered = int(out[-1][3].packing.buffer[:, 1].sum())
    assert counters.tokens == counters.emitted + counters.cropped + buffered  # every token taken is accounted for


def test_bestfit_split_keeps_every_document_that_fits_whole_and_pads_rarely(corpus: dict) -> None:
    spec = spec_for(corpus, "bestfit_split", seq_len=40, buffer_size=24)
    tok, capacity = corpus["tok"], spec.capacity
    iterator = TokenStream(spec, 0).blocks(itertools.repeat(2))
    blocks = [next(iterator) for _ in range(150)]
    iterator.close()
    order = np.concatenate([StreamUnits.of_spec(spec, 0).of_pass(p) for p in range(4)])
    documents = [
        [spec.bos_id, *tok.encode(text).ids]
        for unit in order
        for text in spec.index.read_texts(int(spec.units.group[unit]))
        if text
    ]
    pieces = []
    for block, _ in blocks:
        _, targets, positions = flagged_tensors(block.tokens, block.flags)
        for row, flags in zip(block.tokens, block.flags):
            starts = [*np.flatnonzero(flags & 1).tolist(), capacity]
            for a, b in itertools.pairwise(starts):
                if not (flags[a] & 2 and row[a] == spec.pad_id and (flags[a:b] & 2).all()):
                    pieces.append(row[a:b].tolist())
        assert (positions[:, 0] == 0).all()
        assert (targets[torch.from_numpy(block.flags[:, 1:] & 2 != 0)] == -100).all()
    counters = blocks[-1][1].counters
    taken = documents[: counters.docs]
    wholes = {tuple(d) for d in taken if len(d) <= capacity}
    chunks = {tuple(d[i : i + capacity]) for d in taken if len(d) > capacity for i in range(0, len(d), capacity)}
    assert counters.split_docs == sum(len(d) > capacity for d in taken) > 0
    for piece in map(tuple, pieces):
        # Every piece is a whole document that fits a row, or a row-sized chunk of a longer one (consecutive,
        # non-overlapping): nothing that fits is ever cut, nothing is cropped.
        assert piece in wholes or piece in chunks, piece
    assert len(pieces) == len(set(map(tuple, pieces))) or len(taken) != len(set(map(tuple, taken)))
    assert sum(piece in wholes for piece in map(tuple, pieces)) > len(wholes) // 2
    assert counters.padding / (counters.rows * capacity) < 0.05
    assert counters.emitted + counters.padding == counters.rows * capacity


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("packing", PACKINGS)
def test_resume_from_any_block_is_byte_identical(corpus: dict, packing: str) -> None:
    spec = spec_for(corpus, packing, streams=4, seq_len=40)
    full = take(TokenStream(spec, 1), 120)
    assert len({state.packing.read.pass_index for *_, state in full}) > 1, "the run must cross a pass boundary"
    for cut in [0, 1, 17, 63, 64, 90]:
        saved = pickle.loads(pickle.dumps(full[cut][3].to_dict()))  # what a checkpoint would carry
        assert_same_blocks(
            take(TokenStream(spec, 1, StreamState.from_dict(saved, spec)), 120 - cut - 1), full[cut + 1 :]
        )


def spy_on_tokenizer_calls(monkeypatch) -> list[list[str]]:
    """Record the texts of every call the token streams make to the ``tokenizers`` backend from now on."""
    calls: list[list[str]] = []
    real = HuggingFaceBackend.encode

    def spy(self, texts):
        calls.append(list(texts))
        return real(self, texts)

    monkeypatch.setattr(HuggingFaceBackend, "encode", spy)
    return calls


def test_bestfit_resume_rebuilds_long_documents_from_a_text_prefix(corpus: dict, monkeypatch) -> None:
    spec = spec_for(corpus, "bestfit", seq_len=12, buffer_size=24)
    full = take(TokenStream(spec, 0), 40)
    state = full[20][3]
    buffer = state.packing.buffer
    assert (buffer[:, 1] > spec.capacity).any()  # long documents are buffered
    assert buffer.nbytes + 200 < 1 << 20
    calls = spy_on_tokenizer_calls(monkeypatch)
    resumed = take(TokenStream(spec, 0, state), 19)
    for a, b in zip(full[21:], resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
    longest = max(len(t) for g in range(len(spec.index)) for t in spec.index.read_texts(g) if t)
    assert max(len(t) for texts in calls for t in texts) < longest  # the longest were not re-tokenized whole


def test_bestfit_split_resume_tokenizes_only_a_prefix_for_an_early_chunk(corpus: dict, monkeypatch) -> None:
    spec = spec_for(corpus, "bestfit_split", seq_len=12, buffer_size=24)
    full = take(TokenStream(spec, 0), 60)
    texts = {(g, r): t for g in range(len(spec.index)) for r, t in enumerate(spec.index.read_texts(g)) if t}
    calls = spy_on_tokenizer_calls(monkeypatch)
    prefixes = 0
    for cut in range(10, 50, 4):
        state = full[cut][3]
        calls.clear()
        resumed = take(TokenStream(spec, 0, state), 10)
        for a, b in zip(full[cut + 1 : cut + 11], resumed, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
        buffered = {texts[(g, r)] for g, r in state.packing.buffer[:, 2:4].tolist()}
        tokenized = [t for texts_of_call in calls for t in texts_of_call]
        prefixes += sum(1 for t in tokenized if t not in buffered and any(d.startswith(t) for d in buffered))
    assert prefixes > 0  # some early chunk of a long buffered document came from a prefix of its text


def _wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_chunks_are_tokenized_only_when_asked_for_until_the_lookahead_opens(corpus: dict, monkeypatch) -> None:
    """A process starting many streams must spend its tokenizer on their first blocks, not on reading ahead."""
    calls = spy_on_tokenizer_calls(monkeypatch)

    def chunks():
        for i in itertools.count():
            zeros = np.zeros(1, np.int64)
            yield TextChunk(0, 0, 0, np.asarray([i]), [f"{WORDS[i % len(WORDS)]} {i}"], zeros, zeros)

    prefetch, lookahead = 3, threading.Event()
    stage = tokenize.tokenized(chunks(), corpus["tok"].to_str(), prefetch, lookahead=lookahead)
    for asked in range(1, 5):
        assert next(stage).chunk.texts == [f"{WORDS[(asked - 1) % len(WORDS)]} {asked - 1}"]
        time.sleep(0.2)  # room for a reader that would read ahead
        assert len(calls) == asked
    lookahead.set()
    next(stage)  # asked past the lookahead: now prefetch chunks waiting and one being tokenized, never more
    _wait_until(lambda: len(calls) == 6 + prefetch)
    time.sleep(0.2)
    assert len(calls) == 6 + prefetch
    next(stage)
    _wait_until(lambda: len(calls) == 7 + prefetch)
    time.sleep(0.2)
    assert len(calls) == 7 + prefetch
    stage.close()


@pytest.mark.parametrize("packing", ["bestfit", "bestfit_split"])
def test_a_process_restoring_several_streams_reads_each_buffered_row_group_once(
    corpus: dict, packing: str, monkeypatch
) -> None:
    spec = spec_for(corpus, packing, streams=4, seq_len=40)
    streams = [0, 1, 2, 3]
    full = {sid: take(TokenStream(spec, sid), 30) for sid in streams}
    states = {sid: full[sid][19][3] for sid in streams}
    buffered = {int(g) for state in states.values() for g in state.packing.buffer[:, 2]}
    reads: list[tuple[int, bool]] = []
    real = RowGroupIndex.read_texts

    def counted(self, group, rows=None):
        reads.append((group, rows is not None))
        return real(self, group, rows)

    monkeypatch.setattr(RowGroupIndex, "read_texts", counted)
    saved = {sid: MixtureState(20, {"train": state}) for sid, state in states.items()}
    blocks = rank_blocks(corpus_spec(spec), streams, num_workers=0, states=saved)
    got = [next(blocks) for _ in range(4 * 10)]
    blocks._shutdown_workers()
    restore_reads = [group for group, of_rows in reads if of_rows]
    assert sorted(restore_reads) == sorted(buffered)  # every buffered row group once, for all four streams
    for sid in streams:
        mine = [(block, state) for s, block, state in got if s == sid]
        for (block, state), want in zip(mine, full[sid][20:], strict=True):
            resumed = bos_tensors(block.tokens, spec.bos_id) if block.flags is None else None
            if resumed is None:
                resumed = flagged_tensors(block.tokens, block.flags)
            assert all(torch.equal(x, y) for x, y in zip(resumed, want[:3], strict=True))
            assert state.sources["train"].counters == want[3].counters


@pytest.mark.parametrize("packing", PACKINGS)
def test_how_documents_are_batched_for_the_tokenizer_changes_no_row_or_state(
    corpus: dict, packing: str, monkeypatch, tmp_path: Path
) -> None:
    """Workers cap a call's text (``chunk_chars``); rows, states and resume from any of them must not depend on
    where calls end, even where a state points at an empty row that one batching has read and another not."""
    if packing == "concat":
        # concat's states fall between documents only where a block ends exactly at one: documents of 5
        # tokens (BOS + 4 words) fill a 2 x 25-token block exactly, and every third row is empty or null.
        rng = np.random.default_rng(5)
        docs = [None if i % 6 == 2 else "" if i % 6 == 5 else " ".join(rng.choice(WORDS, 4)) for i in range(600)]
        write_parquet(tmp_path / "aligned", docs, files=3, row_group_size=20)
        index = RowGroupIndex.scan(resolve_files(str(tmp_path / "aligned")), "text")
        plain, cap = spec_for(corpus, packing, streams=4, seq_len=24, index=index), 40
    else:
        plain, cap = spec_for(corpus, packing, streams=4, seq_len=40), 600
    n = 120
    full = take(TokenStream(plain, 1), n)
    assert len({state.packing.read.pass_index for *_, state in full}) > 1, "the run must cross a pass boundary"
    assert any(not unit_text(plain, 1, state.packing.read) for *_, state in full), "no state points at an empty row"

    calls = spy_on_tokenizer_calls(monkeypatch)
    capped = respec(plain, chunk_chars=cap)
    assert_same_blocks(take(TokenStream(capped, 1), n), full)
    sizes = [(len(texts), sum(map(len, texts))) for texts in calls]
    assert all(docs == 1 or chars <= cap for docs, chars in sizes), sizes
    assert any(docs > 1 for docs, _ in sizes)
    assert any(chars > cap for _, chars in sizes) == (packing != "concat")  # only that corpus has longer docs
    one_per_call = respec(plain, tokenizer_batch_size=1)  # a call boundary after every document
    assert_same_blocks(take(TokenStream(one_per_call, 1), n), full)
    for variant in (capped, one_per_call):
        for cut in (17, 45, 90):
            assert_same_blocks(take(TokenStream(variant, 1, full[cut][3]), n - cut - 1), full[cut + 1 :])


@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_worker_processes_hand_over_exactly_their_streams_blocks_in_a_fixed_order(corpus: dict, packing: str) -> None:
    """Blocks cross from the DataLoader workers as compact arrays (uint16 where the vocabulary fits), each stream's in
    its own order."""
    spec = spec_for(corpus, packing, streams=8)
    streams = rank_streams(8, world_size=2, rank=1)  # rank 1 of 2 owns streams 4..7; 2 workers host 2 each
    assert streams == [4, 5, 6, 7]
    blocks = rank_blocks(corpus_spec(spec), streams, num_workers=2, states={})
    got = [next(blocks) for _ in range(40)]
    del blocks
    # Worker 0 hosts streams 4 and 6, worker 1 streams 5 and 7; the DataLoader alternates between them.
    assert [sid for sid, _, _ in got[:8]] == [4, 5, 6, 7] * 2
    for sid in streams:
        iterator = TokenStream(respec(spec, chunk_chars=1 << 18), sid).blocks(itertools.repeat(2))
        expected = [next(iterator) for _ in range(10)]
        iterator.close()
        mine = [(block, state.sources["train"]) for s, block, state in got if s == sid]
        assert len(mine) == 10
        for (block, state), (want, want_state) in zip(mine, expected, strict=True):
            assert block.tokens.dtype in (np.uint16, np.int32) and block.tokens.shape == (2, spec.capacity)
            np.testing.assert_array_equal(block.tokens, want.tokens)
            assert state.counters == want_state.counters and state.packing.read == want_state.packing.read


def test_estimated_pass_is_close_to_the_counted_tokens(corpus: dict) -> None:
    spec = spec_for(corpus, "concat")
    tok = corpus["tok"]
    counted = sum(len(e) + 1 for e in tok.encode_batch_fast([d for d in corpus["docs"] if d]))
    tokens, rows = estimate_pass(spec, sample_groups=8, sample_docs=4096)
    assert abs(tokens - counted) / counted < 0.05 and rows == tokens / spec.capacity
    _, bestfit_rows = estimate_pass(spec_for(corpus, "bestfit"))
    assert 0 < bestfit_rows < rows


# ---------------------------------------------------------------------------------------------- text-free data
def test_text_free_row_groups_are_skipped_and_counted_on_every_stream(corpus: dict, tmp_path: Path) -> None:
    """2 of 6 row groups hold only null or empty text; with 3 streams some stream meets passes of only those."""
    rng = np.random.default_rng(2)
    texts = [" ".join(rng.choice(WORDS, 6)) for _ in range(40)]
    groups = [texts[:10], [None] * 10, texts[10:20], [""] * 5 + [None] * 5, texts[20:30], texts[30:]]
    path = tmp_path / "holes.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for group in groups:
            writer.write_table(pa.table({"text": pa.array(group, pa.string())}))
    dm = PretrainingDataModule(
        train_files=str(path),
        tokenizer=str(corpus["root"] / "tokenizer.json"),
        seq_len=8,
        global_batch_size=6,
        microbatch_size=2,
        num_streams=3,
        num_workers=3,
        steps_per_epoch=40,
    )
    dm.setup("fit")
    assert dm.train_spec.sources[0].index.text_free.tolist() == [False, True, False, True, False, False]
    batches = list(dm.train_dataloader())
    assert len(batches) == 40 * 3
    stats = dm.stream_stats()
    assert stats["text_free_units"] > 0 and stats["docs"] > 0


def test_a_corpus_without_any_text_fails_at_setup(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path, [None, ""] * 20, files=2, row_group_size=5)
    dm = PretrainingDataModule(
        train_files=str(tmp_path), tokenizer=str(corpus["root"] / "tokenizer.json"), num_streams=4, num_workers=0
    )
    with pytest.raises(ValueError, match=r"train_files hold no text: every value of column 'text' in 2 file\(s\)"):
        dm.setup("fit")


# ---------------------------------------------------------------------------------------------- bad input
def setup_dm(**options) -> PretrainingDataModule:
    dm = PretrainingDataModule(**options)
    dm.setup("fit")
    return dm


def base_options(corpus: dict, **changes) -> dict:
    options = dict(
        train_files=str(corpus["root"] / "data"),
        tokenizer=str(corpus["root"] / "tokenizer.json"),
        seq_len=16,
        global_batch_size=4,
        microbatch_size=2,
        num_streams=2,
        num_workers=0,
        tokenizer_batch_size=8,
    )
    options.update(changes)
    return options


@pytest.mark.parametrize(
    "name",
    [
        "seq_len",
        "global_batch_size",
        "microbatch_size",
        "tokenizer_batch_size",
        "steps_per_epoch",
        "val_steps",
        "bestfit_buffer_size",
        "num_streams",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(corpus: dict, name: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive integer.*got {value}"):
        PretrainingDataModule(**base_options(corpus, **{name: value}))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"packing": "greedy"}, "packing='greedy' is not valid.*bestfit.*bestfit_split.*concat"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        (
            {"global_batch_size": 6, "microbatch_size": 4},
            "global_batch_size=6 is not divisible by data-parallel size × microbatch_size = 1 × 4",
        ),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"on_order_mismatch": "skip"}, r"on_order_mismatch must be one of \['raise', 'restart_epoch'\]"),
    ],
)
def test_bad_options_name_the_value(corpus: dict, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PretrainingDataModule(**base_options(corpus, **change))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"num_streams": 3, "global_batch_size": 4},
            r"global_batch_size=4 is not a multiple of num_streams=3: .* use num_streams in \[1, 2, 4\]",
        ),
        (
            {"num_streams": 4, "num_workers": 3, "global_batch_size": 8},
            r"num_workers=3 workers cannot share the 4 streams of each data-parallel replica \(num_streams=4, "
            r"dp_size=1\).*num_workers in \[0, 1, 2, 4\]",
        ),
        (
            {"num_streams": 4, "global_batch_size": 12, "microbatch_size": 4, "world": 3},
            r"num_streams=4 streams cannot be shared by data-parallel size dp_size=3: .* the data-parallel size can "
            r"be \[1, 2, 4\]",
        ),
    ],
)
def test_a_layout_that_cannot_share_the_streams_names_k_and_what_is_valid(
    corpus: dict, change: dict, message: str
) -> None:
    options = base_options(corpus, **change)
    world = options.pop("world", None)  # a simulated data-parallel size
    with pytest.raises(ValueError, match=message):
        if world is None:
            setup_dm(**options)
        else:
            RankDataModule(**options, world=world, rank=0).setup("fit")


def test_no_matching_file_names_the_pattern(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train_files='.*nothing/\*\.parquet' matches no file"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path / "nothing" / "*.parquet")))
    with pytest.raises(ValueError, match=r"val_files='.*missing' matches no file"):
        setup_dm(**base_options(corpus, val_files=str(tmp_path / "missing")))


def test_missing_text_column_names_file_and_columns(corpus: dict) -> None:
    message = r"part-000.parquet' has no column text_column='body'; its columns are \['text', 'id'\]"
    with pytest.raises(ValueError, match=message):
        setup_dm(**base_options(corpus, text_column="body"))


def test_non_text_column_names_file_and_type(corpus: dict) -> None:
    message = r"part-000.parquet': column text_column='id' has type int64; it must hold strings"
    with pytest.raises(ValueError, match=message):
        setup_dm(**base_options(corpus, text_column="id"))


def test_corrupt_parquet_names_the_file(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path, make_docs(40), files=1)
    bad = tmp_path / "zz-corrupt.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file at all PAR1")
    with pytest.raises(ValueError, match="cannot read parquet file '.*zz-corrupt.parquet'"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path)))


def test_tokenizer_without_bos_lists_its_special_tokens(corpus: dict, tmp_path: Path) -> None:
    train_tokenizer(make_docs(50), tmp_path / "nobos.json", bos=None)
    with pytest.raises(ValueError, match=r"no token bos_token='<\|bos\|>'.*\['<unk>'\]"):
        setup_dm(**base_options(corpus, tokenizer=str(tmp_path / "nobos.json")))
    with pytest.raises(ValueError, match="tokenizer='.*absent.json' is not a file"):
        setup_dm(**base_options(corpus, tokenizer=str(tmp_path / "absent.json")))
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(ValueError, match="tokenizer='.*bad.json' is not a valid tokenizers JSON file"):
        setup_dm(**base_options(corpus, tokenizer=str(tmp_path / "bad.json")))


def test_too_small_dataset_fails_at_setup_not_in_a_hang(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path / "small", ["wa wb wc"] * 10, files=1, row_group_size=5)
    with pytest.raises(ValueError, match="too small for one optimizer step.*global_batch_size=4"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path / "small")))
    with pytest.raises(ValueError, match=r"the files hold 10 rows, fewer than num_streams=16"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path / "small"), num_streams=16, global_batch_size=16))


def test_empty_and_null_texts_are_skipped_and_counted(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path / "holes", [None, "", "wa wb", None, "wc", ""] * 10, files=1, row_group_size=6)
    dm = setup_dm(
        **base_options(
            corpus,
            train_files=str(tmp_path / "holes"),
            seq_len=4,
            global_batch_size=2,
            microbatch_size=1,
            num_streams=1,
            steps_per_epoch=3,
            packing="concat",
        )
    )
    batches = list(dm.train_dataloader())
    assert len(batches) == 6
    _, _, states = dm.position.committed
    (state,) = states.values()
    # Two documents (3 and 2 tokens with BOS) per six rows, four of them empty or null; 30 tokens emitted.
    assert state.counters.empty == 2 * state.counters.docs - 1 > 0
    stats = dm.stream_stats()
    assert stats["empty"] == state.counters.empty and stats["emitted"] == 6 * 5 and stats["crops"] == 0


def test_streams_left_running_at_interpreter_exit_end_without_a_traceback(corpus: dict) -> None:
    # Streams never closed (a notebook, a script that ends mid-pass): their readers are stopped as the interpreter
    # tears its modules down, which must not print "Exception ignored ... TypeError" for every stream.
    script = textwrap.dedent(f"""
        from lightning_d9d import PretrainingDataModule
        from lightning_d9d.streaming.loading.loader import rank_blocks
        dm = PretrainingDataModule({str(corpus["root"] / "data")!r}, {str(corpus["root"] / "tokenizer.json")!r},
                                   seq_len=24, global_batch_size=8, microbatch_size=2, num_streams=4, num_workers=0,
                                   packing="bestfit_split", steps_per_epoch=10, pin_memory=False)
        dm.setup("fit")
        blocks = rank_blocks(dm.train_spec, [0, 1, 2, 3], 0, {{}})
        for _ in range(12):
            next(blocks)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
