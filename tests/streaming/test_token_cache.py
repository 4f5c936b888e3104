"""The token cache's storage layer on real files (and a real S3-protocol server): round trips, bad entries
named, deleted and rebuilt, atomic stores under SIGKILL and a file size limit, concurrent writers, keyed
versions, coverage."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.tokens.cache_entry import CachedUnit, token_array, token_dtype
from lightning_d9d.streaming.tokens.token_cache import Coverage, TokenCache, TokenCacheWarning

REPO = Path(__file__).resolve().parents[2]
KEY = {"tokenizer": "sha256:0123", "text_column": "text", "max_document_chars": 1 << 26, "recipe": 1}
FILE = 0x1234_5678_9ABC_DEF0
CONTENT = "0123456789abcdef" * 2  # a unit's content key


def make_unit(
    vocab_size: int, docs: int = 40, seed: int = 0, group: int = 3, start: int = 0, stop: int = 100, long: int = 0
) -> CachedUnit:
    """A unit of ``docs`` random documents (some of them empty of ids) spread over ``[start, stop)``, and
    ``long`` rows skipped as too long."""
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(np.arange(start, stop), docs + long, replace=False))
    long_rows = set(rng.choice(picked, long, replace=False).tolist()) if long else set()
    rows = [int(r) for r in picked if int(r) not in long_rows]
    documents = [rng.integers(0, vocab_size, int(rng.integers(0, 200))).tolist() for _ in rows]
    return CachedUnit.of(group, start, stop, rows, documents, {r: 1000 + r for r in long_rows}, vocab_size=vocab_size)


def assert_same(loaded: CachedUnit | None, unit: CachedUnit) -> None:
    assert loaded is not None
    assert (loaded.group_in_file, loaded.start, loaded.stop) == (unit.group_in_file, unit.start, unit.stop)
    for name in ("rows", "offsets", "tokens", "too_long_rows", "too_long_chars"):
        ours, theirs = getattr(loaded, name), getattr(unit, name)
        assert ours.dtype == theirs.dtype, name
        assert np.array_equal(ours, theirs), name


def entry(cache: TokenCache, unit: CachedUnit, file_digest: int = FILE, content: str = CONTENT) -> Path:
    return Path(cache.fs_path(cache.entry_name(file_digest, unit.group_in_file, unit.start, unit.stop, content)))


def store(cache: TokenCache, unit: CachedUnit, file_digest: int = FILE, content: str = CONTENT) -> bool:
    return cache.store(file_digest, unit.group_in_file, unit.start, unit.stop, content, unit)


def load(cache: TokenCache, unit: CachedUnit, file_digest: int = FILE, content: str = CONTENT) -> CachedUnit | None:
    described = f"parquet file 'part-0.parquet', row group {unit.group_in_file}, rows {unit.start}..{unit.stop - 1}"
    return cache.load(file_digest, unit.group_in_file, unit.start, unit.stop, content, described)


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


# ------------------------------------------------------------------------------------------------ round trips
def test_dtype_is_the_smallest_that_holds_every_id() -> None:
    assert token_dtype(50_000) == np.uint16
    assert token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.uint32
    for bad in (0, (1 << 32) + 1):
        with pytest.raises(ValueError, match="vocab_size"):
            token_dtype(bad)


@pytest.mark.parametrize("vocab_size", [50_000, 150_000])
def test_round_trip(tmp_path: Path, vocab_size: int) -> None:
    unit = make_unit(vocab_size, long=3)
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=vocab_size)
    assert load(cache, unit) is None  # a miss before the store
    assert store(cache, unit)
    # Another process's cache (pickled, as a DataLoader worker gets it) reads the same unit back.
    other = pickle.loads(pickle.dumps(cache))
    loaded = load(other, unit)
    assert_same(loaded, unit)
    assert loaded.tokens.dtype == token_dtype(vocab_size)
    assert not loaded.tokens.flags.writeable  # views of the bytes read
    if vocab_size > 1 << 16:
        assert int(loaded.tokens.max()) >= 1 << 16  # ids past uint16 survive
    for doc in range(len(unit)):
        assert np.array_equal(loaded.ids(doc), unit.ids(doc))
    assert (other.counters.hits, other.counters.misses, cache.counters.stored) == (1, 0, 1)
    kept, long = set(unit.rows.tolist()), set(unit.too_long_rows.tolist())
    assert set(loaded.empty_rows().tolist()) == set(range(unit.start, unit.stop)) - kept - long
    manifest = json.loads((tmp_path / cache.digest / "manifest.json").read_text())
    assert manifest["key"] == KEY and manifest["dtype"] == token_dtype(vocab_size).name


def test_empty_unit_and_documents_without_ids(tmp_path: Path) -> None:
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1000)
    empty = CachedUnit.of(0, 10, 20, [], [], vocab_size=1000)
    assert store(cache, empty)
    loaded = load(cache, empty)
    assert_same(loaded, empty)
    assert len(loaded) == 0 and loaded.empty_rows().tolist() == list(range(10, 20))
    # A text whose encoding has no ids is a document all the same (the stream gives it its BOS).
    blank = CachedUnit.of(1, 0, 3, [0, 2], [[], [5, 6]], {1: 99}, vocab_size=1000)
    assert store(cache, blank)
    assert_same(load(cache, blank), blank)
    assert load(cache, blank).lengths.tolist() == [0, 2]


def test_an_id_outside_the_vocabulary_raises_instead_of_wrapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"token id 65536 \(at position 2\) is outside the vocabulary \[0, 65536\)"):
        CachedUnit.of(0, 0, 2, [0, 1], [[1, 2], [65536]], vocab_size=1 << 16)
    with pytest.raises(ValueError, match=r"token id 1500 \(at position 1\) is outside the vocabulary \[0, 1000\)"):
        CachedUnit.of(0, 0, 1, [0], [[3, 1500]], vocab_size=1000)  # fits uint16, not the vocabulary
    with pytest.raises(ValueError, match="token id 70000"):
        CachedUnit.of(0, 0, 1, [0], [np.asarray([3, 70_000], np.int32)], vocab_size=1 << 16)  # arrays: no wrap
    with pytest.raises(ValueError, match="token id -1"):
        token_array(np.asarray([3, -1], np.int32), 1000)
    assert token_array([65536], (1 << 16) + 1).dtype == np.uint32
    # A unit built by hand with wide ids is checked when stored, and nothing is written.
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1 << 16)
    wide = CachedUnit(0, 0, 1, np.asarray([0]), np.asarray([0, 2]), np.asarray([7, 70_000], np.int32),
                      np.zeros(0, np.int64), np.zeros(0, np.int64))  # fmt: skip
    with pytest.raises(ValueError, match="token id 70000"):
        store(cache, wide)
    assert not entry(cache, wide).exists()
    # Ids that fit are converted to the cache's dtype.
    narrow = CachedUnit(0, 0, 1, np.asarray([0]), np.asarray([0, 2]), np.asarray([7, 65_535], np.int32),
                        np.zeros(0, np.int64), np.zeros(0, np.int64))  # fmt: skip
    assert store(cache, narrow)
    assert load(cache, narrow).tokens.tolist() == [7, 65_535]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(rows=np.asarray([5, 3])), "not ascending rows inside"),
        (dict(rows=np.asarray([0, 100])), "not ascending rows inside"),
        (dict(offsets=np.asarray([0, 2, 4])), "do not frame"),
        (dict(offsets=np.asarray([0, 4, 3]), tokens=np.asarray([1, 2, 3], np.uint16)), "offsets decrease"),
        (dict(too_long_rows=np.asarray([0]), too_long_chars=np.asarray([5])), "both a document and too long"),
        (dict(too_long_rows=np.asarray([7]), too_long_chars=np.asarray([5, 6])), "lengths do not match"),
    ],
)
def test_store_rejects_a_unit_that_does_not_describe_its_rows(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    unit = CachedUnit.of(0, 0, 10, [0, 4], [[1, 2], [3]], vocab_size=100)
    with pytest.raises(ValueError, match=message):
        store(TokenCache(str(tmp_path), Storage(), KEY, vocab_size=100), dataclasses.replace(unit, **change))
    with pytest.raises(ValueError, match="stored as row group 1"):
        TokenCache(str(tmp_path), Storage(), KEY, vocab_size=100).store(FILE, 1, 0, 10, CONTENT, unit)


# ------------------------------------------------------------------------------------------------ bad entries
def rewrite_header(data: bytes, **changes: int) -> bytes:
    """The entry with header fields changed, its header CRC-32 recomputed (so only the change can show)."""
    magic, version, size, _ = struct.unpack_from("<8sIII", data)
    header = json.loads(data[20 : 20 + size])
    header.update(changes)
    raw = json.dumps(header, sort_keys=True).encode().ljust(size)
    assert len(raw) == size
    return struct.pack("<8sIII", magic, version, size, zlib.crc32(raw)) + raw + data[20 + size :]


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def header_size(data: bytes) -> int:
    return 20 + struct.unpack_from("<8sIII", data)[2]


CORRUPTIONS = {
    "flipped payload byte": (lambda d: flip(d, len(d) - 7), "its arrays fail their CRC-32 check"),
    "flipped header byte": (lambda d: flip(d, 30), "its header fails its CRC-32 check"),
    "truncated": (lambda d: d[: len(d) - 100], "truncated"),
    "truncated inside the prefix": (lambda d: d[:11], "shorter than the 20-byte prefix"),
    "empty file": (lambda d: b"", "truncated: 0 bytes"),
    "wrong magic": (lambda d: b"PAR1" + d[4:], "not a token cache entry"),
    "another format version": (lambda d: d[:8] + struct.pack("<I", 99) + d[12:], "format version 99"),
    "header lies about the token count": (
        lambda d: rewrite_header(d, tokens=json.loads(d[20 : header_size(d)])["tokens"] + 1),
        "its header describes",
    ),
    # One document more and 8 uint16 tokens fewer: the sizes add up and the checksum holds, the layout does not.
    "header lies about counts that add up": (
        lambda d: rewrite_header(
            d,
            documents=json.loads(d[20 : header_size(d)])["documents"] + 1,
            tokens=json.loads(d[20 : header_size(d)])["tokens"] - 8,
        ),
        "not ascending rows|do not frame|offsets decrease",
    ),
    "entry of another unit": (lambda d: rewrite_header(d, group=4), "its header says group=4, expected 3"),
    "entry of another content": (lambda d: rewrite_header(d, content="f" * 32), "its header says content='ffff"),
    "entry of another cache version": (lambda d: rewrite_header(d, vocab_size=7), "its header says vocab_size=7"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_bad_entry_is_named_deleted_and_rebuilt(tmp_path: Path, kind: str) -> None:
    corrupt, reason = CORRUPTIONS[kind]
    unit = make_unit(50_000, long=2)
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_000)
    assert store(cache, unit)
    path = entry(cache, unit)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.warns(TokenCacheWarning) as caught:
        assert load(cache, unit) is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(path) in message and "parquet file 'part-0.parquet', row group 3, rows 0..99" in message, message
    assert any(part in message for part in reason.split("|")), message
    assert not path.exists()  # deleted: the next store replaces it
    assert cache.counters.bad == 1
    assert store(cache, unit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(load(cache, unit), unit)


def test_bad_entries_past_the_named_ones_are_counted(tmp_path: Path) -> None:
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1000)
    units = [make_unit(1000, docs=3, group=g, seed=g) for g in range(11)]
    for unit in units:
        assert store(cache, unit)
        entry(cache, unit).write_bytes(b"garbage")
    with pytest.warns(TokenCacheWarning) as caught:
        assert all(load(cache, unit) is None for unit in units)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 9 and "more than 8 unusable entries" in messages[-1]
    assert cache.counters.bad == 11


def test_an_unreadable_entry_is_a_miss_warned_about_once(tmp_path: Path) -> None:
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1000)
    units = [make_unit(1000, docs=3, group=g) for g in range(2)]
    for unit in units:
        entry(cache, unit).mkdir(parents=True)  # reading it fails with an OSError other than "not found"
    with pytest.warns(TokenCacheWarning) as caught:
        assert load(cache, units[0]) is None and load(cache, units[1]) is None
    [message] = [str(w.message) for w in caught]
    assert f"cannot read token cache entry {str(entry(cache, units[0]))!r}" in message, message
    assert entry(cache, units[0]).is_dir() and cache.counters.misses == 2


# ------------------------------------------------------------------------------------------------ atomicity
CHILD_STORES = """
    import dataclasses, sys
    import numpy as np
    from lightning_d9d.streaming.sources.storage import Storage
    from lightning_d9d.streaming.tokens.token_cache import TokenCache
    from lightning_d9d.streaming.tokens.cache_entry import CachedUnit
    root, tokens, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(7)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, tokens, 999)), [tokens]]).astype(np.int64)
    unit = CachedUnit(0, 0, 1000, np.arange(1000, dtype=np.int64), offsets,
                      rng.integers(0, 50_000, tokens).astype(np.uint16), np.zeros(0, np.int64), np.zeros(0, np.int64))
    cache = TokenCache(root, Storage(), {KEY}, vocab_size=50_000)
    print("ready", flush=True)
    for group in range(groups):
        assert cache.store({FILE}, group, 0, 1000, {CONTENT}, dataclasses.replace(unit, group_in_file=group))
        print("stored", group, flush=True)
