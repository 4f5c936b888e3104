"""One tokenizer loader and one padding-id choice for every DataModule (``lightning_d9d.tokenization.tokenizer``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import make_docs, make_texts, train_tokenizer
from tokenizers import Tokenizer

from lightning_d9d import PretrainingDataModule, TextDataModule
from lightning_d9d.text.tokenize import tokenized_split
from lightning_d9d.tokenization.tokenizer import (
    TokenizerFileNotFoundError,
    pad_token_id,
    read_tokenizer,
    tokenizer_from_json,
)


def test_a_missing_or_unreadable_file_gets_one_error_text(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    with pytest.raises(TokenizerFileNotFoundError, match=r"tokenizer='.*absent.json' is not a file: give the path"):
        read_tokenizer(missing)
    assert issubclass(TokenizerFileNotFoundError, FileNotFoundError)
    assert issubclass(TokenizerFileNotFoundError, ValueError)
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"tokenizer='.*bad.json' is not a valid tokenizers JSON file \(.*\): give"):
        read_tokenizer(tmp_path / "bad.json")


def test_both_datamodule_paths_report_a_missing_tokenizer_alike(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": make_texts(20)}), tmp_path / "docs.parquet")
    missing = str(tmp_path / "absent.json")
    with pytest.raises(ValueError) as text_error:
        TextDataModule(
            dataset=str(tmp_path / "docs.parquet"), tokenizer=missing, global_batch_size=4, microbatch_size=2
        )
    pretraining = PretrainingDataModule(
        train_files=str(tmp_path / "docs.parquet"),
        tokenizer=missing,
        global_batch_size=4,
        microbatch_size=2,
        num_streams=4,
    )
    with pytest.raises(ValueError) as pretraining_error:
        pretraining.setup("fit")
    assert str(text_error.value) == str(pretraining_error.value)


def test_a_tokenizer_object_passes_through_and_json_text_parses_once(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(make_docs(30), tmp_path / "t.json")
    assert read_tokenizer(tokenizer) is tokenizer
    tokenizer.enable_truncation(4)
    tokenizer.enable_padding(length=50)
    loaded = tokenizer_from_json(tokenizer.to_str())
    assert loaded is tokenizer_from_json(tokenizer.to_str())
    assert loaded.padding is None and loaded.truncation is None  # documents come out whole and unpadded


def _tokenizer(vocab: list[str], padding: tuple[int, str] | None = None) -> Tokenizer:
    from tokenizers import models

    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token=vocab[0]))
    if padding is not None:
        tokenizer.enable_padding(pad_id=padding[0], pad_token=padding[1])
    return tokenizer


@pytest.mark.parametrize(
    "vocab, padding, avoid, expected",
    [
        (["<unk>", "a", "<pad>"], (1, "a"), None, 1),  # the tokenizer's own padding setting first
        (["<unk>", "a", "<pad>"], None, None, 2),  # then a usual pad token
        (["<unk>", "</s>", "[PAD]"], None, None, 2),  # in PAD_TOKEN_CANDIDATES' order
        (["<unk>", "a"], None, None, 0),  # the fallback
        (["<bos>", "a"], None, 0, 1),  # ... avoiding BOS
        (["<unk>", "<bos>", "<pad>"], (1, "<bos>"), 1, 2),  # a padding setting that is BOS is skipped
    ],
)
def test_pad_token_id_order_and_fallback(vocab, padding, avoid, expected) -> None:
    assert pad_token_id(_tokenizer(vocab, padding), avoid=avoid) == expected


def test_the_text_path_pads_with_the_tokenizers_saved_padding_id(tmp_path: Path) -> None:
    texts = make_texts(60)
    tokenizer = train_tokenizer(texts)  # WordLevel: <unk> = 0, <|bos|> = 1, no usual pad token
    tokenizer.enable_padding(pad_id=1, pad_token="<|bos|>")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    split = tokenized_split(
        str(tmp_path / "docs.parquet"), "train", str(tmp_path / "tokenizer.json"), "text", 32, cache_dir=str(tmp_path)
    )
    assert split.pad_token_id == 1
