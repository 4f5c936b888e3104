"""Parquet source and token stream, without Lightning: sharding, exact stream content, resume, bad input."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from support import BOS, WORDS, make_docs, train_tokenizer, write_parquet

from lightning_d9d.datamodules.pretraining import PretrainingDataModule
from lightning_d9d.streaming.loader import rank_stream_iterator
from lightning_d9d.streaming.packing import microbatch_tensors
from lightning_d9d.streaming.source import RowGroupIndex, deal, pass_order, resolve_files, stream_id
from lightning_d9d.streaming.stream import StreamSpec, TokenStream, estimate_pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(480, seed=3)
    write_parquet(root / "data", docs, files=3, row_group_size=20)
    tok = train_tokenizer(docs, root / "tokenizer.json")
    files = resolve_files(str(root / "data"))
    return {"root": root, "docs": docs, "tok": tok, "index": RowGroupIndex.scan(files, "text")}


def spec_for(corpus: dict, packing: str, streams: int = 2, seq_len: int = 24, **kw) -> StreamSpec:
    tok = corpus["tok"]
    options = dict(microbatch_size=2, seed=0, shuffle=True, tokenizer_batch_size=8, buffer_size=16)
    options.update(kw)
    return StreamSpec(
        index=corpus["index"],
        tokenizer_json=tok.to_str(),
        bos_id=tok.token_to_id(BOS),
        seq_len=seq_len,
        packing=packing,
        num_streams=streams,
        **options,
    )


def take(stream: TokenStream, n: int) -> list:
    """``n`` microbatches as ``(inputs, targets, position_ids, state)``, the tensors the loader builds."""
    iterator = iter(stream)
    out = [next(iterator) for _ in range(n)]
    iterator.close()
    return [(*microbatch_tensors(rows, stream.spec.bos_id), state) for rows, state in out]


def assert_same_microbatches(got: list, want: list) -> None:
    """Identical tensors and identical states (best-fit's buffer included), microbatch by microbatch."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
        assert a[3].keys() == b[3].keys()
        for key in a[3]:
            np.testing.assert_array_equal(a[3][key], b[3][key], err_msg=key)


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


def test_each_pass_deals_every_row_group_to_exactly_one_rank_and_worker(corpus: dict) -> None:
    groups = len(corpus["index"])
    for world, workers in [(1, 0), (1, 2), (2, 2), (3, 1), (2, 0)]:
        streams = world * max(1, workers)
        for pass_index in range(3):
            order = pass_order(groups, 7, pass_index)
            dealt = [
                deal(order, stream_id(r, w, workers), streams) for r in range(world) for w in range(max(1, workers))
            ]
            together = np.concatenate(dealt)
            assert sorted(together.tolist()) == list(range(groups))  # each once, none missing
            assert max(map(len, dealt)) - min(map(len, dealt)) <= 1
    assert not np.array_equal(pass_order(groups, 7, 0), pass_order(groups, 7, 1))  # reshuffled every pass
    np.testing.assert_array_equal(pass_order(groups, 7, 1), pass_order(groups, 7, 1))


def test_streams_read_their_dealt_row_groups_in_order_and_cycle_passes(corpus: dict) -> None:
    spec = spec_for(corpus, "bestfit", streams=3, buffer_size=4)
    stream = TokenStream(spec, 1)
    read: list[int] = []
    original = spec.index.read_texts
    spec.index.read_texts = lambda group: (read.append(group), original(group))[1]  # type: ignore[method-assign]
    try:
        take(stream, 60)
    finally:
        del spec.index.read_texts
    expected = np.concatenate([deal(pass_order(len(spec.index), 0, p), 1, 3) for p in range(4)]).tolist()
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
    order = np.concatenate([deal(pass_order(len(spec.index), 0, p), 0, 2) for p in range(3)])
    expected = [t for g in order for t in spec.index.read_texts(int(g)) if t]
    decoded = [tok.decode(piece[1:].tolist()) for piece in pieces]
    assert decoded[:-1] == expected[: len(decoded) - 1]
    assert expected[len(decoded) - 1].startswith(decoded[-1])  # the last document is cut by the last row
    state = out[-1][3]
    assert state["empty"] > 0 and state["docs"] > state["empty"]


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
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
        spec = dataclasses.replace(spec_for(corpus, packing, streams=2), tokenizer_json=tok.to_str())
        rows[name] = [inputs for inputs, _, _, _ in take(TokenStream(spec, 0), 40)]
    for a, b in zip(rows["plain"], rows["dressed"]):
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
    state = out[-1][3]
    assert state["crops"] > 0 and state["cropped"] > 0
    assert state["emitted"] == 80 * 2 * 25


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_resume_from_any_microbatch_is_byte_identical(corpus: dict, packing: str) -> None:
    spec = spec_for(corpus, packing, streams=4, seq_len=40)
    full = take(TokenStream(spec, 1), 120)
    passes = {state["pass"] for *_, state in full}
    assert len(passes) > 1, "the run must cross a pass boundary"
    for cut in [0, 1, 17, 63, 64, 90]:
        state = pickle.loads(pickle.dumps(full[cut][3]))  # what a checkpoint would carry
        assert_same_microbatches(take(TokenStream(spec, 1, state), 120 - cut - 1), full[cut + 1 :])


def spy_on_tokenizer_calls(monkeypatch) -> list[list[str]]:
    """Record the texts of every ``encode_batch_fast`` call the token streams make from now on."""
    from lightning_d9d.streaming import stream as token_stream

    calls: list[list[str]] = []
    real = token_stream.load_tokenizer

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def encode_batch_fast(self, texts, **options):
            calls.append(list(texts))
            return self.tok.encode_batch_fast(texts, **options)

    monkeypatch.setattr(token_stream, "load_tokenizer", lambda s: Spy(real(s)))
    return calls


def test_bestfit_resume_rebuilds_long_documents_from_a_text_prefix(corpus: dict, monkeypatch) -> None:
    spec = spec_for(corpus, "bestfit", seq_len=12, buffer_size=24)
    full = take(TokenStream(spec, 0), 40)
    state = full[20][3]
    buffer = state["buffer"]
    assert (buffer[:, 1] > spec.capacity).any()  # long documents are buffered
    assert state["buffer"].nbytes + 200 < 1 << 20
    calls = spy_on_tokenizer_calls(monkeypatch)
    resumed = take(TokenStream(spec, 0, state), 19)
    for a, b in zip(full[21:], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    longest = max(len(t) for g in range(len(spec.index)) for t in spec.index.read_texts(g) if t)
    assert max(len(t) for texts in calls for t in texts) < longest  # the longest were not re-tokenized whole


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_how_documents_are_batched_for_the_tokenizer_changes_no_row_or_state(
    corpus: dict, packing: str, monkeypatch, tmp_path: Path
) -> None:
    """Workers cap a call's text (``chunk_chars``); rows, states and resume from any of them must not depend on
    where calls end, even where a state points at an empty row that one batching has read and another not."""
    if packing == "concat":
        # concat's states fall between documents only where a microbatch ends exactly at one: documents of 5
        # tokens (BOS + 4 words) fill a 2 x 25-token microbatch exactly, and every third row is empty or null.
        rng = np.random.default_rng(5)
        docs = [None if i % 6 == 2 else "" if i % 6 == 5 else " ".join(rng.choice(WORDS, 4)) for i in range(600)]
        write_parquet(tmp_path / "aligned", docs, files=3, row_group_size=20)
        index = RowGroupIndex.scan(resolve_files(str(tmp_path / "aligned")), "text")
        plain, cap = spec_for({**corpus, "index": index}, packing, streams=4, seq_len=24), 40
    else:
        plain, cap = spec_for(corpus, packing, streams=4, seq_len=40), 600
    n = 120
    full = take(TokenStream(plain, 1), n)
    assert len({state["pass"] for *_, state in full}) > 1, "the run must cross a pass boundary"

    def text_at(state: dict) -> str | None:
        groups = deal(pass_order(len(plain.index), plain.seed, state["pass"], plain.shuffle), 1, plain.num_streams)
        texts = plain.index.read_texts(int(groups[state["slot"]]))
        return texts[state["row"]] if state["row"] < len(texts) else "(end)"

    assert any(not text_at(state) for *_, state in full), "no state points at an empty row: the case is untested"

    calls = spy_on_tokenizer_calls(monkeypatch)
    capped = dataclasses.replace(plain, chunk_chars=cap)
    assert_same_microbatches(take(TokenStream(capped, 1), n), full)
    sizes = [(len(texts), sum(map(len, texts))) for texts in calls]
    assert all(docs == 1 or chars <= cap for docs, chars in sizes), sizes
    assert any(docs > 1 for docs, _ in sizes)
    assert any(chars > cap for _, chars in sizes) == (packing == "bestfit")  # only that corpus has longer docs
    one_per_call = dataclasses.replace(plain, tokenizer_batch_size=1)  # a call boundary after every document
    assert_same_microbatches(take(TokenStream(one_per_call, 1), n), full)
    for variant in (capped, one_per_call):
        for cut in (17, 45, 90):
            assert_same_microbatches(take(TokenStream(variant, 1, full[cut][3]), n - cut - 1), full[cut + 1 :])


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_worker_processes_hand_over_exactly_their_streams_rows_round_robin(corpus: dict, packing: str) -> None:
    """Rows cross from the DataLoader workers as compact int32 arrays, each stream's in its own order."""
    spec = spec_for(corpus, packing, streams=4)  # 2 ranks x 2 workers; this is rank 1
    loader = rank_stream_iterator(spec, rank=1, num_workers=2, states={})
    got = [next(loader) for _ in range(40)]
    del loader
    for sid in (stream_id(1, 0, 2), stream_id(1, 1, 2)):
        iterator = iter(TokenStream(spec, sid))
        expected = [next(iterator) for _ in range(20)]
        iterator.close()
        mine = [(rows, state) for rows, s, state in got if s == sid]
        assert len(mine) == 20
        for (rows, state), (want_rows, want_state) in zip(mine, expected):
            assert rows.dtype == np.int32 and rows.shape == (2, spec.capacity)
            np.testing.assert_array_equal(rows, want_rows)
            assert state.keys() == want_state.keys()
            for key in state:
                np.testing.assert_array_equal(state[key], want_state[key])
    assert [s for _, s, _ in got[:4]] == [stream_id(1, 0, 2), stream_id(1, 1, 2)] * 2


def test_estimated_pass_is_close_to_the_counted_tokens(corpus: dict) -> None:
    spec = spec_for(corpus, "concat")
    tok = corpus["tok"]
    counted = sum(len(e) + 1 for e in tok.encode_batch_fast([d for d in corpus["docs"] if d]))
    tokens, rows = estimate_pass(spec, sample_groups=8, sample_docs=4096)
    assert abs(tokens - counted) / counted < 0.05 and rows == tokens / spec.capacity
    _, bestfit_rows = estimate_pass(spec_for(corpus, "bestfit"))
    assert 0 < bestfit_rows < rows


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
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(corpus: dict, name: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive integer.*got {value}"):
        PretrainingDataModule(**base_options(corpus, **{name: value}))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"packing": "greedy"}, "packing='greedy' is not valid.*bestfit.*concat"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        (
            {"global_batch_size": 6, "microbatch_size": 4},
            "global_batch_size=6 is not divisible by world_size × microbatch_size = 1 × 4",
        ),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_options_name_the_value(corpus: dict, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PretrainingDataModule(**base_options(corpus, **change))


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


def test_too_small_dataset_fails_at_setup_not_in_a_hang(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path / "small", ["wa wb wc"] * 10, files=1, row_group_size=5)
    with pytest.raises(ValueError, match="too small for one optimizer step.*global_batch_size=4"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path / "small")))
    with pytest.raises(ValueError, match=r"hold 2 parquet row groups, fewer than the 3 streams"):
        setup_dm(**base_options(corpus, train_files=str(tmp_path / "small"), num_workers=3, steps_per_epoch=1))


def test_empty_and_null_texts_are_skipped_and_counted(corpus: dict, tmp_path: Path) -> None:
    write_parquet(tmp_path / "holes", [None, "", "wa wb", None, "wc", ""] * 10, files=1, row_group_size=6)
    dm = setup_dm(
        **base_options(
            corpus,
            train_files=str(tmp_path / "holes"),
            seq_len=4,
            global_batch_size=2,
            microbatch_size=1,
            steps_per_epoch=3,
            packing="concat",
        )
    )
    batches = list(dm.train_dataloader())
    assert len(batches) == 6
    _, _, states = dm.position.committed
    (state,) = states.values()
    assert state["empty"] == 2 * state["docs"] // 3 > 0
    stats = dm.stream_stats()
    assert stats["empty"] == state["empty"] and stats["emitted"] == 6 * 5 and stats["crops"] == 0


def test_negative_chunk_chars_names_the_value(corpus: dict) -> None:
    spec = dataclasses.replace(spec_for(corpus, "concat"), chunk_chars=-1)
    with pytest.raises(ValueError, match=r"chunk_chars=-1 must be >= 0 \(0: no limit\)"):
        TokenStream(spec, 0)
