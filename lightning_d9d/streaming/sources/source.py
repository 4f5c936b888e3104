"""Source: find the parquet and JSONL files, list their row groups, cut them into units, deal each pass's units.

Footers give every row group's row count and text statistics (a digest per file, so a resume notices a file whose
footer changed); a unit's *content key* (its stored text, hashed: ``content.py``, ``jsonl.py``) is taken only when a
stream reads it. A *unit* is a row group, or an equal share of one when there are fewer row groups than streams.
Pass ``p`` visits the units in an order seeded by ``(seed, p)``; stream ``s`` of ``K`` reads ``order[s::K]``, so no
unit is read twice in a pass and no stream's order depends on another's speed or on the process layout. Trade-off:
whole row groups keep reads sequential and columnar, but balance is only as fine as a unit.
"""

from __future__ import annotations

import fnmatch
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lightning_d9d.core.digest import hasher
from lightning_d9d.core.progress import progress
from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.sources.content import chunk_key, decode_chunk, text_chunk, text_leaf
from lightning_d9d.streaming.sources.jsonl import (
    DEFAULT_GROUP_BYTES,
    JsonlLayout,
    group_content_key,
    is_jsonl,
    read_jsonl_group,
    read_jsonl_group_keyed,
)
from lightning_d9d.streaming.sources.jsonl_scan import PARALLEL_SCANS, scan_jsonl_files
from lightning_d9d.streaming.sources.storage import Storage, StorageError, canonical, parse_url, with_query

_GLOB_CHARS = ("*", "?", "[")
JSONL_GROUP_BYTES = DEFAULT_GROUP_BYTES  # text per unit of a JSONL file (its groups of whole lines)
# Guards making an index's per-process lock; a forked child gets a fresh one (another thread may hold the parent's).
_PROCESS_LOCK = [threading.Lock()]
os.register_at_fork(after_in_child=lambda: _PROCESS_LOCK.__setitem__(0, threading.Lock()))


def _rejoin(spec: str, path: str) -> str:
    """A listed path in the user's addressing (scheme, credentials, options kept), so it reaches the spec's endpoint."""
    if "://" not in spec:
        return path
    scheme, userinfo, _, query = parse_url(spec)
    if scheme == "file":
        return f"file://{path}"
    return with_query(f"{scheme}://{userinfo + '@' if userinfo else ''}{path.lstrip('/')}", query)


def _file_infos(fs: pafs.FileSystem, target: Any, spec: str, what: str) -> Any:
    try:
        return fs.get_file_info(target)
    except OSError as err:
        raise StorageError(f"cannot list {what}={redact(spec)!r}: {err}") from err


def _expand(spec: str, storage: Storage, what: str) -> list[str]:
    fs, path = storage.filesystem(spec)
    if any(c in path for c in _GLOB_CHARS):
        parts = path.split("/")
        first_glob = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
        base = "/".join(parts[:first_glob]) or "/"
        recursive = "**" in path or first_glob < len(parts) - 1
        infos = _file_infos(fs, pafs.FileSelector(base, recursive=recursive, allow_not_found=True), spec, what)
        # "**/" may also match nothing (pattern a/**/b.parquet matches a/b.parquet), like pathlib's glob.
        patterns = {path, path.replace("/**/", "/")}
        found = [
            i.path
            for i in infos
            if i.type == pafs.FileType.File and any(fnmatch.fnmatchcase(i.path, p) for p in patterns)
        ]
        return [_rejoin(spec, p) for p in sorted(found)]
    info = _file_infos(fs, path, spec, what)
    if info.type == pafs.FileType.Directory:
        infos = _file_infos(fs, pafs.FileSelector(path, recursive=True), spec, what)
        found = [
            i.path for i in infos if i.type == pafs.FileType.File and (i.path.endswith(".parquet") or is_jsonl(i.path))
        ]
        return [_rejoin(spec, p) for p in sorted(found)]
    if info.type == pafs.FileType.File:
        return [spec if "://" in spec else path]
    return []


