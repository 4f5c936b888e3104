"""The token cache never serves stale tokens: entries are found by the content they were made from.

Edits the footer cannot see (a same-length word swap in a middle row of an uncompressed or a zstd parquet file,
whose footer digest stays the same), files of equal footers in different folders, and a JSONL file edited with its
size and modification time kept (so its cached layout is trusted): each run with the cache trains the rows of a run
without it, and the entry read for the edited unit holds the edited text's ids. An edit between a unit's lookup and
its read cannot store one text's tokens under another's key. A cache on unreachable object storage is one warning
for parquet and JSONL alike, and a damaged JSONL entry is named by its file and lines.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import WORDS, RankDataModule, free_port, make_docs, run_steps, train_tokenizer
from tokenizers import Tokenizer

from lightning_d9d.streaming.sources.jsonl_scan import scan_jsonl_files
from lightning_d9d.streaming.sources.source import JSONL_GROUP_BYTES, RowGroupIndex, _parquet_groups
from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.tokens.token_cache import TokenCache, TokenCacheWarning

FILES, ROWS, EDITED_ROW = 4, 16, 8
STEPS = 12  # more than a pass: every unit is read whole, and so cached


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("content")
    docs = make_docs(FILES * ROWS, seed=5, max_words=30, long_every=9, long_words=90, empties=False)
    train_tokenizer(docs, root / "tokenizer.json")
    (root / "docs.json").write_text(json.dumps(docs))
    return root


def texts_of(root: Path, file: int) -> list[str]:
    return json.loads((root / "docs.json").read_text())[file * ROWS : (file + 1) * ROWS]


def write_parquet_file(path: Path, texts: list[str], compression: str, row_group_size: int = ROWS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, compression=compression,
                   row_group_size=row_group_size)  # fmt: skip


def footer_digest(path: Path) -> int:
    """The digest the resume check (and, before content keys, the token cache) knew the file by."""
    return _parquet_groups(str(path), "text", Storage())[2]


def word_swaps(text: str) -> list[str]:
    """``text`` with one word replaced by another of the same length, every way."""
    words = text.split(" ")
    return [" ".join([*words[:at], other, *words[at + 1 :]]) for at in range(len(words)) for other in WORDS
            if other != words[at]]  # fmt: skip


def edit_keeping_the_footer(path: Path, texts: list[str], row: int, compression: str, **options) -> list[str]:
    """Rewrite ``path`` with row ``row`` given a same-length word swap that leaves the footer digest as it was."""
    before = footer_digest(path)
    for swapped in word_swaps(texts[row]):
        edited = [*texts[:row], swapped, *texts[row + 1 :]]
        write_parquet_file(path, edited, compression, **options)
        if footer_digest(path) == before:
            return edited
    raise AssertionError("no word swap keeps the footer")


def datamodule(root: Path, files: Path, cache: Path | None, **changes) -> RankDataModule:
    options = dict(
        train_files=str(files), tokenizer=str(root / "tokenizer.json"), seq_len=24, global_batch_size=8,
        microbatch_size=2, num_streams=2, num_workers=0, steps_per_epoch=1000, tokenizer_batch_size=8,
        bestfit_buffer_size=16, token_cache=None if cache is None else str(cache),
    )  # fmt: skip
    options.update(changes)
    dm = RankDataModule(**options)
    dm.setup("fit")
    return dm


def ids(root: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(root / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def cached_ids(dm: RankDataModule, path: Path, start: int, stop: int, row: int) -> list[int]:
    """The ids the cache holds now for ``row`` of the unit ``[start, stop)`` of ``path``'s row group holding it."""
    cache = dm.train_spec.sources[0].cache
    index = cache.index
    group = next(g for g in range(len(index)) if index.files[int(index.file_of[g])] == str(path)
                 and int(index.group_in_file[g]) == row // (stop - start))  # fmt: skip
    unit = cache.load(group, start, stop)
    assert unit is not None, "the edited unit was cached again"
    return unit.ids(unit.rows.tolist().index(row % (stop - start) + start)).tolist()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_same_length_edit_the_footer_cannot_see_is_never_served_stale_tokens(
    root: Path, tmp_path: Path, compression: str
) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    for file in range(FILES):
        write_parquet_file(data / f"part-{file}.parquet", texts_of(root, file), compression)
    old_rows = run_steps(datamodule(root, data, cache), STEPS)
    assert len(list(cache.rglob("*.tok"))) == FILES  # every unit cached
    target, texts = data / "part-1.parquet", texts_of(root, 1)
    before = footer_digest(target)
    edited = edit_keeping_the_footer(target, texts, EDITED_ROW, compression)
    assert footer_digest(target) == before  # the edit is invisible to the footer: only the content key sees it
    want = run_steps(datamodule(root, data, None), STEPS)
    assert want != old_rows
    dm = datamodule(root, data, cache)
    assert run_steps(dm, STEPS) == want
    held = cached_ids(dm, target, 0, ROWS, EDITED_ROW)
    assert held == ids(root, edited[EDITED_ROW]) != ids(root, texts[EDITED_ROW])


def test_files_of_equal_footers_in_other_folders_share_no_entry(root: Path, tmp_path: Path) -> None:
    """One file, then another folder's file of the same name and footer but another middle row: it is not served the
    first one's tokens (nor the first the second's, afterwards)."""
    first, second, cache = tmp_path / "a" / "part.parquet", tmp_path / "b" / "c" / "part.parquet", tmp_path / "cache"
    texts = [text for file in range(FILES) for text in texts_of(root, file)]
    write_parquet_file(first, texts, "none", row_group_size=ROWS)
    write_parquet_file(second, texts, "none", row_group_size=ROWS)
    edited = edit_keeping_the_footer(second, texts, ROWS + EDITED_ROW, "none", row_group_size=ROWS)
    assert footer_digest(first) == footer_digest(second)
    want = {path: run_steps(datamodule(root, path, None), STEPS) for path in (first, second)}
    assert want[first] != want[second]
    for path in (first, second, first):
        dm = datamodule(root, path, cache)
        assert run_steps(dm, STEPS) == want[path]
    assert cached_ids(dm, first, 0, ROWS, ROWS + EDITED_ROW) == ids(root, texts[ROWS + EDITED_ROW])
    second_dm = datamodule(root, second, cache)
    assert cached_ids(second_dm, second, 0, ROWS, ROWS + EDITED_ROW) == ids(root, edited[ROWS + EDITED_ROW])


def write_jsonl(path: Path, texts: list[str], kind: str) -> None:
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    if kind == "zst":  # frames of a few lines: the edit is inside one
        lines = b"".join(zstandard.ZstdCompressor().compress(lines[a : a + 700]) for a in range(0, len(lines), 700))
    path.write_bytes(lines)


@pytest.mark.parametrize("kind", ["jsonl", "zst"])
def test_a_jsonl_file_edited_with_its_size_and_time_kept_is_never_served_stale_tokens(
    root: Path, tmp_path: Path, kind: str
) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    suffix = ".jsonl" if kind == "jsonl" else ".jsonl.zst"
    for file in range(FILES):
        write_jsonl(data / f"part-{file}{suffix}", texts_of(root, file), kind)
    old_rows = run_steps(datamodule(root, data, cache), STEPS)
    target, texts = data / f"part-1{suffix}", texts_of(root, 1)
    stat = target.stat()
    for swapped in word_swaps(texts[EDITED_ROW]):
        edited = [*texts[:EDITED_ROW], swapped, *texts[EDITED_ROW + 1 :]]
        write_jsonl(target, edited, kind)
        if target.stat().st_size == stat.st_size:
            break
    else:
        raise AssertionError("no word swap keeps the file's size")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # The cached layout is trusted (size and time match): it is the one scanned before the edit.
    paths = [str(path) for path in sorted(data.iterdir())]
    layouts = scan_jsonl_files(paths, Storage(), group_bytes=JSONL_GROUP_BYTES, cache_dir=str(cache / "jsonl-layouts"))
    fresh = scan_jsonl_files(paths, Storage(), group_bytes=JSONL_GROUP_BYTES)
    assert layouts[1].digest != fresh[1].digest and layouts[0] == fresh[0]
    shutil.copytree(data, tmp_path / "copy")  # the edited files without any cache
    want = run_steps(datamodule(root, tmp_path / "copy", None), STEPS)
    assert want != old_rows
    dm = datamodule(root, data, cache)
    assert run_steps(dm, STEPS) == want
    assert cached_ids(dm, target, 0, ROWS, EDITED_ROW) == ids(root, edited[EDITED_ROW]) != ids(root, texts[EDITED_ROW])


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_the_texts_tokenized_for_an_entry_are_those_of_the_bytes_its_key_was_made_of(
    root: Path, tmp_path: Path, kind: str
) -> None:
    """An edit between a unit's lookup and its read: the read decodes the bytes the lookup hashed, so its tokens can
    only be stored under the key of the text they come from; the next lookup and read meet the edit together."""
    texts = texts_of(root, 0)
    path = tmp_path / f"part.{kind}"
    if kind == "parquet":
        write_parquet_file(path, texts, "none")
    else:
        write_jsonl(path, texts, "jsonl")
    index = RowGroupIndex.scan([str(path)], "text")
    key = index.content_key(0)
    if kind == "parquet":
        edited = edit_keeping_the_footer(path, texts, EDITED_ROW, "none")
    else:
        edited = [*texts[:EDITED_ROW], word_swaps(texts[EDITED_ROW])[0], *texts[EDITED_ROW + 1 :]]
        write_jsonl(path, edited, "jsonl")
    read, _, read_key = index.read_keyed(0, None)
    assert (read, read_key) == (texts, key)
    read, _, read_key = index.read_keyed(0, None)
    assert read == edited and read_key != key and read_key == index.content_key(0)


@pytest.mark.slow
def test_an_unreachable_object_storage_cache_is_one_warning_and_the_run_trains_uncached(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """parquet and JSONL alike: setup does not fail (JSONL's layout cache lives there too), nothing waits per unit."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()  # nothing listens there
    for kind in ("parquet", "jsonl"):
        down = f"s3://tokens/{kind}-cache?endpoint_override=127.0.0.1:{port}&scheme=http"
        data = tmp_path / kind
        for file in range(FILES):
            if kind == "parquet":
                write_parquet_file(data / f"part-{file}.parquet", texts_of(root, file), "snappy")
            else:
                data.mkdir(exist_ok=True)
                write_jsonl(data / f"part-{file}.jsonl", texts_of(root, file), "jsonl")
        want = run_steps(datamodule(root, data, None), STEPS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm = datamodule(root, data, None, token_cache=down, read_retry_seconds=0.5)
            assert run_steps(dm, STEPS) == want
        said = [str(w.message) for w in caught if "-cache" in str(w.message)]
        assert len(said) == 1 and "cannot be reached" in said[0] and "trains without it" in said[0], said
        assert dm.train_spec.sources[0].cache is None


def test_a_damaged_jsonl_entry_is_named_by_its_file_and_lines(root: Path, tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for file in range(FILES):
        write_jsonl(data / f"part-{file}.jsonl", texts_of(root, file), "jsonl")
    dm = datamodule(root, data, cache)
    want = run_steps(dm, STEPS)
    stream_cache = dm.train_spec.sources[0].cache
    folder = cache / stream_cache.cache.digest / TokenCache.file_folder(stream_cache.index.file_digests[1])
    (entry,) = folder.glob("*.tok")
    entry.write_bytes(entry.read_bytes()[:-3])
    with pytest.warns(TokenCacheWarning, match=rf"\(JSONL file '{data / 'part-1.jsonl'}', lines 1\.\.{ROWS}\)"):
        assert run_steps(datamodule(root, data, cache), STEPS) == want


def test_inspects_coverage_reads_no_text(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    for file in range(FILES):
        write_parquet_file(data / f"part-{file}.parquet", texts_of(root, file), "zstd", row_group_size=ROWS // 2)
    dm = datamodule(root, data, cache)
    (line,) = dm.token_cache_report()
    assert f"source 'train': 0 of {2 * FILES} units cached (0 %), 0.0 MiB" in line, line
    run_steps(dm, 3)  # the units read whole are cached
    (next(cache.rglob("*.tok"))).unlink()  # and one is not
    stored = len(list(cache.rglob("*.tok")))
    assert 0 < stored < 2 * FILES
    monkeypatch.setattr(RowGroupIndex, "content_key", lambda *_: pytest.fail("inspect read a unit's text"))
    (line,) = datamodule(root, data, cache).token_cache_report()
    share = round(100 * stored / (2 * FILES))
    assert f"{stored} of {2 * FILES} units cached ({share} %)" in line, line
