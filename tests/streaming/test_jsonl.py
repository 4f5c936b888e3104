"""JSONL files (plain, gzip, zstd; one frame or many) as groups of whole lines, read like parquet row groups.

Every compression gives back the texts written, group by group, one row per line (a blank line is a row without
text, as are a missing field and JSON null), whatever the lines hold (unicode, a line longer than a group or a
pyarrow block, lines across zstd frames, no final newline). A group of a multi-frame file is read from its own
frames: the frames before it may be garbage. The layout cache is used while the file is unchanged, and rebuilt
when the file is edited or the entry is corrupt. A malformed line is one error naming the file and the line, or,
with ``on_malformed="skip"``, a null row that is counted, the rows after it unmoved. Over s3:// (a moto server)
the rows and the cache work as locally.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import zstandard
from support import moto_server

from lightning_d9d.streaming.sources import jsonl, jsonl_scan
from lightning_d9d.streaming.sources.jsonl import (
    JSONL_SUFFIXES,
    JsonlLayout,
    group_content_key,
    is_jsonl,
    read_jsonl_group,
    read_jsonl_group_keyed,
)
from lightning_d9d.streaming.sources.jsonl_scan import scan_jsonl, scan_jsonl_files
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.sources.storage import Storage

STORAGE = Storage(read_retry_seconds=0.0)
KINDS = ["none", "gzip", "gzip-members", "zstd", "zstd-frames"]
SUFFIX = {"none": ".jsonl", "gzip": ".jsonl.gz", "gzip-members": ".json.gz", "zstd": ".jsonl.zst",
          "zstd-frames": ".jsonl.zstd"}  # fmt: skip


def compress(data: bytes, kind: str, frame_bytes: int = 700) -> bytes:
    """``data`` as ``kind``: multi-frame kinds cut it every ``frame_bytes`` bytes, wherever lines are. A gzip member
    records no time (``mtime=0``): the same lines written again are the same bytes, even a second later."""
    cuts = range(0, max(len(data), 1), frame_bytes)
    if kind == "none":
        return data
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "gzip-members":
        return b"".join(gzip.compress(data[i : i + frame_bytes], mtime=0) for i in cuts)
    compressor = zstandard.ZstdCompressor()
    if kind == "zstd":
        return compressor.compress(data)
    return b"".join(compressor.compress(data[i : i + frame_bytes]) for i in cuts)


def write(path: Path, lines: list[str], kind: str, end: str = "\n", **options: Any) -> Path:
    path.write_bytes(compress((end.join(lines) + (end if lines else "")).encode(), kind, **options))
    return path


def expected(lines: list[str], column: str = "text") -> list[str | None]:
    return [json.loads(line).get(column) if line.strip() else None for line in lines]


def read_all(path: Path, layout: JsonlLayout, **options: Any) -> list[str | None]:
    texts: list[str | None] = []
    for group in range(len(layout.groups)):
        column, skipped = read_jsonl_group(str(path), STORAGE, layout, group, "text", **options)
        assert skipped == 0
        assert len(column) == layout.groups[group].num_rows
        texts += column.to_pylist()
    return texts


def docs(count: int = 120) -> list[str]:
    """Lines of every sort: blank (empty, spaces, a lone CR), null and missing text, unicode, escapes, extra
    fields, leading and trailing spaces."""
    lines = []
    for i in range(count):
        kind = i % 10
        if kind == 0:
            lines.append(["", "   ", "\t", "\r"][i // 10 % 4])
        elif kind == 1:
            lines.append(json.dumps({"id": i, "text": None}))
        elif kind == 2:
            lines.append(json.dumps({"id": i, "other": "no text"}))
        elif kind == 3:
            lines.append(json.dumps({"text": f"naïve café 東京 🙂 {i} " * (i % 7)}, ensure_ascii=False))
        elif kind == 4:
            lines.append(json.dumps({"text": f'escaped \u00e9 \U0001f642 "quotes" \\ \t {i}'}))
        elif kind == 5:
            lines.append("  " + json.dumps({"meta": {"a": [1, 2, {"b": None}]}, "text": f"padded {i}"}) + "  ")
        else:
            lines.append(json.dumps({"id": i, "text": " ".join(["word"] * (i * 3 % 50)) + f" {i}"}))
    return lines


@pytest.fixture(params=["pyarrow", "line by line"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every group parsed by pyarrow, or line by line by the standard library (as a group of a few lines is)."""
    monkeypatch.setattr(jsonl, "SMALL_GROUP_LINES", 0 if request.param == "pyarrow" else 10**9)
    return request.param