def resolve_files(
    spec: str | os.PathLike | Sequence[str | os.PathLike], what: str = "train_files", storage: Storage | None = None
) -> list[str]:
    """Resolve a file spec into a de-duplicated list of parquet and JSONL files (each pattern's matches sorted).

    Args:
        spec: a directory, a glob (``data/**/x.jsonl.zst``), a file, a URL of those forms (any fsspec scheme;
            ``s3://…?endpoint_override=…``), or a list of them (kept in list order).
        what: the argument's name, for error messages.
        storage: endpoint, credentials and options for URLs.

    Raises:
        ValueError: the spec is empty, matches no file, or holds unknown storage options.
        StorageError: listing failed, naming the URL and the cause.
    """
    storage = storage or Storage()
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise ValueError(f"{what} is empty: give a directory, a glob, a file, a URL, or a list of them")
    files: list[str] = []
    seen: set[str] = set()
    for item in specs:
        matched = _expand(os.fspath(item), storage, what)
        if not matched:
            raise ValueError(
                f"{what}={redact(os.fspath(item))!r} matches no file: give an existing directory (its *.parquet "
                "and *.jsonl[.gz|.zst] files are used), a glob such as 'data/*.parquet', a parquet or JSONL file, or "
                "a URL such as 's3://bucket/data/*.parquet'"
            )
        for path in matched:
            if path not in seen:
                seen.add(path)
                files.append(path)
    return files


def _open_file(path: str, storage: Storage) -> pq.ParquetFile:
    fs, fs_path = storage.filesystem(path)
    return pq.ParquetFile(fs.open_input_file(fs_path))


def open_parquet(path: str, storage: Storage | None = None) -> pq.ParquetFile:
    """Open one parquet file, retrying transient failures.

    Raises:
        ValueError: the file is missing, unreadable or not valid parquet.
        StorageError: the store refused access or stayed unreachable.
    """
    storage = storage or Storage()
    try:
        return storage.retrying(lambda: _open_file(path, storage), lambda: f"parquet file {redact(path)!r}", _no_op)
    except StorageError:
        raise
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"cannot read parquet file {redact(path)!r}: {err}") from err


def _no_op() -> None:
    pass


def is_text_type(arrow_type: pa.DataType) -> bool:
    """Whether a column of this type holds text: any string type, dictionary-encoded or not."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type)


def plain_strings(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A text column as plain ``string``/``large_string`` values, so every text type is handled alike."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)  # the rows are the dictionary's values
    if pa.types.is_string_view(column.type):
        column = column.cast(pa.large_string())
    return column


def column_texts(column: pa.ChunkedArray, where: Callable[[], str], rows: list[int] | None) -> list[str | None]:
    """A plain text column as Python strings; ValueError naming ``where`` and the row for a value not valid UTF-8."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError as first:
        for position, value in enumerate(column.cast(pa.large_binary()).to_pylist()):
            try:
                value is None or value.decode("utf-8")
            except UnicodeDecodeError as err:
                row = rows[position] if rows is not None else position
                raise ValueError(
                    f"{where()}, row {row}: the text is not valid UTF-8 ({err.reason} at byte {err.start}: "
                    f"{value[max(0, err.start - 8) : err.start + 8]!r}); rewrite the file with valid UTF-8 text"
                ) from err
        raise first


