"""Parquet source: find the files, list their row groups, deal a seeded order of row groups to streams.

Algorithm: a file spec (directory, glob, list, or a pyarrow/fsspec URL such as ``s3://bucket/data/*.parquet``)
is resolved once into a sorted list of files; their footers give every row group and its row count, and are
checked for the text column. The unit of work is one row group (addressed by its *global* index in that
list). For pass ``p`` of a shuffled source the order is a permutation seeded by ``(seed, p)``; a
non-shuffled source (validation) uses file order. Stream ``s`` of ``S`` (``S = world_size * workers``) reads
``order[s::S]``, so within a pass no row group is read by two streams, and the order of one stream never
depends on how fast another one runs.

Trade-off: dealing whole row groups keeps reads sequential and columnar (one ``read_row_group`` per unit), but
balance is only as fine as a row group: streams differ by at most one row group per pass. That never shows up
as unequal batch counts, because each stream cycles through passes forever and the loader cuts epochs by
step count, not by data exhaustion.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

_GLOB_CHARS = ("*", "?", "[")


def _filesystem_for(spec: str) -> tuple[pafs.FileSystem, str]:
    """Return ``(filesystem, path)`` for a local path or a URL (pyarrow's own schemes, else fsspec's)."""
    if "://" not in spec:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(spec))
    try:
        return pafs.FileSystem.from_uri(spec)
    except (pa.ArrowInvalid, ValueError):
        # Not a scheme pyarrow knows natively (e.g. memory://, hf://): fall back to fsspec, if installed.
        try:
            import fsspec
        except ImportError as err:
            raise ValueError(
                f"cannot open {spec!r}: pyarrow does not know its scheme and fsspec is not installed"
            ) from err
        fs, path = fsspec.core.url_to_fs(spec)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _rejoin(spec: str, path: str) -> str:
    """Turn a filesystem path back into the user's addressing (URL scheme kept) for messages and pickling."""
    if "://" not in spec:
        return path
    scheme = spec.split("://", 1)[0]
    return f"{scheme}://{path.lstrip('/')}" if scheme != "file" else f"file://{path}"


def _expand(spec: str) -> list[str]:
    fs, path = _filesystem_for(spec)
    if any(c in path for c in _GLOB_CHARS):
        parts = path.split("/")
        first_glob = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
        base = "/".join(parts[:first_glob]) or "/"
        recursive = "**" in path or first_glob < len(parts) - 1
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
        except OSError:
            infos = []
        # "**/" may also match nothing (pattern a/**/b.parquet matches a/b.parquet), like pathlib's glob.
        patterns = {path, path.replace("/**/", "/")}
        found = [
            i.path
            for i in infos
            if i.type == pafs.FileType.File and any(fnmatch.fnmatchcase(i.path, p) for p in patterns)
        ]
        return [_rejoin(spec, p) for p in sorted(found)]
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        found = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")]
        return [_rejoin(spec, p) for p in sorted(found)]
    if info.type == pafs.FileType.File:
        return [spec if "://" in spec else path]
    return []


