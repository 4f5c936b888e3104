"""Token cache benchmark: store and load throughput of one entry of millions of tokens.

Run: ``python benchmarks/token_cache.py`` (entries of 2, 4 and 8 M tokens, uint16 and uint32; ``--root DIR`` to
measure another filesystem, ``--quick`` for a smoke test). Each entry is stored ``--repeat`` times (under other
row groups, so every store writes a new file: temporary file, fsync, rename) and loaded ``--repeat`` times from
the page cache (one read, then the checks: sizes, CRC-32, ascending rows, monotone offsets, ids below the
vocabulary size). The best time of each is reported, beside a plain ``read()`` of the same file: a load costs
that read plus the checksum and the checks. Then the content hash (SHA-256, what names an entry) beside BLAKE2b
over the same 64 MiB (8 with ``--quick``): the faster of the two here was chosen.

Targets: a load runs at >= 200 M tokens/s and a store at >= 50 M tokens/s, both far above one tokenizer
core (a few M tokens/s), so that reading the cache never limits a stream and writing it costs little beside
tokenizing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import print_verdicts

from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.tokens.cache_entry import CachedUnit, token_dtype
from lightning_d9d.streaming.tokens.token_cache import TokenCache

LOAD_TARGET, STORE_TARGET = 200e6, 50e6  # tokens/s
CONTENT = "0" * 32  # the content key the entries are stored under (a real one digests the unit's stored text)


def entry(tokens: int, vocab_size: int, docs: int = 4000) -> CachedUnit:
    """One unit of ``docs`` documents holding ``tokens`` random ids in all."""
    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, tokens, docs - 1)), [tokens]]).astype(np.int64)
    ids = rng.integers(0, vocab_size, tokens).astype(token_dtype(vocab_size))
    return CachedUnit(0, 0, docs, np.arange(docs, dtype=np.int64), offsets, ids, np.zeros(0, np.int64),
                      np.zeros(0, np.int64))  # fmt: skip


def best(action, repeat: int) -> float:
    times = []
    for attempt in range(repeat):
        start = time.perf_counter()
        action(attempt)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(cache: TokenCache, unit: CachedUnit, repeat: int) -> tuple[float, float, float, int]:
    """Best seconds to store, to load and to ``read()`` the entry, and its bytes."""
    stored = best(lambda g: cache.store(1, g, 0, unit.stop, CONTENT, dataclasses.replace(unit, group_in_file=g)),
                  repeat)  # fmt: skip
    loaded = best(lambda _: cache.load(1, 0, 0, unit.stop, CONTENT), repeat)
    path = Path(cache.fs_path(cache.entry_name(1, 0, 0, unit.stop, CONTENT)))
    raw = best(lambda _: path.read_bytes(), repeat)
    assert cache.counters.bad == 0 and cache.counters.store_failures == 0
    return stored, loaded, raw, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="the cache's folder (default: a temporary folder)")
    parser.add_argument("--tokens", type=float, nargs="+", default=[2, 4, 8], help="entry sizes, M tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 M tokens, 3 repeats")
    args = parser.parse_args()
    sizes, repeat = ([1.0], 3) if args.quick else (args.tokens, args.repeat)
    verdicts = []
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        print(f"{'entry':>22} {'MB':>6} {'store MB/s':>11} {'store tokens/s':>15} {'load MB/s':>10} "
              f"{'load tokens/s':>14} {'read() MB/s':>12}")  # fmt: skip
        for vocab_size in (50_000, 150_000):
            cache = TokenCache(root, Storage(), {"benchmark": vocab_size}, vocab_size=vocab_size)
            for millions in sizes:
                tokens = int(millions * 1e6)
                stored, loaded, raw, size = measure(cache, entry(tokens, vocab_size), repeat)
                name = f"{millions:g} M tokens {token_dtype(vocab_size).name}"
                row = (size / 1e6, size / stored / 1e6, tokens / stored / 1e6, size / loaded / 1e6,
                       tokens / loaded / 1e6, size / raw / 1e6)  # fmt: skip
                print(f"{name:>22} {row[0]:6.1f} {row[1]:11.0f} {row[2]:13.0f} M {row[3]:10.0f} {row[4]:12.0f} M "
                      f"{row[5]:12.0f}")  # fmt: skip
                verdicts.append((tokens / loaded >= LOAD_TARGET, f"load of {name}: {tokens / loaded / 1e6:.0f} M "
                                 f"tokens/s (target >= {LOAD_TARGET / 1e6:.0f} M)"))  # fmt: skip
                verdicts.append((tokens / stored >= STORE_TARGET, f"store of {name}: {tokens / stored / 1e6:.0f} M "
                                 f"tokens/s (target >= {STORE_TARGET / 1e6:.0f} M)"))  # fmt: skip
    print(hash_speeds(8 if args.quick else 64, repeat))
    print_verdicts(verdicts)


def hash_speeds(mb: int, repeat: int) -> str:
    """The content hash's speed beside the alternative considered, on the same random bytes (best of ``repeat``)."""
    data = np.random.default_rng(0).bytes(mb << 20)
    speeds = {}
    for name in ("sha256", "blake2b"):
        seconds = best(lambda _, name=name: hashlib.new(name, data).digest(), repeat)
        speeds[name] = len(data) / seconds / 1e6
    return f"content hash over {mb} MiB: " + ", ".join(f"{name} {speed:,.0f} MB/s" for name, speed in speeds.items())


if __name__ == "__main__":
    main()