# ---------------------------------------------------------------------------------------------- names


def test_suffixes_name_jsonl_files_case_insensitively() -> None:
    for suffix in (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl.zstd"):
        assert suffix in JSONL_SUFFIXES
        assert is_jsonl(f"data/part-0{suffix}") and is_jsonl(f"DATA/PART-0{suffix.upper()}")
    assert is_jsonl("s3://bucket/x.jsonl.zst?endpoint_override=127.0.0.1:9000&scheme=http")
    for name in ("x.json", "x.parquet", "x.jsonl.bz2", "x.jsonl.layout.json", "x.gz"):
        assert not is_jsonl(name)
    assert jsonl.compression_of("A.JSONL.GZ") == "gzip" and jsonl.compression_of("a.json.zstd") == "zstd"
    with pytest.raises(ValueError, match="'x.json' is not a JSONL file"):
        jsonl.compression_of("x.json")


def test_a_directory_lists_parquet_and_jsonl_files_and_a_glob_takes_jsonl(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    for name in ("b.jsonl", "c.jsonl.gz", "sub/d.json.zst", "notes.json", "e.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = [os.path.relpath(path, tmp_path) for path in resolve_files(tmp_path)]
    assert found == ["a.parquet", "b.jsonl", "c.jsonl.gz", "sub/d.json.zst"]
    assert [os.path.basename(p) for p in resolve_files(str(tmp_path / "**" / "*.json.zst"))] == ["d.json.zst"]
    assert resolve_files(str(tmp_path / "b.jsonl")) == [str(tmp_path / "b.jsonl")]


def test_files_without_rows_are_named_with_their_format(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^JSONL file '{empty}' holds no rows \(it has no lines\): give files"):
        RowGroupIndex.scan([str(empty)], "text")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    gz = write(tmp_path / "empty.jsonl.gz", [], "gzip")
    files = [str(empty), str(tmp_path / "empty.parquet"), str(gz)]
    with pytest.raises(ValueError, match=rf"^the 3 files hold no rows: JSONL file '{empty}', parquet file "
                       rf"'{tmp_path / 'empty.parquet'}', JSONL file '{gz}'; give files"):  # fmt: skip
        RowGroupIndex.scan(files, "text")
    # An empty file among others is no error: it has no groups.
    write(tmp_path / "x.jsonl", docs(20), "none")
    assert RowGroupIndex.scan([str(empty), str(tmp_path / "x.jsonl")], "text").total_rows == 20


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_texts_come_back_one_row_per_line_in_every_group(tmp_path: Path, kind: str, end: str, parser: str) -> None:
    lines = docs()
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind, end)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=1000)
    assert layout.compression == {"none": "none", "zstd-frames": "zstd", "gzip-members": "gzip"}.get(kind, kind)
    assert layout.frames > 1 if kind in ("zstd-frames", "gzip-members") else layout.frames == 1
    assert layout.num_lines == len(lines) and len(layout.groups) > 5
    raw = (end.join(lines) + end).encode()
    assert layout.uncompressed_size == len(raw) and layout.size == path.stat().st_size
    want = expected(lines)
    for number, group in enumerate(layout.groups):
        # Groups end at line ends, after at least group_bytes bytes (the last one may be shorter).
        assert raw[group.stop - 1 : group.stop] == b"\n" and (group.start == 0 or raw[group.start - 1] == ord("\n"))
        assert group.stop - group.start >= 1000 or number == len(layout.groups) - 1
        column, skipped = read_jsonl_group(str(path), STORAGE, layout, number, "text")
        assert str(column.type) == "large_string" and skipped == 0
        assert column.to_pylist() == want[group.first_line : group.first_line + group.num_rows]
    assert read_all(path, layout) == want


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_reads_and_decompressor_calls_cut_nothing(tmp_path: Path, monkeypatch, kind: str) -> None:
    """Storage reads, decompressor inputs and outputs of a few bytes: every boundary falls everywhere."""
    monkeypatch.setattr(jsonl, "_READ_BYTES", 17)
    monkeypatch.setattr(jsonl, "_FEED_BYTES", 5)
    monkeypatch.setattr(jsonl, "_GZIP_OUT_BYTES", 7)
    lines = docs(40)
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind, frame_bytes=150)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=400)
    assert read_all(path, layout) == expected(lines)
    monkeypatch.undo()
    assert scan_jsonl(str(path), STORAGE, group_bytes=400) == layout


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_without_a_final_newline_keeps_its_last_line(tmp_path: Path, kind: str) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(30)]
    path = tmp_path / f"x{SUFFIX[kind]}"
    path.write_bytes(compress("\n".join(lines).encode(), kind, frame_bytes=50))
    layout = scan_jsonl(str(path), STORAGE, group_bytes=100)
    assert layout.num_lines == 30
    assert read_all(path, layout) == [f"doc {i}" for i in range(30)]
    # A trailing blank line without a newline is a row too; a final newline adds none.
    path.write_bytes(compress(("\n".join(lines) + "\n  ").encode(), kind))
    assert scan_jsonl(str(path), STORAGE, group_bytes=100).num_lines == 31


