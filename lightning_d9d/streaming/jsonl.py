"""JSONL: compressed or plain JSON-lines files as groups of whole lines, read like parquet row groups.

A one-off scan hashes a file and cuts its text into *groups* of whole lines (a line is a row) of about
``group_bytes``, noting the compressed frames each group starts and ends in, so a read decompresses only those.
A group is parsed by ``pyarrow.json`` after a cheap check that each non-blank line is one object, else line by line,
which names the first malformed line (or, with ``on_malformed="skip"``, makes it a counted null row: row numbers
never move). Trade-off: in a single-frame file a group starts inside the one frame, so a pass costs about ``G / 2``
full decompressions; multi-frame (``pzstd``, ``bgzip``) and plain files read only a group's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import zstandard

from lightning_d9d.progress import byte_progress
from lightning_d9d.streaming.storage import Storage, StorageError, canonical, redact

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
_CACHE_VERSION = 1


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
        out: dict[str, Any] = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "groups"}
        out["groups"] = {name: [getattr(group, name) for group in self.groups] for name in _GROUP_FIELDS}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> JsonlLayout:
        """Read a layout written by :meth:`to_dict`; ValueError for a bad field or groups that do not tile the file."""
        try:
            columns = data["groups"]
            lists = [columns[name] for name in _GROUP_FIELDS]
            if not all(isinstance(values, list) and len(values) == len(lists[0]) for values in lists):
                raise ValueError("group fields of unequal lengths")
            groups = tuple(JsonlGroup(*values) for values in zip(*lists))
            layout = cls(
                path=data["path"],
                size=data["size"],
                mtime_ns=data["mtime_ns"],
                digest=data["digest"],
                compression=data["compression"],
                frames=data["frames"],
                uncompressed_size=data["uncompressed_size"],
                group_bytes=data["group_bytes"],
                groups=groups,
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a JSONL layout: {err!r}") from err
        layout._check()
        return layout

    def _check(self) -> None:
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if not (isinstance(self.path, str) and isinstance(self.digest, str) and len(self.digest) == 64):
            raise ValueError("not a JSONL layout: bad path or digest")
        if self.compression not in ("none", "gzip", "zstd"):
            raise ValueError(f"not a JSONL layout: compression {self.compression!r}")
        numbers = (self.size, self.frames, self.uncompressed_size, self.group_bytes)
        if not all(map(integer, numbers)) or (self.mtime_ns is not None and not integer(self.mtime_ns)):
            raise ValueError("not a JSONL layout: sizes must be integers >= 0")
        position, line = 0, 0
        for group in self.groups:
            if not all(integer(getattr(group, name)) for name in _GROUP_FIELDS):
                raise ValueError(f"not a JSONL layout: bad group {group}")
            frames_ok = (
                group.frame_start <= group.start and group.frame_offset < group.frame_stop <= self.size
                if self.compression != "none"
                else group.frame_offset == group.frame_start == 0 and group.frame_stop == self.size
            )
            if group.start != position or group.stop <= group.start or group.first_line != line:
                raise ValueError(f"not a JSONL layout: group {group} does not follow byte {position}, line {line}")
            if not 1 <= group.num_rows <= group.stop - group.start or not frames_ok:
                raise ValueError(f"not a JSONL layout: inconsistent group {group}")
            position, line = group.stop, line + group.num_rows
        if position != self.uncompressed_size:
            raise ValueError(f"not a JSONL layout: the groups end at {position}, not {self.uncompressed_size}")


# ---------------------------------------------------------------------------------------------- decompression


@dataclass
class _Frames:
    """Frames met so far: compressed offset, decompressed start and compressed end of each."""

    offsets: list[int]
    starts: list[int]
    stops: list[int]


def _decompressed(
    read: Callable[[int], bytes], compression: Compression, offset: int, start: int, frames: _Frames, what: str
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


# ---------------------------------------------------------------------------------------------- scan


def scan_jsonl(
    path: str, storage: Storage | None = None, *, group_bytes: int = DEFAULT_GROUP_BYTES, cache_dir: str | None = None
) -> JsonlLayout:
    """The layout of one JSONL file: scanned once from storage (retried from the start), or read from ``cache_dir``.

    Args:
        path: a local path or URL of a file ending in one of :data:`JSONL_SUFFIXES`.
        storage: how to reach it (and the cache).
        group_bytes: decompressed bytes per group, at least: a group ends at the first newline after that many.
        cache_dir: where layouts are kept, reused while the file's size and mtime match; ``None``: scan every time.

    Raises:
        ValueError: the file is missing, not valid gzip/zstd, truncated, or changed while scanned; ``group_bytes`` < 1.
        StorageError: storage refused access, or stayed unreachable for ``storage.read_retry_seconds``.
    """
    storage = storage or Storage()
    if not isinstance(group_bytes, int) or group_bytes < 1:
        raise ValueError(f"group_bytes={group_bytes!r} must be an integer >= 1")
    compression = compression_of(path)
    fs, fs_path = storage.filesystem(path)
    info = _checked(storage, lambda: fs.get_file_info(fs_path), path)
    if info.type != pafs.FileType.File:
        raise ValueError(f"JSONL file {redact(path)!r} does not exist" + (" (a directory)" if info.type else ""))
    # A local file is known by its absolute path, a URL without its endpoint options and credentials.
    identity = {
        "path": canonical(path) if "://" in path else fs_path,
        "size": info.size,
        "mtime_ns": info.mtime_ns,
        "group_bytes": group_bytes,
    }
    if cache_dir is not None:
        cached = _load_cached(cache_dir, identity, storage)
        if cached is not None:
            return cached

    def scan() -> JsonlLayout:
        # A bar per attempt: a retried scan starts again from the file's first byte.
        bar = byte_progress(info.size, f"scanning {os.path.basename(fs_path)}")
        with fs.open_input_stream(fs_path, compression=None) as stream, bar:
            return _scan(stream, compression, identity, path, bar.update)

    layout = _checked(storage, scan, path)
    if cache_dir is not None:
        try:
            _save_cached(cache_dir, layout, storage)
        except (OSError, pa.ArrowException) as err:
            # The layout is good without its copy: a cache that cannot be written costs the next start a scan.
            warnings.warn(
                f"could not keep the layout of {redact(path)!r} in {redact(cache_dir)!r}: {err}", stacklevel=2
            )
    return layout


def _checked(storage: Storage, action: Callable[[], Any], path: str) -> Any:
    """``action`` retried through ``storage``; a missing or unreadable file is a ValueError naming it."""
    try:
        return storage.retrying(action, lambda: f"JSONL file {redact(path)!r}", lambda: None)
    except StorageError:
        raise
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"cannot read JSONL file {redact(path)!r}: {err}") from err


def _scan(
    stream: Any, compression: Compression, identity: dict[str, Any], path: str, on_read: Callable[[int], Any]
) -> JsonlLayout:
    """The layout, in one pass that hashes the stored bytes and cuts the text; ``on_read`` gets each piece's size."""
    digest = hashlib.sha256()
    stored = 0

    def read(size: int) -> bytes:
        nonlocal stored
        chunk = stream.read(size)
        digest.update(chunk)
        stored += len(chunk)
        on_read(len(chunk))
        return chunk

    frames = _Frames([], [], [])
    pieces = _decompressed(read, compression, 0, 0, frames, f"JSONL file {redact(path)!r}")
    groups, uncompressed_size = _cut_into_groups(pieces, identity["group_bytes"])
    if stored != identity["size"]:
        raise ValueError(
            f"JSONL file {redact(path)!r} changed while it was scanned: {stored} bytes read, "
            f"{identity['size']} expected"
        )
    plain = compression == "none"
    return JsonlLayout(
        path=identity["path"],
        size=stored,
        mtime_ns=identity["mtime_ns"],
        digest=digest.hexdigest(),
        compression=compression,
        frames=len(frames.offsets) if not plain else 1,
        uncompressed_size=uncompressed_size,
        group_bytes=identity["group_bytes"],
        groups=tuple(
            JsonlGroup(
                g_start,
                g_stop,
                g_line,
                g_rows,
                0 if plain else frames.offsets[f_first],
                0 if plain else frames.starts[f_first],
                stored if plain else frames.stops[f_last],
            )
            for g_start, g_stop, g_line, g_rows, f_first, f_last in groups
        ),
    )


