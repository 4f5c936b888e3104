"""Stream cache: one stream's view of the token cache — lookups by unit, recording what it tokenizes, file labels.

A stream looks a unit up by its content key (taken when it is about to read the unit), records the documents it
tokenizes into a :class:`UnitRecorder` that stores the whole entry when the unit was read whole and a partial entry
(its first rows) when the reader stopped inside it, and keeps per file set a label record of the footers it saw, so
setup can say which files changed since their tokens were cached. Trade-off: labels are per file set and process,
so two runs filling one cache may each warn once about the same changed file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from lightning_d9d.core.digest import digest
from lightning_d9d.core.urls import redact
from lightning_d9d.streaming.sources.storage import Storage, StorageError, canonical
from lightning_d9d.streaming.tokens.cache_entry import CachedUnit, token_array
from lightning_d9d.streaming.tokens.token_cache import Coverage, TokenCache, warn_once, write_atomic
from lightning_d9d.tokenization.backends import EncodedBatch


class StreamCache:
    """A token cache as a source's streams use it; ``index`` (the source's ``RowGroupIndex``) names each unit's file
    and gives each unit's content key; ``scope`` names the file set (``train_files``, ``val_files['web']``): file labels
    are relative to their set's common folder, so two sets may hold the same label for different files."""

    def __init__(self, cache: TokenCache, index: Any, scope: str = ""):
        self.cache, self.index, self.scope = cache, index, scope
        self.labelled: set[int] = set()  # files whose label record this process has written
        # Entries this process stored whole: a recorder of the same unit (a later pass read ahead of the tokenizer)
        # writes no partial entry beside one.
        self.completed: set[tuple[int | str, int, int, int, str]] = set()
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

    def lookup(self, group: int, start: int, stop: int) -> tuple[CachedUnit | None, CachedUnit | None, str]:
        """``(whole entry, partial entry, content key)`` of unit ``[start, stop)`` of global row group ``group``: its
        whole entry where cached, else its partial entry where one is (each ``None`` where missing or bad), found by
        the content key of its stored text as read and hashed now; raises as :meth:`load`."""
        content = self.index.content_key(group)
        file_digest, in_file = self._where(group)
        described = self.index.describe_rows(group, start, stop)
        whole = self.cache.load(file_digest, in_file, start, stop, content, described)
        if whole is not None:
            return whole, None, content
        return None, self.cache.load(file_digest, in_file, start, stop, content, described, partial=True), content

    def partial(self, group: int, start: int, stop: int) -> CachedUnit | None:
        """The partial entry of unit ``[start, stop)`` of ``group`` for its current content, or ``None``."""
        content = self.index.content_key(group)
        file_digest, in_file = self._where(group)
        return self.cache.load(file_digest, in_file, start, stop, content, partial=True)

    def recorder(
        self,
        group: int,
        start: int,
        stop: int,
        too_long: Mapping[int, int],
        content: str,
        base: CachedUnit | None = None,
    ) -> UnitRecorder | None:
        """What records the unit's documents as they are tokenized, to be stored under ``content`` (the content key of
        the bytes they were decoded from), after ``base`` (its partial entry, where the read continues it); ``None``
        when this process stores nothing."""
        if not self.cache.writing:
            return None
        file_digest, in_file = self._where(group)
        long_rows = {row: chars for row, chars in too_long.items() if start <= row < stop}
        return UnitRecorder(self, group, (file_digest, in_file, start, stop, content), long_rows, base)

    def stored(self, group: int) -> None:
        """Record once which file label a digest belongs to, so a later run can name the files edited since."""
        file = int(self.index.file_of[group])
        if file in self.labelled:
            return
        self.labelled.add(file)
        label = self.label(file)
        record = f"{TokenCache.file_folder(self.index.file_digests[file])}\n{label}\n"
        with contextlib.suppress(OSError):
            write_atomic(self.cache.filesystem()[0], self._label_path(label), [memoryview(record.encode())])

    def _label_path(self, label: str) -> str:
        return self.cache.fs_path(f"labels/{self._label_key(label)}")

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
        fs, _ = self.cache.filesystem()
        present = {info.base_name for info in fs.get_file_info(pafs.FileSelector(self.cache.fs_path(),
                                                                                  allow_not_found=True))}  # fmt: skip
        records = {info.base_name for info in fs.get_file_info(pafs.FileSelector(self.cache.fs_path("labels"),
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
    """A unit's documents recorded chunk by chunk as compact ids: stored whole once every chunk is in, and meanwhile
    kept as a partial entry (its first documents) so that a run stopping inside the unit loses little of its work.

    Chunks may be tokenized out of order (a consumer and the tokenizing thread); only the chunks in order from the
    first (or from ``base``) are stored. A partial entry is rewritten when the documents in order have doubled since
    the last one (so at most about twice the unit is written in all), and at :meth:`close`, when the reader stops.

    Args:
        source: the stream cache it stores through.
        group: the unit's global row group.
        entry: ``(file digest, group in file, start, stop, content key)``: the entry it is stored as.
        too_long: ``{row: characters}`` of the unit's rows skipped as too long.
        base: the unit's partial entry that the chunks continue (their first document follows its last row).
    """

    def __init__(
        self,
        source: StreamCache,
        group: int,
        entry: tuple[int | str, int, int, int, str],
        too_long: dict[int, int],
        base: CachedUnit | None = None,
    ):
        self.source, self.cache, self.group = source, source.cache, group
        self.entry, self.too_long = entry, too_long
        self.rows: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        if base is not None:
            self.rows.append(base.rows)
            self.ids.append(base.tokens)
            self.lengths.append(base.lengths)
        self.documents = self.saved = len(base) if base is not None else 0
        self.waiting: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = {}
        self.next_part, self.closed, self.done = 0, False, False
        self._lock = threading.Lock()

    def add(self, part: int, rows: np.ndarray, encodings: Sequence[Any], last: bool = False) -> None:
        """Record chunk ``part`` (0, 1, ... in the unit's order) of documents; ``last``: the unit's last chunk."""
        if isinstance(encodings, EncodedBatch):  # flat ids already
            lengths, flat = encodings.counts, encodings.ids
        else:
            lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
            flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int64, int(lengths.sum()))
        chunk = (np.asarray(rows, np.int64), token_array(flat, self.cache.vocab_size), lengths, last)
        with self._lock:
            if self.done:
                return
            self.waiting[part] = chunk
            complete = False
            while self.next_part in self.waiting:
                rows, ids, lengths, complete = self.waiting.pop(self.next_part)
                self.rows.append(rows)
                self.ids.append(ids)
                self.lengths.append(lengths)
                self.documents += len(rows)
                self.next_part += 1
            if complete:
                self._store_whole()
            elif self.documents > self.saved and (self.closed or self.documents >= 2 * self.saved):
                self._store_partial()

    def store(self) -> None:
        """Store the unit whole now: every one of its documents was added (or it has none)."""
        with self._lock:
            if not self.done:
                self._store_whole()

    def close(self) -> None:
        """The reader stopped: keep what is recorded as a partial entry now, and any chunk still added later."""
        with self._lock:
            self.closed = True
            if not self.done and self.documents > self.saved:
                self._store_partial()

    def _unit(self, stop: int) -> CachedUnit:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        long_rows = sorted((row, chars) for row, chars in self.too_long.items() if row < stop)
        return CachedUnit(
            self.entry[1],
            self.entry[2],
            stop,
            np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64),
            offsets,
            np.concatenate(self.ids) if self.ids else np.zeros(0, self.cache.dtype),
            np.asarray([row for row, _ in long_rows], np.int64),
            np.asarray([chars for _, chars in long_rows], np.int64),
        )

    def _store_whole(self) -> None:
        self.done = True
        if self.cache.store(*self.entry, self._unit(self.entry[3])):
            self.source.completed.add(self.entry)
            self.source.stored(self.group)
            if self.saved:  # its partial entry (this run's or an earlier one's) is superseded
                self.cache.delete_partial(*self.entry)
        self.rows, self.ids, self.lengths, self.waiting = [], [], [], {}

    def _store_partial(self) -> None:
        covered = int(self.rows[-1][-1]) + 1 if self.rows and any(len(rows) for rows in self.rows) else None
        if covered is None or covered >= self.entry[3]:
            return  # nothing recorded, or every row: the unit is stored whole when its last chunk is in
        if self.entry in self.source.completed:
            self.done, self.rows, self.ids, self.lengths, self.waiting = True, [], [], [], {}
            return
        # Joined once, so that the next rewrite starts from one array per field.
        unit = self._unit(covered)
        self.rows, self.ids, self.lengths = [unit.rows], [unit.tokens], [unit.lengths]
        if self.cache.store(*self.entry, unit, partial=True):
            self.source.stored(self.group)
        self.saved = self.documents


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
        warn_once(("unreachable", canonical(root)), f"token cache {redact(root)!r} cannot be reached ({err}); this "
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