@pytest.mark.parametrize("kind", KINDS)
def test_long_lines_make_long_groups_and_cross_frames_and_pyarrow_blocks(tmp_path: Path, kind: str, parser) -> None:
    long_text = "x" * (3 << 20)  # longer than a group, a frame and pyarrow's 1 MiB block
    lines = [json.dumps({"text": "short"}), json.dumps({"text": long_text}), "", json.dumps({"text": "é" * 5000})]
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind, frame_bytes=100_000)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=1 << 20)
    assert [g.num_rows for g in layout.groups] == [2, 2]  # the long line ends the first group, 3 MiB in
    assert layout.groups[0].stop - layout.groups[0].start > 3 << 20
    assert read_all(path, layout) == ["short", long_text, None, "é" * 5000]


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_file_has_no_groups_and_a_blank_one_only_null_rows(tmp_path: Path, kind: str) -> None:
    path = write(tmp_path / f"empty{SUFFIX[kind]}", [], kind)
    layout = scan_jsonl(str(path), STORAGE)
    assert layout.groups == () and layout.num_lines == 0 and layout.uncompressed_size == 0
    path = write(tmp_path / f"blank{SUFFIX[kind]}", ["", " ", "\t \r"], kind)
    layout = scan_jsonl(str(path), STORAGE)
    assert read_all(path, layout) == [None, None, None]


def test_a_byte_order_mark_before_the_first_line_is_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert read_all(path, scan_jsonl(str(path), STORAGE)) == ["first", "second"]


# ---------------------------------------------------------------------------------------------- frames


@pytest.mark.parametrize("kind", ["zstd-frames", "gzip-members"])
def test_a_group_is_read_from_its_own_frames_never_from_the_file_start(tmp_path: Path, kind: str) -> None:
    lines = [json.dumps({"text": f"document {i} " + "w " * (i % 40)}) for i in range(400)]
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind, frame_bytes=1000)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=3000)
    last = layout.groups[-1]
    assert 0 < last.frame_offset < last.frame_stop == layout.size and last.frame_start <= last.start
    # Every compressed byte before the last group's frame becomes garbage (the size stays, so the layout holds).
    data = bytearray(path.read_bytes())
    data[: last.frame_offset] = b"\xff" * last.frame_offset
    path.write_bytes(bytes(data))
    column, _ = read_jsonl_group(str(path), STORAGE, layout, len(layout.groups) - 1, "text")
    assert column.to_pylist() == expected(lines)[last.first_line :]
    with pytest.raises(ValueError, match=rf"x{SUFFIX[kind]}' is not valid"):
        read_jsonl_group(str(path), STORAGE, layout, 0, "text")


@pytest.mark.parametrize("kind", ["zstd", "gzip"])
def test_a_single_frame_file_is_decompressed_from_its_start(tmp_path: Path, kind: str) -> None:
    """The stated cost: each group of a one-frame file starts at frame 0 (a damaged start fails every group)."""
    lines = [json.dumps({"text": f"document {i}"}) for i in range(400)]
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=2000)
    assert len(layout.groups) > 3 and all(g.frame_offset == 0 == g.frame_start for g in layout.groups)
    data = bytearray(path.read_bytes())
    data[12:40] = b"\x00" * 28
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is not valid|changed since it was scanned"):  # garbage out, or an error
        read_jsonl_group(str(path), STORAGE, layout, len(layout.groups) - 1, "text")


def test_a_group_starting_where_a_frame_starts_is_read_from_that_frame(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"line {i}"}) for i in range(20)]
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(b"".join(compressor.compress((line + "\n").encode()) for line in lines))  # a frame a line
    layout = scan_jsonl(str(path), STORAGE, group_bytes=1)
    assert layout.frames == 20 and [g.num_rows for g in layout.groups] == [1] * 20
    assert all(g.frame_start == g.start for g in layout.groups)  # not the frame before, which ends at the newline
    assert all(a.frame_stop == b.frame_offset for a, b in zip(layout.groups, layout.groups[1:]))
    assert read_all(path, layout) == [f"line {i}" for i in range(20)]


