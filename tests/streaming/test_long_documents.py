"""A document far longer than the rest is tokenized in pieces: what the tokenizer holds at once is bounded by
``LONG_DOCUMENT_CHARS``, the rows are those of tokenizing it whole (where it has spaces), and resume stays exact."""

from __future__ import annotations

import itertools
import json
import random
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import BOS, WORDS, digest, make_docs, stream_spec, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.plans.spec import StreamSpec
from lightning_d9d.streaming.sources import reader
from lightning_d9d.streaming.sources import source as source_module
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.stream import StreamState, TokenStream
from lightning_d9d.streaming.tokens import tokenize
from lightning_d9d.tokenization.backends import HuggingFaceBackend, backend_for

PIECE = 3000


def long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("long")
    docs = make_docs(60, seed=4, empties=False)
    docs[5] = long_text(12000, seed=1)  # about 80K characters: some 25 pieces
    docs[40] = long_text(9000, seed=2)
    write_parquet(root / "data", docs, files=1, row_group_size=20)
    word = train_tokenizer(docs, root / "word.json")
    bpe = train_tokenizer(docs, root / "bpe.json", kind="bpe", vocab_size=400, bos=None)
    return {"index": RowGroupIndex.scan(resolve_files(str(root / "data")), "text"), "word": word, "bpe": bpe}


def spec(corpus: dict, kind: str, packing: str) -> StreamSpec:
    tok = corpus[kind]
    bos = tok.token_to_id(BOS if kind == "word" else "<eos>")
    return stream_spec(tok, corpus["index"], packing, 1, 64, rows=4, bos_id=bos, pad_id=0, prefetch=0)


def blocks(stream: TokenStream, n: int) -> list:
    iterator = stream.blocks(itertools.repeat(4))
    out = [next(iterator) for _ in range(n)]
    iterator.close()
    return out


def rows(out: list) -> np.ndarray:
    return np.concatenate([block.tokens for block, _ in out])


@pytest.mark.parametrize("kind", ["word", "bpe"])
@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_pieces_give_the_rows_of_one_call_and_bound_each_call(corpus: dict, monkeypatch, kind, packing) -> None:
    s = spec(corpus, kind, packing)
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", 0)
    whole = blocks(TokenStream(s, 0), 120)
    calls: list[int] = []
    real = HuggingFaceBackend.encode

    def spy(self, texts):
        calls.append(max(map(len, texts)))
        return real(self, texts)

    monkeypatch.setattr(HuggingFaceBackend, "encode", spy)
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    pieced = blocks(TokenStream(s, 0), 120)
    np.testing.assert_array_equal(rows(pieced), rows(whole))
    assert max(calls) <= 2 * PIECE, "a call held more than two pieces' text"
    assert sum(1 for size in calls if size >= PIECE - 50) >= 20, "the long documents were cut into pieces"


