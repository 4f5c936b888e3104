"""The default epoch length: one pass's tokens, estimated from a sample that does not depend on row-group size."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import make_texts, train_tokenizer

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.streams.estimate import estimate_pass

DOCS = 6000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("estimate")
    texts = make_texts(DOCS, seed=4)  # heavy-tailed lengths, like real text
    tokenizer = train_tokenizer(texts, root / "tokenizer.json")
    table = pa.table({"text": pa.array(texts, pa.string())})
    for name, row_group_size in (("one-row-groups", 1), ("five-row-groups", DOCS // 5)):
        (root / name).mkdir()
        pq.write_table(table, root / name / "part-000.parquet", row_group_size=row_group_size)
    counted = sum(len(e) + 1 for e in tokenizer.encode_batch_fast([t for t in texts if t], add_special_tokens=False))
    return {"root": root, "counted": counted}


@pytest.mark.parametrize("layout, groups", [("one-row-groups", DOCS), ("five-row-groups", 5)])
def test_the_estimate_is_within_a_few_percent_whatever_the_row_group_size(corpus: dict, layout: str, groups: int):
    dm = PretrainingDataModule(
        train_files=str(corpus["root"] / layout),
        tokenizer=str(corpus["root"] / "tokenizer.json"),
        seq_len=64,
        global_batch_size=8,
        microbatch_size=8,
        num_streams=4,
        num_workers=0,
        packing="concat",
    )
    dm.setup("fit")
    assert len(dm.train_spec.sources[0].index) == groups
    tokens, rows = estimate_pass(dm.train_spec.sources[0])
    assert abs(tokens - corpus["counted"]) / corpus["counted"] < 0.03
    assert dm.steps_per_epoch == int(rows // 8) and rows == tokens / 65


@pytest.mark.parametrize("layout", ["one-row-groups", "five-row-groups"])
def test_the_sample_stops_at_its_characters_so_long_documents_cost_little_at_setup(
    corpus: dict, layout: str, monkeypatch
) -> None:
    import lightning_d9d.streaming.streams.estimate as estimate

    dm = PretrainingDataModule(
        train_files=str(corpus["root"] / layout), tokenizer=str(corpus["root"] / "tokenizer.json"), seq_len=64,
        global_batch_size=8, microbatch_size=8, num_streams=4, num_workers=0, packing="concat",
    )  # fmt: skip
    dm.setup("fit")
    tokenized: list[str] = []
    encode = estimate.encode_documents
    monkeypatch.setattr(estimate, "encode_documents", lambda tok, texts: tokenized.extend(texts) or encode(tok, texts))
    sample_chars, longest = 100_000, max(len(text) for text in make_texts(DOCS, seed=4))
    tokens, _ = estimate_pass(dm.train_spec.sources[0], sample_chars=sample_chars)
    groups = min(len(dm.train_spec.sources[0].index), 8)
    # The sample reaches its characters, and passes them by at most one document per row group it read.
    assert sample_chars <= sum(map(len, tokenized)) <= sample_chars + groups * longest
    assert len(tokenized) < DOCS // 3
    assert abs(tokens - corpus["counted"]) / corpus["counted"] < 0.08


def test_a_long_sampled_document_is_tokenized_up_to_a_limit_and_scaled_by_its_length(corpus: dict, monkeypatch) -> None:
    import lightning_d9d.streaming.streams.estimate as estimate

    dm = PretrainingDataModule(
        train_files=str(corpus["root"] / "five-row-groups"), tokenizer=str(corpus["root"] / "tokenizer.json"),
        seq_len=64, global_batch_size=8, microbatch_size=8, num_streams=4, num_workers=0, packing="concat",
    )  # fmt: skip
    dm.setup("fit")
    whole, _ = estimate_pass(dm.train_spec.sources[0])
    tokenized: list[str] = []
    encode = estimate.encode_documents
    monkeypatch.setattr(estimate, "encode_documents", lambda tok, texts: tokenized.extend(texts) or encode(tok, texts))
    monkeypatch.setattr(estimate, "SAMPLE_DOCUMENT_CHARS", 60)
    prefixed, _ = estimate_pass(dm.train_spec.sources[0])
    assert max(map(len, tokenized)) == 60  # longer documents reach the tokenizer as their first 60 characters
    assert sum(len(text) > 60 for text in make_texts(DOCS, seed=4)) > DOCS // 3  # and many are longer
    assert abs(prefixed - whole) / whole < 0.03  # tokens per character hardly change along a document
