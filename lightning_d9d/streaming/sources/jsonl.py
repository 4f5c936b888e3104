"""JSONL: compressed or plain JSON-lines files as groups of whole lines, read like parquet row groups.

A one-off scan (``jsonl_scan.py``) cuts a file's text into *groups* of whole lines (a line is a row) of about
``group_bytes``, noting the compressed frames each group starts and ends in, so a read decompresses only those.
A group is parsed by ``pyarrow.json`` after a cheap check that each non-blank line is one object, else (and when it
has a few lines only) line by line by the standard library, which names the first malformed line (or, with
``on_malformed="skip"``, makes it a counted null row: row numbers never move). A group's *content key* (what names
its cached tokens) is a digest of its stored range (its bytes in a plain file, its frames in a compressed one) and
of the offsets that decide its decoding; a keyed read hashes the very bytes it decodes. Trade-off: in a
single-frame file a group starts inside the one frame, so a pass costs about ``G / 2`` full decompressions (and a
keyed read hashes the whole file); multi-frame (``pzstd``, ``bgzip``) and plain files read only a group's bytes.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import zstandard

from lightning_d9d.core.digest import content_key, hasher
from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.sources.storage import Storage, StorageError, canonical

# The suffixes of JSONL files (matched case-insensitively) and their compression. Plain ``.json`` is left out: it
# is as often one JSON document as JSON lines, and layout cache files end in ``.json``.
Compression = Literal["none", "gzip", "zstd"]
_COMPRESSIONS: dict[str, Compression] = {"": "none", ".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_SUFFIX_COMPRESSION: dict[str, Compression] = {
    base + ending: compression
    for base in (".jsonl", ".json")
    for ending, compression in _COMPRESSIONS.items()
    if (base, ending) != (".json", "")
}
JSONL_SUFFIXES: tuple[str, ...] = tuple(_SUFFIX_COMPRESSION)

# Parsing holds a group's bytes, Arrow column and Python strings at once in every stream, so larger groups cost
# memory; smaller ones make a request, a partial frame and a parse call a larger share of each read and, in
# single-frame files, multiply the re-decompressed prefixes.
DEFAULT_GROUP_BYTES = 32 << 20
# Bytes asked of storage per read: on object storage each read is a request, so reads are large.
_READ_BYTES = 8 << 20
# Compressed bytes given to a decompressor per call, which bounds what one call returns (zstd output is unbounded).
_FEED_BYTES = 256 << 10
# Most decompressed bytes a gzip call returns.
_GZIP_OUT_BYTES = 4 << 20
_JSON_SPACE = b" \t\r\n"
_OPEN_BRACE, _CLOSE_BRACE, _NEWLINE, _CR = ord("{"), ord("}"), ord("\n"), ord("\r")
_BOM = b"\xef\xbb\xbf"
# Groups of at most this many lines are parsed line by line (as the stdlib parses any line pyarrow's parse
# refuses, so every group's texts are those the stdlib reads); many small files make many such groups.
SMALL_GROUP_LINES = 32


def compression_of(path: str) -> Compression:
    """The compression of a JSONL file, from its suffix (ValueError for another suffix)."""
    name = canonical(os.fspath(path)).lower()
    for suffix, compression in _SUFFIX_COMPRESSION.items():
        if name.endswith(suffix):
            return compression
    raise ValueError(f"{redact(os.fspath(path))!r} is not a JSONL file: its name must end in one of {JSONL_SUFFIXES}")


def is_jsonl(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a JSONL file (by suffix, case-insensitively; a URL's query is ignored)."""
    return canonical(os.fspath(path)).lower().endswith(JSONL_SUFFIXES)


@dataclass(frozen=True)
class JsonlGroup:
    """One group of lines of a JSONL file.

    Attributes:
        start, stop: its decompressed bytes ``[start, stop)``, whole lines.
        first_line, num_rows: its first line (0-based) and its lines, blank ones included.
        frame_offset, frame_start: compressed offset and decompressed start of the frame holding ``start``.
        frame_stop: the compressed offset past the frame holding ``stop - 1``.
    """

    start: int
    stop: int
    first_line: int
    num_rows: int
    frame_offset: int = 0
    frame_start: int = 0
    frame_stop: int = 0