def resolve_files(spec: str | os.PathLike | Sequence[str | os.PathLike], what: str = "train_files") -> list[str]:
    """Resolve a file spec into a de-duplicated list of parquet files (each pattern's matches sorted).

    Args:
        spec: a directory (every ``*.parquet`` below it), a glob (``data/*.parquet``, ``data/**/x.parquet``), a
            single file, a URL with any of those forms (``s3://…``, ``gs://…``, ``file://…``, or any fsspec
            scheme when fsspec is installed), or a list of them (kept in list order).
        what: the argument's name, for error messages.

    Raises:
        ValueError: when the spec is empty or matches no file.
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise ValueError(f"{what} is empty: give a directory, a glob, a file, a URL, or a list of them")
    files: list[str] = []
    for item in specs:
        matched = _expand(os.fspath(item))
        if not matched:
            raise ValueError(
                f"{what}={os.fspath(item)!r} matches no file: give an existing directory (its *.parquet files "
                "are used), a glob such as 'data/*.parquet', a parquet file, or a URL such as "
                "'s3://bucket/data/*.parquet'"
            )
        files.extend(m for m in matched if m not in files)
    return files


def open_parquet(path: str) -> pq.ParquetFile:
    """Open one parquet file, naming it in the error when it is not valid parquet.

    Raises:
        ValueError: the file is missing, unreadable or not a valid parquet file.
    """
    fs, fs_path = _filesystem_for(path)
    try:
        return pq.ParquetFile(fs.open_input_file(fs_path))
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"cannot read parquet file {path!r}: {err}") from err


@dataclass
class RowGroupIndex:
    """Every row group of a list of parquet files, addressed by one global index.

    Attributes:
        files: the resolved files, in order.
        text_column: the column that holds the documents.
        file_of: for each global row group, the index of its file.
        group_in_file: for each global row group, its index inside its file.
        num_rows: for each global row group, its row count (from the footer).
    """

    files: list[str]
    text_column: str
    file_of: np.ndarray
    group_in_file: np.ndarray
    num_rows: np.ndarray
    _open: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _pid: int = field(default_factory=os.getpid, repr=False, compare=False)

    @classmethod
    def scan(cls, files: list[str], text_column: str) -> RowGroupIndex:
        """Read every file's footer, check the text column, list the row groups.

        Raises:
            ValueError: a file is not valid parquet (the error names it), lacks ``text_column`` (naming the
                file and its columns), or the files hold no rows at all.
        """
        file_of, group_in_file, num_rows = [], [], []
        for file_index, path in enumerate(files):
            pf = open_parquet(path)
            names = pf.schema_arrow.names
            if text_column not in names:
                raise ValueError(
                    f"parquet file {path!r} has no column text_column={text_column!r}; its columns are {names}"
                )
            column_type = pf.schema_arrow.field(text_column).type
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
                raise ValueError(
                    f"parquet file {path!r}: column text_column={text_column!r} has type {column_type}; "
                    "it must hold strings (text)"
                )
            for g in range(pf.metadata.num_row_groups):
                file_of.append(file_index)
                group_in_file.append(g)
                num_rows.append(pf.metadata.row_group(g).num_rows)
        index = cls(
            list(files),
            text_column,
            np.asarray(file_of, np.int64),
            np.asarray(group_in_file, np.int64),
            np.asarray(num_rows, np.int64),
        )
        if index.total_rows == 0:
            raise ValueError(f"the parquet files {files} hold no rows")
        return index

    def __len__(self) -> int:
        return len(self.num_rows)

    @property
    def total_rows(self) -> int:
        return int(self.num_rows.sum())

    def __getstate__(self) -> dict:
        # Open file handles and locks do not travel to worker processes; each process makes its own.
        state = dict(self.__dict__)
        state["_open"], state["_lock"], state["_pid"] = OrderedDict(), None, -1
        return state

    def _local(self) -> threading.Lock:
        """This process's lock (a forked or unpickled copy gets fresh handles and a fresh lock)."""
        if self._pid != os.getpid():
            self._open, self._lock, self._pid = OrderedDict(), threading.Lock(), os.getpid()
        return self._lock

    def read_texts(self, group: int) -> list[str | None]:
        """Read the text column of one global row group as Python strings (``None`` for nulls).

        Raises:
            ValueError: the file cannot be read (the error names the file and row group).
        """
        file_index = int(self.file_of[group])
        path = self.files[file_index]
        # One reader at a time per process: streams of one process may share this index (a resumed stream's
        # reader can overlap its predecessor's last read), and a ParquetFile is not meant for concurrent use.
        with self._local():
            pf = self._open.pop(file_index, None) or open_parquet(path)
            self._open[file_index] = pf
            while len(self._open) > 8:  # a few handles: files are read a row group at a time, in shuffled order
                self._open.popitem(last=False)
            try:
                table = pf.read_row_group(int(self.group_in_file[group]), columns=[self.text_column])
            except (pa.ArrowException, OSError) as err:
                raise ValueError(
                    f"cannot read row group {int(self.group_in_file[group])} of parquet file {path!r}: {err}"
                ) from err
        return table.column(0).to_pylist()


def pass_order(num_groups: int, seed: int, pass_index: int, shuffle: bool = True) -> np.ndarray:
    """The order in which the row groups are visited in one pass: a fresh seeded permutation per pass.

    A pure function of its arguments, so every rank and worker computes the same order without talking.
    """
    if not shuffle:
        return np.arange(num_groups, dtype=np.int64)
    return np.random.Generator(np.random.PCG64([seed, pass_index])).permutation(num_groups).astype(np.int64)


def deal(order: np.ndarray, stream: int, num_streams: int) -> np.ndarray:
    """The row groups stream ``stream`` of ``num_streams`` reads in a pass (disjoint across streams)."""
    return order[stream::num_streams]


def stream_id(rank: int, worker: int, num_workers: int) -> int:
    """Global stream number of worker ``worker`` on rank ``rank`` (``num_workers=0`` counts as one stream)."""
    return rank * max(1, num_workers) + worker
