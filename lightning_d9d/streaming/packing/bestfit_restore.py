"""Best-fit restore: rebuild a best-fit buffer from its saved rows, re-reading texts now, tokenizing lazily.

A saved buffer row locates a document or piece (row group, row) and gives its length and, where the length does
not determine the tokens, a checksum. The packer is usable at once; the buffered texts are re-read now (one read
per row group for all of a process's streams), and a document is tokenized only when first picked, from a text
prefix where only a prefix of its tokens is needed, verified by the checksum (a prefix's tokens can differ from the
whole text's near the cut; a mismatch falls back to the whole text). Trade-off: a few reads per resume instead of
MiBs of tokens per stream in every checkpoint.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_d9d.streaming.packing.rows import prefix_hash
from lightning_d9d.streaming.tokens.tokenize import encode_documents

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec


BufferedTexts = Mapping[tuple[int, int], str]


def buffer_fetch(
    spec: StreamSpec, meta: np.ndarray, texts: BufferedTexts | UnitTokens | None = None
) -> Callable[[Any, int], Any]:
    """The ``fetch`` a best-fit packer needs to rebuild the buffer ``meta``: from the token cache where the spec has
    one (``texts``: the process's shared :class:`UnitTokens`, or ``None``), else from the texts (``texts``: already
    read, or ``None``).

    Raises:
        ValueError: a saved row group cannot be read.
    """
    meta = np.asarray(meta, np.int64)
    if spec.cache is not None:
        return _CachedFetch(spec, meta, texts if isinstance(texts, UnitTokens) else UnitTokens(spec))
    own = _own_texts(spec, meta, texts)
    return _SplitFetch(spec, meta, own) if spec.packing.flagged else _PrefixFetch(spec, meta, own)


class UnitTokens:
    """The cached tokens of the units that restored buffers' pieces come from, shared by a process's streams of one
    source: a unit is loaded when a piece of it is first fetched (once for all those streams), and dropped once
    every buffered piece of it that was counted in is fetched.
    """

    def __init__(self, spec: StreamSpec):
        self.spec = spec
        self._lock = threading.Lock()
        self._loads: dict[int, _UnitLoad] = {}
        self._pending: Counter[int] = Counter()  # buffered pieces per unit not fetched yet

    def count(self, units: np.ndarray) -> None:
        """Pieces of ``units`` (one entry per piece) will be fetched."""
        with self._lock:
            self._pending.update(units.tolist())

    def document(self, unit: int, row: int) -> np.ndarray | None:
        """The cached ids of ``row`` in ``unit`` (``None``: the unit is not cached, or not with that document)."""
        with self._lock:
            load = self._loads.get(unit)
            if load is None:
                load = self._loads[unit] = _UnitLoad()
            self._pending[unit] -= 1
            if self._pending[unit] <= 0:
                del self._pending[unit], self._loads[unit]
        with load.lock:  # a unit wanted by several streams at once is loaded by the first of them
            if not load.done:
                units = self.spec.units
                start, stop = int(units.start[unit]), int(units.stop[unit])
                load.cached, load.done = self.spec.cache.load(int(units.group[unit]), start, stop), True
        cached = load.cached
        if cached is None:
            return None
        at = int(np.searchsorted(cached.rows, row))
        return cached.ids(at) if at < len(cached.rows) and cached.rows[at] == row else None


class _UnitLoad:
    __slots__ = ("cached", "done", "lock")

    def __init__(self) -> None:
        self.lock, self.done, self.cached = threading.Lock(), False, None


class _CachedFetch:
    """``fetch`` from the token cache: a piece's tokens cut from its unit's cached ids (its unit loaded when first
    needed); a unit that is not cached, or holds another content, has its pieces rebuilt from text instead."""

    def __init__(self, spec: StreamSpec, meta: np.ndarray, units: UnitTokens):
        self.spec, self.meta, self.tokens = spec, meta, units
        self.units = _units_of(spec, meta)
        self.unit_of = dict(zip(zip(meta[:, 2].tolist(), meta[:, 3].tolist()), self.units.tolist()))
        units.count(self.units)
        self.from_text: dict[int, Callable[[Any, int], Any]] = {}

    def __call__(self, row: np.ndarray, need: int) -> np.ndarray:
        key = (int(row[2]), int(row[3]))
        unit = self.unit_of[key]
        fallback = self.from_text.get(unit)
        ids = self.tokens.document(unit, key[1]) if fallback is None else None
        if ids is None:
            if fallback is None:  # the unit's pieces are rebuilt from its texts, read now
                mine = self.meta[self.units == unit]
                fallback = self.from_text[unit] = buffer_fetch(replace(self.spec, cache=None), mine)
            return fallback(row, need)
        start = int(row[4])
        tokens = np.empty(min(len(ids) + 1, start + need), np.int32)  # BOS, then the ids up to the piece's end
        tokens[0] = self.spec.bos_id
        tokens[1:] = ids[: len(tokens) - 1]
        return tokens[start:]


def _units_of(spec: StreamSpec, meta: np.ndarray) -> np.ndarray:
    """The unit of each buffered piece (by its row group and row)."""
    units = spec.units
    order = np.lexsort((units.start, units.group))  # units by (row group, first row)
    groups, starts = units.group[order], units.start[order]
    at = np.searchsorted(groups * (1 << 32) + starts, meta[:, 2] * (1 << 32) + meta[:, 3], side="right") - 1
    return order[at]


def read_buffered_texts(spec: StreamSpec, metas: Iterable[np.ndarray]) -> dict[tuple[int, int], str]:
    """The text of every document buffered in ``metas``, by (row group, row), in one read per row group for all.

    Raises:
        ValueError: a saved row group cannot be read.
    """
    wanted: dict[int, set[int]] = {}
    for meta in metas:
        meta = np.asarray(meta, np.int64)
        for group, row in zip(meta[:, 2].tolist(), meta[:, 3].tolist()):
            wanted.setdefault(group, set()).add(row)
    texts: dict[tuple[int, int], str] = {}
    for group in sorted(wanted):
        rows = sorted(wanted[group])
        for row, text in zip(rows, spec.index.read_texts(group, rows)):
            texts[(group, row)] = text or ""
    return texts


def _own_texts(spec: StreamSpec, meta: np.ndarray, texts: BufferedTexts | None) -> dict[tuple[int, int], str]:
    """This buffer's texts in a dict of its own (its fetch trims and drops them as it goes)."""
    if texts is None:
        return read_buffered_texts(spec, [meta])
    return {key: texts[key] for key in zip(meta[:, 2].tolist(), meta[:, 3].tolist())}