_GROUP_FIELDS = ("start", "stop", "first_line", "num_rows", "frame_offset", "frame_start", "frame_stop")


@dataclass(frozen=True)
class JsonlLayout:
    """What a scan of one JSONL file found: its identity (``path``, ``size``, ``mtime_ns``, SHA-256 ``digest``), its
    ``compression`` and ``frames``, ``uncompressed_size``, the ``group_bytes`` it was cut with, and its ``groups``.
    """

    path: str
    size: int
    mtime_ns: int | None
    digest: str
    compression: Compression
    frames: int
    uncompressed_size: int
    group_bytes: int
    groups: tuple[JsonlGroup, ...]

    @property
    def num_rows(self) -> np.ndarray:
        return np.asarray([group.num_rows for group in self.groups], np.int64)

    @property
    def num_lines(self) -> int:
        return sum(group.num_rows for group in self.groups)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _LAYOUT_FIELDS}
        out["groups"] = {name: [getattr(group, name) for group in self.groups] for name in _GROUP_FIELDS}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> JsonlLayout:
        """Read a layout written by :meth:`to_dict`; ValueError for a bad field or groups that do not tile the file."""
        try:
            files: dict[str, Any] = {name: [data[name]] for name in _LAYOUT_FIELDS}
            groups = data["groups"]
            files["groups"] = [len(groups["start"])]
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a JSONL layout: {err!r}") from err
        return layouts_from_columns({"files": files, "groups": groups})[0]


_LAYOUT_FIELDS = ("path", "size", "mtime_ns", "digest", "compression", "frames", "uncompressed_size", "group_bytes")


def layouts_to_columns(layouts: Sequence[JsonlLayout]) -> dict[str, Any]:
    """Many layouts as JSON-serialisable columns: per file its fields and group count, then every group's fields."""
    files: dict[str, Any] = {name: [getattr(layout, name) for layout in layouts] for name in _LAYOUT_FIELDS}
    files["groups"] = [len(layout.groups) for layout in layouts]
    groups = {name: [getattr(g, name) for layout in layouts for g in layout.groups] for name in _GROUP_FIELDS}
    return {"files": files, "groups": groups}


def layouts_from_columns(data: Any) -> list[JsonlLayout]:
    """Read layouts written by :func:`layouts_to_columns`, checked all at once; ValueError for a bad field or a file
    whose groups do not tile its text (consecutive bytes and lines, frames inside the file)."""
    try:
        files, groups = data["files"], data["groups"]
        file_columns = [files[name] for name in (*_LAYOUT_FIELDS, "groups")]
        group_columns = [groups[name] for name in _GROUP_FIELDS]
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a JSONL layout: {err!r}") from err
    _check_columns(file_columns, group_columns)
    paths, sizes, times, digests, compressions, frames, uncompressed, group_bytes, counts = file_columns
    made = list(map(JsonlGroup, *group_columns))
    out, at = [], 0
    for i, count in enumerate(counts):
        out.append(JsonlLayout(paths[i], sizes[i], times[i], digests[i], compressions[i], frames[i], uncompressed[i],
                               group_bytes[i], tuple(made[at : at + count])))  # fmt: skip
        at += count
    return out


