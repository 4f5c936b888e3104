"""Token cache: each unit's tokens, stored the first time the unit is tokenized and read back instead of tokenizing.

Under ``root``, one folder per *version* (``sha256(key)[:16]``; the key is everything that decides the tokens, so a
changed setting never meets stale tokens) holds one self-validating entry (CRC-32s, structure) per unit, named by
the unit's *content key*: a digest of the stored bytes its texts are decoded from (``content.py``, ``jsonl.py``),
computed when a stream is about to read the unit. An edited unit has another key, so its old entry is never looked
up, and two files share an entry only where their bytes are the same. The entry's folder is its file's footer (or
layout) digest, which only groups entries for listing (coverage, "files changed" at setup) and is trusted with no
token. A bad entry is a miss, warned about and deleted. Stores are atomic and uncoordinated: every writer of an
entry writes the same bytes. While a unit is read, its documents tokenized so far are kept as its *partial entry*
(the same format, ``.part``, holding the documents of its first rows), rewritten as they double and when the reader
stops: a run that stops inside its units keeps its work, and the next read continues it instead of starting over.
Trade-off: one file per unit needs no index and keeps writers independent, at the price of a file per row group,
of reading an entry whole, and of a read and a hash of the unit's stored text per lookup; rewriting a partial
entry as it doubles writes about twice a unit in all, and a killed process loses at most half of its last unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow.fs as pafs

from lightning_d9d.core.digest import digest
from lightning_d9d.streaming.sources.storage import Storage, canonical, is_transient
from lightning_d9d.streaming.tokens.cache_entry import (
    ENTRY_SUFFIX,
    FORMAT_VERSION,
    PARTIAL_SUFFIX,
    BadEntry,
    CachedUnit,
    decode_entry,
    encode_entry,
    entry_counts,
    entry_name,
    entry_problem,
    file_folder,
    token_array,
    token_dtype,
    unit_name,
)

MANIFEST = "manifest.json"
# Store failures that the next store would meet too: the process stops writing.
_STOPS_WRITING = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                  errno.EEXIST}  # fmt: skip
# Bad entries named in a warning per cache version and process. Past that many, the cache is probably damaged
# as a whole; one more warning says so, and the rest are only counted.
MAX_NAMED_ENTRIES = 8
_VERSION_NAME = re.compile(r"[0-9a-f]{16}")
_ENTRY = re.compile(
    r"(?P<unit>(?P<file>[^/]+)/(?P<group>\d+)-(?P<start>\d+)-(?P<stop>\d+))\.(?P<content>[0-9a-f]{16,64})"
    + re.escape(ENTRY_SUFFIX)
)
_PARTIAL = re.compile(_ENTRY.pattern[: -len(re.escape(ENTRY_SUFFIX))] + re.escape(PARTIAL_SUFFIX))

# What this process has warned about, and the cache versions (by where()) it no longer writes to. A forked
# worker inherits both, which keeps a failure it would meet again from being warned about once more per worker.
_WARNED: set[tuple[str, ...]] = set()
_NAMED: dict[str, int] = {}
_NOT_WRITING: dict[str, str] = {}
_LOCK = threading.Lock()


class TokenCacheWarning(UserWarning):
    """The token cache could not be used as it should (a bad entry, a failed store); training goes on."""


class Coverage(NamedTuple):
    """How much of a list of units a cache holds: ``cached`` of ``total`` units whole, in ``bytes`` bytes; ``partial``
    more units have a partial entry (their first documents), in ``partial_bytes`` bytes."""

    cached: int
    total: int
    bytes: int
    partial: int = 0
    partial_bytes: int = 0


@dataclass
class CacheCounters:
    """One process's :class:`TokenCache` counters."""

    hits: int = 0
    misses: int = 0
    partial_hits: int = 0
    bad: int = 0
    stored: int = 0
    store_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


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
    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            storage = self.storage
            if self.root.split("://", 1)[0].lower() in ("s3", "s3a"):  # a small object in one PUT, not a multipart
                storage = dataclasses.replace(storage, options={**storage.options, "allow_delayed_open": True})
            fs, base = storage.filesystem(self.root)
            self._fs, self._base = fs, base.rstrip("/")
        return self._fs, self._base

    def fs_path(self, relative: str = "") -> str:
        base = f"{self.filesystem()[1]}/{self.digest}"
        return f"{base}/{relative}" if relative else base

    def where(self, relative: str = "") -> str:
        """``relative`` inside this version's folder, for messages (a URL without query or credentials)."""
        root = canonical(self.root).rstrip("/") if "://" in self.root else self.filesystem()[1]
        return f"{root}/{self.digest}/{relative}" if relative else f"{root}/{self.digest}"

    entry_name = staticmethod(entry_name)
    unit_name = staticmethod(unit_name)
    file_folder = staticmethod(file_folder)

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
        partial: bool = False,
    ) -> CachedUnit | None:
        """The cached tokenization of the unit whose stored text has content key ``content``, or ``None``: not cached,
        a failed read (warned once), or a bad entry (warned about, up to ``MAX_NAMED_ENTRIES`` per version, and
        deleted). ``described`` names the unit in those warnings. ``partial``: the unit's partial entry, a unit
        whose ``stop`` is the row its documents reach (rows ``[start, stop)`` of it are accounted for).
        """
        name = self.entry_name(file_digest, group_in_file, start, stop, content, partial)
        path = self.fs_path(name)
        fs, _ = self.filesystem()
        # A unit without a whole entry is one miss, whether or not a partial entry of it is found.
        missed = {} if partial else {"misses": 1}
        try:
            data = _read_whole(fs, path)
        except FileNotFoundError:
            self._count(**missed)
            return None
        except OSError as err:
            self._count(**missed)
            warn_once(("read", self.where()), f"cannot read token cache entry {self.where(name)!r} ({err}); its "
                                              "unit is tokenized instead (further read failures of this cache are "
                                              "not reported)")  # fmt: skip
            return None
        try:
            identity = self._identity(name.split("/", 1)[0], group_in_file, start, stop, content)
            unit = decode_entry(data, identity, self.vocab_size, partial)
        except BadEntry as bad:
            self._count(**missed, bad=1)
            described = described or f"row group {group_in_file}, rows {start}..{stop - 1}"
            _report_bad(self.where(), self.where(name), described, str(bad))
            _delete_quietly(fs, path)
            return None
        self._count(**{"partial_hits" if partial else "hits": 1}, bytes_read=len(data))
        return unit

    # ------------------------------------------------------------------------------------------------ storing
    @property
    def writing(self) -> bool:
        """Whether this process still stores entries (``False`` after a full disk, quota or permission error)."""
        return self.where() not in _NOT_WRITING

    def store(
        self,
        file_digest: int | str,
        group_in_file: int,
        start: int,
        stop: int,
        content: str,
        unit: CachedUnit,
        partial: bool = False,
    ) -> bool:
        """Store a whole unit's tokenization atomically, under the content key of the stored text it was decoded from;
        whether it was stored. A write failure is a warning, never an exception (space, quota or permission errors
        stop this process's writing); ValueError for an invalid ``unit``. ``partial``: ``unit`` holds the documents
        of the unit's rows ``[start, unit.stop)``, stored as its partial entry (replacing the one there).
        """
        name = self.entry_name(file_digest, group_in_file, start, stop, content, partial)
        same = (unit.group_in_file, unit.start) == (group_in_file, start)
        if not (same and (start <= unit.stop < stop if partial else unit.stop == stop)):
            raise ValueError(f"unit of row group {unit.group_in_file}, rows [{unit.start}, {unit.stop}) stored as "
                             f"{'part of ' if partial else ''}row group {group_in_file}, rows [{start}, "
                             f"{stop})")  # fmt: skip
        if unit.tokens.dtype != self.dtype:
            unit = dataclasses.replace(unit, tokens=token_array(unit.tokens, self.vocab_size))
        problem = entry_problem(unit, self.vocab_size)
        if problem is not None:
            raise ValueError(f"cannot store {self.where(name)!r}: {problem}")
        if not self.writing:
            return False
        identity = self._identity(name.split("/", 1)[0], group_in_file, start, stop, content)
        if partial:
            identity.update(partial=True, covered=int(unit.stop))
        pieces = encode_entry(unit, identity, self.dtype)
        fs, _ = self.filesystem()
        try:
            self._write_manifest()
            write_atomic(fs, self.fs_path(name), pieces)
        except OSError as err:
            self._count(store_failures=1)
            local = isinstance(fs, pafs.LocalFileSystem)
            _store_failed(canonical(self.root), self.where(), self.where(name), local, err)
            return False
        self._count(stored=1, bytes_written=sum(len(piece) for piece in pieces))
        return True

    def delete_partial(self, file_digest: int | str, group_in_file: int, start: int, stop: int, content: str) -> None:
        """Delete the unit's partial entry, best effort: its whole entry holds every document of it."""
        _delete_quietly(self.filesystem()[0], self.fs_path(self.entry_name(file_digest, group_in_file, start, stop,
                                                                          content, partial=True)))  # fmt: skip

    def _write_manifest(self) -> None:
        """Once per process; every writer writes the same manifest."""
        if self._manifest_written:
            return
        path = self.fs_path(MANIFEST)
        fs, _ = self.filesystem()
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            manifest = {"format": FORMAT_VERSION, "key": self.key, "vocab_size": self.vocab_size,
                        "dtype": self.dtype.name}  # fmt: skip
            write_atomic(fs, path, [memoryview(json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")])
        self._manifest_written = True

    # ------------------------------------------------------------------------------------------------ inspecting
    def coverage(self, units: Iterable[tuple[int | str, int, int, int]]) -> Coverage:
        """How many of ``units`` (``(file digest, group in file, start, stop)``) have an entry, and their bytes; OSError
        where the root cannot be listed. Nothing is read or hashed: an entry of the unit under its file's current
        footer (or layout) digest counts, whatever content it was made from, so a unit edited without changing its
        file's footer counts until it is read (and its new tokens stored beside).
        """
        listed = _entry_sizes(self.filesystem()[0], self.fs_path(), (ENTRY_SUFFIX, PARTIAL_SUFFIX))
        entries, partials = _by_unit(listed, _ENTRY), _by_unit(listed, _PARTIAL)
        cached = total = size = partial = partial_size = 0
        for file_digest, group, start, stop in units:
            total += 1
            unit = f"{self.file_folder(file_digest)}/{self.unit_name(group, start, stop)}"
            found = entries.get(unit)
            if found is not None:
                cached, size = cached + 1, size + found[0][1]
            elif unit in partials:
                partial, partial_size = partial + 1, partial_size + partials[unit][0][1]
        return Coverage(cached, total, size, partial, partial_size)

    def entries(self) -> dict[str, tuple[str, int]]:
        """``{<file digest>/<group>-<start>-<stop>: (entry name, bytes)}`` from one listing (OSError as
        :meth:`coverage`); of a unit's several entries (contents made under one footer), the first by name."""
        return {unit: found[0] for unit, found in self.unit_entries().items()}

    def unit_entries(self) -> dict[str, list[tuple[str, int]]]:
        """``{<file digest>/<group>-<start>-<stop>: [(entry name, bytes), ...]}``: every whole entry of each unit (one
        per content it was stored from), by name, from one listing (OSError as :meth:`coverage`)."""
        return _by_unit(_entry_sizes(self.filesystem()[0], self.fs_path()), _ENTRY)

    def entry_counts(self, name: str, lengths: int = 0) -> tuple[int, int, np.ndarray] | None:
        """``(documents, tokens, the first lengths documents' token counts)`` of entry ``name`` (as :meth:`entries`
        names it) from its header and offsets; ``None``: missing, unreadable or failing its header's checks."""
        parts = _entry_parts(name)
        if parts is None:
            return None
        try:  # the arrays' CRC-32 is not checked: nothing read here is ever a token
            return entry_counts(self.filesystem()[0], self.fs_path(name), self._identity(*parts), lengths)
        except (OSError, BadEntry):
            return None

    def size(self) -> int:
        """Bytes under this version's folder, killed writers' temporary files included; OSError as :meth:`coverage`."""
        return sum(int(info.size) for info in _files(self.filesystem()[0], self.fs_path()))

    def other_versions(self) -> dict[str, Any]:
        """``{folder: key}`` of the other versions under ``root`` (``None`` where the manifest is unreadable)."""
        return _version_keys(*self.filesystem(), skip=self.digest)

    def describe_other_versions(self) -> str | None:
        """A message naming the other versions under ``root`` and how their keys differ, or ``None``; OSError as
        :meth:`coverage`. Every process computes the same message: say it once per run.
        """
        formats: dict[str, Any] = {}
        others = _version_keys(*self.filesystem(), skip=self.digest, formats=formats)
        if not others:
            return None
        fs, _ = self.filesystem()
        exists = fs.get_file_info(self.fs_path(MANIFEST)).type != pafs.FileType.NotFound
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


def _entry_parts(name: str) -> tuple[str, int, int, int, str] | None:
    """``(file folder, group, start, stop, content key)`` of an entry's name inside its version, or ``None``."""
    match = _ENTRY.fullmatch(name)
    if match is None:
        return None
    return match.group("file"), *(int(match.group(part)) for part in ("group", "start", "stop")), match.group("content")


# ------------------------------------------------------------------------------------------------ files
def _read_whole(fs: pafs.FileSystem, path: str) -> Any:
    if isinstance(fs, pafs.LocalFileSystem):
        with open(path, "rb") as entry:
            return entry.read()  # one read of the whole file: its size is known from fstat
    with fs.open_input_file(path) as entry:
        return entry.read_buffer()


def write_atomic(fs: pafs.FileSystem, path: str, pieces: list[memoryview]) -> None:
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
    return bytes(_read_whole(cache.filesystem()[0], cache.fs_path(relative)))


def write_record(cache: TokenCache, relative: str, data: bytes) -> None:
    """Write a record into ``cache``'s version folder atomically (OSError where it cannot be written)."""
    write_atomic(cache.filesystem()[0], cache.fs_path(relative), [memoryview(data)])


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(OSError):  # best effort: a later store replaces it anyway
        if isinstance(fs, pafs.LocalFileSystem):
            os.unlink(path)
        else:
            fs.delete_file(path)


def _files(fs: pafs.FileSystem, folder: str) -> list[pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    return [info for info in infos if info.type == pafs.FileType.File]


def _entry_sizes(fs: pafs.FileSystem, folder: str, suffixes: tuple[str, ...] = (ENTRY_SUFFIX,)) -> dict[str, int]:
    """``{entry name: bytes}`` of the entries (by default whole ones) under a version's ``folder``, temporary files
    and the manifest left out."""
    out = {}
    for info in _files(fs, folder):
        name = info.base_name
        if name.endswith(suffixes) and not name.startswith("."):
            out[info.path[len(folder) + 1 :]] = int(info.size)
    return out


def _by_unit(sizes: Mapping[str, int], pattern: re.Pattern) -> dict[str, list[tuple[str, int]]]:
    """``{unit: [(entry name, bytes), ...]}`` of the entries of ``sizes`` that ``pattern`` names, by name."""
    found: dict[str, list[tuple[str, int]]] = {}
    for name, size in sorted(sizes.items()):
        match = pattern.fullmatch(name)
        if match is not None:
            found.setdefault(match.group("unit"), []).append((name, size))
    return found


# ------------------------------------------------------------------------------------------------ warnings
def _warn(message: str) -> None:
    warnings.warn(message, TokenCacheWarning, stacklevel=3)


def warn_once(what: tuple[str, ...], message: str) -> None:
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
    warn_once(("store", version, kind), f"could not store token cache entry {entry!r} ({err}); its unit is "
               f"tokenized again when next read (further {kind} failures of this cache are not reported)")  # fmt: skip


# ------------------------------------------------------------------------------------------------ streams