def _cut_into_groups(
    pieces: Iterable[tuple[int, bytes]], group_bytes: int
) -> tuple[list[tuple[int, int, int, int, int, int]], int]:
    """Cut the text of ``pieces`` into groups of whole lines; returns per group (start, stop, first line, rows, first
    and last frame) and the text's size.
    """
    groups: list[tuple[int, int, int, int, int, int]] = []
    position = 0  # decompressed offset of the current piece
    start, first_line, lines, first_frame = 0, 0, 0, -1  # the open group
    last_frame, last_byte = 0, _NEWLINE
    for frame, piece in pieces:
        size, counted = len(piece), 0  # newlines of piece[:counted] are in ``lines`` or in closed groups
        while True:
            if first_frame < 0 and counted < size:
                first_frame = frame  # the open group's first byte is in this piece
            # The group ends at the first newline at or after its ``group_bytes``-th byte.
            search = max(counted, start + group_bytes - 1 - position)
            end = piece.find(b"\n", search) if search < size else -1
            if end < 0:
                lines += piece.count(b"\n", counted)
                break
            lines += piece.count(b"\n", counted, end + 1)
            groups.append((start, position + end + 1, first_line, lines, first_frame, frame))
            start, first_line, lines, first_frame = position + end + 1, first_line + lines, 0, -1
            counted = end + 1
        position += size
        last_frame, last_byte = frame, piece[-1]
    if position > start:  # the last line has no newline: it is a row too
        groups.append((start, position, first_line, lines + (last_byte != _NEWLINE), first_frame, last_frame))
    return groups, position


# ---------------------------------------------------------------------------------------------- layout cache