def _check_columns(files: list[Any], groups: list[Any]) -> None:
    """Raise ValueError unless the columns describe sound layouts (see :func:`layouts_from_columns`)."""

    def integers(values: Any, none: bool = False) -> bool:
        return all((type(v) is int and v >= 0) or (none and v is None) for v in values)

    if not all(isinstance(column, list) for column in (*files, *groups)):
        raise ValueError("not a JSONL layout: its fields must be lists")
    if len({len(column) for column in files}) != 1 or len({len(column) for column in groups}) != 1:
        raise ValueError("not a JSONL layout: fields of unequal lengths")
    paths, sizes, times, digests, compressions, frames, uncompressed, group_bytes, counts = files
    if not all(isinstance(path, str) for path in paths) or not all(
        isinstance(d, str) and len(d) == 64 for d in digests
    ):
        raise ValueError("not a JSONL layout: bad path or digest")
    if not set(compressions) <= {"none", "gzip", "zstd"}:
        raise ValueError(f"not a JSONL layout: compression {sorted(set(compressions), key=str)!r}")
    if not all(map(integers, (sizes, frames, uncompressed, group_bytes, counts, *groups))) or not integers(times, True):
        raise ValueError("not a JSONL layout: sizes must be integers >= 0")
    if sum(counts) != len(groups[0]):
        raise ValueError("not a JSONL layout: the group counts do not add up")
    if not groups[0]:
        if any(uncompressed):
            raise ValueError("not a JSONL layout: a file with text has no groups")
        return
    start, stop, first_line, rows, frame_offset, frame_start, frame_stop = (np.asarray(c, np.int64) for c in groups)
    counts_array = np.asarray(counts, np.int64)
    of_file = np.repeat(np.arange(len(counts)), counts_array)
    first = np.zeros(len(start), bool)
    first[(np.cumsum(counts_array) - counts_array)[counts_array > 0]] = True
    # Each group begins where the one before it in its file ends (the first at byte 0, line 0).
    previous_stop = np.where(first, 0, np.concatenate([[0], stop[:-1]]))
    previous_line = np.where(first, 0, np.concatenate([[0], (first_line + rows)[:-1]]))
    if np.any(start != previous_stop) or np.any(first_line != previous_line) or np.any(stop <= start):
        raise ValueError("not a JSONL layout: its groups do not follow one another")
    if np.any(rows < 1) or np.any(rows > stop - start):
        raise ValueError("not a JSONL layout: a group's line count does not fit its bytes")
    size, plain = np.asarray(sizes, np.int64)[of_file], np.asarray(compressions, object)[of_file] == "none"
    framed = (frame_start <= start) & (frame_offset < frame_stop) & (frame_stop <= size)
    whole = (frame_offset == 0) & (frame_start == 0) & (frame_stop == size)
    if not np.all(np.where(plain, whole, framed)):
        raise ValueError("not a JSONL layout: a group's frames lie outside its file")
    ends = np.zeros(len(counts), np.int64)
    ends[counts_array > 0] = stop[np.cumsum(counts_array)[counts_array > 0] - 1]  # each file's last group's stop
    if np.any(ends != np.asarray(uncompressed, np.int64)):
        raise ValueError("not a JSONL layout: the groups do not end where the text does")


# ---------------------------------------------------------------------------------------------- decompression


@dataclass
class FramesMet:
    """Frames met so far: compressed offset, decompressed start and compressed end of each."""

    offsets: list[int]
    starts: list[int]
    stops: list[int]


def decompressed_pieces(
    read: Callable[[int], bytes], compression: Compression, offset: int, start: int, frames: FramesMet, what: str
) -> Iterator[tuple[int, bytes]]:
    """``(frame index, piece)`` of the text of a stream that begins with a frame at ``offset`` (text at ``start``);
    records each frame in ``frames``. ValueError (naming ``what``) for invalid data or a truncated frame.
    """
    frames.offsets.append(offset)
    frames.starts.append(start)
    if compression == "none":
        while chunk := read(_READ_BYTES):
            yield 0, chunk
            offset += len(chunk)
        frames.stops.append(offset)
        return
    decoder = _decoder(compression)
    frame, fed, produced = 0, False, start
    raw, at = b"", 0  # the bytes read and not yet decompressed: raw[at:], which begins at compressed ``offset``
    while True:
        if at >= len(raw):
            raw, at = read(_READ_BYTES), 0
            if not raw:
                break
        piece = raw[at : at + _FEED_BYTES]
        fed = True
        try:
            output = decoder.decompress(piece) if compression == "zstd" else decoder.decompress(piece, _GZIP_OUT_BYTES)
            while True:
                if output:
                    yield frame, output
                    produced += len(output)
                # A full output may leave more behind, even with all input taken: ask until it comes up short.
                if compression == "zstd" or decoder.eof:
                    break
                if not decoder.unconsumed_tail and len(output) < _GZIP_OUT_BYTES:
                    break
                output = decoder.decompress(decoder.unconsumed_tail, _GZIP_OUT_BYTES)
        except (zstandard.ZstdError, zlib.error) as err:
            raise ValueError(
                f"{what} is not valid {compression} data at compressed byte {offset} or after: {err}"
            ) from err
        if not decoder.eof:
            at += len(piece)
            offset += len(piece)
            continue
        # The frame ended inside this piece: what follows it starts the next frame, with a fresh decompressor.
        used = len(piece) - len(decoder.unused_data)
        at, offset = at + used, offset + used
        frames.stops.append(offset)
        frames.offsets.append(offset)
        frames.starts.append(produced)
        decoder, frame, fed = _decoder(compression), frame + 1, False
    if fed:
        raise ValueError(f"{what} is truncated: its {compression} data ends inside a frame (at byte {offset})")
    # The last frame recorded began where the data ended: it is no frame.
    frames.offsets.pop()
    frames.starts.pop()