@dataclass
class RowGroupIndex:
    """Every row group of a list of parquet and JSONL files (a JSONL "row group" is a group of lines), by global index.

    Attributes:
        files, text_column: the resolved files, in order, and the column (JSONL: field) of the documents.
        file_of, group_in_file, num_rows: per global row group, its file, its index in that file, its row count.
        file_digests: per file, a 63-bit digest of its footer (parquet: row counts, sizes, statistics of the text
            column) or of its bytes as scanned (JSONL): the resume check compares them; no token is trusted for them.
        text_free: per global row group, whether its statistics prove it holds no text.
        text_proven: per global row group, whether its statistics prove it holds a non-empty text (empty: unknown).
        layouts: each JSONL file's layout, by file index.
        on_malformed: a malformed JSONL line is an error (``"error"``) or a row without text (``"skip"``).
        storage: how the files are reached; it decides no row.
    """

    files: list[str]
    text_column: str
    file_of: np.ndarray
    group_in_file: np.ndarray
    num_rows: np.ndarray
    file_digests: tuple[int, ...] = ()
    text_free: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    layouts: dict[int, JsonlLayout] = field(default_factory=dict, repr=False)
    on_malformed: str = "error"
    storage: Storage = field(default_factory=Storage, compare=False)
    _open: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _pid: int = field(default_factory=os.getpid, repr=False, compare=False)
    _kept: threading.local = field(default_factory=threading.local, repr=False, compare=False)
    _labels: list[str] | None = field(default=None, repr=False, compare=False)
    text_proven: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), repr=False, compare=False)

    @classmethod
    def scan(
        cls,
        files: list[str],
        text_column: str,
        storage: Storage | None = None,
        layout_cache: str | None = None,
        on_malformed: str = "error",
    ) -> RowGroupIndex:
        """Read every parquet footer and JSONL layout, and list the row groups.

        Args:
            files: the resolved files.
            text_column: the column (field) of the documents.
            storage: how to reach them.
            layout_cache: where JSONL layouts are kept (``None``: each JSONL file is scanned again).
            on_malformed: ``"error"`` or ``"skip"`` for malformed JSONL lines.

        Raises:
            ValueError: a file is not valid parquet, gzip or zstd, lacks ``text_column``, or the files hold no rows.
            StorageError: a file could not be reached.
        """
        storage = storage or Storage()
        groups, file_digests, layouts = _scan_files(files, text_column, storage, layout_cache)
        columns = list(zip(*groups)) if groups else [(), (), (), (), ()]
        index = cls(
            list(files),
            text_column,
            np.asarray(columns[0], np.int64),
            np.asarray(columns[1], np.int64),
            np.asarray(columns[2], np.int64),
            tuple(file_digests),
            np.asarray(columns[3], bool),
            layouts,
            on_malformed,
            storage,
            text_proven=np.asarray(columns[4], bool),
        )
        if index.total_rows == 0:
            raise ValueError(_no_rows(files, layouts))
        return index

    def __len__(self) -> int:
        return len(self.num_rows)

    @property
    def total_rows(self) -> int:
        return int(self.num_rows.sum())

    def __getstate__(self) -> dict:
        # Open file handles, locks and read bytes do not travel to worker processes; each process makes its own.
        state = dict(self.__dict__)
        state["_open"], state["_lock"], state["_pid"], state["_kept"] = OrderedDict(), None, -1, None
        return state

    def _local(self) -> threading.Lock:
        """This process's lock; a forked or unpickled copy gets fresh handles and a fresh lock."""
        if self._pid != os.getpid():
            # Several streams' threads may be the first of a process to read: one of them makes the lock.
            with _PROCESS_LOCK[0]:
                if self._pid != os.getpid():
                    self._open, self._lock, self._pid = OrderedDict(), threading.Lock(), os.getpid()
                    self._kept = threading.local()
        return self._lock

    def file_labels(self) -> list[str]:
        """The files relative to their common folder (a corpus moved elsewhere keeps its labels)."""
        if self._labels is None:
            # Without the URL's query and credentials: the same files through another endpoint keep their labels.
            self._labels = _relative([canonical(path) for path in self.files])
        return self._labels

    # ------------------------------------------------------------------------------------------------ naming
    def describe(self, group: int) -> str:
        """Where global row group ``group`` is, for messages: its file, and its row group or lines."""
        file_index, in_file = int(self.file_of[group]), int(self.group_in_file[group])
        path, layout = redact(self.files[file_index]), self.layouts.get(file_index)
        if layout is None:
            return f"row group {in_file} of parquet file {path!r}"
        span = layout.groups[in_file]
        return f"lines {span.first_line + 1}..{span.first_line + span.num_rows} of JSONL file {path!r}"

    def describe_rows(self, group: int, start: int, stop: int) -> str:
        """Rows ``[start, stop)`` of global row group ``group`` as their file names them (parquet: row group and
        rows; JSONL: 1-based lines)."""
        file_index, in_file = int(self.file_of[group]), int(self.group_in_file[group])
        path, layout = redact(self.files[file_index]), self.layouts.get(file_index)
        if layout is None:
            rows = f"row {start}" if stop == start + 1 else f"rows {start}..{stop - 1}"
            return f"parquet file {path!r}, row group {in_file}, {rows}"
        first = layout.groups[in_file].first_line + 1
        lines = f"line {first + start}" if stop == start + 1 else f"lines {first + start}..{first + stop - 1}"
        return f"JSONL file {path!r}, {lines}"

    # ------------------------------------------------------------------------------------------------ reading
    def read_texts(self, group: int, rows: list[int] | None = None) -> list[str | None]:
        """The text column of one global row group as Python strings (``None`` for nulls).

        Args:
            rows: only these rows, in this order.

        Raises:
            ValueError: the file cannot be read, or a text is not valid UTF-8 (naming file, row group and row).
            StorageError: the store refused access, or stayed unreachable.
        """
        column, where, _ = self._read_column(group)
        if rows is not None:
            column = column.take(pa.array(rows, pa.int64()))
        return column_texts(column, where, rows)

    def read_capped(self, group: int, max_chars: int | None) -> tuple[list[str | None], dict[int, int]]:
        """The text column of one global row group, with texts over ``max_chars`` characters ``None`` (never converted)
        and their ``{row: characters}`` returned; raises as :meth:`read_texts`.
        """
        texts, too_long, _ = self.read_keyed(group, max_chars, keyed=False)
        return texts, too_long

    def read_keyed(
        self, group: int, max_chars: int | None, keyed: bool = True
    ) -> tuple[list[str | None], dict[int, int], str | None]:
        """As :meth:`read_capped`, with the content key of the stored bytes the texts were decoded from (``None`` when
        not ``keyed``, or where the bytes cannot be decoded alone); raises as :meth:`read_texts`.
        """
        column, where, key = self._read_column(group, keyed)
        return *capped_texts(column, where, max_chars), key

    def content_key(self, group: int) -> str:
        """The content key of global row group ``group`` as stored now: one ranged read of its stored text (parquet:
        its text column chunk; JSONL: its bytes or frames), hashed. This thread's next :meth:`read_keyed` of the
        group decodes the bytes read here (where they are not a whole shared frame) instead of reading again.

        Raises:
            ValueError, StorageError: as :meth:`read_texts`.
        """
        file_index, in_file = int(self.file_of[group]), int(self.group_in_file[group])
        layout = self.layouts.get(file_index)
        if layout is not None:
            key, stored = group_content_key(self.files[file_index], self.storage, layout, in_file, self.on_malformed)
        else:
            stored = self._parquet_chunk(group)
            key = chunk_key(stored[1], stored[2])
        self._local()
        self._kept.value = (group, stored) if stored is not None else None
        return key

    def _taken(self, group: int) -> Any:
        """What this thread's last :meth:`content_key` read of ``group`` (``None``: another group, or nothing); a read
        takes it, so it never outlives the next read of this thread."""
        self._local()
        kept, self._kept.value = getattr(self._kept, "value", None), None
        return kept[1] if kept is not None and kept[0] == group else None

    def _read_column(self, group: int, keyed: bool = False) -> tuple[pa.ChunkedArray, Callable[[], str], str | None]:
        """One row group's text column as plain strings, a callable naming where it was read, and its content key
        (``None`` unless ``keyed``)."""
        file_index, in_file = int(self.file_of[group]), int(self.group_in_file[group])
        path, layout, kept = self.files[file_index], self.layouts.get(file_index), self._taken(group)
        if layout is not None:
            span, key = layout.groups[in_file], None
            if keyed or kept is not None:
                column, skipped, key = read_jsonl_group_keyed(path, self.storage, layout, in_file, self.text_column,
                                                              on_malformed=self.on_malformed, stored=kept)  # fmt: skip
            else:
                column, skipped = read_jsonl_group(path, self.storage, layout, in_file, self.text_column,
                                                   on_malformed=self.on_malformed)  # fmt: skip
            if skipped:
                _warn_malformed(path, span.first_line, span.num_rows, skipped)
            return column, lambda: self.describe(group), key if keyed else None
        if keyed or kept is not None:  # decoded from the bytes hashed (this read's, or the lookup's just before)
            metadata, span, data, size = kept if kept is not None else self._parquet_chunk(group)
            try:
                column = decode_chunk(metadata, in_file, self.text_column, span, data, size)
            except (pa.ArrowException, OSError) as err:
                raise ValueError(f"cannot read {self.describe(group)}: {err}") from err
            if column is not None:
                return plain_strings(column), lambda: self.describe(group), chunk_key(span, data) if keyed else None
        text_column = self.text_column
        table = self._parquet_io(group, lambda pf, _, g: pf.read_row_group(g, columns=[text_column]))
        return plain_strings(table.column(0)), lambda: self.describe(group), None

    def _handle(self, file_index: int) -> tuple[pq.ParquetFile, Any]:
        """An open parquet file and its handle (a few kept open: files are read a row group at a time, shuffled)."""
        handle = self._open.pop(file_index, None) or _open_handle(self.files[file_index], self.storage)
        self._open[file_index] = handle
        while len(self._open) > 8:
            self._open.popitem(last=False)
        return handle

    def _parquet_io(self, group: int, action: Callable[[pq.ParquetFile, Any, int], Any]) -> Any:
        """``action(parquet file, handle, row group in file)`` under this process's lock, retried."""
        file_index, in_file = int(self.file_of[group]), int(self.group_in_file[group])
        # One reader at a time per process: streams of one process may share this index (a resumed stream's
        # reader can overlap its predecessor's last read), and a ParquetFile is not meant for concurrent use.
        with self._local():
            try:
                # A failed read may leave its handle mid-request: the retry opens the file afresh.
                return self.storage.retrying(lambda: action(*self._handle(file_index), in_file),
                                             lambda: self.describe(group),
                                             lambda: self._open.pop(file_index, None))  # fmt: skip
            except StorageError:
                raise
            except (pa.ArrowException, OSError) as err:
                raise ValueError(f"cannot read {self.describe(group)}: {err}") from err

    def _parquet_chunk(self, group: int) -> tuple[Any, Any, bytes, int]:
        """``(footer, chunk span, stored bytes, file size)`` of a parquet row group's text column chunk."""

        def fetch(pf: pq.ParquetFile, handle: Any, in_file: int) -> tuple[Any, Any, bytes, int]:
            span = text_chunk(pf.metadata, in_file, self.text_column)
            return pf.metadata, span, handle.read_at(span.length, span.offset), handle.size()

        return self._parquet_io(group, fetch)


