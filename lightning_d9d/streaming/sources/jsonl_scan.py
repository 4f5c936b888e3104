"""JSONL scan: the layout of every JSONL file of a source at setup, one pass over each file, kept in a layout cache.

The files' sizes and modification times are listed in one call per filesystem. A file up to ``WHOLE_READ_BYTES`` is
read in one request and cut in memory; a larger one is streamed (with a progress bar where it takes a while). On
object storage, where every read is a request, several files are scanned at once. A scan hashes the stored bytes
(the file's digest, which the resume check compares) and cuts the text into groups of whole lines.

With a cache folder, one *record* holds the layouts of every file of the list (one read at the next setup), and a
file of at least ``OWN_RECORD_BYTES`` also gets a record of its own, so a list that gains or loses a file rescans
its small files only. A layout is reused while its file's size and modification time match. That is all it is
trusted with: it says where lines and frames are. Every group's line count is checked when the group is read (a
mismatch is an error naming the file), and a group's tokens are keyed by the bytes it is decoded from, so a layout
outdated by an edit that kept size and time never yields stale tokens. A layout cache that cannot be read or
written is one warning, and the files are scanned. Trade-off: a list's record is rewritten whole when any file of
it changes (a few hundred bytes per file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from lightning_d9d.core import progress
from lightning_d9d.core.digest import digest, hasher
from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.sources.jsonl import (
    DEFAULT_GROUP_BYTES,
    Compression,
    FramesMet,
    JsonlGroup,
    JsonlLayout,
    compression_of,
    decompressed_pieces,
    layouts_from_columns,
    layouts_to_columns,
    read_checked,
)
from lightning_d9d.streaming.sources.storage import Storage, canonical

# Up to this size a file is read in one request and cut in memory; larger ones are streamed in pieces.
WHOLE_READ_BYTES = 8 << 20
# Files at least this large get a layout record of their own: rescanning one costs far more than a record's read.
OWN_RECORD_BYTES = 64 << 20
# Files scanned at once on object storage (each read a request, mostly waiting).
PARALLEL_SCANS = 16
_RECORD_VERSION = 2
_NEWLINE = ord("\n")
# Layout caches this process could not use (by folder), so a broken one is warned about once.
_BROKEN: set[str] = set()
_BROKEN_LOCK = threading.Lock()


@dataclass(frozen=True)
class _File:
    """One JSONL file to scan: as given, where it is, its compression and its identity (path, size, time, groups)."""

    path: str
    fs: pafs.FileSystem
    fs_path: str
    compression: Compression
    identity: dict[str, Any]


def scan_jsonl(
    path: str, storage: Storage | None = None, *, group_bytes: int = DEFAULT_GROUP_BYTES, cache_dir: str | None = None
) -> JsonlLayout:
    """The layout of one JSONL file (see :func:`scan_jsonl_files`)."""
    return scan_jsonl_files([path], storage, group_bytes=group_bytes, cache_dir=cache_dir)[0]


def scan_jsonl_files(
    paths: Sequence[str],
    storage: Storage | None = None,
    *,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    cache_dir: str | None = None,
) -> list[JsonlLayout]:
    """The layouts of JSONL files, in order: scanned (each retried from its start), or read from ``cache_dir``.

    Args:
        paths: local paths or URLs of files ending in one of ``JSONL_SUFFIXES``.
        storage: how to reach them (and the cache).
        group_bytes: decompressed bytes per group, at least: a group ends at the first newline after that many.
        cache_dir: where layouts are kept, reused while each file's size and mtime match; ``None``: scan every time.

    Raises:
        ValueError: a file is missing, not valid gzip/zstd, truncated, or changed while scanned; ``group_bytes`` < 1.
        StorageError: storage refused access, or stayed unreachable for ``storage.read_retry_seconds``.
    """
    storage = storage or Storage()
    if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes < 1:
        raise ValueError(f"group_bytes={group_bytes!r} must be an integer >= 1")
    files = _listed(list(paths), storage, group_bytes)
    records = _Records(cache_dir, files, storage) if cache_dir is not None and files else None
    layouts = records.load() if records is not None else [None] * len(files)
    missing = [i for i, layout in enumerate(layouts) if layout is None]
    scanned = _scan_all([files[i] for i in missing], storage)
    for i, layout in zip(missing, progress.progress(scanned, len(missing), "reading footers and layouts", "file")):
        layouts[i] = layout
    if records is not None:
        records.save(layouts, missing)
    return layouts  # type: ignore[return-value]


def _listed(paths: list[str], storage: Storage, group_bytes: int) -> list[_File]:
    """Every file's location, compression and identity, with one listing call per filesystem."""
    compressions = [compression_of(path) for path in paths]
    located = storage.filesystems(paths)
    by_filesystem: dict[int, list[int]] = {}
    for i, (fs, _) in enumerate(located):
        by_filesystem.setdefault(id(fs), []).append(i)
    infos: list[Any] = [None] * len(paths)
    for indices in by_filesystem.values():
        fs = located[indices[0]][0]
        try:
            found = fs.get_file_info([located[i][1] for i in indices])
        except OSError:  # ask file by file (retrying), so the error names the one that failed
            found = [read_checked(storage, lambda i=i: located[i][0].get_file_info(located[i][1]), paths[i])
                     for i in indices]  # fmt: skip
        for i, info in zip(indices, found):
            infos[i] = info
    files = []
    for path, compression, (fs, fs_path), info in zip(paths, compressions, located, infos):
        if info.type != pafs.FileType.File:
            raise ValueError(f"JSONL file {redact(path)!r} does not exist" + (" (a directory)" if info.type else ""))
        # A local file is known by its absolute path, a URL without its endpoint options and credentials.
        identity = {"path": canonical(path) if "://" in path else fs_path, "size": info.size,
                    "mtime_ns": info.mtime_ns, "group_bytes": group_bytes}  # fmt: skip
        files.append(_File(path, fs, fs_path, compression, identity))
    return files