def _decoder(compression: Compression) -> Any:
    if compression == "zstd":
        # One frame per decompressor, so that the scan learns where each frame ends.
        return zstandard.ZstdDecompressor().decompressobj(read_across_frames=False)
    return zlib.decompressobj(wbits=31)  # one gzip member, header and trailer checked


def read_checked(storage: Storage, action: Callable[[], Any], path: str) -> Any:
    """``action`` retried through ``storage``; a missing or unreadable file is a ValueError naming it."""
    try:
        return storage.retrying(action, lambda: f"JSONL file {redact(path)!r}", lambda: None)
    except StorageError:
        raise
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"cannot read JSONL file {redact(path)!r}: {err}") from err


# ---------------------------------------------------------------------------------------------- read


def read_jsonl_group(
    path: str,
    storage: Storage | None,
    layout: JsonlLayout,
    group: int,
    text_column: str,
    *,
    on_malformed: Literal["error", "skip"] = "error",
) -> tuple[pa.ChunkedArray, int]:
    """One group's texts (a ``large_string`` per line, null where none) and how many malformed lines were skipped.

    Args:
        path: the file, as the layout was scanned from.
        storage: how to reach it.
        layout: its layout (from :func:`~lightning_d9d.streaming.sources.jsonl_scan.scan_jsonl`).
        group: the group's index in ``layout.groups``.
        text_column: the field of each JSON object that holds the text.
        on_malformed: ``"error"``: a malformed line raises; ``"skip"``: it becomes a null row and is counted.

    Raises:
        ValueError: a malformed line (naming file and 1-based line), an unreadable file, or one changed since scanned.
        StorageError: storage refused access, or stayed unreachable for ``storage.read_retry_seconds``.
    """
    storage = storage or Storage()
    _check_read(path, layout, group, on_malformed)
    span = layout.groups[group]
    data = read_checked(storage, lambda: _group_text(path, storage, layout, group, None, None), path)
    return _parse(data, span, layout, path, text_column, on_malformed)


def read_jsonl_group_keyed(
    path: str,
    storage: Storage | None,
    layout: JsonlLayout,
    group: int,
    text_column: str,
    *,
    on_malformed: Literal["error", "skip"] = "error",
    stored: bytes | None = None,
) -> tuple[pa.ChunkedArray, int, str]:
    """As :func:`read_jsonl_group`, with the content key of the stored bytes the texts were decoded from: every byte
    of the group's stored range is read and hashed, so the key names exactly the texts returned.

    Args:
        stored: the group's stored range as :func:`group_content_key` returned it (decoded instead of a read).
    """
    storage = storage or Storage()
    _check_read(path, layout, group, on_malformed)
    span, (low, high) = layout.groups[group], stored_range(layout, group)

    def read() -> tuple[bytes, str]:
        fs, fs_path = storage.filesystem(path)
        shared = _shares_its_range(layout, group) and stored is None
        before = _stat(fs, fs_path, "://" not in path) if shared else None
        hashed = hasher()
        text = _group_text(path, storage, layout, group, hashed, stored)
        if before is not None and _stat(fs, fs_path, "://" not in path) == before:
            _SHARED_RANGES.keep((layout.path, low, high), before, hashed.hexdigest())
        return text, hashed.hexdigest()

    data, stored_digest = read_checked(storage, read, path)
    column, skipped = _parse(data, span, layout, path, text_column, on_malformed)
    return column, skipped, group_key(layout, group, stored_digest, on_malformed)