class _PrefixFetch:
    """``fetch`` for ``bestfit``: a document's first ``need`` tokens, from a text prefix where it is long."""

    def __init__(self, spec: StreamSpec, meta: np.ndarray, texts: dict[tuple[int, int], str]):
        self.spec = spec
        self.texts = texts
        self.trimmed: set[tuple[int, int]] = set()  # texts kept as a prefix only
        for row in meta.tolist():
            key, length, hashed = (row[2], row[3]), row[1], row[7]
            if hashed:  # a long document: keep a generous text prefix; the rest is re-read if ever needed
                text = self.texts[key]
                keep = 16 * self._prefix_chars(text, length, max(hashed, spec.max_capacity))
                if len(text) > keep:
                    self.texts[key] = text[:keep]
                    self.trimmed.add(key)
        self.uses = Counter(zip(meta[:, 2].tolist(), meta[:, 3].tolist()))  # a small corpus may buffer a doc twice

    def __call__(self, row: np.ndarray, need: int) -> np.ndarray:
        group, index, hashed = int(row[2]), int(row[3]), int(row[7])
        key = (group, index)
        text = self.texts[key]
        self.uses[key] -= 1
        if not self.uses[key]:
            del self.texts[key]
        if not hashed:  # a whole document, verified by its length
            return self._with_bos(encode_documents(self.spec.encoder(), [text])[0].ids, need)
        return self._long_prefix(group, index, text, int(row[1]), need, int(row[6]), hashed)

    @staticmethod
    def _prefix_chars(text: str, length: int, need: int) -> int:
        # Characters that should hold the first ``need`` tokens, from the document's own chars/token, with margin.
        return int(len(text) * (need + 64) / length * 1.25) + 256

    def _with_bos(self, ids: list[int], need: int) -> np.ndarray:
        prefix = np.empty(min(len(ids) + 1, need), np.int32)
        prefix[0] = self.spec.bos_id
        prefix[1:] = ids[: len(prefix) - 1]
        return prefix

    def _long_prefix(
        self, group: int, row: int, text: str, length: int, need: int, checksum: int, hashed: int
    ) -> np.ndarray:
        tokenizer = self.spec.encoder()
        cut = self._prefix_chars(text, length, need)
        full = None
        while True:
            if cut >= len(text) and full is None and (group, row) in self.trimmed:
                full = text = self.spec.index.read_texts(group, [row])[0] or ""  # the kept prefix ran out: re-read
            ids = encode_documents(tokenizer, [text[:cut]])[0].ids
            prefix = self._with_bos(ids, need)
            whole = cut >= len(text)
            if whole or (len(ids) + 1 >= need + 16 and prefix_hash(prefix[:hashed]) == checksum):
                return prefix  # the packer verifies the checksum (a whole text that mismatches raises there)
            cut *= 2