def capped_texts(
    column: pa.ChunkedArray, where: Callable[[], str], max_chars: int | None
) -> tuple[list[str | None], dict[int, int]]:
    """A plain text column as Python strings, texts over ``max_chars`` characters ``None`` (never converted), and
    their ``{row: characters}``; ValueError as :func:`column_texts`."""
    too_long: dict[int, int] = {}
    if max_chars is not None:
        # A text has at most as many characters as bytes: the byte lengths (read off the offsets) pick the
        # few candidates whose characters need counting, so an ordinary row group costs one comparison.
        candidates = np.flatnonzero(pc.fill_null(pc.binary_length(column), 0).to_numpy() > max_chars)
        for row in candidates.tolist():  # a slice, not a take: a take would copy the long text
            chars = pc.utf8_length(column.slice(row, 1))[0].as_py()
            if chars > max_chars:
                too_long[row] = chars
        if too_long:
            mask = np.zeros(len(column), bool)
            mask[list(too_long)] = True
            column = pc.if_else(pa.array(mask), pa.scalar(None, column.type), column)
    return column_texts(column, where, None), too_long


def _relative(files: list[str]) -> list[str]:
    """``files`` relative to their common folder (one file: its name)."""
    if len(files) == 1:
        return [os.path.basename(files[0])]
    root = os.path.commonpath(files)
    prefix = root.rstrip("/") + "/"
    return [path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, root) for path in files]