def _check_read(path: str, layout: JsonlLayout, group: int, on_malformed: str) -> None:
    if on_malformed not in ("error", "skip"):
        raise ValueError(f"on_malformed={on_malformed!r} must be 'error' or 'skip'")
    if not 0 <= group < len(layout.groups):
        raise IndexError(f"group {group} of JSONL file {redact(path)!r}, which has {len(layout.groups)} groups")


def _group_text(
    path: str, storage: Storage, layout: JsonlLayout, group: int, hashed: Any, stored: bytes | None
) -> bytes:
    """The group's decompressed bytes ``[start, stop)``, decoded from its stored range (``stored``, or read from the
    frame holding ``start`` on); ``hashed`` (when given) gets every byte of the stored range, read to its end.
    """
    low, high = stored_range(layout, group)
    if stored is not None:
        if len(stored) != high - low:
            raise ValueError(f"{len(stored)} stored bytes given for the {high - low} of group {group}")
        view = memoryview(stored)
        return _decoded(lambda size, at: bytes(view[at - low : at - low + size]), layout, group, hashed, path)
    fs, fs_path = storage.filesystem(path)
    with fs.open_input_file(fs_path) as file:
        if file.size() != layout.size:
            raise _changed(path, f"its size is {file.size()} bytes, not {layout.size}")
        return _decoded(file.read_at, layout, group, hashed, path)


def _decoded(read_at: Callable[[int, int], bytes], layout: JsonlLayout, group: int, hashed: Any, path: str) -> bytes:
    """The group's text from ``read_at(size, offset)`` of its stored range; see :func:`_group_text`."""
    span, (low, high) = layout.groups[group], stored_range(layout, group)
    offset = low

    def read(size: int) -> bytes:
        nonlocal offset
        size = min(size, high - offset)
        chunk = read_at(size, offset) if size > 0 else b""
        offset += len(chunk)
        if hashed is not None:
            hashed.update(chunk)
        return chunk

    if layout.compression == "none":
        text = read(high - low)
    else:
        parts, position = [], span.frame_start
        pieces = decompressed_pieces(read, layout.compression, low, span.frame_start, FramesMet([], [], []),
                               f"JSONL file {redact(path)!r}")  # fmt: skip
        for _, piece in pieces:
            first, last = max(0, span.start - position), min(len(piece), span.stop - position)
            if first < last:
                parts.append(piece[first:last] if (first, last) != (0, len(piece)) else piece)
            position += len(piece)
            if position >= span.stop:
                break
        text = b"".join(parts)
    if hashed is not None:
        while read(_READ_BYTES):  # the rest of the range: the key covers every byte it names
            pass
    return text


# ---------------------------------------------------------------------------------------------- content keys


def stored_range(layout: JsonlLayout, group: int) -> tuple[int, int]:
    """The stored bytes ``[low, high)`` group ``group`` is decoded from: its own bytes in a plain file, its frames in
    a compressed one."""
    span = layout.groups[group]
    return (span.start, span.stop) if layout.compression == "none" else (span.frame_offset, span.frame_stop)


def group_key(layout: JsonlLayout, group: int, stored_digest: str, on_malformed: str) -> str:
    """The content key of group ``group`` whose stored range hashes to ``stored_digest``: that digest and what decides
    how the range decodes (compression, the group's offsets in it, its line count, whether it ends the file, and
    ``on_malformed``, which turns a malformed line into an empty row or an error)."""
    span, (low, high) = layout.groups[group], stored_range(layout, group)
    facts = [layout.compression, low, high, span.start, span.stop, span.frame_start, span.num_rows,
             span.stop == layout.uncompressed_size, on_malformed]  # fmt: skip
    return content_key("jsonl", json.dumps(facts), stored_digest)


