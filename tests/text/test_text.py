"""TextDataModule on small local datasets and tokenizers made by the tests (real datasets/tokenizers, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import make_texts, train_tokenizer
from tokenizers import Tokenizer

from lightning_d9d import TextDataModule
from lightning_d9d.text.collate import IGNORE_INDEX, CausalLMCollator, TextBatch


def train_bpe(texts: list[str], path: Path, vocab_size: int = 300) -> Path:
    train_tokenizer(texts, path, kind="bpe", vocab_size=vocab_size)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text_corpus")
    texts = make_texts(600)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts[:500]}), root / "parquet" / "train.parquet")
    pq.write_table(pa.table({"text": texts[500:]}), root / "parquet" / "validation.parquet")
    with open(root / "docs.jsonl", "w") as file:
        for text in texts[:300]:
            file.write(json.dumps({"body": text}) + "\n")
    return {
        "root": root,
        "parquet": root / "parquet",
        "jsonl": root / "docs.jsonl",
        "tokenizer": train_bpe(texts, root / "tokenizer.json"),
        "texts": texts,  # type: ignore[dict-item]
    }


def make_dm(corpus: dict, tmp_path: Path, **overrides) -> TextDataModule:
    kwargs = dict(
        dataset=str(corpus["parquet"]),
        tokenizer=str(corpus["tokenizer"]),
        max_length=64,
        global_batch_size=32,
        microbatch_size=4,
        sort_buffer_size=256,
        num_workers=0,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    kwargs.update(overrides)
    return TextDataModule(**kwargs)


def epoch_batches(dm: TextDataModule) -> list[TextBatch]:
    dm.setup("fit")
    return list(dm.train_dataloader())


# ---------------------------------------------------------------------------------------------------- collate
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_collate_pads_to_multiple_with_hugging_face_labels(padding_side: str) -> None:
    collate = CausalLMCollator(pad_token_id=0, pad_to_multiple_of=8, padding_side=padding_side)
    samples = [{"input_ids": np.array([5, 6, 7])}, {"input_ids": np.arange(10, 21)}]  # lengths 3 and 11
    batch = collate(samples)
    assert isinstance(batch, TextBatch)
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.labels.shape == (2, 16)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    for row, sample in enumerate(samples):
        ids = torch.as_tensor(sample["input_ids"])
        real = batch.attention_mask[row].bool()
        assert real.sum() == len(ids)
        span = slice(0, len(ids)) if padding_side == "right" else slice(16 - len(ids), 16)
        assert real[span].all()
        assert torch.equal(batch.input_ids[row, span], ids)
        assert (batch.input_ids[row][~real] == 0).all()
        # labels are the input ids (the model shifts), -100 at padding; after left padding also at the
        # sample's first token, which would be predicted from a padding position.
        expected = torch.full((16,), IGNORE_INDEX)
        expected[span] = ids
        if padding_side == "left":
            expected[span.start] = IGNORE_INDEX
        assert torch.equal(batch.labels[row], expected)
        # After a causal LM's shift every sample has exactly len - 1 targets, its own next tokens.
        shifted = batch.labels[row, 1:]
        assert torch.equal(shifted[shifted != IGNORE_INDEX], ids[1:])
        assert torch.equal(batch.input_ids[row, :-1][shifted != IGNORE_INDEX], ids[:-1])
    assert batch.step_label_tokens == batch.label_tokens == (3 - 1) + (11 - 1)
    assert batch.num_tokens == 14
    assert batch.padding_fraction == pytest.approx(1 - 14 / 32)


def test_collate_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="padding_side"):
        CausalLMCollator(padding_side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        CausalLMCollator(pad_to_multiple_of=0)


# ---------------------------------------------------------------------------------------------------- data
def test_batches_hold_the_tokenized_documents(corpus: dict, tmp_path: Path) -> None:
    dm = make_dm(corpus, tmp_path, val_split="validation")
    dm.prepare_data()
    batches = epoch_batches(dm)
    tokenizer = Tokenizer.from_file(str(corpus["tokenizer"]))
    tokenizer.enable_truncation(64)
    kept = [tuple(e.ids) for e in tokenizer.encode_batch(corpus["texts"][:500]) if len(e.ids) >= 2]
    expected = set(kept)
    # The documents of at least 2 tokens are all there (the empty document is dropped), truncated to max_length.
    assert 490 < len(kept) < 500
    assert len(dm.train_dataset) == len(kept)
    assert sorted(tuple(row.tolist()) for row in dm.train_dataset["input_ids"]) == sorted(kept)
    assert len(batches) == dm.steps_per_epoch * dm.microbatches_per_step == (len(dm.train_dataset) // 32) * 8
    seen = set()
    for batch in batches:
        assert batch.input_ids.shape[1] % 8 == 0
        assert batch.input_ids.shape[1] - int(batch.attention_mask.sum(1).max()) < 8  # padded to the longest only
        for row in range(batch.input_ids.shape[0]):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()]
            seen.add(tuple(ids.tolist()))
            assert len(ids) <= 64
            real_labels = batch.labels[row][batch.labels[row] != IGNORE_INDEX]
            assert torch.equal(real_labels, ids)  # Hugging Face convention: the model shifts
    assert seen <= expected
    assert dm.train_dataset.column_names == ["input_ids", "token_counts"]
    counts = np.asarray(dm.train_dataset.with_format("numpy")["token_counts"])
    assert counts.min() >= 2 and counts.max() <= 64
    assert sum(batch.input_ids.shape[0] for batch in dm.val_dataloader()) == len(dm.val_dataset)


def test_sorted_microbatches_pad_less_than_random(corpus: dict, tmp_path: Path) -> None:
    def padding(dm: TextDataModule) -> float:
        batches = epoch_batches(dm)
        real = sum(batch.num_tokens for batch in batches)
        return 1 - real / sum(batch.attention_mask.numel() for batch in batches)

    sorted_padding = padding(make_dm(corpus, tmp_path, sort_buffer_size=256, pad_to_multiple_of=1))
    random_padding = padding(make_dm(corpus, tmp_path, sort_buffer_size=None, pad_to_multiple_of=1))
    assert sorted_padding < random_padding / 3, (sorted_padding, random_padding)


def test_second_prepare_reuses_the_cache(corpus: dict, tmp_path: Path) -> None:
    first = make_dm(corpus, tmp_path)
    first.prepare_data()
    first.setup("fit")
    cache_files = [Path(entry["filename"]) for entry in first.train_dataset.cache_files]
    assert cache_files and all(path.name.startswith("cache-") for path in cache_files)
    stamps = {path: path.stat().st_mtime_ns for path in cache_files}
    before = set((tmp_path / "hf_cache").rglob("cache-*.arrow"))

    second = make_dm(corpus, tmp_path)
    second.prepare_data()
    second.setup("fit")
    assert second.train_dataset._fingerprint == first.train_dataset._fingerprint
    assert [Path(entry["filename"]) for entry in second.train_dataset.cache_files] == cache_files
    assert {path: path.stat().st_mtime_ns for path in cache_files} == stamps  # read, not rewritten
    assert set((tmp_path / "hf_cache").rglob("cache-*.arrow")) == before  # no new cache file


def test_changed_max_length_or_tokenizer_invalidates_the_cache(corpus: dict, tmp_path: Path) -> None:
    tokenizer = train_bpe(corpus["texts"], tmp_path / "tokenizer.json", vocab_size=300)
    base = make_dm(corpus, tmp_path, tokenizer=str(tokenizer))
    base.setup("fit")
    shorter = make_dm(corpus, tmp_path, tokenizer=str(tokenizer), max_length=16)
    shorter.setup("fit")
    assert shorter.train_dataset._fingerprint != base.train_dataset._fingerprint
    assert np.asarray(shorter.train_dataset.with_format("numpy")["token_counts"]).max() <= 16

    train_bpe(corpus["texts"], tokenizer, vocab_size=270)  # same path, new content (256 bytes + 14 merges)
    retrained = make_dm(corpus, tmp_path, tokenizer=str(tokenizer))
    retrained.setup("fit")
    assert retrained.train_dataset._fingerprint != base.train_dataset._fingerprint
    assert int(np.concatenate(list(retrained.train_dataset["input_ids"])).max()) < 270


def test_jsonl_file_and_saved_dataset_sources(corpus: dict, tmp_path: Path) -> None:
    import datasets

    from_json = make_dm(corpus, tmp_path, dataset=str(corpus["jsonl"]), text_column="body")
    from_json.prepare_data()
    from_json.setup("fit")
    assert 250 < len(from_json.train_dataset) < 300

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": corpus["texts"][:400]}),
        validation=datasets.Dataset.from_dict({"text": corpus["texts"][400:450]}),
    ).save_to_disk(str(saved))
    from_disk = make_dm(corpus, tmp_path, dataset=str(saved), val_split="validation")
    from_disk.prepare_data()
    from_disk.setup("fit")
    assert len(from_disk.train_dataset) == 399 and len(from_disk.val_dataset) == 50
    assert next(iter(from_disk.train_dataloader())).input_ids.shape[0] == 4


def test_tiny_gpt_loss_is_the_same_for_left_and_right_padding(corpus: dict, tmp_path: Path) -> None:
    from lightning_d9d.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=300, max_positions=64, width=32, num_layers=1, num_heads=2).eval()
    samples = [{"input_ids": np.array([5, 6, 7, 8])}, {"input_ids": np.arange(10, 21)}]
    losses = [model._loss(CausalLMCollator(padding_side=side)(samples))[:2] for side in ("left", "right")]
    torch.testing.assert_close(losses[0][0], losses[1][0])
    assert int(losses[0][1]) == int(losses[1][1]) == 3 + 10


# ---------------------------------------------------------------------------------------------------- bad input
def test_missing_tokenizer_file(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
        make_dm(corpus, tmp_path, tokenizer=str(tmp_path / "nope" / "tokenizer.json"))


def test_missing_dataset_path(corpus: dict, tmp_path: Path) -> None:
    missing = str(tmp_path / "no_such_corpus")
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        make_dm(corpus, tmp_path, dataset=missing)
    # A name that is neither a local path nor reachable (offline): one error naming it.
    with pytest.raises(ValueError, match="no-such-org/no-such-dataset"):
        make_dm(corpus, tmp_path, dataset="no-such-org/no-such-dataset").prepare_data()


def test_missing_text_column(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'content'.*columns are \\['text'\\]"):
        make_dm(corpus, tmp_path, text_column="content").prepare_data()


def test_empty_dataset(corpus: dict, tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": []}, features=datasets.Features(text=datasets.Value("string"))).save_to_disk(
        str(tmp_path / "empty")
    )
    with pytest.raises(ValueError, match="empty.*is empty"):
        make_dm(corpus, tmp_path, dataset=str(tmp_path / "empty")).prepare_data()
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(ValueError, match="empty.jsonl.*is empty"):
        make_dm(corpus, tmp_path, dataset=str(tmp_path / "empty.jsonl")).prepare_data()
    (tmp_path / "blank").mkdir()
    pq.write_table(pa.table({"text": ["", ""]}), tmp_path / "blank" / "train.parquet")  # <eos> only
    with pytest.raises(ValueError, match="no document of 2 or more tokens"):
        make_dm(corpus, tmp_path, dataset=str(tmp_path / "blank")).prepare_data()


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_length", 0),
        ("global_batch_size", -1),
        ("microbatch_size", 0),
        ("sort_buffer_size", 0),
        ("pad_to_multiple_of", 0),
        ("num_proc", 0),
        ("padding_side", "middle"),
    ],
)
def test_bad_sizes_and_choices_name_the_field(corpus: dict, tmp_path: Path, field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        make_dm(corpus, tmp_path, **{field: value})


def test_a_batch_size_schedule_is_refused_naming_where_schedules_are(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=\[\[0, 8\], \[5, 16\]\] has phases.*PretrainingData"):
        make_dm(corpus, tmp_path, global_batch_size=[[0, 8], [5, 16]])