def test_skippable_frames_are_passed_over(tmp_path: Path) -> None:
    compressor = zstandard.ZstdCompressor()
    skippable = (0x184D2A50).to_bytes(4, "little") + (6).to_bytes(4, "little") + b"seektb"  # e.g. a seek table
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(compressor.compress(b'{"text": "a"}\n') + skippable + compressor.compress(b'{"text": "b"}\n'))
    layout = scan_jsonl(str(path), STORAGE, group_bytes=1)
    assert read_all(path, layout) == ["a", "b"]


@pytest.mark.parametrize("kind", ["zstd", "gzip"])
def test_truncated_and_invalid_compressed_files_are_named(tmp_path: Path, kind: str) -> None:
    data = compress(b'{"text": "a"}\n' * 1000, kind)
    path = tmp_path / f"cut{SUFFIX[kind]}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"'{path}' is truncated"):
        scan_jsonl(str(path), STORAGE)
    path.write_bytes(b"not compressed at all")
    with pytest.raises(ValueError, match=rf"'{path}' is not valid {kind}"):
        scan_jsonl(str(path), STORAGE)
    with pytest.raises(ValueError, match="does not exist"):
        scan_jsonl(str(tmp_path / f"missing{SUFFIX[kind]}"), STORAGE)


@pytest.mark.parametrize("kind", ["none", "zstd-frames"])
def test_a_file_changed_since_its_scan_is_an_error_not_shifted_rows(tmp_path: Path, kind: str) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(100)]
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=200)
    write(path, [json.dumps({"text": f"doc {i}"}) for i in range(101)], kind)
    with pytest.raises(ValueError, match="changed since it was scanned"):
        read_jsonl_group(str(path), STORAGE, layout, 1, "text")
    # The same size, a newline moved: the group's lines are no longer the ones counted.
    write(path, lines, kind)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=200)
    span = layout.groups[1]
    edited = bytearray((("\n".join(lines)) + "\n").encode())
    edited[span.start + 3] = ord("\n")
    path.write_bytes(compress(bytes(edited), kind))
    with pytest.raises(ValueError, match="changed since it was scanned"):
        read_jsonl_group(str(path), STORAGE, layout, 1, "text")


def test_a_kept_layout_outdated_by_an_edit_with_size_and_time_kept_is_an_error_until_touched(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(100)]
    path, cache = write(tmp_path / "x.jsonl", lines, "none"), str(tmp_path / "cache")
    layout = scan_jsonl(str(path), STORAGE, group_bytes=200, cache_dir=cache)
    stat = path.stat()
    edited = bytearray(path.read_bytes())
    edited[layout.groups[1].start + 3] = ord("\n")  # a line cut in two: same size, the group's lines move
    path.write_bytes(bytes(edited))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    kept = scan_jsonl(str(path), STORAGE, group_bytes=200, cache_dir=cache)
    assert kept == layout  # reused: size and time match
    with pytest.raises(ValueError, match="changed since it was scanned .*touch it first"):
        read_jsonl_group_keyed(str(path), STORAGE, kept, 1, "text", on_malformed="skip")
    path.touch()
    fresh = scan_jsonl(str(path), STORAGE, group_bytes=200, cache_dir=cache)
    assert fresh != layout and fresh.num_lines == 101


# ---------------------------------------------------------------------------------------------- content keys


class _CountingFilesystem:
    """A local filesystem that counts the files opened for reading."""

    def __init__(self, opened: list[str]):
        self.fs, self.opened = pafs.LocalFileSystem(), opened

    def get_file_info(self, path: Any) -> Any:
        return self.fs.get_file_info(path)

    def open_input_file(self, path: str) -> Any:
        self.opened.append(path)
        return self.fs.open_input_file(path)


@dataclasses.dataclass(frozen=True)
class CountingStorage(Storage):
    opened: list = dataclasses.field(default_factory=list)

    def filesystem(self, spec: str) -> Any:
        return _CountingFilesystem(self.opened), super().filesystem(spec)[1]