def group_content_key(
    path: str, storage: Storage | None, layout: JsonlLayout, group: int, on_malformed: str
) -> tuple[str, bytes | None]:
    """The content key of group ``group`` as stored now, and its stored range where a read may decode it instead of
    reading again (``None`` for a range other groups share: it may be a whole single-frame file).

    A range several groups share is hashed once per process while the file stays as it was around the hashing (its
    inode, size, modification and status-change times; on object storage its size and time of last write); any other
    range is read and hashed at every call.

    Raises:
        ValueError: the file is unreadable, or its size is not the layout's (changed since scanned).
        StorageError: as :func:`read_jsonl_group`.
    """
    storage = storage or Storage()
    low, high = stored_range(layout, group)

    def fetch() -> tuple[str, bytes | None]:
        fs, fs_path = storage.filesystem(path)
        shared = _shares_its_range(layout, group)
        before = _stat(fs, fs_path, "://" not in path) if shared else None
        known = _SHARED_RANGES.get((layout.path, low, high), before)
        if known is not None:
            return known, None
        with fs.open_input_file(fs_path) as file:
            if file.size() != layout.size:
                raise _changed(path, f"its size is {file.size()} bytes, not {layout.size}")
            if not shared:
                data = file.read_at(high - low, low)
                return hasher_of(data), data
            hashed = hasher()
            for at in range(low, high, _READ_BYTES):
                hashed.update(file.read_at(min(_READ_BYTES, high - at), at))
        if before is not None and _stat(fs, fs_path, "://" not in path) == before:
            _SHARED_RANGES.keep((layout.path, low, high), before, hashed.hexdigest())
        return hashed.hexdigest(), None

    stored_digest, data = read_checked(storage, fetch, path)
    return group_key(layout, group, stored_digest, on_malformed), data


def hasher_of(data: bytes) -> str:
    hashed = hasher()
    hashed.update(data)
    return hashed.hexdigest()


def _shares_its_range(layout: JsonlLayout, group: int) -> bool:
    if layout.compression == "none":
        return False
    span = layout.groups[group]
    return sum(1 for g in layout.groups if (g.frame_offset, g.frame_stop) == (span.frame_offset, span.frame_stop)) > 1


def _stat(fs: pafs.FileSystem, fs_path: str, local: bool) -> tuple[int, ...] | None:
    """What changes whenever a file's bytes do, or ``None`` where there is nothing to tell: locally its inode, size,
    modification and status-change times (no ``utime`` can set the latter back); on object storage its size and
    time of last write, which the store sets itself (an object is rewritten whole)."""
    if local:
        stat = os.stat(fs_path)
        return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    info = fs.get_file_info(fs_path)
    return None if info.mtime_ns is None else (int(info.size), int(info.mtime_ns))


class _RangeDigests:
    """Digests of stored ranges by ``(file, low, high)``, each kept with its file's :func:`_stat` around the hashing
    and given back only while the file's is still the same; the least recently used are forgotten."""

    def __init__(self, capacity: int = 1024):
        self.capacity, self._entries, self._lock = capacity, OrderedDict(), threading.Lock()

    def get(self, key: tuple[str, int, int], stat: tuple[int, ...] | None) -> str | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None or stat is None or found[0] != stat:
                return None
            self._entries.move_to_end(key)
            return found[1]

    def keep(self, key: tuple[str, int, int], stat: tuple[int, ...], digest: str) -> None:
        with self._lock:
            self._entries[key] = (stat, digest)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


_SHARED_RANGES = _RangeDigests()


def _changed(path: str, why: str) -> ValueError:
    return ValueError(
        f"JSONL file {redact(path)!r} changed since it was scanned ({why}): set up again to scan it anew (after an "
        "edit that kept its size and modification time, touch it first, or its kept layout is reused)"
    )


