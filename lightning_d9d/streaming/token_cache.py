"""Token cache: each unit's tokens, stored the first time the unit is tokenized and read back instead of tokenizing.

Under ``root``, one folder per *version* (``sha256(key)[:16]``; the key is everything that decides the tokens, so a
changed setting never meets stale tokens) holds one self-validating entry (CRC-32s, structure) per unit, named by
the unit's *content key*: a digest of the stored bytes its texts are decoded from (``content.py``, ``jsonl.py``),
computed when a stream is about to read the unit. An edited unit has another key, so its old entry is never looked
up, and two files share an entry only where their bytes are the same. The entry's folder is its file's footer (or
layout) digest, which only groups entries for listing (coverage, "files changed" at setup) and is trusted with no
token. A bad entry is a miss, warned about and deleted. Stores are atomic and uncoordinated: every writer of an
entry writes the same bytes. Trade-off: one file per unit needs no index and keeps writers independent, at the price
of a file per row group, of reading an entry whole, and of a read and a hash of the unit's stored text per lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import re
import struct
import threading
import uuid
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow.fs as pafs

from lightning_d9d.digest import digest
from lightning_d9d.streaming.storage import Storage, StorageError, canonical, is_transient, redact
from lightning_d9d.tokenizer_backends import EncodedBatch

FORMAT_VERSION = 2
MAGIC = b"D9DTOKS\n"
ENTRY_SUFFIX = ".tok"
MANIFEST = "manifest.json"
# magic, format version, header length in bytes, the header's CRC-32. CRC-32 (zlib) rather than a faster hash:
# no optional dependency, and one entry format.
_PREFIX = struct.Struct("<8sIII")
_INDEX = np.dtype("<i8")
# Store failures that the next store would meet too: the process stops writing.
_STOPS_WRITING = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                  errno.EEXIST}  # fmt: skip
# Bad entries named in a warning per cache version and process. Past that many, the cache is probably damaged
# as a whole; one more warning says so, and the rest are only counted.
MAX_NAMED_ENTRIES = 8
_VERSION_NAME = re.compile(r"[0-9a-f]{16}")
_FILE_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,127}")
_CONTENT_KEY = re.compile(r"[0-9a-f]{16,64}")
_ENTRY = re.compile(
    r"(?P<unit>(?P<file>[^/]+)/(?P<group>\d+)-(?P<start>\d+)-(?P<stop>\d+))\.(?P<content>[0-9a-f]{16,64})"
    + re.escape(ENTRY_SUFFIX)
)
# What a count reads of an entry at first: its prefix and header (a longer header is read whole in a second read).
_HEAD_BYTES = 4096

# What this process has warned about, and the cache versions (by where()) it no longer writes to. A forked
# worker inherits both, which keeps a failure it would meet again from being warned about once more per worker.
_WARNED: set[tuple[str, ...]] = set()
_NAMED: dict[str, int] = {}
_NOT_WRITING: dict[str, str] = {}
_LOCK = threading.Lock()


class TokenCacheWarning(UserWarning):
    """The token cache could not be used as it should (a bad entry, a failed store); training goes on."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a ``vocab_size`` vocabulary (ValueError outside 1..2**32)."""
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..2**32")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def token_array(ids: Any, vocab_size: int) -> np.ndarray:
    """``ids`` in the cache's dtype; ValueError for non-integers or an id outside ``[0, vocab_size)``."""
    dtype = token_dtype(vocab_size)
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype)
    if array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, not {array.dtype}")
    array = array.reshape(-1)
    if int(array.min()) < 0 or int(array.max()) >= vocab_size:
        bad = int(np.flatnonzero((array < 0) | (array >= vocab_size))[0])
        raise ValueError(
            f"token id {int(array[bad])} (at position {bad}) is outside the vocabulary [0, {vocab_size}): a "
            f"{dtype} token cache cannot store it"
        )
    return array.astype(dtype, copy=False)


