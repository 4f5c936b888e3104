"""Cache entry: the self-validating file format of one unit's tokens, and the checks it passes before it is used.

An entry is a prefix (magic, format version, header length, the header's CRC-32), a JSON header that repeats the
unit's identity (file, row group, rows, content key) and the ids' dtype, then per document the token offsets and the
ids, each part under its own CRC-32. Decoding checks all of it and that every id is in the vocabulary, so a torn
write, a bit flip or an entry of another unit is a miss, never tokens. Trade-off: an entry is read whole to be
checked, and ids are stored in the narrowest dtype of the vocabulary (uint16 under 65,536) rather than compressed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs

FORMAT_VERSION = 2
MAGIC = b"D9DTOKS\n"
CONTENT_KEY = re.compile(r"[0-9a-f]{16,64}")
FILE_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,127}")
# A partial entry: the documents of a unit's first rows, kept while a run reads the unit and extended by later ones.
PARTIAL_SUFFIX = ".part"
ENTRY_SUFFIX = ".tok"


# magic, format version, header length in bytes, the header's CRC-32. CRC-32 (zlib) rather than a faster hash:
# no optional dependency, and one entry format.
ENTRY_PREFIX = struct.Struct("<8sIII")
ENTRY_INDEX = np.dtype("<i8")
# What a count reads of an entry at first: its prefix and header (a longer header is read whole in a second read).
HEAD_BYTES = 4096


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


class BadEntry(Exception):
    """An entry that must not be read as tokens; the message says why."""


# ------------------------------------------------------------------------------------------------ entries
def encode_entry(unit: CachedUnit, identity: Mapping[str, Any], dtype: np.dtype) -> list[memoryview]:
    """An entry's bytes, as pieces to write in order: prefix, header (identity, sizes, payload CRC-32), arrays."""
    arrays = [np.ascontiguousarray(a, ENTRY_INDEX) for a in (unit.rows, unit.offsets, unit.too_long_rows,
                                                        unit.too_long_chars)]  # fmt: skip
    arrays.append(np.ascontiguousarray(unit.tokens, dtype))
    views = [memoryview(a).cast("B") for a in arrays]
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    header = dict(identity, documents=len(unit.rows), too_long=len(unit.too_long_rows), tokens=len(unit.tokens))
    header["payload_crc32"] = crc
    header = json.dumps(header, sort_keys=True).encode()
    header += b" " * (-(ENTRY_PREFIX.size + len(header)) % 8)  # the arrays start 8-byte aligned
    prefix = ENTRY_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header))
    return [memoryview(prefix), memoryview(header), *views]


def entry_header(data: Any, identity: Mapping[str, Any]) -> tuple[list[int], int, dict[str, Any]]:
    """An entry's ``[documents, too-long rows, tokens]``, where its arrays start and its header, from ``data`` (the
    entry, or at least its prefix and header), checked: magic, format version, the header's CRC-32 and ``identity``;
    raises :class:`BadEntry` naming the problem."""
    size = len(data)
    if size < ENTRY_PREFIX.size:
        raise BadEntry(f"truncated: {size} bytes, shorter than the {ENTRY_PREFIX.size}-byte prefix")
    magic, version, header_size, header_crc = ENTRY_PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadEntry(f"not a token cache entry (it starts with {bytes(magic)!r}, not {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}; this code reads version {FORMAT_VERSION}")
    payload_at = ENTRY_PREFIX.size + header_size
    if payload_at > size:
        raise BadEntry(f"truncated: {size} bytes, shorter than its {header_size}-byte header")
    raw = memoryview(data)[ENTRY_PREFIX.size : payload_at]
    if zlib.crc32(raw) != header_crc:
        raise BadEntry("its header fails its CRC-32 check")
    try:
        header = json.loads(bytes(raw))
        counts = [int(header[name]) for name in ("documents", "too_long", "tokens")]
    except (ValueError, KeyError, TypeError) as err:
        raise BadEntry(f"unreadable header ({err})") from err
    for name, value in identity.items():
        if header.get(name) != value:
            raise BadEntry(f"its header says {name}={header.get(name)!r}, expected {value!r}")
    if min(counts) < 0:
        raise BadEntry(f"its header holds negative counts {counts}")
    return counts, payload_at, header