def same_size_edit(lines: list[str], line: int, kind: str, size: int) -> list[str]:
    """``lines`` with one letter of ``line``'s text replaced such that the file, written as ``kind``, keeps ``size``."""
    text_at = lines[line].index("doc")
    for at in range(text_at, len(lines[line]) - 2):
        for letter in "abcdefghijklmnopqrstuvwxyz":
            edited = list(lines)
            edited[line] = lines[line][:at] + letter + lines[line][at + 1 :]
            if edited[line] != lines[line] and len(compress(("\n".join(edited) + "\n").encode(), kind)) == size:
                return edited
    raise AssertionError("no one-letter edit keeps the file's size")


@pytest.mark.parametrize("kind", KINDS)
def test_a_keyed_read_names_the_bytes_it_decoded_and_a_same_size_edit_changes_the_key(tmp_path: Path, kind: str):
    lines = [json.dumps({"text": f"doc {i:03d} " + "word " * (i % 9)}) for i in range(120)]
    path = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=400)
    assert len(layout.groups) > 3
    keys = []
    for group in range(len(layout.groups)):
        key, stored = group_content_key(str(path), STORAGE, layout, group, "error")
        column, _, read_key = read_jsonl_group_keyed(str(path), STORAGE, layout, group, "text")
        assert read_key == key and column.equals(read_jsonl_group(str(path), STORAGE, layout, group, "text")[0])
        if stored is not None:  # decoded from the bytes the key was made of: the same texts, the same key
            again, _, stored_key = read_jsonl_group_keyed(str(path), STORAGE, layout, group, "text", stored=stored)
            assert again.equals(column) and stored_key == key
        keys.append(key)
    assert len(set(keys)) == len(keys)  # no two groups share a key
    assert group_content_key(str(path), STORAGE, layout, 0, "skip")[0] != keys[0]  # on_malformed decides rows
    # One letter of a middle line replaced, size and modification time kept: the layout is stale and trusted, the
    # edited group's key changes (every group's, in a single-frame file), and its read gives the new text.
    stat, middle = path.stat(), layout.groups[2].first_line + 1
    edited = same_size_edit(lines, middle, kind, stat.st_size)
    write(path, edited, kind)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    new_keys = [group_content_key(str(path), STORAGE, layout, g, "error")[0] for g in range(len(layout.groups))]
    assert new_keys[2] != keys[2]
    column, _, read_key = read_jsonl_group_keyed(str(path), STORAGE, layout, 2, "text")
    span = layout.groups[2]
    assert read_key == new_keys[2]
    assert column.to_pylist() == expected(edited)[span.first_line : span.first_line + span.num_rows]
    if kind in ("none", "zstd-frames", "gzip-members"):
        assert new_keys[0] == keys[0]  # a group of other bytes keeps its key


def test_a_single_frame_file_is_hashed_once_per_process_while_its_size_and_time_hold(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(300)]
    path = write(tmp_path / "one.jsonl.gz", lines, "gzip")
    storage = CountingStorage(read_retry_seconds=0.0)
    layout = scan_jsonl(str(path), STORAGE, group_bytes=300)
    assert len(layout.groups) > 5
    keys = [group_content_key(str(path), storage, layout, g, "error")[0] for g in range(len(layout.groups))]
    assert len(storage.opened) == 1  # the whole file, hashed for the first group, serves the others
    assert keys == [group_content_key(str(path), storage, layout, g, "error")[0] for g in range(len(layout.groups))]
    assert len(storage.opened) == 1
    # A keyed read hashes what it decodes (not the remembered digest), and agrees.
    assert read_jsonl_group_keyed(str(path), storage, layout, 3, "text")[2] == keys[3] and len(storage.opened) == 2
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its times set back as they were: hashed again
    assert group_content_key(str(path), storage, layout, 0, "error")[0] == keys[0] and len(storage.opened) == 3
    assert group_content_key(str(path), storage, layout, 1, "error")[0] == keys[1] and len(storage.opened) == 3


# ---------------------------------------------------------------------------------------------- malformed lines


MALFORMED = {
    "not JSON": ('{"text": "cut', "not valid JSON"),
    "JSON null": ("null", "it is null, not a JSON object"),
    "an array": ('["text"]', "it is an array, not a JSON object"),
    "a string": ('"text"', "it is a string, not a JSON object"),
    "two objects": ('{"text": "a"} {"text": "b"}', "not valid JSON"),
    "an object over two lines": ('{"text":\n"a"}', "not valid JSON"),
    "a bare inf": ('{"text": "a", "score": inf}', "not valid JSON"),
    "a number": ('{"text": 12}', "text_column 'text' holds a number, not a string"),
    "an object": ('{"text": {"a": 1}}', "text_column 'text' holds an object, not a string"),
    "a boolean": ('{"text": true}', "text_column 'text' holds a boolean, not a string"),
    "a list": ('{"text": ["a"]}', "text_column 'text' holds an array, not a string"),
    "a lone surrogate": ('{"text": "\\ud800"}', "not valid UTF-8 or holds a lone surrogate"),
    "bytes that are not UTF-8": ('{"text": "\xff"}', "not valid UTF-8 or holds a lone surrogate"),
}


