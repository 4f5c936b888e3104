"""Every Arrow string type a parquet writer produces is read as text; bytes that are not UTF-8 are one clear error.

The same documents written as string, large_string, string_view and dictionary-encoded strings (what pandas'
Categorical writes) give the same rows. A document that is not valid UTF-8 (a broken byte sequence, or an encoded
lone surrogate, which some writers emit) fails with one error naming the file, the row group and the row, at
setup or when a stream meets it later.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import make_texts, stream_spec, train_tokenizer

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.streams.stream import TokenStream

TEXTS = make_texts(200, seed=8)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    train_tokenizer(TEXTS, root / "tokenizer.json")
    plain = pa.array(TEXTS, pa.string())
    columns = {
        "string": plain,
        "large_string": plain.cast(pa.large_string()),
        "string_view": plain.cast(pa.string_view()),
        "dictionary": plain.dictionary_encode(),
        "large_dictionary": plain.cast(pa.large_string()).dictionary_encode(),
    }
    for name, column in columns.items():
        (root / name).mkdir()
        pq.write_table(pa.table({"text": column}), root / name / "part-000.parquet", row_group_size=40)
    (root / "categorical").mkdir()
    pd.DataFrame({"text": pd.Categorical(TEXTS)}).to_parquet(root / "categorical" / "part-000.parquet",
                                                               row_group_size=40)  # fmt: skip
    return root


def make_dm(root: Path, files: str, **changes) -> PretrainingDataModule:
    options = dict(
        train_files=files,
        tokenizer=str(root / "tokenizer.json"),
        seq_len=16,
        global_batch_size=4,
        microbatch_size=2,
        num_streams=2,
        num_workers=0,
        tokenizer_batch_size=8,
        steps_per_epoch=8,
    )
    options.update(changes)
    return PretrainingDataModule(**options)


@pytest.mark.parametrize("kind", ["large_string", "string_view", "dictionary", "large_dictionary", "categorical"])
def test_every_string_type_gives_the_rows_of_plain_strings(root: Path, kind: str) -> None:
    index = RowGroupIndex.scan(resolve_files(str(root / kind)), "text")
    assert [t for g in range(len(index)) for t in index.read_texts(g)] == TEXTS
    assert index.read_texts(1, [3, 0]) == [TEXTS[43], TEXTS[40]]
    want = make_dm(root, str(root / "string"))
    got = make_dm(root, str(root / kind), num_workers=2)
    want.setup("fit")
    got.setup("fit")
    assert got.fingerprint.sources[0][2] != () and got.steps_per_epoch == want.steps_per_epoch
    pairs = list(zip(got.train_dataloader(), want.train_dataloader(), strict=True))
    assert len(pairs) == 16
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids) for a, b in pairs)


def write_with_bad_row(path: Path, bad: bytes, row: int) -> None:
    """40 good documents and, at ``row``, one whose bytes are not UTF-8, in row groups of 10."""
    values = [text.encode() for text in TEXTS[:40]]
    values[row] = b"starts well " + bad + b" then ends"
    column = pa.array(values, pa.binary()).view(pa.string())  # a writer that did not check its bytes
    pq.write_table(pa.table({"text": column}), path, row_group_size=10)


BAD_BYTES = {"invalid": b"\xff\xfe", "lone_surrogate": b"\xed\xa0\x80"}


@pytest.mark.parametrize("bad", list(BAD_BYTES))
def test_text_that_is_not_utf8_is_named_by_file_row_group_and_row_at_setup(root: Path, tmp_path: Path, bad: str):
    """Where setup samples the text to size the epoch, it meets the row and names it; where ``steps_per_epoch`` is
    given, setup reads no text, and the first batch names the row in the same words."""
    path = tmp_path / "broken.parquet"
    write_with_bad_row(path, BAD_BYTES[bad], row=23)
    message = r"row group 2 of parquet file '.*broken\.parquet', row 3: the text is not valid UTF-8"
    with pytest.raises(ValueError, match=message):
        make_dm(root, str(path), steps_per_epoch=None).setup("fit")
    given = make_dm(root, str(path), num_streams=1, global_batch_size=2)
    given.setup("fit")
    with pytest.raises(ValueError, match=message):
        next(iter(given.train_dataloader()))
    given.teardown("fit")


@pytest.mark.parametrize("bad", list(BAD_BYTES))
def test_text_that_is_not_utf8_is_named_when_a_stream_meets_it(root: Path, tmp_path: Path, bad: str) -> None:
    path = tmp_path / "broken.parquet"
    write_with_bad_row(path, BAD_BYTES[bad], row=37)
    index = RowGroupIndex.scan([str(path)], "text")  # footers only: nothing has read the row yet
    tokenizer = train_tokenizer(TEXTS)
    spec = stream_spec(tokenizer, index, "concat", streams=1, seq_len=16)
    message = r"row group 3 of parquet file '.*broken\.parquet', row 7: the text is not valid UTF-8"
    with pytest.raises(ValueError, match=message):
        for _ in zip(range(1000), TokenStream(spec, 0).blocks(itertools.repeat(2))):
            pass