class _SplitFetch:
    """``fetch`` for ``bestfit_split``: a piece's tokens, from a verified prefix of its document's tokens (kept while
    any of the document's pieces is buffered), else from the whole text.
    """

    def __init__(self, spec: StreamSpec, meta: np.ndarray, texts: dict[tuple[int, int], str]):
        self.spec = spec
        self.texts = texts
        keys = list(zip(meta[:, 2].tolist(), meta[:, 3].tolist()))
        self.uses = Counter(keys)
        self.tokens: dict[tuple[int, int], np.ndarray] = {}
        self.whole: set[tuple[int, int]] = set()  # documents whose kept tokens are all of their tokens
        # Characters per token of the whole documents buffered (their lengths are exact, BOS included).
        chars = tokens = 0
        for key, (length, offset, final, hashed) in zip(keys, meta[:, [1, 4, 5, 7]].tolist()):
            if offset == 0 and final and not hashed and length > 1:
                chars, tokens = chars + len(texts[key]), tokens + length - 1
        self.chars_per_token = chars / tokens if tokens else 4.0

    def __call__(self, row: np.ndarray, need: int) -> Any:
        key = (int(row[2]), int(row[3]))
        length, start, final, checksum = int(row[1]), int(row[4]), bool(row[5]), int(row[6])
        end = start + length
        tokens = self.tokens.get(key)
        if tokens is None or not (key in self.whole or _verified(tokens, start, end, checksum)):
            tokens = self._tokenize(key, start, end, checksum, needs_end=final)
        self.uses[key] -= 1
        if not self.uses[key]:
            self.tokens.pop(key, None)
            self.texts.pop(key, None)
            self.whole.discard(key)
        return tokens[start:end]

    def _tokenize(self, key: tuple[int, int], start: int, end: int, checksum: int, needs_end: bool) -> np.ndarray:
        text = self.texts[key]
        if not needs_end and key not in self.tokens:  # a first try on a prefix; a second need takes the whole
            cut = int((end + 64) * self.chars_per_token * 1.25) + 256
            if cut < len(text) // 2:
                tokens = self._with_bos(text[:cut])
                if _verified(tokens, start, end, checksum):
                    self.tokens[key] = tokens
                    return tokens
        tokens = self._with_bos(text)
        self.tokens[key] = tokens
        self.whole.add(key)
        return tokens

    def _with_bos(self, text: str) -> np.ndarray:
        ids = encode_documents(self.spec.encoder(), [text])[0].ids
        tokens = np.empty(len(ids) + 1, np.int32)
        tokens[0] = self.spec.bos_id
        tokens[1:] = ids
        return tokens


def _verified(prefix: np.ndarray, start: int, end: int, checksum: int) -> bool:
    """Whether a prefix holds the piece ``[start, end)`` as saved: checksum matches, and the prefix runs past it."""
    return len(prefix) >= end + 16 and prefix_hash(prefix[start:end]) == checksum