def _open_handle(path: str, storage: Storage) -> tuple[pq.ParquetFile, Any]:
    fs, fs_path = storage.filesystem(path)
    handle = fs.open_input_file(fs_path)
    return pq.ParquetFile(handle), handle


def _scan_files(
    files: list[str], text_column: str, storage: Storage, layout_cache: str | None
) -> tuple[list[tuple[int, int, int, bool, bool]], list[int], dict[int, JsonlLayout]]:
    """Per row group ``(file, group in file, rows, text-free, proven to hold text)``, per file its digest, and the
    JSONL layouts."""
    jsonl = [i for i, path in enumerate(files) if is_jsonl(path)]
    scanned = scan_jsonl_files([files[i] for i in jsonl], storage, group_bytes=JSONL_GROUP_BYTES,
                               cache_dir=layout_cache)  # fmt: skip
    layouts = dict(zip(jsonl, scanned))
    parquet = [path for i, path in enumerate(files) if i not in layouts]
    remote = any("://" in path for path in parquet)
    with ThreadPoolExecutor(PARALLEL_SCANS if remote and len(parquet) > 1 else 1) as pool:
        # Each footer is a request on object storage: several at once. A bar where many are read.
        footers = progress(pool.map(lambda path: _parquet_groups(path, text_column, storage), parquet),
                           len(parquet), "reading footers and layouts", "file")  # fmt: skip
        footers = iter(list(footers))
    groups: list[tuple[int, int, int, bool, bool]] = []
    digests = []
    for file_index in range(len(files)):
        layout = layouts.get(file_index)
        if layout is not None:
            groups += [(file_index, g, int(n), False, False) for g, n in enumerate(layout.num_rows.tolist())]
            digests.append(int(layout.digest[:16], 16) >> 1)
        else:
            rows, free, footer_digest, proven = next(footers)
            groups += [(file_index, g, n, t, p) for g, (n, t, p) in enumerate(zip(rows, free, proven))]
            digests.append(footer_digest)
    return groups, digests, layouts