def _scan_all(files: list[_File], storage: Storage) -> Iterable[JsonlLayout]:
    """Each file's layout, in order; several at once where reads are requests."""
    remote = any(not isinstance(file.fs, pafs.LocalFileSystem) for file in files)
    if not remote or len(files) < 2:
        return (_scan_file(file, storage) for file in files)
    pool = ThreadPoolExecutor(min(PARALLEL_SCANS, len(files)), thread_name_prefix="jsonl-scan")
    try:
        return list(pool.map(lambda file: _scan_file(file, storage), files))
    finally:
        pool.shutdown(cancel_futures=True)


def _scan_file(file: _File, storage: Storage) -> JsonlLayout:
    size = file.identity["size"]

    def scan() -> JsonlLayout:
        # A retried scan starts again from the file's first byte (and its bar, if any, from zero).
        shown = size >= progress.MIN_SCAN_BYTES  # no bar for the many small files: it would cost more than them
        if size <= WHOLE_READ_BYTES and not shown:
            return _scan(io.BytesIO(_read_whole(file)), file.compression, file.identity, file.path, _ignore)
        bar = progress.byte_progress(size, f"scanning {os.path.basename(file.fs_path)}") if shown else None
        with file.fs.open_input_stream(file.fs_path, compression=None) as stream, bar or contextlib.nullcontext():
            return _scan(stream, file.compression, file.identity, file.path, bar.update if bar else _ignore)

    return read_checked(storage, scan, file.path)


def _read_whole(file: _File) -> bytes:
    if isinstance(file.fs, pafs.LocalFileSystem):
        with open(file.fs_path, "rb") as handle:
            return handle.read()
    with file.fs.open_input_file(file.fs_path) as handle:
        return handle.read()


def _ignore(_: int) -> None:
    pass


def _scan(
    stream: Any, compression: Compression, identity: dict[str, Any], path: str, on_read: Callable[[int], Any]
) -> JsonlLayout:
    """The layout, in one pass that hashes the stored bytes and cuts the text; ``on_read`` gets each piece's size."""
    hashed = hasher()
    stored = 0

    def read(size: int) -> bytes:
        nonlocal stored
        chunk = stream.read(size)
        hashed.update(chunk)
        stored += len(chunk)
        on_read(len(chunk))
        return chunk

    frames = FramesMet([], [], [])
    pieces = decompressed_pieces(read, compression, 0, 0, frames, f"JSONL file {redact(path)!r}")
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
        digest=hashed.hexdigest(),
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


# ---------------------------------------------------------------------------------------------- layout records


