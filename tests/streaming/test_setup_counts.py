"""Setup without needless work: no text read or tokenized where the epoch's length is given; a pass counted exactly
from a filled token cache (its true token count, nothing tokenized); the estimate's sample made once, kept in the
cache and made again for another tokenizer or other files; a resume keeping its checkpoint's epoch length; and a
Trainer's processes taking rank 0's count while the cache fills under them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import fill_token_cache, fit_in_processes, make_docs, read_records, train_tokenizer, write_parquet
from tokenizers import Tokenizer

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.sources.source import RowGroupIndex
from lightning_d9d.streaming.streams import estimate
from lightning_d9d.streaming.tokens import tokenize

CAP = 2000  # max_document_chars: the corpus holds documents over it
G, K = 8, 4
DOCS, ROWS = 4800, 200  # more rows than the estimate's sample takes (4,096), in row groups of ROWS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three parquet files of row groups of ``ROWS`` documents, with empty ones, a row group of nulls (text-free by
    its statistics), one of empty strings, and one whose documents are all over ``CAP``; the same texts as JSONL."""
    root = tmp_path_factory.mktemp("counts")
    docs = make_docs(DOCS, seed=1, max_words=12, long_every=40, long_words=200)
    docs[2 * ROWS : 3 * ROWS] = [None] * ROWS
    docs[3 * ROWS : 4 * ROWS] = [""] * ROWS
    docs[5 * ROWS : 6 * ROWS] = ["wab " * 600] * ROWS  # 2,400 characters each
    write_parquet(root / "train", docs, files=3, row_group_size=ROWS)
    write_parquet(root / "val", make_docs(200, seed=2), files=1, row_group_size=20)
    (root / "jsonl").mkdir()
    (root / "jsonl" / "part.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    tokenizer = train_tokenizer(docs + make_docs(200, seed=2), root / "tokenizer.json")
    train_tokenizer(docs[:200], root / "other-tokenizer.json")
    kept = [doc for doc in docs if doc and len(doc) <= CAP]
    true_tokens = sum(len(e) + 1 for e in tokenizer.encode_batch(kept, add_special_tokens=False))
    (root / "true_tokens").write_text(str(true_tokens))
    return root


def datamodule(root: Path, cache: Path | None = None, train: str = "train", **changes: Any) -> PretrainingDataModule:
    options = dict(
        train_files=str(root / train), tokenizer=str(root / "tokenizer.json"), seq_len=32, global_batch_size=G,
        microbatch_size=4, num_streams=K, num_workers=0, packing="concat", max_document_chars=CAP,
        token_cache=None if cache is None else str(cache),
    )  # fmt: skip
    options.update(changes)
    return PretrainingDataModule(**options)


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """What setup reads and tokenizes: every text column read (by row group) and every batch of documents handed to
    the tokenizer, recorded by wrapping the real functions."""
    seen: dict[str, list] = {"reads": [], "encoded": []}
    read_column, encode = RowGroupIndex._read_column, tokenize.encode_documents

    def reading(self: RowGroupIndex, group: int, keyed: bool = False) -> Any:
        seen["reads"].append(group)
        return read_column(self, group, keyed)

    def encoding(tokenizer: Any, texts: list[str]) -> Any:
        seen["encoded"].extend(texts)
        return encode(tokenizer, texts)

    monkeypatch.setattr(RowGroupIndex, "_read_column", reading)
    monkeypatch.setattr(estimate, "encode_documents", encoding)
    monkeypatch.setattr(tokenize, "encode_documents", encoding)
    return seen


@pytest.fixture(scope="module")
def filled(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token cache holding every unit of ``train`` (one pass read through it)."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    fill_token_cache(str(corpus / "train"), str(corpus / "tokenizer.json"), str(cache), seq_len=32,
                     global_batch_size=G, num_streams=K, max_document_chars=CAP)  # fmt: skip
    return cache


def test_setup_with_the_epoch_given_reads_and_tokenizes_nothing(corpus: Path, work: dict) -> None:
    dm = datamodule(corpus, steps_per_epoch=7, val_files=str(corpus / "val"), val_steps=3)
    dm.setup("fit")
    assert (dm.steps_per_epoch, dm.val_steps) == (7, 3)
    # The footers' statistics prove that the files hold text: not one row group is read.
    assert work == {"reads": [], "encoded": []}
    # A report that needs the pass counts it when asked, and only then.
    assert dm.estimated_pass_tokens > 0 and dm.source_pass_rows["train"] > 0
    assert work["encoded"]


def test_without_statistics_one_row_group_is_read_to_find_a_text_and_nothing_tokenized(
    corpus: Path, work: dict, filled: Path
) -> None:
    datamodule(corpus, train="jsonl", steps_per_epoch=7).setup("fit")
    assert work["reads"] == [0] and work["encoded"] == []  # JSONL has no statistics: its first group is read


def test_a_filled_cache_counts_a_pass_exactly_and_tokenizes_nothing(corpus: Path, filled: Path, work: dict) -> None:
    true_tokens = int((corpus / "true_tokens").read_text())
    dm = datamodule(corpus, filled)
    dm.setup("fit")
    assert work == {"reads": [], "encoded": []}
    assert dm.estimated_pass_tokens == true_tokens
    assert dm.steps_per_epoch == true_tokens // (33 * G)  # concat: every token in a row of seq_len + 1
    sampled = datamodule(corpus)  # no cache: the estimate from a sample, within a few percent but not exact
    sampled.setup("fit")
    assert work["encoded"] and sampled.estimated_pass_tokens != true_tokens
    assert abs(sampled.estimated_pass_tokens - true_tokens) / true_tokens < 0.05


def test_the_count_follows_the_shape_schedule(corpus: Path, filled: Path, work: dict) -> None:
    true_tokens = int((corpus / "true_tokens").read_text())
    dm = datamodule(corpus, filled, seq_len=[[0, 16], [20, 64]], global_batch_size=[[0, 4], [30, 8]],
                    microbatch_size=4)  # fmt: skip
    dm.setup("fit")
    # concat trains every token once per pass: the steps whose positions the pass's tokens fill.
    used, steps = 0, 0
    while used + dm.global_batch_size_at(steps) * (dm.seq_len_at(steps) + 1) <= true_tokens:
        used += dm.global_batch_size_at(steps) * (dm.seq_len_at(steps) + 1)
        steps += 1
    assert steps > 30 and dm.steps_per_epoch == steps
    assert work["encoded"] == []


@pytest.mark.parametrize("packing", ["bestfit", "bestfit_split"])
def test_best_fit_counts_from_the_cache_too(corpus: Path, filled: Path, work: dict, packing: str) -> None:
    true_tokens = int((corpus / "true_tokens").read_text())
    dm = datamodule(corpus, filled, packing=packing, context_parallel_size=2, seq_len=32)
    dm.setup("fit")
    assert work == {"reads": [], "encoded": []}  # the yield is judged by lengths read off the cache's offsets
    assert dm.estimated_pass_tokens == true_tokens
    sampled = datamodule(corpus, packing=packing, context_parallel_size=2, seq_len=32)
    sampled.setup("fit")
    assert abs(dm.steps_per_epoch - sampled.steps_per_epoch) <= 0.1 * sampled.steps_per_epoch


def test_a_mixture_counts_every_source(corpus: Path, filled: Path, work: dict, tmp_path: Path) -> None:
    true_tokens = int((corpus / "true_tokens").read_text())
    files = {"web": str(corpus / "train"), "val": str(corpus / "val")}
    dm = datamodule(corpus, filled, train_files=files, weights={"web": 0.7, "val": 0.3})
    dm.setup("fit")
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    val_docs = [doc for doc in make_docs(200, seed=2) if doc]
    val_tokens = sum(len(e) + 1 for e in tokenizer.encode_batch(val_docs, add_special_tokens=False))
    # "web" is counted from the cache; "val" is not in it: estimated from its sample
    assert dm.corpus.train.counts["web"].exact and not dm.corpus.train.counts["val"].exact
    assert dm.corpus.train.counts["web"].tokens == true_tokens
    assert abs(dm.corpus.train.counts["val"].tokens - val_tokens) / val_tokens < 0.1
    assert set(dm.source_pass_rows) == {"web", "val"}


def test_the_sample_is_made_once_and_again_for_another_tokenizer_or_files(
    corpus: Path, work: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = datamodule(corpus, cache, val_files=str(corpus / "val"))
    first.setup("fit")
    made, read = len(work["encoded"]), len(work["reads"])
    assert made > 0
    again = datamodule(corpus, cache, val_files=str(corpus / "val"))
    again.setup("fit")
    assert (len(work["encoded"]), len(work["reads"])) == (made, read)  # both samples read from their records
    assert (again.steps_per_epoch, again.val_steps) == (first.steps_per_epoch, first.val_steps)
    assert again.estimated_pass_tokens == first.estimated_pass_tokens
    other = datamodule(corpus, cache, tokenizer=str(corpus / "other-tokenizer.json"))
    other.setup("fit")
    assert len(work["encoded"]) > made  # another tokenizer: another version of the cache, another sample
    made = len(work["encoded"])
    edited = tmp_path / "edited"
    write_parquet(edited, make_docs(600, seed=3, max_words=50), files=3, row_group_size=20)
    datamodule(corpus, cache, train_files=str(edited)).setup("fit")
    assert len(work["encoded"]) > made  # other footers: another record


def test_a_sample_record_that_is_damaged_is_made_again(corpus: Path, work: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = datamodule(corpus, cache)
    first.setup("fit")
    (record,) = cache.glob("*/counts/*.json")
    record.write_text("{not json")
    made = len(work["encoded"])
    again = datamodule(corpus, cache)
    again.setup("fit")
    assert len(work["encoded"]) > made and again.steps_per_epoch == first.steps_per_epoch
    assert json.loads(record.read_text())["sample"]["tokens"] == first.estimated_pass_tokens


def test_validation_keeps_the_sampled_estimate_whatever_the_cache_holds(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    empty = datamodule(corpus, cache, val_files=str(corpus / "val"))
    empty.setup("fit")
    fill_token_cache(str(corpus / "val"), str(corpus / "tokenizer.json"), str(cache), seq_len=32,
                     global_batch_size=G, num_streams=K, max_document_chars=CAP)  # fmt: skip
    full = datamodule(corpus, cache, val_files=str(corpus / "val"))
    full.setup("fit")
    assert full.val_steps == empty.val_steps  # every run validates on the same microbatches


def run_rows(dm: PretrainingDataModule, epochs: int, steps: int) -> list[str]:
    """The rows of ``epochs`` whole epochs and ``steps`` steps of the next, as digests."""
    rows = []
    for epoch in range(epochs + 1):
        batches = iter(dm.train_dataloader())
        for _ in range(dm.steps_per_epoch if epoch < epochs else steps):
            for _ in range(dm.microbatches_per_step):
                rows.append(next(batches).input_ids.numpy().tobytes().hex())
        if epoch < epochs:
            assert next(batches, None) is None
        batches.close()
    return rows


def test_a_resume_keeps_the_checkpoints_epoch_length(corpus: Path, tmp_path: Path) -> None:
    """A run sized by the sample, resumed in its second epoch after its cache filled (which would count another
    length): the resume keeps the saved length and trains the uninterrupted run's rows."""
    cache = tmp_path / "cache"
    first = datamodule(corpus)
    first.setup("fit")
    run_rows(first, 1, 3)
    state = first.state_dict()
    assert state["plan"]["steps_per_epoch"] == first.steps_per_epoch
    whole = datamodule(corpus)
    whole.setup("fit")
    assert whole.steps_per_epoch == first.steps_per_epoch
    want = run_rows(whole, 1, 6)
    fill_token_cache(str(corpus / "train"), str(corpus / "tokenizer.json"), str(cache), seq_len=32,
                     global_batch_size=G, num_streams=K, max_document_chars=CAP)  # fmt: skip
    without = {**state, "plan": {key: value for key, value in state["plan"].items() if key != "steps_per_epoch"}}
    for saved in (state, without):
        resumed = datamodule(corpus, cache)
        resumed.setup("fit")
        assert resumed.steps_per_epoch != first.steps_per_epoch  # counted from the filled cache
        resumed.load_state_dict(saved)  # a state without the key (an older checkpoint): the sampled estimate's
        assert resumed.steps_per_epoch == first.steps_per_epoch
        batches = iter(resumed.train_dataloader())
        got = [next(batches).input_ids.numpy().tobytes().hex() for _ in range(3 * resumed.microbatches_per_step)]
        batches.close()
        assert got == want[-3 * resumed.microbatches_per_step :]
    bad = datamodule(corpus, cache)
    bad.setup("fit")
    with pytest.raises(ValueError, match=r"steps_per_epoch.*-2.*a whole number of optimizer steps >= 1"):
        bad.load_state_dict({**state, "plan": {**state["plan"], "steps_per_epoch": -2}})


@pytest.mark.slow
def test_ddp_ranks_take_rank_zeros_count_while_the_cache_fills(corpus: Path, tmp_path: Path) -> None:
    """Two DDP processes (gloo): rank 1 fills the token cache inside its setup, before it sizes the epoch, while
    rank 0 sizes it at once. Counting on its own, each would size another epoch (the sampled estimate against the
    exact count); both take rank 0's."""
    cache = tmp_path / "cache"
    options = dict(train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), seq_len=32,
                   global_batch_size=G, microbatch_size=2, num_streams=K, num_workers=0, packing="concat",
                   max_document_chars=CAP, token_cache=str(cache))  # fmt: skip
    config = {"data": "pretraining_cache_filling", "options": options, "record_dir": str(tmp_path / "records"),
              "devices": 2, "runs": [{"name": "fit", "max_steps": 3}]}  # fmt: skip
    fit_in_processes(config)
    epochs = [int((tmp_path / "records" / f"epochs-rank{rank}.txt").read_text()) for rank in (0, 1)]
    assert epochs[0] == epochs[1]
    trained = read_records(tmp_path / "records")
    assert {r["rank"] for r in trained} == {0, 1} and max(r["step"] for r in trained) == 2
    # The cache went from empty to full during setup, and the two states size different epochs.
    sampled, counted = datamodule(corpus), datamodule(corpus, cache)
    sampled.setup("fit")
    counted.setup("fit")
    assert counted.corpus.train.exact and sampled.steps_per_epoch != counted.steps_per_epoch


def test_a_too_small_corpus_is_one_error_counted_exactly(corpus: Path, filled: Path) -> None:
    true_tokens = int((corpus / "true_tokens").read_text())
    dm = datamodule(corpus, filled, seq_len=4096, global_batch_size=64, microbatch_size=8, num_streams=4)
    with pytest.raises(ValueError, match=rf"train_files are too small for one optimizer step: {true_tokens} tokens"):
        dm.setup("fit")


def test_a_text_free_corpus_is_still_one_error(tmp_path: Path, corpus: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([None, "", None] * 10, pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"train_files hold no text: every value of column 'text' in 1 file"):
        datamodule(corpus, tmp_path / "cache", train_files=str(tmp_path / "empty.parquet"),
                   steps_per_epoch=3).setup("fit")  # fmt: skip
