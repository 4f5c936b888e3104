"""Count records: what sizing a pass needs of a source, kept beside its token cache so ``setup`` need not tokenize.

A source's record, ``<version>/counts/<digest of its files' footer (layout) digests>.json`` in its token cache,
holds per unit (``<file digest>/<group>-<start>-<stop>``) the documents and tokens of its cache entry, read from
the entry's header the first time a setup finds the entry (one listing of the version finds them all); the token
counts of the first documents of a few units (what best-fit's yield is judged by); and the estimate's tokenized
sample once one was made. The version folder already names the tokenizer and every setting that decides tokens,
and the record's name the files' footers, so a record is never read for other tokens or files.

A record is found by the files' footers, not by their content, and it is trusted with counts only (the length of
an epoch), never with a token: tokens are always found by the content they were made from (``content.py``). A
unit edited without changing its file's footer keeps its old counts here until its record is deleted, which can
make an epoch a few steps longer or shorter, never a row wrong.

Trade-off: one small file per source, read at every setup and rewritten by whichever setup learns something new
(the last writer wins; every version of it is true), against reading every entry's header at every setup.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lightning_d9d.core.digest import digest
from lightning_d9d.streaming.tokens.token_cache import StreamCache, TokenCache, read_record, write_record

RECORD_FORMAT = 1
# Entry headers read at once where the cache is on object storage (each is a request).
PARALLEL_READS = 16


class CountRecord:
    """A source's count record, as read at construction, with what this process adds to it (:meth:`save` writes it).

    Args:
        cache: the source's stream cache (its token cache and its files' index).
    """

    def __init__(self, cache: StreamCache):
        self.cache, self.index = cache.cache, cache.index
        self.files = [int(file_digest) for file_digest in self.index.file_digests]
        self.path = f"counts/{digest(json.dumps(self.files))}.json"
        self.changed = False
        self.data = self._read()

    def _read(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"format": RECORD_FORMAT, "files": self.files, "units": {}, "lengths": {}}
        try:
            data = json.loads(read_record(self.cache, self.path))
        except (OSError, ValueError):  # none yet, or unreadable: counted afresh (and written again)
            return empty
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or data.get("files") != self.files:
            return empty
        # What a damaged record holds that is not counts is left out (and counted again).
        empty["units"] = {name: [int(n) for n in value] for name, value in _items(data.get("units")) if _counts(value)}
        empty["lengths"] = {name: value for name, value in _items(data.get("lengths")) if _counts(value, None)}
        sample = data.get("sample")
        if (
            isinstance(sample, dict)
            and isinstance(sample.get("tokens"), float)
            and _counts(sample.get("lengths"), None)
        ):
            empty["sample"] = sample
        return empty

    def unit_name(self, group: int, start: int, stop: int) -> str:
        """A unit's name in the record and the cache: ``<file digest>/<group in file>-<start>-<stop>``."""
        folder = TokenCache.file_folder(self.index.file_digests[int(self.index.file_of[group])])
        return f"{folder}/{TokenCache.unit_name(int(self.index.group_in_file[group]), start, stop)}"

    def counts(self, names: list[str], wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit of ``names``: its documents, its tokens (BOS not included) and whether they are known; the
        ``wanted`` units the record lacks are looked for in the cache (one listing, then their entries' headers)."""
        units = self.data["units"]
        missing = [name for name, want in zip(names, wanted.tolist()) if want and name not in units]
        if missing:
            self._count_entries(missing)
        known = np.asarray([name in units for name in names], bool)
        docs = np.asarray([units[name][0] if name in units else 0 for name in names], np.int64)
        tokens = np.asarray([units[name][1] if name in units else 0 for name in names], np.int64)
        return docs, tokens, known

    def _listed(self) -> dict[str, tuple[str, int]]:
        """The cache's entries by unit; none where it cannot be listed (nothing is counted from it then)."""
        try:
            return self.cache.entries()
        except OSError:
            return {}

    def _count_entries(self, names: list[str]) -> None:
        listed = self._listed()
        found = [(name, listed[name][0]) for name in names if name in listed]
        local = "://" not in self.cache.root or self.cache.root.startswith("file://")
        with ThreadPoolExecutor(1 if local or len(found) < 2 else PARALLEL_READS) as pool:
            counted = list(pool.map(lambda item: self.cache.entry_counts(item[1]), found))
        for (name, _), count in zip(found, counted):
            if count is not None:
                self.data["units"][name] = [count[0], count[1]]
                self.changed = True

    def lengths(self, names: list[str], per_unit: int, wanted: int) -> list[int]:
        """Token counts (BOS included) of the first ``per_unit`` documents of the units ``names`` (counted ones, in
        this order) until ``wanted`` documents are reached, read from their entries' offsets where not recorded."""
        out: list[int] = []
        listed: dict[str, tuple[str, int]] | None = None
        for name in names:
            if len(out) >= wanted:
                break
            documents = self.data["units"][name][0]
            kept = self.data["lengths"].get(name)
            if not isinstance(kept, list) or len(kept) < min(per_unit, documents):
                listed = self._listed() if listed is None else listed
                count = self.cache.entry_counts(listed[name][0], per_unit) if name in listed else None
                if count is None:
                    continue
                kept = (count[2] + 1).tolist()
                self.data["lengths"][name], self.changed = kept, True
            out.extend(kept[:per_unit])
        return out

    def sample(self, params: list[Any]) -> tuple[float, list[int]] | None:
        """The estimate's sample made with ``params``, ``(tokens, lengths)``, if the record holds it."""
        sample = self.data.get("sample")
        if not isinstance(sample, dict) or sample.get("params") != params:
            return None
        return float(sample["tokens"]), [int(length) for length in sample["lengths"]]

    def keep_sample(self, params: list[Any], tokens: float, lengths: list[int]) -> None:
        self.data["sample"] = {"params": params, "tokens": tokens, "lengths": [int(length) for length in lengths]}
        self.changed = True

    def save(self) -> None:
        """Write the record where this process learnt something and still writes to the cache; a failure is silent
        (the next setup counts again)."""
        if not self.changed or not self.cache.writing:
            return
        try:
            write_record(self.cache, self.path, json.dumps(self.data, separators=(",", ":")).encode())
        except OSError:
            return
        self.changed = False


def _items(value: Any) -> list[tuple[str, Any]]:
    return list(value.items()) if isinstance(value, dict) else []


def _counts(value: Any, size: int | None = 2) -> bool:
    """Whether ``value`` is a list of ``size`` (any number: ``None``) non-negative integers."""
    return (
        isinstance(value, list)
        and (size is None or len(value) == size)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    )