def _no_rows(files: list[str], layouts: dict[int, JsonlLayout]) -> str:
    """The error for files that hold no row at all, naming each file and its format."""
    named = [f"{'JSONL' if i in layouts else 'parquet'} file {redact(path)!r}" for i, path in enumerate(files)]
    if len(named) == 1:
        what = "it has no lines" if layouts else "its row groups hold no rows"
        return f"{named[0]} holds no rows ({what}): give files with at least one row (a JSONL line)"
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    return f"the {len(files)} files hold no rows: {shown}; give files with at least one row (a JSONL line)"


_WARNED_MALFORMED: set[tuple[str, int]] = set()


def _warn_malformed(path: str, first_line: int, rows: int, skipped: int) -> None:
    key = (redact(path), first_line)
    if key not in _WARNED_MALFORMED:
        _WARNED_MALFORMED.add(key)
        warnings.warn(
            f"skipped {skipped} malformed line(s) among lines {first_line + 1}..{first_line + rows} of JSONL file "
            f"{key[0]!r} (on_malformed='skip': each is a row without text, counted as empty)",
            stacklevel=2,
        )


def _parquet_groups(path: str, text_column: str, storage: Storage) -> tuple[list[int], list[bool], int, list[bool]]:
    """A parquet file's row counts, whether each row group is text-free, its footer digest, and whether each row group
    is proven to hold a non-empty text; ValueError as scan."""
    pf = open_parquet(path, storage)
    names = pf.schema_arrow.names
    if text_column not in names:
        raise ValueError(
            f"parquet file {redact(path)!r} has no column text_column={text_column!r}; its columns are {names}"
        )
    column_type = pf.schema_arrow.field(text_column).type
    if not is_text_type(column_type):
        raise ValueError(
            f"parquet file {redact(path)!r}: column text_column={text_column!r} has type {column_type}; it must "
            "hold strings (text)"
        )
    column = text_leaf(pf.metadata, text_column)
    digest = hasher()
    rows, free, proven = [], [], []
    for g in range(pf.metadata.num_row_groups):
        group = pf.metadata.row_group(g)
        chunk = group.column(column)
        stats = chunk.statistics if chunk.is_stats_set else None
        rows.append(group.num_rows)
        free.append(_proves_text_free(stats, group.num_rows))
        proven.append(_proves_text(stats))
        digest.update(repr(_footer_facts(group.num_rows, chunk, stats)).encode())
    return rows, free, int.from_bytes(digest.digest()[:8], "little") >> 1, proven