def test_text_without_spaces_is_cut_too_and_the_same_on_every_run(corpus: dict, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    tok = corpus["bpe"]
    backend = backend_for("tokenizers", tok.to_str())
    text = ("abcdefgh" * 2000) + " " + long_text(3000, seed=5)
    first = tokenize.encode_documents(backend, [text, "short text"])
    again = tokenize.encode_documents(backend, [text, "short text"])
    np.testing.assert_array_equal(first[0].ids, again[0].ids)
    assert first[1].ids.tolist() == tok.encode("short text", add_special_tokens=False).ids
    assert abs(len(first[0]) - len(tok.encode(text, add_special_tokens=False).ids)) <= 2 * len(text) // PIECE


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_resume_inside_long_documents_is_exact(corpus: dict, monkeypatch, packing: str) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    s = spec(corpus, "bpe", packing)
    full = blocks(TokenStream(s, 0), 90)
    for cut in (3, 20, 55):
        saved = StreamState.from_dict(full[cut][1].to_dict(), s)
        resumed = blocks(TokenStream(s, 0, saved), 90 - cut - 1)
        np.testing.assert_array_equal(rows(resumed), rows(full[cut + 1 :]))


# ------------------------------------------------------------------------------------------------ max_document_chars
CAP = 2000
HUGE_AT = 27  # file 0 (30 documents), row group 1 (rows 20..39 of the file), row 7 of the group
DM_OPTIONS = dict(seq_len=32, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=2,
                  steps_per_epoch=1000, bestfit_buffer_size=8, tokenizer_batch_size=4, pin_memory=False)  # fmt: skip


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One corpus with a document over ``CAP``, and the same corpus with that document empty (so the same units)."""
    root = tmp_path_factory.mktemp("capped")
    docs = make_docs(60, seed=7, empties=True)
    tokenizer = train_tokenizer(docs, root / "tok.json")
    docs[HUGE_AT] = long_text(1500, seed=3)  # some 8000 characters
    assert len(docs[HUGE_AT]) > CAP and all(len(d or "") <= CAP for i, d in enumerate(docs) if i != HUGE_AT)
    write_parquet(root / "huge", docs, files=2, row_group_size=20)
    write_parquet(root / "emptied", [d if i != HUGE_AT else "" for i, d in enumerate(docs)], files=2, row_group_size=20)
    return {"root": root, "tokenizer": str(root / "tok.json"), "length": len(docs[HUGE_AT]), "tok": tokenizer}


def capped_dm(capped: dict, data: str, packing: str, cap: int | None = CAP, **options) -> PretrainingDataModule:
    dm = PretrainingDataModule(str(capped["root"] / data), capped["tokenizer"], packing=packing,
                               max_document_chars=cap, **{**DM_OPTIONS, **options})  # fmt: skip
    dm.setup("fit")
    return dm


def take(dm: PretrainingDataModule, n: int) -> list[str]:
    batches = iter(dm.train_dataloader())
    out = [digest(next(batches)) for _ in range(n)]
    batches.close()
    return out


def too_long_warnings(record: list) -> list[str]:
    return [str(w.message) for w in record if "max_document_chars" in str(w.message)]


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_a_document_over_the_cap_is_skipped_counted_and_named_once(capped: dict, packing: str, monkeypatch) -> None:
    """Several passes over the corpus: the rows are those of the corpus with that document empty, the counter
    counts it once per pass, and one warning names its file, row group, row and length."""
    monkeypatch.setattr(reader, "_WARNED_TOO_LONG", set())  # once per process: forget the other tests' warnings
    steps = 40
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm = capped_dm(capped, "huge", packing)
        got = take(dm, steps * dm.microbatches_per_step)
    emptied = capped_dm(capped, "emptied", packing)
    assert got == take(emptied, steps * emptied.microbatches_per_step)
    stats, reference = dm.stream_stats(), emptied.stream_stats()
    assert stats["too_long"] >= 2, "met on every pass, counted on every pass"
    assert stats["too_long"] + stats["empty"] == reference["empty"] and reference["too_long"] == 0
    assert stats["docs"] == reference["docs"] and stats["tokens"] == reference["tokens"]
    assert sum(source["too_long"] for source in dm.source_stats().values()) == stats["too_long"]
    named = too_long_warnings(record)
    assert len(named) == 1, named
    assert "part-000.parquet" in named[0] and "row group 1, row 7" in named[0]
    assert f"{capped['length']} characters" in named[0] and f"max_document_chars={CAP}" in named[0]


def test_a_jsonl_document_over_the_cap_is_named_by_its_file_and_line(capped: dict, tmp_path, monkeypatch) -> None:
    """The same corpus as JSONL files in groups of a few lines: the warning names the JSONL file and the 1-based line
    (never a parquet row group), and the rows are those of the parquet corpus."""
    monkeypatch.setattr(reader, "_WARNED_TOO_LONG", set())
    monkeypatch.setattr(source_module, "JSONL_GROUP_BYTES", 2000)  # the document is in the file's second group
    texts = [t for path in resolve_files(str(capped["root"] / "huge"))
             for t in pq.read_table(path).column("text").to_pylist()]  # fmt: skip
    (tmp_path / "data").mkdir()
    for number, part in enumerate((texts[:30], texts[30:])):
        lines = "".join(json.dumps({"text": text}) + "\n" for text in part)
        (tmp_path / "data" / f"part-{number:03d}.jsonl").write_text(lines)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm = PretrainingDataModule(str(tmp_path / "data"), capped["tokenizer"], packing="concat",
                                   max_document_chars=CAP, **DM_OPTIONS)  # fmt: skip
        dm.setup("fit")
        take(dm, 40 * dm.microbatches_per_step)
    named = too_long_warnings(record)
    assert len(named) == 1, named
    assert f"JSONL file '{tmp_path / 'data' / 'part-000.jsonl'}', line {HUGE_AT + 1};" in named[0], named[0]
    assert "row group" not in named[0] and "parquet" not in named[0]


def test_without_a_cap_the_document_is_trained_on(capped: dict) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm = capped_dm(capped, "huge", "concat", cap=None)
        got = take(dm, 40 * dm.microbatches_per_step)
    assert not too_long_warnings(record) and dm.stream_stats()["too_long"] == 0
    assert got != take(capped_dm(capped, "huge", "concat"), 40 * dm.microbatches_per_step)


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_resume_with_a_skipped_document_is_exact(capped: dict, packing: str) -> None:
    """A state saved before the skipped document resumes onto the same batches and the same counters."""
    uninterrupted = capped_dm(capped, "huge", packing)
    m = uninterrupted.microbatches_per_step
    batches = iter(uninterrupted.train_dataloader())
    for _ in range(5 * m):
        next(batches)
    state, before = uninterrupted.state_dict(), uninterrupted.stream_stats()
    want = [digest(next(batches)) for _ in range(40 * m)]
    after = uninterrupted.stream_stats()
    batches.close()
    assert after["too_long"] > before["too_long"], "the resumed part meets the skipped document"
    resumed = capped_dm(capped, "huge", packing)
    resumed.load_state_dict(state)
    assert take(resumed, 40 * m) == want
    assert resumed.stream_stats() == after


def test_the_epoch_estimate_skips_documents_over_the_cap(capped: dict) -> None:
    huge, emptied = capped_dm(capped, "huge", "concat"), capped_dm(capped, "emptied", "concat")
    assert huge.estimated_pass_tokens == emptied.estimated_pass_tokens
    assert capped_dm(capped, "huge", "concat", cap=None).estimated_pass_tokens > huge.estimated_pass_tokens


def test_a_changed_cap_is_refused(capped: dict) -> None:
    state = capped_dm(capped, "huge", "concat").state_dict()
    with pytest.raises(ValueError, match=r"max_document_chars: checkpoint 2000, this run 3000"):
        capped_dm(capped, "huge", "concat", cap=3000).load_state_dict(state)
    with pytest.raises(ValueError, match=r"max_document_chars: checkpoint 2000, this run None"):
        capped_dm(capped, "huge", "concat", cap=None).load_state_dict(state)


@pytest.mark.parametrize("cap", [0, -1, 1.5, "64"])
def test_a_cap_that_is_not_a_positive_integer_is_one_error(capped: dict, cap) -> None:
    with pytest.raises(ValueError, match="max_document_chars"):
        PretrainingDataModule(str(capped["root"] / "huge"), capped["tokenizer"], max_document_chars=cap)