"""


def child_unit(tokens: int, group: int) -> CachedUnit:
    """The unit CHILD_STORES stores as ``group``."""
    rng = np.random.default_rng(7)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, tokens, 999)), [tokens]]).astype(np.int64)
    return CachedUnit(group, 0, 1000, np.arange(1000, dtype=np.int64), offsets,
                      rng.integers(0, 50_000, tokens).astype(np.uint16), np.zeros(0, np.int64),
                      np.zeros(0, np.int64))  # fmt: skip


def child_script(code: str) -> list[str]:
    code = code.replace("{KEY}", repr(KEY)).replace("{FILE}", str(FILE)).replace("{CONTENT}", repr(CONTENT))
    return [sys.executable, "-c", textwrap.dedent(code)]


def size_of(path: Path) -> int:
    """The size of a file another process may rename at any moment (0 once it is gone)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_a_store_killed_mid_write_leaves_no_entry(tmp_path: Path) -> None:
    """SIGKILL while an entry is being written (its temporary file exists): the entry stays absent, and the
    entries stored before stay whole."""
    tokens = 16 << 20  # 32 MiB per entry: long enough to be caught mid-write
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_000)
    folder = Path(cache.fs_path(f"{FILE:016x}"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([*child_script(CHILD_STORES), str(tmp_path), str(tokens), "50"], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    caught = None
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while caught is None and time.monotonic() < deadline and child.poll() is None:
            names = os.listdir(folder) if folder.exists() else []
            done = [n for n in names if n.endswith(".tok")]
            partial = [n for n in names if n.startswith(".") and size_of(folder / n) > 0]
            if done and partial:  # one entry stored, the next half written
                child.send_signal(signal.SIGKILL)
                caught = partial[0]
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert caught is not None, "the child was never caught writing"
    group = int(caught[1:].split("-", 1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no bad entry anywhere: only whole entries or none
        assert cache.load(FILE, group, 0, 1000, CONTENT) is None
        for done in range(group):
            assert_same(cache.load(FILE, done, 0, 1000, CONTENT), child_unit(tokens, done))
    assert not (folder / f"{group}-0-1000.{CONTENT}.tok").exists()
    # The killed writer's temporary file is no entry; the entry can be stored and read.
    assert cache.coverage([(FILE, g, 0, 1000) for g in range(group + 1)]).cached == group
    assert store(cache, child_unit(tokens, group))
    assert_same(cache.load(FILE, group, 0, 1000, CONTENT), child_unit(tokens, group))


CHILD_SIZE_LIMIT = """
    import dataclasses, json, resource, signal, sys, warnings
    import numpy as np
    from lightning_d9d.streaming.sources.storage import Storage
    from lightning_d9d.streaming.tokens.token_cache import TokenCache
    from lightning_d9d.streaming.tokens.cache_entry import CachedUnit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cache = TokenCache(sys.argv[1], Storage(), {KEY}, vocab_size=50_000)
    small = CachedUnit.of(0, 0, 2, [0, 1], [[1, 2, 3], [4]], vocab_size=50_000)
    big = CachedUnit.of(1, 0, 1, [0], [np.arange(1 << 20) % 50_000], vocab_size=50_000)
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["small"] = cache.store({FILE}, 0, 0, 2, {CONTENT}, small)
        results["big"] = cache.store({FILE}, 1, 0, 1, {CONTENT}, big)
        results["big again"] = cache.store({FILE}, 2, 0, 1, {CONTENT}, dataclasses.replace(big, group_in_file=2))
        results["small loads"] = cache.load({FILE}, 0, 0, 2, {CONTENT}) is not None
    results["writing"] = cache.writing
    results["warnings"] = [str(w.message) for w in caught]
    results["failures"] = cache.counters.store_failures
    print(json.dumps(results))
"""


def test_a_file_size_limit_is_one_warning_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """A real EFBIG from the OS (RLIMIT_FSIZE, as a full disk or quota would fail): one warning naming the root
    and the cause, no exception, no file left half written; the process stops writing and keeps reading."""
    done = subprocess.run([*child_script(CHILD_SIZE_LIMIT), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results["small"] and results["small loads"]
    assert not results["big"] and not results["big again"] and not results["writing"]
    assert results["failures"] == 1  # the second big store is not even tried
    [message] = results["warnings"]
    assert str(tmp_path) in message and "File too large" in message and "stops writing" in message, message
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_000)
    assert files == [f"{cache.digest}/{FILE:016x}/0-0-2.{CONTENT}.tok", f"{cache.digest}/manifest.json"]
    assert cache.load(FILE, 0, 0, 2, CONTENT).tokens.tolist() == [1, 2, 3, 4]


CHILD_SAME_ENTRY = """
    import sys
    from lightning_d9d.streaming.sources.storage import Storage
    from lightning_d9d.streaming.tokens.token_cache import TokenCache
    from lightning_d9d.streaming.tokens.cache_entry import CachedUnit
    import numpy as np
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50_000, 5000).tolist() for _ in range(100)]
    unit = CachedUnit.of(0, 0, 100, list(range(100)), docs, vocab_size=50_000)
    cache = TokenCache(sys.argv[1], Storage(), {KEY}, vocab_size=50_000)
    for _ in range(int(sys.argv[2])):
        assert cache.store({FILE}, 0, 0, 100, {CONTENT}, unit)
"""


def test_concurrent_stores_of_one_entry_are_harmless(tmp_path: Path) -> None:
    """Two writers of the same entry (tensor-parallel peers) and a reader: every load is the whole entry or a
    miss, never a bad one, and no temporary file is left."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [subprocess.Popen([*child_script(CHILD_SAME_ENTRY), str(tmp_path), "40"], env=env) for _ in range(2)]
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50_000, 5000).tolist() for _ in range(100)]
    expected = CachedUnit.of(0, 0, 100, list(range(100)), docs, vocab_size=50_000)
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_000)
    hits = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        while any(w.poll() is None for w in writers):
            loaded = cache.load(FILE, 0, 0, 100, CONTENT)
            if loaded is not None:
                assert_same(loaded, expected)
                hits += 1
        assert [w.wait() for w in writers] == [0, 0]
        assert_same(cache.load(FILE, 0, 0, 100, CONTENT), expected)
    assert hits > 0
    files = sorted(str(p.relative_to(tmp_path / cache.digest)) for p in (tmp_path / cache.digest).rglob("*"))
    assert files == [f"{FILE:016x}", f"{FILE:016x}/0-0-100.{CONTENT}.tok", "manifest.json"]


# ------------------------------------------------------------------------------------------------ versions
def test_a_changed_key_misses_and_says_so_once(tmp_path: Path) -> None:
    unit = make_unit(50_000)
    old = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_000)
    assert store(old, unit)
    assert old.describe_other_versions() is None
    new = TokenCache(str(tmp_path), Storage(), {**KEY, "tokenizer": "sha256:4567"}, vocab_size=50_000)
    assert new.digest != old.digest
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another version is a plain miss, not a bad entry
        assert load(new, unit) is None
    assert new.other_versions() == {old.digest: KEY}
    message = new.describe_other_versions()
    assert f"{old.digest} (differs in tokenizer)" in message and "starts its own version" in message, message
    assert store(new, unit)
    assert "continues its own version" in new.describe_other_versions()
    # Other settings and other vocabularies are versions too; a string key differs as a whole.
    assert TokenCache(str(tmp_path), Storage(), KEY, vocab_size=50_001).digest != old.digest
    text_key = TokenCache(str(tmp_path), Storage(), "tokenizer-v2", vocab_size=50_000)
    assert text_key.digest not in (old.digest, new.digest)
    assert f"{old.digest} (differs in key)" in text_key.describe_other_versions()
    # Another file digest, or the same unit with other content: its entries are simply not there.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(old, unit, file_digest=FILE + 1) is None
        assert load(old, unit, content="f" * 32) is None
    assert_same(load(old, unit), unit)
    with pytest.raises(ValueError, match="content key 'x' must be 16 to 64 lowercase hex digits"):
        load(old, unit, content="x")
    with pytest.raises(ValueError, match="JSON"):
        TokenCache(str(tmp_path), Storage(), {"tokenizer": object()}, vocab_size=10)


def test_a_version_of_an_older_entry_format_is_said_to_be_one(tmp_path: Path) -> None:
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1000)
    older = tmp_path / ("0" * 16)
    older.mkdir()
    (older / "manifest.json").write_text(json.dumps({"format": 1, "key": KEY, "vocab_size": 1000}))
    assert f"{'0' * 16} (differs in entry format)" in cache.describe_other_versions()


def test_coverage_and_size(tmp_path: Path) -> None:
    cache = TokenCache(str(tmp_path), Storage(), KEY, vocab_size=1000)
    units = [make_unit(1000, docs=5, group=g, seed=g) for g in range(5)]
    assert cache.coverage([(FILE, u.group_in_file, u.start, u.stop) for u in units]) == Coverage(0, 5, 0)
    assert cache.size() == 0
    for unit in units[:3]:
        assert store(cache, unit)
    sizes = [entry(cache, u).stat().st_size for u in units[:3]]
    stray = entry(cache, units[0]).with_name(f".3-0-100.{CONTENT}.tok.999.abc.tmp")
    stray.write_bytes(b"x" * 10)  # a killed writer's temporary file
    coverage = cache.coverage([(FILE, u.group_in_file, u.start, u.stop) for u in units])
    assert coverage == Coverage(3, 5, sum(sizes))
    manifest = (tmp_path / cache.digest / "manifest.json").stat().st_size
    assert cache.size() == sum(sizes) + manifest + 10


# ------------------------------------------------------------------------------------------------ S3
S3_BUCKET = "tokens"


def completing_multipart_uploads(app: Any) -> Any:
    """moto's app, with CompleteMultipartUpload answered as S3 does. moto 5.2 names the answer's root element
    ``CompleteMultipartUploadResponse``, S3 ``CompleteMultipartUploadResult``; pyarrow takes any other root
    for an error embedded in a 200 response, so no upload through pyarrow would complete."""

    def wrapped(environ: dict, start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] != "POST" or "uploadId=" not in environ.get("QUERY_STRING", ""):
            return app(environ, start_response)
        answer: dict[str, Any] = {}

        def keep(status: str, headers: list, exc_info: Any = None) -> None:
            answer.update(status=status, headers=headers)

        body = b"".join(app(environ, keep))
        body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
        headers = [(name, value) for name, value in answer["headers"] if name.lower() != "content-length"]
        start_response(answer["status"], [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return wrapped


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 with an empty bucket, and the storage options that reach it."""
    import threading

    import boto3
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = completing_multipart_uploads(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_port
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        env.setenv("AWS_CONFIG_FILE", os.devnull)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                              aws_secret_access_key="test")  # fmt: skip
        client.create_bucket(Bucket=S3_BUCKET)
        options = {"endpoint_url": endpoint, "key": "test", "secret": "test", "client_kwargs": {"region_name":
                   "us-east-1"}}  # fmt: skip
        try:
            yield {"client": client, "storage": Storage(options), "port": port, "options": options}
        finally:
            server.shutdown()
            thread.join()


def s3_objects(s3: dict, prefix: str) -> dict[str, int]:
    listing = s3["client"].list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix).get("Contents", [])
    return {item["Key"][len(prefix) :]: item["Size"] for item in listing}


@pytest.mark.slow
def test_s3_round_trip_bad_entry_and_coverage(s3: dict) -> None:
    root = f"s3://{S3_BUCKET}/round-trip"
    cache = TokenCache(root, s3["storage"], KEY, vocab_size=150_000)
    units = [make_unit(150_000, group=g, seed=g, long=1) for g in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(cache, units[0]) is None  # a plain miss
        for unit in units[:2]:
            assert store(cache, unit)
        for unit in units[:2]:
            assert_same(load(pickle.loads(pickle.dumps(cache)), unit), unit)
    names = s3_objects(s3, f"round-trip/{cache.digest}/")
    assert sorted(names) == [f"{FILE:016x}/{g}-0-100.{CONTENT}.tok" for g in (0, 1)] + ["manifest.json"]
    spans = [(FILE, u.group_in_file, u.start, u.stop) for u in units]
    entry_bytes = sum(size for name, size in names.items() if name.endswith(".tok"))
    assert cache.coverage(spans) == Coverage(2, 3, entry_bytes)
    assert cache.size() == sum(names.values())
    # A truncated object is named, deleted and rebuilt.
    key = f"round-trip/{cache.digest}/{cache.entry_name(FILE, 0, 0, 100, CONTENT)}"
    body = s3["client"].get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
    s3["client"].put_object(Bucket=S3_BUCKET, Key=key, Body=body[: len(body) // 2])
    with pytest.warns(TokenCacheWarning, match=rf"{root}/{cache.digest}/{FILE:016x}/0-0-100.{CONTENT}.tok.*truncated"):
        assert load(cache, units[0]) is None
    assert f"{FILE:016x}/0-0-100.{CONTENT}.tok" not in s3_objects(s3, f"round-trip/{cache.digest}/")
    assert store(cache, units[0])
    assert_same(load(cache, units[0]), units[0])
    other = TokenCache(root, s3["storage"], {**KEY, "max_document_chars": 10}, vocab_size=150_000)
    assert f"{cache.digest} (differs in max_document_chars)" in other.describe_other_versions()


CHILD_S3_STORE = """
    import dataclasses, json, sys
    import numpy as np
    from lightning_d9d.streaming.sources.storage import Storage
    from lightning_d9d.streaming.tokens.token_cache import TokenCache
    from lightning_d9d.streaming.tokens.cache_entry import CachedUnit
    tokens = 24 << 20
    unit = CachedUnit(0, 0, 1, np.zeros(1, np.int64), np.asarray([0, tokens]), np.ones(tokens, np.uint16),
                      np.zeros(0, np.int64), np.zeros(0, np.int64))
    cache = TokenCache(sys.argv[1], Storage(json.loads(sys.argv[2])), {KEY}, vocab_size=50_000)
    assert cache.store({FILE}, 1, 0, 1, {CONTENT}, dataclasses.replace(unit, group_in_file=1))  # and the manifest
    print("ready", flush=True)
    cache.store({FILE}, 0, 0, 1, {CONTENT}, unit)
"""


@pytest.mark.slow
def test_s3_store_killed_mid_upload_leaves_no_object(s3: dict) -> None:
    """A writer killed while its upload is under way leaves no object (S3 commits an upload only once it is
    completed), so nothing is ever read back from it."""
    root = f"s3://{S3_BUCKET}/killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([*child_script(CHILD_S3_STORE), root, json.dumps(s3["options"])], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            uploads = s3["client"].list_multipart_uploads(Bucket=S3_BUCKET, Prefix="killed/").get("Uploads", [])
            parts = [s3["client"].list_parts(Bucket=S3_BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
                     for u in uploads]  # fmt: skip
            if any(parts):  # part of the entry is uploaded, the rest is not
                child.send_signal(signal.SIGKILL)
                break
        else:
            pytest.fail("the upload was never seen under way")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    cache = TokenCache(root, s3["storage"], KEY, vocab_size=50_000)
    names = s3_objects(s3, f"killed/{cache.digest}/")
    assert sorted(names) == [f"{FILE:016x}/1-0-1.{CONTENT}.tok", "manifest.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.load(FILE, 0, 0, 1, CONTENT) is None
        assert cache.load(FILE, 1, 0, 1, CONTENT) is not None