def entry_counts(
    fs: pafs.FileSystem, path: str, identity: Mapping[str, Any], lengths: int
) -> tuple[int, int, np.ndarray]:
    """``(documents, tokens, the first lengths documents' token counts)`` of the entry at ``path``, from its prefix,
    header and offsets (two or three small reads); raises :class:`BadEntry` or OSError."""
    with open(path, "rb") if isinstance(fs, pafs.LocalFileSystem) else fs.open_input_file(path) as entry:
        head = entry.read(HEAD_BYTES)
        if len(head) >= ENTRY_PREFIX.size and ENTRY_PREFIX.size + ENTRY_PREFIX.unpack_from(head, 0)[2] > len(head):
            entry.seek(0)
            head = entry.read(ENTRY_PREFIX.size + ENTRY_PREFIX.unpack_from(head, 0)[2])
        (docs, _long_docs, tokens), payload_at, _ = entry_header(head, identity)
        take = min(int(lengths), docs)
        entry.seek(payload_at + ENTRY_INDEX.itemsize * docs)
        data = entry.read(ENTRY_INDEX.itemsize * (take + 1))
    if len(data) != ENTRY_INDEX.itemsize * (take + 1):
        raise BadEntry("truncated: its offsets end early")
    offsets = np.frombuffer(data, ENTRY_INDEX)
    if offsets[0] != 0 or bool(np.any(offsets[1:] < offsets[:-1])) or offsets[-1] > tokens:
        raise BadEntry("its document offsets do not frame its tokens")
    return docs, tokens, np.diff(offsets)


def decode_entry(data: Any, identity: Mapping[str, Any], vocab_size: int, partial: bool = False) -> CachedUnit:
    """The unit ``data`` holds, fully checked against ``identity``; raises :class:`BadEntry` naming the problem.
    ``partial``: a partial entry, whose unit ends at the row its header says it covers."""
    size, dtype = len(data), token_dtype(vocab_size)
    counts, payload_at, header = entry_header(data, identity)
    stop = identity["stop"]
    if bool(header.get("partial")) != partial:
        raise BadEntry("a partial entry under a whole entry's name" if header.get("partial") else
                        "a whole entry under a partial entry's name")  # fmt: skip
    if partial:
        stop = header.get("covered")
        if not isinstance(stop, int) or not identity["start"] <= stop < identity["stop"]:
            raise BadEntry(f"it covers rows up to {stop!r}, not inside [{identity['start']}, {identity['stop']})")
    docs, long_docs, tokens = counts
    payload = ENTRY_INDEX.itemsize * (2 * docs + 1 + 2 * long_docs) + dtype.itemsize * tokens
    if size != payload_at + payload:
        state = "truncated" if size < payload_at + payload else "longer than its header says"
        raise BadEntry(f"{state}: {size} bytes, its header describes {payload_at + payload}")
    if zlib.crc32(memoryview(data)[payload_at:]) != header.get("payload_crc32"):
        raise BadEntry("its arrays fail their CRC-32 check")
    arrays, at = [], payload_at
    layout = ((ENTRY_INDEX, docs), (ENTRY_INDEX, docs + 1), (ENTRY_INDEX, long_docs), (ENTRY_INDEX, long_docs),
              (dtype, tokens))  # fmt: skip
    for array_dtype, count in layout:
        arrays.append(np.frombuffer(data, array_dtype, count, at))
        at += array_dtype.itemsize * count
    unit = CachedUnit(identity["group"], identity["start"], stop, arrays[0], arrays[1], arrays[4], arrays[2],
                      arrays[3])  # fmt: skip
    problem = entry_problem(unit, vocab_size)
    if problem is not None:
        raise BadEntry(problem)
    return unit


def entry_problem(unit: CachedUnit, vocab_size: int) -> str | None:
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


def entry_name(
    file_digest: int | str, group_in_file: int, start: int, stop: int, content: str, partial: bool = False
) -> str:
    """The entry's path inside the version folder: ``<file digest>/<group>-<start>-<stop>.<content key>.tok``
    (``.part`` for a partial entry); ValueError for a negative number, a file digest not a plain name, or a
    content key not 16 to 64 hex digits."""
    if not isinstance(content, str) or not CONTENT_KEY.fullmatch(content):
        raise ValueError(f"content key {content!r} must be 16 to 64 lowercase hex digits")
    unit = unit_name(group_in_file, start, stop)
    return f"{file_folder(file_digest)}/{unit}.{content}{PARTIAL_SUFFIX if partial else ENTRY_SUFFIX}"


def unit_name(group_in_file: int, start: int, stop: int) -> str:
    """``<group>-<start>-<stop>``; ValueError where that is no unit."""
    if not 0 <= start <= stop or group_in_file < 0:
        raise ValueError(f"row group {group_in_file}, rows [{start}, {stop}) are not a unit")
    return f"{int(group_in_file)}-{int(start)}-{int(stop)}"


def file_folder(file_digest: int | str) -> str:
    """The folder of a file's entries; ValueError for a negative digest or one not a plain name."""
    if isinstance(file_digest, str):
        if not FILE_NAME.fullmatch(file_digest):
            raise ValueError(f"file digest {file_digest!r} must be letters, digits, '.', '_', '-'")
        file_part = file_digest
    elif int(file_digest) >= 0:
        file_part = f"{int(file_digest):016x}"
    else:
        raise ValueError(f"file digest {file_digest} must be >= 0")
    return file_part