def malformed_file(tmp_path: Path, bad: str, kind: str = "zstd-frames") -> tuple[Path, JsonlLayout, list[str]]:
    lines = [json.dumps({"text": f"doc {i}"}) if i % 4 else "" for i in range(60)]
    lines[37] = bad  # in the middle of a group after the first
    data = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
    if bad == '{"text": "\xff"}':
        data = data.replace(b'"\xc3\xbf"', b'"\xff"')
    path = tmp_path / f"bad{SUFFIX[kind]}"
    path.write_bytes(compress(data, kind, frame_bytes=100))
    return path, scan_jsonl(str(path), STORAGE, group_bytes=300), lines


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_line_is_one_error_naming_the_file_and_line(tmp_path: Path, case: str, parser: str) -> None:
    bad, problem = MALFORMED[case]
    path, layout, _ = malformed_file(tmp_path, bad)
    group = next(g for g, span in enumerate(layout.groups) if span.first_line <= 37 < span.first_line + span.num_rows)
    assert group > 0
    with pytest.raises(ValueError, match=rf"^line 38 of JSONL file '{path}': .*{problem}"):
        read_jsonl_group(str(path), STORAGE, layout, group, "text")


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_skipping_a_malformed_line_counts_it_as_a_null_row(tmp_path: Path, case: str, parser: str) -> None:
    bad, _ = MALFORMED[case]
    path, layout, _ = malformed_file(tmp_path, bad)
    texts, skipped = [], 0
    for group in range(len(layout.groups)):
        column, count = read_jsonl_group(str(path), STORAGE, layout, group, "text", on_malformed="skip")
        assert len(column) == layout.groups[group].num_rows
        texts += column.to_pylist()
        skipped += count
    good = [f"doc {i}" if i % 4 else None for i in range(60)]
    if case == "an object over two lines":  # two lines, each malformed on its own
        assert skipped == 2 and texts == [*good[:37], None, None, *good[38:]]
    else:
        assert skipped == 1 and texts == [*good[:37], None, *good[38:]]


def test_a_line_reads_the_same_whether_its_group_is_parsed_by_pyarrow_or_line_by_line(tmp_path, monkeypatch) -> None:
    """A group with a malformed line is parsed by the standard library; what both parsers take, both read alike
    (NaN outside the text, bytes that are not UTF-8 outside the text, escapes)."""
    monkeypatch.setattr(jsonl, "SMALL_GROUP_LINES", 0)  # the first group by pyarrow
    accepted = [b'{"text": "a", "score": NaN, "s": -Infinity}', b'{"text": "b", "junk": "\xff"}',
                b'{"text": "\\u00e9\\ud83d\\ude42 \\"q\\" \\\\ \\/"}', b'  {"text" : "d"}  ', b"{}"]  # fmt: skip
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\n".join([*accepted, b"", *accepted, b"[malformed]"]) + b"\n")
    layout = scan_jsonl(str(path), STORAGE, group_bytes=sum(map(len, accepted)) + 6)
    assert [g.num_rows for g in layout.groups] == [6, 6]
    fast, skipped_fast = read_jsonl_group(str(path), STORAGE, layout, 0, "text", on_malformed="skip")
    slow, skipped_slow = read_jsonl_group(str(path), STORAGE, layout, 1, "text", on_malformed="skip")
    assert (skipped_fast, skipped_slow) == (0, 1)
    assert fast.to_pylist() == ["a", "b", 'é🙂 "q" \\ /', "d", None, None]
    assert slow.to_pylist() == ["a", "b", 'é🙂 "q" \\ /', "d", None, None]


