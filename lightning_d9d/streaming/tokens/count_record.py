"""Count records: what sizing a pass needs of a source, kept beside its token cache so ``setup`` need not tokenize.

A source's record, ``<version>/counts/<digest of its files' footer (layout) digests>.json`` in its token cache,
holds per whole entry (``<file digest>/<group>-<start>-<stop>.<content key>.tok``) its documents and tokens, read
from the entry's header the first time a setup counts it; the token counts of the first documents of a few
entries (what best-fit's yield is judged by); and the estimate's tokenized sample once one was made. The version
folder already names the tokenizer and every setting that decides tokens, and the record's name the files'
footers, so a record is never read for other tokens or files.

Which entry counts for a unit is decided at every setup from one listing of the version: a unit's only entry under
its file's footer (layout) digest counts without reading its text; where a unit has several (its text was edited
without changing the footer, and a later read stored the new tokens beside the old), its stored text is read and
hashed, and the entry of that content counts (none, if its tokens are not stored yet: the unit is estimated). So
a count trusts the footer only for a unit whose edited tokens no read has stored yet: such an epoch is a few steps
longer or shorter than the content's until a pass reads the unit, never a row wrong, since tokens are always found
by the content they were made from (``content.py``).

Trade-off: one small file per source and one listing, read at every setup, the record rewritten by whichever
setup learns something new (the last writer wins; every version of it is true), against reading every entry's
header at every setup; the listing is what lets an edited unit's new tokens count as soon as they are stored.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lightning_d9d.core.digest import digest
from lightning_d9d.streaming.tokens.stream_cache import StreamCache
from lightning_d9d.streaming.tokens.token_cache import ENTRY_SUFFIX, TokenCache, read_record, write_record

RECORD_FORMAT = 2  # 2: counts per entry (content key included), not per unit
# Entry headers read at once where the cache is on object storage (each is a request).
PARALLEL_READS = 16


class CountRecord:
    """A source's count record, as read at construction, with what this process adds to it (:meth:`save` writes it).

    Args:
        cache: the source's stream cache (its token cache and its files' index).
    """

    def __init__(self, cache: StreamCache):
        self.cache, self.index = cache.cache, cache.index
        self.chosen: dict[str, str] = {}  # unit name -> the entry counted for it, decided by :meth:`counts`
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

    def counts(
        self, names: list[str], groups: list[int], wanted: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit of ``names`` (of global row groups ``groups``): its documents, its tokens (BOS not included) and
        whether they are known, for the ``wanted`` units with an entry of their current content (as the module
        docstring says which); entries the record lacks are counted from their headers."""
        listed = self._listed()
        self.chosen = {}
        for name, group, want in zip(names, groups, wanted.tolist()):
            entry = self._current(group, listed.get(name, [])) if want else None
            if entry is not None:
                self.chosen[name] = entry
        units = self.data["units"]
        missing = [entry for entry in self.chosen.values() if entry not in units]
        if missing:
            self._count_entries(missing)
        for name in [name for name, entry in self.chosen.items() if entry not in units]:
            del self.chosen[name]  # unreadable: estimated
        known = np.asarray([name in self.chosen for name in names], bool)
        docs = np.asarray([units[self.chosen[name]][0] if name in self.chosen else 0 for name in names], np.int64)
        tokens = np.asarray([units[self.chosen[name]][1] if name in self.chosen else 0 for name in names], np.int64)
        return docs, tokens, known

    def _current(self, group: int, entries: list[str]) -> str | None:
        """The entry of ``entries`` (one unit's) that counts: the only one, else the one of its current content."""
        if len(entries) <= 1:
            return entries[0] if entries else None
        try:
            content = self.index.content_key(group)
        except (ValueError, OSError):  # unreadable now: estimated (the read that trains it says why)
            return None
        return next((entry for entry in entries if entry.endswith(f".{content}{ENTRY_SUFFIX}")), None)

    def _listed(self) -> dict[str, list[str]]:
        """Every whole entry of each unit, from one listing of the cache; where it cannot be listed, those this record
        counted (nothing new is counted then)."""
        try:
            return {unit: [name for name, _ in found] for unit, found in self.cache.unit_entries().items()}
        except OSError:
            listed: dict[str, list[str]] = {}
            for entry in sorted(self.data["units"]):
                listed.setdefault(entry.rsplit(".", 2)[0], []).append(entry)
            return listed

    def _count_entries(self, entries: list[str]) -> None:
        local = "://" not in self.cache.root or self.cache.root.startswith("file://")
        with ThreadPoolExecutor(1 if local or len(entries) < 2 else PARALLEL_READS) as pool:
            counted = list(pool.map(self.cache.entry_counts, entries))
        for entry, count in zip(entries, counted):
            if count is not None:
                self.data["units"][entry] = [count[0], count[1]]
                self.changed = True

    def lengths(self, names: list[str], per_unit: int, wanted: int) -> list[int]:
        """Token counts (BOS included) of the first ``per_unit`` documents of the units ``names`` (counted ones, in
        this order) until ``wanted`` documents are reached, read from their entries' offsets where not recorded."""
        out: list[int] = []
        for name in names:
            if len(out) >= wanted:
                break
            entry = self.chosen.get(name)
            if entry is None:
                continue
            documents = self.data["units"][entry][0]
            kept = self.data["lengths"].get(entry)
            if not isinstance(kept, list) or len(kept) < min(per_unit, documents):
                count = self.cache.entry_counts(entry, per_unit)
                if count is None:
                    continue
                kept = (count[2] + 1).tolist()
                self.data["lengths"][entry], self.changed = kept, True
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
