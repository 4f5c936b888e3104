"""Resume cost: time from ``load_state_dict`` to the first batch, at sample 0 vs sample 10⁷ of 10⁸; state size.

What is measured, on ``IndexDataset(10⁸)`` (sample ``i`` is ``i``: only the order and loader are timed) with
G = 256 and m = 8, unsorted and sorted (16·G windows, a per-index Python sort key):

* resume: a fresh ``D9DDataModule`` is set up, then the clock runs over ``load_state_dict(state)`` and
  ``next(iter(dm.train_dataloader()))``. ``state`` is what ``dm.state_dict()`` writes (epoch, step and the
  order fingerprint) with ``step`` set to the position: 0 or 10⁷ // G steps (sample 9,999,872). The first
  batch is checked against the order's global batch at that step, so the figure is for a correct resume.
  Median of several repeats. Target: flat in the position, < 1 s.
* naive resume: iterate the loader from the epoch start and throw batches away until the position; timed over
  a short skip and extrapolated linearly to 10⁷ samples (it is linear: every skipped batch is fetched).
* state size per rank: ``len(pickle.dumps(dm.state_dict()))``, and what it adds to a ``torch.save`` file
  (saved into a ``BytesIO``, minus the same file without it: the zip container's ~1.3 KB is paid once per
  checkpoint, whatever it holds). Target: < 1 KiB. Every rank saves the same state: the position is counted in
  global steps.

Run: ``python benchmarks/resume_cost.py`` (~20 s on 2 cores) or ``--quick`` (a smoke test: one resume per cell, a
50-microbatch skip; its figures are meaningless).
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import time
import warnings
from typing import Any

import numpy as np
import torch
from common import IndexDataset, print_verdicts

from lightning_d9d import D9DDataModule

SIZE = 10**8
GLOBAL_BATCH = 256
MICROBATCH = 8
SORT_BUFFER = 16 * GLOBAL_BATCH
FAR_SAMPLE = 10**7
TARGET_S = 1.0
TARGET_STATE_BYTES = 1024

warnings.filterwarnings("ignore", message=".*set_vital.*")


def python_key(index: int) -> int:
    """A per-index sort key in pure Python (a hash-like length stand-in in [0, 4096))."""
    return (index * 2654435761) % 4096


def make_datamodule(sorted_: bool) -> D9DDataModule:
    datamodule = D9DDataModule(
        IndexDataset(SIZE),
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICROBATCH,
        sort_buffer_size=SORT_BUFFER if sorted_ else None,
        sort_key=python_key if sorted_ else None,
        pin_memory=False,
    )
    datamodule.setup("fit")
    return datamodule


def time_resume(sorted_: bool, state: dict[str, Any], step: int) -> float:
    """Seconds from ``load_state_dict`` to the first batch on a freshly set-up DataModule (checked)."""
    datamodule = make_datamodule(sorted_)
    began = time.perf_counter()
    datamodule.load_state_dict(state)
    batch = next(iter(datamodule.train_dataloader()))
    seconds = time.perf_counter() - began
    # Rank 0 of 1 trains the first m samples of the step's global batch first.
    expected = datamodule.order.global_batch(0, step)[:MICROBATCH]
    assert np.array_equal(batch.numpy(), expected), "resumed at the wrong batch"
    return seconds


def time_skip(sorted_: bool, microbatches: int) -> float:
    """Seconds per microbatch of the naive resume: iterate from the epoch start, discarding batches."""
    loader = iter(make_datamodule(sorted_).train_dataloader())
    next(loader)  # start-up is not per-batch cost
    began = time.perf_counter()
    for _ in range(microbatches):
        next(loader)
    return (time.perf_counter() - began) / microbatches


def torch_saved_bytes(obj: Any) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def state_sizes(datamodule: D9DDataModule) -> tuple[int, int]:
    """(pickled bytes, bytes the state adds to a ``torch.save`` file) of ``dm.state_dict()``.

    ``torch.save`` writes a zip container with ~1.3 KB of fixed records for any object (even ``{}``); a
    Lightning checkpoint is one such file, so what a rank's data state costs there is the difference.
    """
    state = datamodule.state_dict()
    return len(pickle.dumps(state)), torch_saved_bytes({"data": state}) - torch_saved_bytes({"data": None})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, a 50-microbatch skip (smoke test)")
    parser.add_argument("--repeats", type=int, default=7, help="resumes timed per cell (median)")
    parser.add_argument("--skip", type=int, default=3000, help="microbatches of the timed naive skip")
    args = parser.parse_args()
    repeats, skip = (1, 50) if args.quick else (args.repeats, args.skip)

    began = time.perf_counter()
    far_step = FAR_SAMPLE // GLOBAL_BATCH
    naive_batches = far_step * GLOBAL_BATCH // MICROBATCH
    print(f"N = {SIZE:,} indices, G = {GLOBAL_BATCH}, m = {MICROBATCH}, 1 rank; far position = step {far_step:,} "
          f"= sample {far_step * GLOBAL_BATCH:,}; median of {repeats} resumes")  # fmt: skip
    print(f"{'order':<30} {'resume @0 s':>11} {'resume @1e7 s':>13} {'far/0':>6} {'naive skip s/mb':>15} "
          f"{'naive @1e7 s':>12} {'pickle B':>8} {'torch.save +B':>13}")  # fmt: skip
    verdicts: list[tuple[bool, str]] = []
    cases: list[tuple[str, bool]] = [
        ("unsorted", False),
        (f"sorted ({SORT_BUFFER}, Python key)", True),
    ]
    for name, sorted_ in cases:
        reference = make_datamodule(sorted_)
        template = reference.state_dict()  # exactly what a checkpoint stores, at step 0
        timings: dict[int, list[float]] = {0: [], far_step: []}
        for _ in range(repeats):
            for step in timings:  # interleaved, so drift on a shared machine hits both positions alike
                timings[step].append(time_resume(sorted_, {**template, "step": step}, step))
        near, far = (statistics.median(timings[step]) for step in (0, far_step))
        per_batch = time_skip(sorted_, skip)
        pickled, saved = state_sizes(reference)
        far_state = make_datamodule(sorted_)
        far_state.load_state_dict({**template, "step": far_step})
        # The position is a few integers: a far position may add a byte or two to the pickle, never more.
        assert abs(state_sizes(far_state)[0] - pickled) < 16
        print(f"{name:<30} {near:>11.4f} {far:>13.4f} {far / near:>6.2f} {per_batch:>15.2e} "
              f"{per_batch * naive_batches:>12.1f} {pickled:>8} {saved:>13}")  # fmt: skip
        verdicts.append((far < TARGET_S and near < TARGET_S, f"{name}: resume {near:.4f} s @0, {far:.4f} s @1e7 "
                         f"(target < {TARGET_S:.0f} s, flat)"))  # fmt: skip
        bare = torch_saved_bytes(reference.state_dict())
        verdicts.append((max(pickled, saved) < TARGET_STATE_BYTES, f"{name}: state {pickled} B pickled, {saved} B "
                         f"added to a torch.save file; torch.save of the bare state dict is {bare} B "
                         f"(target < {TARGET_STATE_BYTES} B)"))  # fmt: skip
    print(f"naive @1e7 = naive skip s/mb x {naive_batches:,} microbatches (extrapolated from a {skip}-microbatch skip)")
    print_verdicts(verdicts)
    print(f"elapsed {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