def test_a_group_opening_with_json_null_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """pyarrow 26's read_json crashes the process on a first row ``null``: it must never see one."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'null\n{"text": "a"}\n')
    with pytest.raises(ValueError, match="line 1 of JSONL file .*it is null, not a JSON object"):
        read_jsonl_group(str(path), STORAGE, scan_jsonl(str(path), STORAGE), 0, "text")


def test_other_text_columns_and_bad_settings(tmp_path: Path) -> None:
    path = write(tmp_path / "x.jsonl", [json.dumps({"text": 1, "body": "b"}), json.dumps({"body": "c"})], "none")
    layout = scan_jsonl(str(path), STORAGE)
    assert read_jsonl_group(str(path), STORAGE, layout, 0, "body")[0].to_pylist() == ["b", "c"]
    with pytest.raises(ValueError, match="on_malformed='ignore' must be 'error' or 'skip'"):
        read_jsonl_group(str(path), STORAGE, layout, 0, "body", on_malformed="ignore")  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="group 1 of JSONL file"):
        read_jsonl_group(str(path), STORAGE, layout, 1, "body")
    with pytest.raises(ValueError, match="group_bytes=0 must be an integer >= 1"):
        scan_jsonl(str(path), STORAGE, group_bytes=0)


# ---------------------------------------------------------------------------------------------- layout cache


def test_a_layout_is_json_and_a_broken_one_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "x.jsonl.zst", docs(), "zstd-frames")
    layout = scan_jsonl(str(path), STORAGE, group_bytes=500)
    assert JsonlLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    for field, value in [("stop", 1), ("first_line", 3), ("num_rows", 0), ("frame_stop", 10**9)]:
        data = layout.to_dict()
        data["groups"][field][1] = value
        with pytest.raises(ValueError, match="not a JSONL layout"):
            JsonlLayout.from_dict(data)
    for broken in [{}, {**layout.to_dict(), "compression": "bz2"}, {**layout.to_dict(), "uncompressed_size": 1}]:
        with pytest.raises(ValueError, match="not a JSONL layout"):
            JsonlLayout.from_dict(broken)


def cache_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.layouts.json"))


def test_the_cache_is_used_while_the_file_is_unchanged_and_rebuilt_after_an_edit(tmp_path: Path, monkeypatch) -> None:
    path = write(tmp_path / "x.jsonl.gz", docs(), "gzip")
    cache = tmp_path / "cache"
    first = scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache))
    assert len(cache_entries(cache)) == 1 and not list(cache.glob(".layout-*"))  # no temporary left over
    assert first.path == str(path) and first.mtime_ns == path.stat().st_mtime_ns
    scans = []
    original = jsonl_scan._scan
    monkeypatch.setattr(jsonl_scan, "_scan", lambda *args: scans.append(1) or original(*args))
    assert scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache)) == first and scans == []
    monkeypatch.chdir(tmp_path)  # the same file by a relative path: the same entry
    assert scan_jsonl("x.jsonl.gz", STORAGE, group_bytes=800, cache_dir="cache") == first and scans == []
    # Another group size is another entry.
    assert scan_jsonl(str(path), STORAGE, group_bytes=900, cache_dir=str(cache)) != first and len(scans) == 1
    assert len(cache_entries(cache)) == 2
    # An edit (new size and time) makes the entry stale: rebuilt, and replaced.
    write(path, docs(130), "gzip")
    edited = scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache))
    assert len(scans) == 2 and edited.num_lines == 130 and edited.digest != first.digest
    assert scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache)) == edited and len(scans) == 2
    # An edit that keeps size but not time is stale too.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache)).mtime_ns == stat.st_mtime_ns + 10**9
    assert len(scans) == 3 and len(cache_entries(cache)) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "groups that do not tile", "another version"])
def test_a_corrupt_cache_entry_is_rebuilt_never_trusted(tmp_path: Path, damage: str) -> None:
    path = write(tmp_path / "x.jsonl", docs(), "none")
    cache = tmp_path / "cache"
    layout = scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache))
    (entry,) = cache_entries(cache)
    text = entry.read_text()
    data = json.loads(text)
    if damage == "garbage":
        entry.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "groups that do not tile":
        data["groups"]["num_rows"][0] += 1
        entry.write_text(json.dumps(data))
    else:
        data["version"] = 99
        entry.write_text(json.dumps(data))
    assert scan_jsonl(str(path), STORAGE, group_bytes=800, cache_dir=str(cache)) == layout
    assert JsonlLayout.from_dict(layout.to_dict()) == layout
    assert json.loads(entry.read_text())["files"]["digest"] == [layout.digest]  # rewritten whole


def test_an_unusable_cache_warns_once_and_the_layouts_are_still_given(tmp_path: Path) -> None:
    paths = [str(write(tmp_path / f"x{i}.jsonl", docs(), "none")) for i in range(5)]
    (tmp_path / "file").write_text("a file, not a directory")
    with pytest.warns(UserWarning, match=r"JSONL layout cache '.*file': cannot read it") as caught:
        layouts = scan_jsonl_files(paths, STORAGE, cache_dir=str(tmp_path / "file"))
    assert len(caught) == 1  # one warning, not one per file
    assert [layout.num_lines for layout in layouts] == [len(docs())] * 5
    assert (tmp_path / "file").read_text() == "a file, not a directory"


def test_many_files_scan_as_each_alone_and_a_large_file_keeps_a_record_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [str(write(tmp_path / f"x{i}{SUFFIX[kind]}", docs(20 + i), kind)) for i, kind in enumerate(KINDS)]
    alone = [scan_jsonl(path, STORAGE, group_bytes=300) for path in paths]
    cache = tmp_path / "cache"
    assert scan_jsonl_files(paths, STORAGE, group_bytes=300, cache_dir=str(cache)) == alone
    assert len(cache_entries(cache)) == 1 and not list(cache.glob("*.layout.json"))  # one record for the list
    scans: list[str] = []
    original = jsonl_scan._scan
    monkeypatch.setattr(jsonl_scan, "_scan", lambda *args: scans.append(args[3]) or original(*args))
    assert scan_jsonl_files(paths, STORAGE, group_bytes=300, cache_dir=str(cache)) == alone and scans == []
    # Files from 1 KB on keep a record of their own: a list that gains a file rescans its small files only.
    monkeypatch.setattr(jsonl_scan, "OWN_RECORD_BYTES", 1000)
    large = [path for path in paths if os.path.getsize(path) >= 1000]
    assert 0 < len(large) < len(paths)
    fresh = tmp_path / "fresh"
    scan_jsonl_files(paths[:-1], STORAGE, group_bytes=300, cache_dir=str(fresh))
    assert len(list(fresh.glob("*.layout.json"))) == len([p for p in large if p != paths[-1]])
    scans.clear()
    assert scan_jsonl_files(paths, STORAGE, group_bytes=300, cache_dir=str(fresh)) == alone
    assert sorted(scans) == sorted(p for p in paths if p not in large or p == paths[-1])


# ---------------------------------------------------------------------------------------------- s3


@pytest.fixture(scope="module")
def s3() -> Any:
    """A moto S3 server on 127.0.0.1 with a bucket."""
    import boto3

    with moto_server() as (_, endpoint):
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                              aws_secret_access_key="test")  # fmt: skip
        client.create_bucket(Bucket="corpus")
        yield {"client": client, "endpoint": endpoint, "port": int(endpoint.rsplit(":", 1)[1])}


@pytest.fixture
def s3_env(s3: dict, monkeypatch, tmp_path: Path) -> dict:
    """No real AWS settings reach the test: credentials, region and endpoint are the server's."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "gzip", "zstd-frames"])