def _footer_facts(num_rows: int, chunk: Any, stats: Any) -> tuple:
    """What a footer says about one row group's text column: a rewrite with other text usually changes some of it,
    but not always (a same-length edit may keep sizes and statistics): it serves the resume check and messages,
    never the token cache, whose keys are digests of the stored text."""
    facts: tuple = (num_rows, chunk.total_compressed_size, chunk.total_uncompressed_size)
    if stats is not None:
        facts += (stats.null_count if stats.has_null_count else None,)
        facts += _min_max(stats) if stats.has_min_max else (None, None)
    return facts


def _min_max(stats: Any) -> tuple:
    """The statistics' bounds as text, or as bytes where they are not UTF-8."""
    try:
        return stats.min, stats.max
    except UnicodeDecodeError:
        return stats.min_raw, stats.max_raw


def _proves_text(stats: Any) -> bool:
    """Whether a row group's statistics prove a non-empty text in it: a largest value that is not empty (a writer
    may truncate it, never to empty)."""
    return stats is not None and bool(stats.has_min_max) and _min_max(stats)[1] not in ("", b"")


def _proves_text_free(stats: Any, num_rows: int) -> bool:
    if stats is None:
        return False
    if stats.has_null_count and stats.null_count == num_rows:
        return True
    return bool(stats.has_min_max and _min_max(stats)[1] in ("", b""))


@dataclass(frozen=True)
class Units:
    """The units streams read: row ranges ``[start, stop)`` of global row groups (``group``, ``start``, ``stop``)."""

    group: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    def __len__(self) -> int:
        return len(self.group)

    @classmethod
    def of(cls, index: RowGroupIndex, num_streams: int) -> Units:
        """Whole row groups, or, with fewer than ``num_streams``, equal row ranges of each; ValueError: too few rows."""
        if len(index) >= num_streams:
            return cls(np.arange(len(index), dtype=np.int64), np.zeros(len(index), np.int64), index.num_rows.copy())
        if index.total_rows < num_streams:
            raise ValueError(
                f"the files hold {index.total_rows} rows, fewer than num_streams={num_streams}: every stream needs "
                "a row to read; add data or lower num_streams"
            )
        parts = -(-num_streams // len(index))
        groups, starts, stops = [], [], []
        for group, rows in enumerate(index.num_rows.tolist()):
            cuts = np.linspace(0, rows, min(parts, rows) + 1).astype(np.int64) if rows else np.zeros(1, np.int64)
            for start, stop in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
                groups.append(group)
                starts.append(start)
                stops.append(stop)
        if len(groups) < num_streams:
            # Row groups of very unequal sizes: cut the largest units further until every stream has one.
            while len(groups) < num_streams:
                largest = int(np.argmax(np.asarray(stops) - np.asarray(starts)))
                middle = (starts[largest] + stops[largest]) // 2
                groups.insert(largest + 1, groups[largest])
                starts.insert(largest + 1, middle)
                stops.insert(largest + 1, stops[largest])
                stops[largest] = middle
        return cls(np.asarray(groups, np.int64), np.asarray(starts, np.int64), np.asarray(stops, np.int64))


def pass_order(num_units: int, seed: int, pass_index: int, shuffle: bool = True) -> np.ndarray:
    """One pass's order of the units: a seeded permutation, or (no shuffle) file order rotated by the pass. Pure, so
    every rank and worker computes it without talking.
    """
    if not shuffle:
        return np.roll(np.arange(num_units, dtype=np.int64), -(pass_index % max(1, num_units)))
    return np.random.Generator(np.random.PCG64([seed, pass_index])).permutation(num_units).astype(np.int64)


def deal(order: np.ndarray, stream: int, num_streams: int) -> np.ndarray:
    """The units stream ``stream`` of ``num_streams`` reads in a pass (disjoint across streams)."""
    return order[stream::num_streams]
