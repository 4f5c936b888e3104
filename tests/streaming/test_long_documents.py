"""A document far longer than the rest is tokenized in pieces: what the tokenizer holds at once is bounded by
``LONG_DOCUMENT_CHARS``, the rows are those of tokenizing it whole (where it has spaces), and resume stays exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support import BOS, WORDS, make_docs, train_tokenizer, write_parquet

from lightning_d9d.streaming import tokenize
from lightning_d9d.streaming.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.stream import StreamSpec, StreamState, TokenStream

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
    tok, index = corpus[kind], corpus["index"]
    bos = tok.token_to_id(BOS if kind == "word" else "<eos>")
    return StreamSpec(index=index, units=Units.of(index, 1), tokenizer_json=tok.to_str(), bos_id=bos, seq_len=64,
                      rows_per_block=4, packing=packing, seed=0, shuffle=True, num_streams=1, tokenizer_batch_size=8,
                      buffer_size=16, prefetch=0)  # fmt: skip


def blocks(stream: TokenStream, n: int) -> list:
    iterator = iter(stream)
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
    real = tokenize.Tokenizer.encode_batch_fast

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def encode_batch_fast(self, texts, **options):
            calls.append(max(map(len, texts)))
            return real(self.tok, texts, **options)

    loaded = tokenize.load_tokenizer
    monkeypatch.setattr(tokenize, "load_tokenizer", lambda text: Spy(loaded(text)))
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    pieced = blocks(TokenStream(s, 0), 120)
    np.testing.assert_array_equal(rows(pieced), rows(whole))
    assert max(calls) <= 2 * PIECE, "a call held more than two pieces' text"
    assert sum(1 for size in calls if size >= PIECE - 50) >= 20, "the long documents were cut into pieces"


def test_text_without_spaces_is_cut_too_and_the_same_on_every_run(corpus: dict, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    tok = corpus["bpe"]
    text = ("abcdefgh" * 2000) + " " + long_text(3000, seed=5)
    first = tokenize.encode_documents(tok, [text, "short text"])
    again = tokenize.encode_documents(tok, [text, "short text"])
    assert isinstance(first[0], tokenize.LongEncoding) and not isinstance(first[1], tokenize.LongEncoding)
    np.testing.assert_array_equal(first[0].ids, again[0].ids)
    assert first[1].ids == tok.encode("short text", add_special_tokens=False).ids
    assert abs(len(first[0]) - len(tok.encode(text, add_special_tokens=False).ids)) <= 2 * len(text) // PIECE


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_resume_inside_long_documents_is_exact(corpus: dict, monkeypatch, packing: str) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    s = spec(corpus, "bpe", packing)
    full = blocks(TokenStream(s, 0), 90)
    for cut in (3, 20, 55):
        saved = StreamState.from_dict(full[cut][1].to_dict(), packing)
        resumed = blocks(TokenStream(s, 0, saved), 90 - cut - 1)
        np.testing.assert_array_equal(rows(resumed), rows(full[cut + 1 :]))