@dataclass(frozen=True, eq=False)
class CachedUnit:
    """What reading and tokenizing one unit produced, enough to replay both without the text.

    Attributes:
        group_in_file: the unit's row group, counted within its file (independent of the file list).
        start, stop: the unit's rows ``[start, stop)`` of that row group.
        rows: int64, ascending: the row of each document kept.
        offsets: int64, ``len(rows) + 1`` entries: document ``i``'s ids are ``tokens[offsets[i]:offsets[i+1]]``.
        tokens: every document's ids, BOS not included (the stream prepends it), uint16 or uint32.
        too_long_rows: int64, ascending: the rows skipped for exceeding ``max_document_chars``.
        too_long_chars: int64: their lengths in characters.
    """

    group_in_file: int
    start: int
    stop: int
    rows: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    too_long_rows: np.ndarray
    too_long_chars: np.ndarray

    @classmethod
    def of(
        cls,
        group_in_file: int,
        start: int,
        stop: int,
        rows: Sequence[int] | np.ndarray,
        documents: Sequence[Sequence[int] | np.ndarray],
        too_long: Mapping[int, int] | None = None,
        *,
        vocab_size: int,
    ) -> CachedUnit:
        """Build a unit from each kept document's row and ids, and the ``{row: characters}`` skipped as too long."""
        if len(rows) != len(documents):
            raise ValueError(f"{len(rows)} rows for {len(documents)} documents")
        lengths = np.fromiter(map(len, documents), np.int64, len(documents))
        offsets = np.zeros(len(documents) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        dtype, tokens = token_dtype(vocab_size), None
        if all(isinstance(ids, list) for ids in documents):
            # Python ints straight into the narrow dtype: numpy raises on one out of the dtype's range, and the
            # checked path below names it (or one past the vocabulary).
            with contextlib.suppress(OverflowError):
                tokens = np.fromiter(itertools.chain.from_iterable(documents), dtype, int(offsets[-1]))
        if tokens is None or (len(tokens) and int(tokens.max()) >= vocab_size):
            flat = np.concatenate([np.asarray(ids, np.int64) for ids in documents]) if documents else []
            tokens = token_array(flat, vocab_size)
        long_rows = sorted((too_long or {}).items())
        return cls(
            int(group_in_file),
            int(start),
            int(stop),
            np.asarray(rows, np.int64).reshape(-1),
            offsets,
            tokens,
            np.asarray([row for row, _ in long_rows], np.int64),
            np.asarray([chars for _, chars in long_rows], np.int64),
        )

    def __len__(self) -> int:
        return len(self.rows)

    def ids(self, doc: int) -> np.ndarray:
        """Document ``doc``'s ids (a view, read-only when loaded)."""
        return self.tokens[int(self.offsets[doc]) : int(self.offsets[doc + 1])]

    @property
    def lengths(self) -> np.ndarray:
        """Each document's id count (BOS not included)."""
        return np.diff(self.offsets)

    def empty_rows(self) -> np.ndarray:
        """The rows of ``[start, stop)`` that held a null or empty text."""
        return np.setdiff1d(np.arange(self.start, self.stop, dtype=np.int64), np.union1d(self.rows, self.too_long_rows))


class Coverage(NamedTuple):
    """How much of a list of units a cache holds: ``cached`` of ``total`` units, in ``bytes`` bytes."""

    cached: int
    total: int
    bytes: int


@dataclass
class CacheCounters:
    """One process's :class:`TokenCache` counters."""

    hits: int = 0
    misses: int = 0
    bad: int = 0
    stored: int = 0
    store_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class _BadEntry(Exception):
    """An entry that must not be read as tokens; the message says why."""


class TokenCache:
    """The tokens of every unit tokenized with one key, under ``root``.

    Picklable: a worker process opens its own filesystem and keeps its own counters.

    Args:
        root: a local folder or a URL (``s3://bucket/prefix``) holding one folder per key.
        storage: how ``root`` is reached (endpoint, credentials).
        key: JSON-serialisable, everything that decides the tokens (tokenizer digest, settings, recipe version).
        vocab_size: the tokenizer's vocabulary size; it decides the dtype.

    Raises:
        ValueError: a key that is not JSON-serialisable, or a bad ``vocab_size``.
    """

    def __init__(self, root: str, storage: Storage, key: Mapping[str, Any] | str, *, vocab_size: int):
        self.root, self.storage, self.vocab_size = root, storage, int(vocab_size)
        self.key: Any = key if isinstance(key, str) else dict(key)
        self.dtype = token_dtype(self.vocab_size)
        try:
            self.digest = _version_digest(self.key, self.vocab_size)
        except (TypeError, ValueError) as err:
            raise ValueError(f"token cache key {key!r} is not JSON-serialisable: {err}") from err
        self._setup()

    def _setup(self) -> None:
        self.counters = CacheCounters()
        self._fs: pafs.FileSystem | None = None
        self._base = ""
        self._manifest_written = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("root", "storage", "vocab_size", "key", "dtype", "digest")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"TokenCache({self.where()!r}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------------------------------------ paths
    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            storage = self.storage
            if self.root.split("://", 1)[0].lower() in ("s3", "s3a"):  # a small object in one PUT, not a multipart
                storage = dataclasses.replace(storage, options={**storage.options, "allow_delayed_open": True})
            fs, base = storage.filesystem(self.root)
            self._fs, self._base = fs, base.rstrip("/")
        return self._fs, self._base

    def _path(self, relative: str = "") -> str:
        base = f"{self._filesystem()[1]}/{self.digest}"
        return f"{base}/{relative}" if relative else base

    def where(self, relative: str = "") -> str:
        """``relative`` inside this version's folder, for messages (a URL without query or credentials)."""
        root = canonical(self.root).rstrip("/") if "://" in self.root else self._filesystem()[1]
        return f"{root}/{self.digest}/{relative}" if relative else f"{root}/{self.digest}"

    @staticmethod
    def entry_name(file_digest: int | str, group_in_file: int, start: int, stop: int, content: str) -> str:
        """The entry's path inside the version folder: ``<file digest>/<group>-<start>-<stop>.<content key>.tok``;
        ValueError for a negative number, a file digest not a plain name, or a content key not 16 to 64 hex digits."""
        if not isinstance(content, str) or not _CONTENT_KEY.fullmatch(content):
            raise ValueError(f"content key {content!r} must be 16 to 64 lowercase hex digits")
        return f"{TokenCache.file_folder(file_digest)}/{TokenCache.unit_name(group_in_file, start, stop)}.{content}" + (
            ENTRY_SUFFIX
        )

    @staticmethod
    def unit_name(group_in_file: int, start: int, stop: int) -> str:
        """``<group>-<start>-<stop>``; ValueError where that is no unit."""
        if not 0 <= start <= stop or group_in_file < 0:
            raise ValueError(f"row group {group_in_file}, rows [{start}, {stop}) are not a unit")
        return f"{int(group_in_file)}-{int(start)}-{int(stop)}"

    @staticmethod
    def file_folder(file_digest: int | str) -> str:
        """The folder of a file's entries; ValueError for a negative digest or one not a plain name."""
        if isinstance(file_digest, str):
            if not _FILE_NAME.fullmatch(file_digest):
                raise ValueError(f"file digest {file_digest!r} must be letters, digits, '.', '_', '-'")
            file_part = file_digest
        elif int(file_digest) >= 0:
            file_part = f"{int(file_digest):016x}"
        else:
            raise ValueError(f"file digest {file_digest} must be >= 0")
        return file_part

    def _identity(self, file_part: str, group: int, start: int, stop: int, content: str) -> dict[str, Any]:
        """What an entry's header must say: it is the entry looked up (the same content), of this version."""
        identity = {"format": FORMAT_VERSION, "key": self.digest, "vocab_size": self.vocab_size}
        identity.update(dtype=self.dtype.name, file=file_part, group=int(group), start=int(start), stop=int(stop))
        identity["content"] = content
        return identity

    # ------------------------------------------------------------------------------------------------ loading
    def load(
        self,
        file_digest: int | str,
        group_in_file: int,
        start: int,
        stop: int,
        content: str,
        described: str | None = None,
    ) -> CachedUnit | None:
        """The cached tokenization of the unit whose stored text has content key ``content``, or ``None``: not cached,
        a failed read (warned once), or a bad entry (warned about, up to ``MAX_NAMED_ENTRIES`` per version, and
        deleted). ``described`` names the unit in those warnings.
        """
        name = self.entry_name(file_digest, group_in_file, start, stop, content)
        path = self._path(name)
        fs, _ = self._filesystem()
        try:
            data = _read_whole(fs, path)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError as err:
            self._count(misses=1)
            _warn_once(("read", self.where()), f"cannot read token cache entry {self.where(name)!r} ({err}); its "
                                              "unit is tokenized instead (further read failures of this cache are "
                                              "not reported)")  # fmt: skip
            return None
        try:
            identity = self._identity(name.split("/", 1)[0], group_in_file, start, stop, content)
            unit = _decode(data, identity, self.vocab_size)
        except _BadEntry as bad:
            self._count(misses=1, bad=1)
            described = described or f"row group {group_in_file}, rows {start}..{stop - 1}"
            _report_bad(self.where(), self.where(name), described, str(bad))
            _delete_quietly(fs, path)
            return None
        self._count(hits=1, bytes_read=len(data))
        return unit

    # ------------------------------------------------------------------------------------------------ storing
    @property
    def writing(self) -> bool:
        """Whether this process still stores entries (``False`` after a full disk, quota or permission error)."""
        return self.where() not in _NOT_WRITING

    def store(
        self, file_digest: int | str, group_in_file: int, start: int, stop: int, content: str, unit: CachedUnit
    ) -> bool:
        """Store a whole unit's tokenization atomically, under the content key of the stored text it was decoded from;
        whether it was stored. A write failure is a warning, never an exception (space, quota or permission errors
        stop this process's writing); ValueError for an invalid ``unit``.
        """
        name = self.entry_name(file_digest, group_in_file, start, stop, content)
        if (unit.group_in_file, unit.start, unit.stop) != (group_in_file, start, stop):
            raise ValueError(f"unit of row group {unit.group_in_file}, rows [{unit.start}, {unit.stop}) stored as "
                             f"row group {group_in_file}, rows [{start}, {stop})")  # fmt: skip
        if unit.tokens.dtype != self.dtype:
            unit = dataclasses.replace(unit, tokens=token_array(unit.tokens, self.vocab_size))
        problem = _problem(unit, self.vocab_size)
        if problem is not None:
            raise ValueError(f"cannot store {self.where(name)!r}: {problem}")
        if not self.writing:
            return False
        identity = self._identity(name.split("/", 1)[0], unit.group_in_file, unit.start, unit.stop, content)
        pieces = _encode(unit, identity, self.dtype)
        fs, _ = self._filesystem()
        try:
            self._write_manifest()
            _write_atomic(fs, self._path(name), pieces)
        except OSError as err:
            self._count(store_failures=1)
            local = isinstance(fs, pafs.LocalFileSystem)
            _store_failed(canonical(self.root), self.where(), self.where(name), local, err)
            return False
        self._count(stored=1, bytes_written=sum(len(piece) for piece in pieces))
        return True

    def _write_manifest(self) -> None:
        """Once per process; every writer writes the same manifest."""
        if self._manifest_written:
            return
        path = self._path(MANIFEST)
        fs, _ = self._filesystem()
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            manifest = {"format": FORMAT_VERSION, "key": self.key, "vocab_size": self.vocab_size,
                        "dtype": self.dtype.name}  # fmt: skip
            _write_atomic(fs, path, [memoryview(json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")])
        self._manifest_written = True

    # ------------------------------------------------------------------------------------------------ inspecting
    def coverage(self, units: Iterable[tuple[int | str, int, int, int]]) -> Coverage:
        """How many of ``units`` (``(file digest, group in file, start, stop)``) have an entry, and their bytes; OSError
        where the root cannot be listed. Nothing is read or hashed: an entry of the unit under its file's current
        footer (or layout) digest counts, whatever content it was made from, so a unit edited without changing its
        file's footer counts until it is read (and its new tokens stored beside).
        """
        entries = self.entries()
        cached = total = size = 0
        for file_digest, group, start, stop in units:
            total += 1
            found = entries.get(f"{self.file_folder(file_digest)}/{self.unit_name(group, start, stop)}")
            if found is not None:
                cached, size = cached + 1, size + found[1]
        return Coverage(cached, total, size)

    def entries(self) -> dict[str, tuple[str, int]]:
        """``{<file digest>/<group>-<start>-<stop>: (entry name, bytes)}`` from one listing (OSError as
        :meth:`coverage`); of a unit's several entries (contents made under one footer), the first by name."""
        found: dict[str, tuple[str, int]] = {}
        for name, size in sorted(_entry_sizes(self._filesystem()[0], self._path()).items()):
            match = _ENTRY.fullmatch(name)
            if match is not None:
                found.setdefault(match.group("unit"), (name, size))
        return found

    def entry_counts(self, name: str, lengths: int = 0) -> tuple[int, int, np.ndarray] | None:
        """``(documents, tokens, the first lengths documents' token counts)`` of entry ``name`` (as :meth:`entries`
        names it) from its header and offsets; ``None``: missing, unreadable or failing its header's checks."""
        parts = _entry_parts(name)
        if parts is None:
            return None
        try:  # the arrays' CRC-32 is not checked: nothing read here is ever a token
            return _entry_counts(self._filesystem()[0], self._path(name), self._identity(*parts), lengths)
        except (OSError, _BadEntry):
            return None

    def size(self) -> int:
        """Bytes under this version's folder, killed writers' temporary files included; OSError as :meth:`coverage`."""
        return sum(int(info.size) for info in _files(self._filesystem()[0], self._path()))

    def other_versions(self) -> dict[str, Any]:
        """``{folder: key}`` of the other versions under ``root`` (``None`` where the manifest is unreadable)."""
        return _version_keys(*self._filesystem(), skip=self.digest)

    def describe_other_versions(self) -> str | None:
        """A message naming the other versions under ``root`` and how their keys differ, or ``None``; OSError as
        :meth:`coverage`. Every process computes the same message: say it once per run.
        """
        formats: dict[str, Any] = {}
        others = _version_keys(*self._filesystem(), skip=self.digest, formats=formats)
        if not others:
            return None
        fs, _ = self._filesystem()
        exists = fs.get_file_info(self._path(MANIFEST)).type != pafs.FileType.NotFound
        return _versions_message(canonical(self.root), others, formats, self.key, self.digest, exists)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)


# ------------------------------------------------------------------------------------------------ versions
def _version_digest(key: Any, vocab_size: int) -> str:
    """The version folder's name; TypeError or ValueError where ``key`` is not JSON-serialisable."""
    identity = json.dumps(
        {"format": FORMAT_VERSION, "key": key, "vocab_size": vocab_size}, sort_keys=True, separators=(",", ":")
    )
    return digest(identity)


def _version_keys(fs: pafs.FileSystem, base: str, skip: str, formats: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{folder: key}`` of the versions under ``base`` but ``skip``; ``formats`` (if given) gets their formats."""
    out: dict[str, Any] = {}
    for info in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        name = info.base_name
        if info.type != pafs.FileType.Directory or not _VERSION_NAME.fullmatch(name) or name == skip:
            continue
        try:
            with fs.open_input_stream(f"{base}/{name}/{MANIFEST}") as manifest:
                data = json.loads(manifest.read())
            out[name] = data.get("key")
            if formats is not None:
                formats[name] = data.get("format")
        except (OSError, ValueError, AttributeError):
            out[name] = None
    return out


def _versions_message(
    root: str, others: Mapping[str, Any], formats: Mapping[str, Any], key: Any, digest: str, exists: bool
) -> str:
    described = []
    for name, their_key in sorted(others.items()):
        differs = _differences(key, their_key)
        if formats.get(name, FORMAT_VERSION) != FORMAT_VERSION:
            differs.append("entry format")
        described.append(f"{name} (differs in {', '.join(differs)})" if differs else name)
    state = "continues" if exists else "starts"
    return (
        f"token cache {root!r} holds tokens of {len(others)} other tokenizer or settings version(s): "
        f"{'; '.join(described)}. This run {state} its own version {digest} (key: "
        f"{json.dumps(key, sort_keys=True)[:300]}) and tokenizes the units it lacks; the others are kept (delete "
        "their folders to free space)"
    )


def _differences(ours: Any, theirs: Any) -> list[str]:
    if not isinstance(ours, Mapping) or not isinstance(theirs, Mapping):
        return [] if ours == theirs else ["key"]
    return sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))


# ------------------------------------------------------------------------------------------------ entries
def _encode(unit: CachedUnit, identity: Mapping[str, Any], dtype: np.dtype) -> list[memoryview]:
    """An entry's bytes, as pieces to write in order: prefix, header (identity, sizes, payload CRC-32), arrays."""
    arrays = [np.ascontiguousarray(a, _INDEX) for a in (unit.rows, unit.offsets, unit.too_long_rows,
                                                        unit.too_long_chars)]  # fmt: skip
    arrays.append(np.ascontiguousarray(unit.tokens, dtype))
    views = [memoryview(a).cast("B") for a in arrays]
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    header = dict(identity, documents=len(unit.rows), too_long=len(unit.too_long_rows), tokens=len(unit.tokens))
    header["payload_crc32"] = crc
    header = json.dumps(header, sort_keys=True).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % 8)  # the arrays start 8-byte aligned
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header))
    return [memoryview(prefix), memoryview(header), *views]


def _header(data: Any, identity: Mapping[str, Any]) -> tuple[list[int], int, dict[str, Any]]:
    """An entry's ``[documents, too-long rows, tokens]``, where its arrays start and its header, from ``data`` (the
    entry, or at least its prefix and header), checked: magic, format version, the header's CRC-32 and ``identity``;
    raises :class:`_BadEntry` naming the problem."""
    size = len(data)
    if size < _PREFIX.size:
        raise _BadEntry(f"truncated: {size} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_size, header_crc = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise _BadEntry(f"not a token cache entry (it starts with {bytes(magic)!r}, not {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise _BadEntry(f"format version {version}; this code reads version {FORMAT_VERSION}")
    payload_at = _PREFIX.size + header_size
    if payload_at > size:
        raise _BadEntry(f"truncated: {size} bytes, shorter than its {header_size}-byte header")
    raw = memoryview(data)[_PREFIX.size : payload_at]
    if zlib.crc32(raw) != header_crc:
        raise _BadEntry("its header fails its CRC-32 check")
    try:
        header = json.loads(bytes(raw))
        counts = [int(header[name]) for name in ("documents", "too_long", "tokens")]
    except (ValueError, KeyError, TypeError) as err:
        raise _BadEntry(f"unreadable header ({err})") from err
    for name, value in identity.items():
        if header.get(name) != value:
            raise _BadEntry(f"its header says {name}={header.get(name)!r}, expected {value!r}")
    if min(counts) < 0:
        raise _BadEntry(f"its header holds negative counts {counts}")
    return counts, payload_at, header


def _entry_parts(name: str) -> tuple[str, int, int, int, str] | None:
    """``(file folder, group, start, stop, content key)`` of an entry's name inside its version, or ``None``."""
    match = _ENTRY.fullmatch(name)
    if match is None:
        return None
    return match.group("file"), *(int(match.group(part)) for part in ("group", "start", "stop")), match.group("content")


def _entry_counts(
    fs: pafs.FileSystem, path: str, identity: Mapping[str, Any], lengths: int
) -> tuple[int, int, np.ndarray]:
    """``(documents, tokens, the first lengths documents' token counts)`` of the entry at ``path``, from its prefix,
    header and offsets (two or three small reads); raises :class:`_BadEntry` or OSError."""
    with open(path, "rb") if isinstance(fs, pafs.LocalFileSystem) else fs.open_input_file(path) as entry:
        head = entry.read(_HEAD_BYTES)
        if len(head) >= _PREFIX.size and _PREFIX.size + _PREFIX.unpack_from(head, 0)[2] > len(head):
            entry.seek(0)
            head = entry.read(_PREFIX.size + _PREFIX.unpack_from(head, 0)[2])
        (docs, _long_docs, tokens), payload_at, _ = _header(head, identity)
        take = min(int(lengths), docs)
        entry.seek(payload_at + _INDEX.itemsize * docs)
        data = entry.read(_INDEX.itemsize * (take + 1))
    if len(data) != _INDEX.itemsize * (take + 1):
        raise _BadEntry("truncated: its offsets end early")
    offsets = np.frombuffer(data, _INDEX)
    if offsets[0] != 0 or bool(np.any(offsets[1:] < offsets[:-1])) or offsets[-1] > tokens:
        raise _BadEntry("its document offsets do not frame its tokens")
    return docs, tokens, np.diff(offsets)


def _decode(data: Any, identity: Mapping[str, Any], vocab_size: int) -> CachedUnit:
    """The unit ``data`` holds, fully checked against ``identity``; raises :class:`_BadEntry` naming the problem."""
    size, dtype = len(data), token_dtype(vocab_size)
    counts, payload_at, header = _header(data, identity)
    docs, long_docs, tokens = counts
    payload = _INDEX.itemsize * (2 * docs + 1 + 2 * long_docs) + dtype.itemsize * tokens
    if size != payload_at + payload:
        state = "truncated" if size < payload_at + payload else "longer than its header says"
        raise _BadEntry(f"{state}: {size} bytes, its header describes {payload_at + payload}")
    if zlib.crc32(memoryview(data)[payload_at:]) != header.get("payload_crc32"):
        raise _BadEntry("its arrays fail their CRC-32 check")
    arrays, at = [], payload_at
    for array_dtype, count in ((_INDEX, docs), (_INDEX, docs + 1), (_INDEX, long_docs), (_INDEX, long_docs),
                               (dtype, tokens)):  # fmt: skip
        arrays.append(np.frombuffer(data, array_dtype, count, at))
        at += array_dtype.itemsize * count
    unit = CachedUnit(identity["group"], identity["start"], identity["stop"], arrays[0], arrays[1], arrays[4],
                      arrays[2], arrays[3])  # fmt: skip
    problem = _problem(unit, vocab_size)
    if problem is not None:
        raise _BadEntry(problem)
    return unit


# ------------------------------------------------------------------------------------------------ files
def _read_whole(fs: pafs.FileSystem, path: str) -> Any:
    if isinstance(fs, pafs.LocalFileSystem):
        with open(path, "rb") as entry:
            return entry.read()  # one read of the whole file: its size is known from fstat
    with fs.open_input_file(path) as entry:
        return entry.read_buffer()


def _write_atomic(fs: pafs.FileSystem, path: str, pieces: list[memoryview]) -> None:
    """``path`` holds all of ``pieces`` or stays as it was."""
    if isinstance(fs, pafs.LocalFileSystem):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        # Unique per writer, in the same folder (a rename does not cross filesystems), hidden from listings.
        temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(temporary, "wb") as out:
                for piece in pieces:
                    out.write(piece)
                out.flush()
                os.fsync(out.fileno())  # the data is on disk before the name points at it
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return
    data = b"".join(pieces)  # one write: a failure cannot leave part of the entry queued for the commit
    out = fs.open_output_stream(path)
    try:
        out.write(data)
    except BaseException:
        # pyarrow streams have no abort, and closing one (here, or when it is freed) commits what it holds:
        # delete whatever that committed (a peer's complete entry at worst, stored again later).
        with contextlib.suppress(Exception):
            out.close()
        with contextlib.suppress(OSError):
            fs.delete_file(path)
        raise
    out.close()  # the object exists from here on, whole


def read_record(cache: TokenCache, relative: str) -> bytes:
    """The bytes of a record kept in ``cache``'s version folder (``relative`` to it); OSError where there is none."""
    return bytes(_read_whole(cache._filesystem()[0], cache._path(relative)))


def write_record(cache: TokenCache, relative: str, data: bytes) -> None:
    """Write a record into ``cache``'s version folder atomically (OSError where it cannot be written)."""
    _write_atomic(cache._filesystem()[0], cache._path(relative), [memoryview(data)])


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(OSError):  # best effort: a later store replaces it anyway
        if isinstance(fs, pafs.LocalFileSystem):
            os.unlink(path)
        else:
            fs.delete_file(path)


def _files(fs: pafs.FileSystem, folder: str) -> list[pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    return [info for info in infos if info.type == pafs.FileType.File]


def _entry_sizes(fs: pafs.FileSystem, folder: str) -> dict[str, int]:
    """``{entry name: bytes}`` under a version's ``folder``, temporary files and the manifest left out."""
    out = {}
    for info in _files(fs, folder):
        name = info.base_name
        if name.endswith(ENTRY_SUFFIX) and not name.startswith("."):
            out[info.path[len(folder) + 1 :]] = int(info.size)
    return out


# ------------------------------------------------------------------------------------------------ warnings
def _warn(message: str) -> None:
    warnings.warn(message, TokenCacheWarning, stacklevel=3)


def _warn_once(what: tuple[str, ...], message: str) -> None:
    with _LOCK:
        if what in _WARNED:
            return
        _WARNED.add(what)
    _warn(message)


def _report_bad(version: str, entry: str, unit: str, reason: str) -> None:
    """Name the bad entry in a warning, up to ``MAX_NAMED_ENTRIES`` per ``version``."""
    with _LOCK:
        named = _NAMED.get(version, 0)
        _NAMED[version] = named + 1
    if named < MAX_NAMED_ENTRIES:
        _warn(f"token cache entry {entry!r} ({unit}) is unusable, {reason}: it is deleted, and the unit is "
              "tokenized and stored again")  # fmt: skip
    elif named == MAX_NAMED_ENTRIES:
        _warn(f"token cache {version!r}: more than {MAX_NAMED_ENTRIES} unusable entries; the rest are deleted and "
              "rebuilt without a warning each (TokenCache.counters.bad counts them)")  # fmt: skip


def _store_failed(root: str, version: str, entry: str, local: bool, err: OSError) -> None:
    """Warn; stop writing to ``version`` where the next store would fail too."""
    stops = isinstance(err, PermissionError) or err.errno in _STOPS_WRITING or (not local and not is_transient(err))
    if stops:
        with _LOCK:
            first = version not in _NOT_WRITING
            _NOT_WRITING[version] = str(err)
        if first:
            _warn(f"token cache {root!r}: cannot store tokens ({err}); this process stops writing to the cache and "
                  "keeps reading it, tokenizing the units it lacks")  # fmt: skip
        return
    kind = type(err).__name__ + str(err.errno or "")
    _warn_once(("store", version, kind), f"could not store token cache entry {entry!r} ({err}); its unit is "
               f"tokenized again when next read (further {kind} failures of this cache are not reported)")  # fmt: skip


def _problem(unit: CachedUnit, vocab_size: int) -> str | None:
    arrays = {"rows": unit.rows, "offsets": unit.offsets, "too_long_rows": unit.too_long_rows,
              "too_long_chars": unit.too_long_chars, "tokens": unit.tokens}  # fmt: skip
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
            return f"{name} is not a 1-D integer array"
    rows, offsets, tokens, start, stop = unit.rows, unit.offsets, unit.tokens, unit.start, unit.stop
    if not 0 <= start <= stop:
        return f"rows [{start}, {stop}) are not a range"
    for name, some in (("documents", rows), ("too-long rows", unit.too_long_rows)):
        if len(some) and (some[0] < start or some[-1] >= stop or bool(np.any(some[1:] <= some[:-1]))):
            return f"the {name} are not ascending rows inside [{start}, {stop})"
    if len(unit.too_long_chars) != len(unit.too_long_rows) or bool(np.any(unit.too_long_chars < 1)):
        return "the too-long rows' lengths do not match them"
    if len(unit.too_long_rows) and np.intersect1d(rows, unit.too_long_rows).size:
        return "a row is both a document and too long"
    if len(offsets) != len(rows) + 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
        return f"{len(offsets)} offsets from {offsets[0] if len(offsets) else None} do not frame {len(rows)} documents"
    if bool(np.any(offsets[1:] < offsets[:-1])):
        return "the document offsets decrease"
    if tokens.dtype != token_dtype(vocab_size):
        return f"tokens are {tokens.dtype}, not {token_dtype(vocab_size)}"
    if len(tokens) and int(tokens.max()) >= vocab_size:
        return f"token id {int(tokens.max())} is outside the vocabulary [0, {vocab_size})"
    return None


# ------------------------------------------------------------------------------------------------ streams
class StreamCache:
    """A token cache as a source's streams use it; ``index`` (the source's ``RowGroupIndex``) names each unit's file
    and gives each unit's content key; ``scope`` names the file set (``train_files``, ``val_files['web']``): file labels
    are relative to their set's common folder, so two sets may hold the same label for different files."""

    def __init__(self, cache: TokenCache, index: Any, scope: str = ""):
        self.cache, self.index, self.scope = cache, index, scope
        self.labelled: set[int] = set()  # files whose label record this process has written
        self._labels: list[str] | None = None

    def label(self, file: int) -> str:
        """A file's path relative to the corpus's common folder: the same wherever the corpus is."""
        if self._labels is None:
            self._labels = self.index.file_labels()
        return self._labels[file]

    def _where(self, group: int) -> tuple[int, int]:
        file = int(self.index.file_of[group])
        return self.index.file_digests[file], int(self.index.group_in_file[group])

    def load(self, group: int, start: int, stop: int) -> CachedUnit | None:
        """Unit ``[start, stop)`` of global row group ``group``, or ``None`` when it is not (validly) cached. The unit's
        stored text is read and hashed to find its entry; ValueError or StorageError where it cannot be read.
        """
        content = self.index.content_key(group)
        file_digest, in_file = self._where(group)
        return self.cache.load(file_digest, in_file, start, stop, content, self.index.describe_rows(group, start, stop))

    def recorder(
        self, group: int, start: int, stop: int, too_long: Mapping[int, int], content: str
    ) -> UnitRecorder | None:
        """What records the unit's documents as they are tokenized, to be stored under ``content`` (the content key of
        the bytes they were decoded from); ``None`` when this process stores nothing."""
        if not self.cache.writing:
            return None
        file_digest, in_file = self._where(group)
        long_rows = {row: chars for row, chars in too_long.items() if start <= row < stop}
        return UnitRecorder(self, group, (file_digest, in_file, start, stop, content), long_rows)

    def stored(self, group: int) -> None:
        """Record once which file label a digest belongs to, so a later run can name the files edited since."""
        file = int(self.index.file_of[group])
        if file in self.labelled:
            return
        self.labelled.add(file)
        label = self.label(file)
        record = f"{TokenCache.file_folder(self.index.file_digests[file])}\n{label}\n"
        with contextlib.suppress(OSError):
            _write_atomic(self.cache._filesystem()[0], self._label_path(label), [memoryview(record.encode())])

    def _label_path(self, label: str) -> str:
        return self.cache._path(f"labels/{self._label_key(label)}")

    def _label_key(self, label: str) -> str:
        return digest(f"{self.scope}\n{label}" if self.scope else label)

    def changes(self) -> list[str]:
        """What a user should hear once: other versions of this cache, and files changed since they were cached."""
        messages = []
        with contextlib.suppress(OSError):
            other = self.cache.describe_other_versions()
            if other is not None:
                messages.append(other)
        with contextlib.suppress(OSError):
            changed = self._changed_files()
            if changed:
                shown = ", ".join(repr(label) for label in changed[:5]) + (" ..." if len(changed) > 5 else "")
                messages.append(
                    f"token cache {self.cache.where()!r}: {len(changed)} file(s)"
                    + (f" of {self.scope}" if self.scope else "")
                    + f" changed since their tokens were cached ({shown}); their tokens are rebuilt as they "
                    "are read, the old ones are never used"
                )
        return messages

    def _changed_files(self) -> list[str]:
        """Labels of files whose footer (layout) digest has no entries while their label record names another: a
        message only (an edit that keeps the footer is not named; its tokens are rebuilt all the same, as every entry
        is found by the content it was made from)."""
        fs, _ = self.cache._filesystem()
        present = {info.base_name for info in fs.get_file_info(pafs.FileSelector(self.cache._path(),
                                                                                  allow_not_found=True))}  # fmt: skip
        records = {info.base_name for info in fs.get_file_info(pafs.FileSelector(self.cache._path("labels"),
                                                                                  allow_not_found=True))}  # fmt: skip
        changed = []
        for file, file_digest in enumerate(self.index.file_digests):
            folder = TokenCache.file_folder(file_digest)
            if folder in present:
                continue
            label = self.label(file)
            if self._label_key(label) not in records:
                continue  # never cached: a new file, not a changed one
            try:
                with fs.open_input_stream(self._label_path(label)) as stream:
                    recorded = stream.read().decode().split("\n", 1)[0]
            except (OSError, UnicodeDecodeError):
                continue
            if recorded != folder:
                changed.append(label)
        return changed

    def coverage(self, units: Any) -> Coverage:
        """How much of ``units`` (``Units`` of this index) the cache holds (see :meth:`TokenCache.coverage`)."""
        return self.cache.coverage(
            (*self._where(int(group)), int(begin), int(end))
            for group, begin, end in zip(units.group, units.start, units.stop)
        )


class UnitRecorder:
    """A unit's documents recorded chunk by chunk as compact ids, stored once whole.

    Args:
        source: the stream cache it stores through.
        group: the unit's global row group.
        entry: ``(file digest, group in file, start, stop, content key)``: the entry it is stored as.
        too_long: ``{row: characters}`` of the unit's rows skipped as too long.
    """

    def __init__(
        self, source: StreamCache, group: int, entry: tuple[int | str, int, int, int, str], too_long: dict[int, int]
    ):
        self.source, self.cache, self.group = source, source.cache, group
        self.entry, self.too_long = entry, too_long
        self.rows: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []

    def add(self, rows: np.ndarray, encodings: Sequence[Any]) -> None:
        """Record one chunk's documents, in the stream's order."""
        if isinstance(encodings, EncodedBatch):  # flat ids already
            lengths, flat = encodings.counts, encodings.ids
        else:
            lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
            flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int64, int(lengths.sum()))
        self.rows.append(np.asarray(rows, np.int64))
        self.ids.append(token_array(flat, self.cache.vocab_size))
        self.lengths.append(lengths)

    def store(self) -> None:
        """Store the unit, once all its documents were added."""
        _digest, group_in_file, start, stop, _content = self.entry
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        long_rows = sorted(self.too_long.items())
        unit = CachedUnit(
            group_in_file,
            start,
            stop,
            np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64),
            offsets,
            np.concatenate(self.ids) if self.ids else np.zeros(0, self.cache.dtype),
            np.asarray([row for row, _ in long_rows], np.int64),
            np.asarray([chars for _, chars in long_rows], np.int64),
        )
        if self.cache.store(*self.entry, unit):
            self.source.stored(self.group)
        self.rows, self.ids, self.lengths = [], [], []


def usable_root(root: str, storage: Storage) -> str | None:
    """``root`` where a token cache can be kept there, ``None`` (one warning) where its storage cannot be reached: the
    run trains without a cache rather than failing or waiting at every unit.

    Raises:
        ValueError: ``root`` is an existing file or lies inside one (a folder is created where missing), or bad
            storage options.
    """
    fs, path = storage.filesystem(root)
    local = isinstance(fs, pafs.LocalFileSystem)
    try:
        info = storage.retrying(lambda: fs.get_file_info(path), lambda: f"token cache {redact(root)!r}", _no_op)
    except OSError as err:
        if local and not isinstance(err, StorageError):
            raise ValueError(f"token_cache={redact(root)!r} cannot be used: {err}") from err
        _warn_once(("unreachable", canonical(root)), f"token cache {redact(root)!r} cannot be reached ({err}); this "
                   "run trains without it: every unit is tokenized, and JSONL files are scanned at setup")  # fmt: skip
        return None
    if info.type == pafs.FileType.File:
        raise ValueError(f"token_cache={redact(root)!r} is a file: give a folder (created where missing) or a URL")
    if local and info.type == pafs.FileType.NotFound:
        parent = os.path.dirname(path)
        while parent and not os.path.exists(parent) and parent != os.path.dirname(parent):
            parent = os.path.dirname(parent)
        if os.path.isfile(parent):
            raise ValueError(f"token_cache={redact(root)!r} lies inside the file {parent!r}: give a folder (created "
                             "where missing) or a URL")  # fmt: skip
    return root


def _no_op() -> None:
    pass