def test_over_s3_rows_equal_a_local_copys_and_the_cache_lives_in_the_bucket(
    s3_env: dict, tmp_path: Path, monkeypatch, kind: str
) -> None:
    lines = docs(200)
    local = write(tmp_path / f"x{SUFFIX[kind]}", lines, kind)
    key = f"data/{kind}/x{SUFFIX[kind]}"
    s3_env["client"].upload_file(str(local), "corpus", key)
    query = f"?endpoint_override=127.0.0.1:{s3_env['port']}&scheme=http"
    url = f"s3://corpus/{key}{query}"
    cache = f"s3://corpus/layouts/{kind}{query}"
    layout = scan_jsonl(url, STORAGE, group_bytes=1000, cache_dir=cache)
    here = scan_jsonl(str(local), STORAGE, group_bytes=1000)
    assert layout.digest == here.digest and layout.groups == here.groups and layout.path == f"s3://corpus/{key}"
    assert read_all(url, layout) == expected(lines)  # type: ignore[arg-type]
    # The cache entry is one object in the bucket; the next scan reads it instead of the file.
    listed = s3_env["client"].list_objects_v2(Bucket="corpus", Prefix=f"layouts/{kind}/")["Contents"]
    assert len(listed) == 1 and listed[0]["Key"].endswith(".layouts.json")
    monkeypatch.setattr(jsonl_scan, "_scan", lambda *args: pytest.fail("scanned despite a cached layout"))
    assert scan_jsonl(url, STORAGE, group_bytes=1000, cache_dir=cache) == layout
    assert [os.path.basename(p.split("?")[0]) for p in resolve_files(f"s3://corpus/data/{kind}{query}")] == [
        f"x{SUFFIX[kind]}"
    ]