class _Records:
    """The layout records of one list of files under ``cache_dir``: the list's record, and large files' own."""

    def __init__(self, cache_dir: str, files: list[_File], storage: Storage):
        self.cache_dir, self.files, self.storage = cache_dir, files, storage
        if cache_dir.split("://", 1)[0].lower() in ("s3", "s3a") and "://" in cache_dir:
            # A delayed open lets pyarrow send a small object as one PUT (else a multipart upload of one part).
            storage = dataclasses.replace(storage, options={**storage.options, "allow_delayed_open": True})
        self.fs, directory = storage.filesystem(cache_dir)
        self.directory = directory.rstrip("/")
        group_bytes = files[0].identity["group_bytes"]
        self.list_record = f"{self.directory}/list.{digest(str(group_bytes), *(f.identity['path'] for f in files))}"
        self.list_record += ".layouts.json"
        self.usable = cache_dir not in _BROKEN
        self.list_found = False

    def own_record(self, file: _File) -> str:
        key = digest(json.dumps([file.identity["path"], file.identity["group_bytes"]]), digits=24)
        return f"{self.directory}/{os.path.basename(file.identity['path'].rstrip('/'))}.{key}.layout.json"

    def load(self) -> list[JsonlLayout | None]:
        """Each file's layout where a record holds it with the file's size and mtime, else ``None``."""
        layouts: list[JsonlLayout | None] = [None] * len(self.files)
        if not self.usable:
            return layouts
        wanted = {file.identity["path"]: i for i, file in enumerate(self.files)}
        listed = self._read(self.list_record)
        self.list_found = listed is not None
        for layout in _layouts(listed, own=False):
            self._take(layout, wanted, layouts)
        for i, file in enumerate(self.files):
            if layouts[i] is None and file.identity["size"] >= OWN_RECORD_BYTES and self.usable:
                for layout in _layouts(self._read(self.own_record(file)), own=True):
                    self._take(layout, wanted, layouts)
        return layouts

    def _take(self, layout: JsonlLayout, wanted: dict[str, int], layouts: list[JsonlLayout | None]) -> None:
        """Put ``layout`` where its file is wanted, if it is of the file as it is now."""
        i = wanted.get(layout.path)
        if i is None:
            return
        found = {"path": layout.path, "size": layout.size, "mtime_ns": layout.mtime_ns,
                 "group_bytes": layout.group_bytes}  # fmt: skip
        if found == self.files[i].identity:
            layouts[i] = layout

    def _read(self, path: str) -> Any:
        """A record's JSON, or ``None`` (absent, unreadable, another version); a store that fails is warned about."""

        def read() -> bytes:
            with self.fs.open_input_stream(path, compression=None) as stream:
                return stream.read()

        try:
            data = json.loads(self.storage.retrying(read, lambda: f"JSONL layout record {redact(path)!r}", _nothing))
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowException) as err:
            self._broken(f"cannot read it ({err})")
            return None
        except (ValueError, TypeError):
            return None
        return data if isinstance(data, dict) and data.get("version") == _RECORD_VERSION else None

    def save(self, layouts: list[JsonlLayout], scanned: list[int]) -> None:
        """Write the list's record when a file was scanned or it was missing, and large scanned files' own."""
        if not self.usable or (not scanned and self.list_found):
            return
        try:
            for i in scanned:
                if self.files[i].identity["size"] >= OWN_RECORD_BYTES:
                    self._write(self.own_record(self.files[i]), {"layout": layouts[i].to_dict()})
            self._write(self.list_record, layouts_to_columns(layouts))
        except (OSError, pa.ArrowException) as err:
            # The layouts are good without their copy: a cache that cannot be written costs the next start a scan.
            self._broken(f"cannot write to it ({err})")

    def _write(self, path: str, record: dict[str, Any]) -> None:
        """Write a record atomically: a reader sees the old one or the new one, whole."""
        text = json.dumps({"version": _RECORD_VERSION, **record}, separators=(",", ":")).encode()
        if isinstance(self.fs, pafs.LocalFileSystem):
            os.makedirs(self.directory, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".layout-", suffix=".tmp")
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(text)
                os.replace(temporary, path)  # atomic on one filesystem; concurrent writers write equal records
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            return

        def put() -> None:
            # One object: object storage makes it visible whole, when the stream closes.
            with self.fs.open_output_stream(path, compression=None) as out:
                out.write(text)

        self.storage.retrying(put, lambda: f"JSONL layout record {redact(path)!r} (writing it)", _nothing)

    def _broken(self, why: str) -> None:
        """Stop using this layout cache in this process, and say so once."""
        self.usable = False
        with _BROKEN_LOCK:
            first = self.cache_dir not in _BROKEN
            _BROKEN.add(self.cache_dir)
        if first:
            warnings.warn(
                f"JSONL layout cache {redact(self.cache_dir)!r}: {why}; JSONL files are scanned at every setup "
                "instead (this process no longer uses it)",
                stacklevel=4,
            )


def _nothing() -> None:
    pass


def _layouts(record: Any, own: bool) -> list[JsonlLayout]:
    """The layouts a record (a file's ``own`` or a list's) holds; none where it is missing, corrupt or of another
    version: those files are scanned, the record is never trusted."""
    if record is None:
        return []
    try:
        return [JsonlLayout.from_dict(record["layout"])] if own else layouts_from_columns(record)
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