def _cache_entry(cache_dir: str, identity: dict[str, Any], storage: Storage) -> tuple[pafs.FileSystem, str]:
    key = hashlib.sha256(json.dumps([identity["path"], identity["group_bytes"]]).encode()).hexdigest()[:24]
    name = os.path.basename(identity["path"].rstrip("/"))
    fs, directory = storage.filesystem(cache_dir)
    return fs, f"{directory.rstrip('/')}/{name}.{key}.layout.json"


def _load_cached(cache_dir: str, identity: dict[str, Any], storage: Storage) -> JsonlLayout | None:
    """The cached layout, or ``None`` (absent, unreadable, stale or corrupt)."""
    fs, entry = _cache_entry(cache_dir, identity, storage)

    def load() -> bytes:
        with fs.open_input_stream(entry, compression=None) as stream:
            return stream.read()

    try:
        data = json.loads(storage.retrying(load, lambda: f"JSONL layout cache {redact(entry)!r}", lambda: None))
        if data.get("version") != _CACHE_VERSION:
            return None
        layout = JsonlLayout.from_dict(data["layout"])
    except FileNotFoundError:
        return None
    except StorageError:
        raise
    except (OSError, pa.ArrowException, ValueError, KeyError, TypeError, AttributeError):
        return None  # corrupt or written by another version: rebuilt, never trusted
    found = {"path": layout.path, "size": layout.size, "mtime_ns": layout.mtime_ns, "group_bytes": layout.group_bytes}
    return layout if found == identity else None


def _save_cached(cache_dir: str, layout: JsonlLayout, storage: Storage) -> None:
    """Write the layout where :func:`_load_cached` looks, atomically."""
    identity = {"path": layout.path, "group_bytes": layout.group_bytes}
    if cache_dir.split("://", 1)[0].lower() in ("s3", "s3a") and "://" in cache_dir:
        # A delayed open lets pyarrow send a small object as one PUT (else a multipart upload of one part).
        storage = dataclasses.replace(storage, options={**storage.options, "allow_delayed_open": True})
    fs, entry = _cache_entry(cache_dir, identity, storage)
    text = json.dumps({"version": _CACHE_VERSION, "layout": layout.to_dict()}, separators=(",", ":")).encode()
    if isinstance(fs, pafs.LocalFileSystem):
        directory = os.path.dirname(entry)
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".layout-", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(text)
            os.replace(temporary, entry)  # atomic on one filesystem; concurrent writers write equal entries
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return

    def put() -> None:
        # One object: object storage makes it visible whole, when the stream closes.
        with fs.open_output_stream(entry, compression=None) as out:
            out.write(text)

    storage.retrying(put, lambda: f"JSONL layout cache entry {redact(entry)!r} (writing it)", lambda: None)


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
        layout: its layout (from :func:`scan_jsonl`).
        group: the group's index in ``layout.groups``.
        text_column: the field of each JSON object that holds the text.
        on_malformed: ``"error"``: a malformed line raises; ``"skip"``: it becomes a null row and is counted.

    Raises:
        ValueError: a malformed line (naming file and 1-based line), an unreadable file, or one changed since scanned.
        StorageError: storage refused access, or stayed unreachable for ``storage.read_retry_seconds``.
    """
    storage = storage or Storage()
    if on_malformed not in ("error", "skip"):
        raise ValueError(f"on_malformed={on_malformed!r} must be 'error' or 'skip'")
    if not 0 <= group < len(layout.groups):
        raise IndexError(f"group {group} of JSONL file {redact(path)!r}, which has {len(layout.groups)} groups")
    span = layout.groups[group]
    data = _checked(storage, lambda: _read_bytes(path, storage, layout, span), path)
    return _parse(data, span, layout, path, text_column, on_malformed)


def _read_bytes(path: str, storage: Storage, layout: JsonlLayout, span: JsonlGroup) -> bytes:
    """The decompressed bytes ``[span.start, span.stop)``, fetched from the frame holding ``span.start`` on."""
    fs, fs_path = storage.filesystem(path)
    with fs.open_input_file(fs_path) as file:
        if file.size() != layout.size:
            raise _changed(path, f"its size is {file.size()} bytes, not {layout.size}")
        if layout.compression == "none":
            return file.read_at(span.stop - span.start, span.start)
        offset = span.frame_offset

        def read(size: int) -> bytes:
            nonlocal offset
            size = min(size, span.frame_stop - offset)
            chunk = file.read_at(size, offset) if size > 0 else b""
            offset += len(chunk)
            return chunk

        parts, position = [], span.frame_start
        pieces = _decompressed(
            read,
            layout.compression,
            span.frame_offset,
            span.frame_start,
            _Frames([], [], []),
            f"JSONL file {redact(path)!r}",
        )
        for _, piece in pieces:
            low, high = max(0, span.start - position), min(len(piece), span.stop - position)
            if low < high:
                parts.append(piece[low:high] if (low, high) != (0, len(piece)) else piece)
            position += len(piece)
            if position >= span.stop:
                break
        return b"".join(parts)


def _changed(path: str, why: str) -> ValueError:
    return ValueError(f"JSONL file {redact(path)!r} changed since it was scanned ({why}): scan it again")


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
