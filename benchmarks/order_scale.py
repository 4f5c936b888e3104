"""Order construction at 10⁹ samples: peak memory and time from ``setup()`` to the first batch.

What is measured, each case in a fresh subprocess (so one case's allocations cannot hide another's peak):

* ``D9DDataModule(IndexDataset(10⁹), global_batch_size=256, microbatch_size=8, ...)``, then ``setup("fit")``
  and ``next(iter(dm.train_dataloader()))`` — a tiny dataset whose sample ``i`` is ``i``, so only the order,
  sharding and the loader are measured:
  - unsorted (``sort_buffer_size=None``): the seeded Feistel bijection alone;
  - sorted by a per-index Python callable (``sort_key=callable``): one call per sample of the first window
    (B = 16·G = 4,096 calls), the cost every ``dataset.sort_key(i)`` user pays per window;
  - sorted by a numpy-backed key column (``sort_key="length"``, a ``np.memmap`` of 10⁹ uint16 corpus lengths
    on disk, exposed like a Hugging Face column): keys of a window are read in one vectorised gather.
* ``torch.randperm(n)`` — what a full permutation costs (int64, O(N)). At 10⁹ it needs 8 GB; by default it
  runs at 10⁸ and the 10⁹ figures are extrapolated linearly (``--randperm-size`` to change).

Memory: peak RSS growth (``VmHWM`` reset just before, minus ``VmRSS`` then; includes numpy and torch), the
growth of anonymous (private) RSS, and the tracemalloc peak (Python and numpy allocations) of a second, traced
run. The verdict uses private memory (max of anon RSS growth and the tracemalloc peak): in the memmap case the
peak RSS also counts page-cache pages of the key file mapped by the random key reads (here the kernel maps whole
large folios, ~1.9 GB for 4,096 reads of a freshly written file) — shared, evictable, not allocated by us.
Target: < 100 MB and < 1 s.

Run: ``python benchmarks/order_scale.py`` (~30 s on 2 cores) or ``--quick`` (a smoke test: 10⁶ samples, randperm
at 10⁵, without the memmap case, every case in this process; its figures are meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 10**9
QUICK_SIZE = 10**6  # --quick only proves the script runs and judges its targets: a small order is enough
GLOBAL_BATCH = 256
MICROBATCH = 8
SORT_BUFFER = 16 * GLOBAL_BATCH
TARGET_MB = 100
TARGET_S = 1.0


def python_key(index: int) -> int:
    """A per-index sort key in pure Python (a hash-like length stand-in in [0, 4096))."""
    return (index * 2654435761) % 4096


def _first_batch(case: str, key_file: str | None, size: int) -> tuple[float, float, Any]:
    """Build a DataModule for ``case`` over ``size`` samples; return (setup seconds, first-batch seconds, the batch)."""
    from common import IndexDataset

    from lightning_d9d import D9DDataModule

    if case == "memmap":
        column = np.memmap(key_file, dtype=np.uint16, mode="r", shape=(size,))
        dataset, sort_buffer, sort_key = IndexDataset(size, column), SORT_BUFFER, "length"
    elif case == "callable":
        dataset, sort_buffer, sort_key = IndexDataset(size), SORT_BUFFER, python_key
    else:
        dataset, sort_buffer, sort_key = IndexDataset(size), None, None
    began = time.perf_counter()
    datamodule = D9DDataModule(
        dataset, global_batch_size=GLOBAL_BATCH, microbatch_size=MICROBATCH,
        sort_buffer_size=sort_buffer, sort_key=sort_key, pin_memory=False,
    )  # fmt: skip
    datamodule.setup("fit")
    set_up = time.perf_counter()
    batch = next(iter(datamodule.train_dataloader()))
    return set_up - began, time.perf_counter() - set_up, batch


def child(case: str, key_file: str | None, randperm_size: int, size: int = SIZE) -> dict[str, Any]:
    """Run one case in this (fresh) process and return its figures."""
    import torch
    from common import process_kib, reset_peak_rss

    if case == "randperm":
        reset_peak_rss()
        before = process_kib("VmRSS")
        began = time.perf_counter()
        permutation = torch.randperm(randperm_size)
        seconds = time.perf_counter() - began
        assert len(permutation) == randperm_size
        rss_mb = (process_kib("VmHWM") - before) / 1024
        return {"seconds": seconds, "rss_mb": rss_mb, "anon_mb": rss_mb, "traced_mb": None}
    from lightning_d9d import D9DDataModule  # noqa: F401  (imported before the baseline: its import is not counted)

    reset_peak_rss()
    before, anon_before = process_kib("VmRSS"), process_kib("RssAnon")
    set_up, first, batch = _first_batch(case, key_file, size)
    rss_mb = (process_kib("VmHWM") - before) / 1024
    anon_mb = (process_kib("RssAnon") - anon_before) / 1024
    assert batch.shape == (MICROBATCH,) and int(batch.min()) >= 0 and int(batch.max()) < size
    # A second, traced run: tracemalloc slows Python down, so it does not feed the timings.
    tracemalloc.start()
    _first_batch(case, key_file, size)
    traced_mb = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return {
        "setup_s": set_up, "first_s": first, "seconds": set_up + first,
        "rss_mb": rss_mb, "anon_mb": anon_mb, "traced_mb": traced_mb,
    }  # fmt: skip


def run_child(case: str, key_file: str | None, randperm_size: int, quick: bool = False) -> dict[str, Any]:
    if quick:  # a smoke test: no fresh interpreter per case (each costs seconds of imports on 2 cores)
        return child(case, key_file, randperm_size, QUICK_SIZE)
    command = [sys.executable, __file__, "--child", case, "--randperm-size", str(randperm_size)]
    if key_file:
        command += ["--key-file", key_file]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"case {case} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_key_file(path: str) -> float:
    """Write 10⁹ uint16 sort keys (the real corpus lengths, tiled) to ``path``; return seconds taken."""
    from corpus import load_corpus

    began = time.perf_counter()
    lengths = np.minimum(load_corpus().lengths, np.iinfo(np.uint16).max).astype(np.uint16)
    chunk = np.tile(lengths, -(-(2**24) // len(lengths)))[: 2**24]
    with open(path, "wb") as file:
        for start in range(0, SIZE, len(chunk)):
            chunk[: SIZE - start].tofile(file)
    assert os.path.getsize(path) == 2 * SIZE
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 10⁶ samples in this process, no memmap case, randperm at 10⁵"
    )
    parser.add_argument("--randperm-size", type=int, default=None, help="randperm size (default 10⁸; quick 10⁵)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    randperm_size = args.randperm_size or (10**5 if args.quick else 10**8)
    size = QUICK_SIZE if args.quick else SIZE
    if args.child:
        print(json.dumps(child(args.child, args.key_file, randperm_size)))
        return 0

    began = time.perf_counter()
    where = "this process (--quick)" if args.quick else "a fresh process"
    print(f"N = {size:,} indices, G = {GLOBAL_BATCH}, m = {MICROBATCH}, sort buffer = {SORT_BUFFER}; each case in "
          f"{where}; MB = 2^20 bytes")  # fmt: skip
    rows: list[tuple[str, dict[str, Any]]] = []
    rows.append(("ours, unsorted", run_child("unsorted", None, randperm_size, args.quick)))
    rows.append(("ours, sorted, Python key/index", run_child("callable", None, randperm_size, args.quick)))
    if not args.quick:
        with tempfile.TemporaryDirectory(prefix="d9d-keys-") as folder:
            key_file = str(Path(folder) / "keys.u16")
            print(f"(wrote a 2 GB uint16 key file in {write_key_file(key_file):.1f} s, not timed below)")
            rows.append(("ours, sorted, numpy memmap key", run_child("memmap", key_file, randperm_size)))
    randperm = run_child("randperm", None, randperm_size, args.quick)
    scale = size / randperm_size
    rows.append((f"torch.randperm({randperm_size:.0e})", randperm))
    if scale != 1:
        extrapolated = {key: randperm[key] * scale for key in ("seconds", "rss_mb", "anon_mb")}
        rows.append((f"torch.randperm({size:.0e}), x{scale:.0f} extrapolated".replace("e+0", "e"), extrapolated))

    print(f"{'case':<40} {'setup s':>8} {'1st batch s':>11} {'total s':>8} {'peak RSS +MB':>12} "
          f"{'anon RSS +MB':>12} {'traced MB':>9}")  # fmt: skip
    for name, row in rows:
        cells = [row.get("setup_s"), row.get("first_s"), row["seconds"], row["rss_mb"], row["anon_mb"],
                 row.get("traced_mb")]  # fmt: skip
        text = [f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}" for value, width in
                zip(cells, (8, 11, 8, 12, 12, 9))]  # fmt: skip
        print(f"{name:<40} {' '.join(text)}")
    for name, row in rows:
        if name.startswith("ours"):
            # Private memory: the memmap case maps page-cache pages of its key file (shared with the OS cache,
            # evictable, not allocated by the process); they show in peak RSS but not in anon RSS.
            memory = max(row["anon_mb"], row["traced_mb"])
            passed = memory < TARGET_MB and row["seconds"] < TARGET_S
            print(f"{'PASS' if passed else 'FAIL'}: {name}: {memory:.1f} MB private (peak RSS +{row['rss_mb']:.1f} "
                  f"MB), {row['seconds']:.3f} s (target < {TARGET_MB} MB, < {TARGET_S:.0f} s)")  # fmt: skip
    print(f"elapsed {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