def _parse(
    data: bytes, span: JsonlGroup, layout: JsonlLayout, path: str, text_column: str, on_malformed: str
) -> tuple[pa.ChunkedArray, int]:
    if len(data) != span.stop - span.start:
        raise _changed(path, f"bytes {span.start}..{span.stop} of its text are missing")
    if span.start == 0 and data.startswith(_BOM):
        data = b"   " + data[3:]  # a byte-order mark is whitespace here: no offset moves
    bytes_ = np.frombuffer(data, np.uint8)
    newlines = np.flatnonzero(bytes_ == _NEWLINE)
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(data))
    if len(ends) != span.num_rows or (span.stop != layout.uncompressed_size and not data.endswith(b"\n")):
        raise _changed(path, f"lines {span.first_line + 1}.. are {len(ends)}, not {span.num_rows}")
    starts = np.concatenate([[0], newlines[: len(ends) - 1] + 1])
    if len(ends) <= SMALL_GROUP_LINES:  # pyarrow's parse has a fixed cost that the stdlib's beats on a few lines
        return _parse_lines(data, starts, ends, span, path, text_column, on_malformed)
    # A line that is one JSON object starts with "{" and ends with "}" (before its "\r"); then no object can span
    # lines (a "}" that does not close it must be followed by "," or "}"), so pyarrow's rows are these lines'.
    lengths = ends - starts
    last = np.where(lengths > 0, ends - 1, 0)
    last = np.where((lengths > 1) & (bytes_[last] == _CR), last - 1, last)
    first_bytes = bytes_[np.minimum(starts, len(data) - 1)] if len(data) else np.zeros(0, np.uint8)
    objects = (lengths > 0) & (first_bytes == _OPEN_BRACE) & (bytes_[last] == _CLOSE_BRACE)
    blank = lengths == 0
    suspects = np.flatnonzero(~objects & ~blank)
    clean = True
    for line in suspects.tolist():  # leading or trailing spaces, "\r" alone, or not an object at all
        stripped = data[starts[line] : ends[line]].strip(_JSON_SPACE)
        if not stripped:
            blank[line] = True
        elif stripped[:1] == b"{" and stripped[-1:] == b"}":
            objects[line] = True
        else:
            clean = False
            break
    if clean:
        texts = _parse_fast(data, objects, lengths, text_column)
        if texts is not None:
            return texts, 0
    return _parse_lines(data, starts, ends, span, path, text_column, on_malformed)


def _parse_fast(data: bytes, objects: np.ndarray, lengths: np.ndarray, text_column: str) -> pa.ChunkedArray | None:
    """pyarrow's parse of lines checked to be one object each; ``None`` where it fails or its rows differ."""
    count = int(objects.sum())
    if count == 0:
        return pa.chunked_array([pa.nulls(len(objects), pa.large_string())])
    # Every pyarrow block must hold whole lines: a block is at least the longest line.
    block_size = max(1 << 20, int(lengths.max()) + 2)
    try:
        table = pajson.read_json(
            pa.BufferReader(data),
            read_options=pajson.ReadOptions(block_size=min(block_size, (1 << 31) - 1)),
            parse_options=pajson.ParseOptions(
                explicit_schema=pa.schema([(text_column, pa.large_string())]), unexpected_field_behavior="ignore"
            ),
        )
        column = table.column(text_column)
        column.validate(full=True)  # pyarrow does not check UTF-8 itself
    except (pa.ArrowException, ValueError, KeyError):
        return None
    if len(column) != count:
        return None
    if count == len(objects):
        return column
    # Blank lines back as nulls: row r of the group takes pyarrow's row (objects before r), or null.
    rows = np.cumsum(objects) - 1
    return column.take(pa.array(rows, pa.int64(), mask=~objects))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), type(value).__name__)


def _parse_lines(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    span: JsonlGroup,
    path: str,
    text_column: str,
    on_malformed: str,
) -> tuple[pa.ChunkedArray, int]:
    """The standard library's parse, line by line: slower, but it names every malformed line."""
    texts: list[str | None] = []
    skipped = 0
    for line, (begin, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        raw = data[begin:end].strip(_JSON_SPACE)
        if not raw:
            texts.append(None)
            continue
        problem, text = None, None
        try:
            # surrogateescape: bytes that are not UTF-8 fail below only where they are in the text, as in pyarrow.
            # NaN and Infinity are taken, as pyarrow takes them (outside the text).
            value = json.loads(raw.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError) as err:
            problem = f"not valid JSON ({err})"
        else:
            if not isinstance(value, dict):
                problem = f"it is {_json_type(value)}, not a JSON object"
            else:
                text = value.get(text_column)
                if text is not None and not isinstance(text, str):
                    problem, text = f"text_column {text_column!r} holds {_json_type(text)}, not a string", None
                elif text is not None:
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as err:
                        problem, text = f"its text is not valid UTF-8 or holds a lone surrogate ({err.reason})", None
        if problem is not None:
            if on_malformed == "error":
                raise ValueError(
                    f"line {span.first_line + line + 1} of JSONL file {redact(path)!r}: {problem}; fix the line, "
                    "or pass on_malformed='skip' to skip malformed lines (counted)"
                )
            skipped += 1
        texts.append(text)
    return pa.chunked_array([pa.array(texts, pa.large_string())]), skipped
