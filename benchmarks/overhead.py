"""Per-microbatch cost of the whole D9DDataModule stack vs a bare torchdata StatefulDataLoader.

What is measured: wall time per microbatch of one whole epoch (loader and worker start-up included), for

* bare    — ``StatefulDataLoader(dataset, batch_size=8, collate_fn=pad_collate, shuffle=True, num_workers=w)``;
* ours    — ``D9DDataModule(dataset, pad_collate, global_batch_size=64, microbatch_size=8,
  sort_buffer_size=16·64, num_workers=w)``: seeded-bijection order, window sorting by ``dataset.sort_key``,
  snake sharding, its own StatefulDataLoader and the pack/position bookkeeping, through the public
  ``train_dataloader_for_rank(0, 1, epoch)`` (pinning is off: this is a CPU machine);
* ours (unsorted) — the same with ``sort_buffer_size=None``. Sorting makes microbatches shorter (less padding),
  so the sorted figure includes a saving in collate work; the unsorted one isolates the pure bookkeeping cost.

The dataset is the real corpus of ``benchmarks/corpus.py`` (token-id tensors of stdlib functions) and the
collate pads to the longest sample, as a causal-LM collate does. Configurations run interleaved (in a rotating
order, so none always runs first or last on a machine shared with other jobs), repeated; the table gives the
best (least disturbed) and median run, and the median of the per-repeat ratios (each run against the bare run
of the same repeat), which is what the verdict uses. With 2 workers a run is the first 2,000 microbatches
(start-up included): every batch then crosses a process boundary (~1 ms), and whole epochs would take minutes.
Target: ours ≤ 1.05 × bare.

Run: ``python benchmarks/overhead.py`` (~1.5 min on 2 cores) or ``--quick`` (a smoke test: one
run of 100 microbatches per configuration; its figures are meaningless).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterable

import torch
from common import print_verdicts
from corpus import TokenDataset, load_corpus, pad_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_d9d import D9DDataModule

MICROBATCH = 8
GLOBAL_BATCH = 64
SORT_BUFFER = 16 * GLOBAL_BATCH
TARGET = 1.05

# torchdata 0.11 warns about the deprecated torch.set_vital on every loader construction: noise here.
warnings.filterwarnings("ignore", message=".*set_vital.*")


def bare(dataset: TokenDataset, num_workers: int) -> Callable[[int], Iterable]:
    def epoch_loader(epoch: int) -> Iterable:
        return StatefulDataLoader(
            dataset, batch_size=MICROBATCH, collate_fn=pad_collate, shuffle=True, num_workers=num_workers
        )

    return epoch_loader


def ours(dataset: TokenDataset, num_workers: int, sort_buffer: int | None) -> Callable[[int], Iterable]:
    datamodule = D9DDataModule(
        dataset,
        pad_collate,
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICROBATCH,
        sort_buffer_size=sort_buffer,
        num_workers=num_workers,
        pin_memory=False,
    )
    datamodule.setup("fit")  # once, as Trainer.fit does; per-epoch work happens in the loader
    return lambda epoch: datamodule.train_dataloader_for_rank(0, 1, epoch=epoch)


def time_epoch(loader: Iterable, limit: int | None) -> float:
    """Seconds per microbatch over one epoch (or its first ``limit`` microbatches), start-up included."""
    began = time.perf_counter()
    count = 0
    for batch in loader:
        count += 1
        if batch["input_ids"].ndim != 2:  # touch the batch so nothing can be skipped lazily
            raise AssertionError("unexpected batch")
        if limit is not None and count >= limit:
            break
    return (time.perf_counter() - began) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run of 100 microbatches (smoke test)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved runs per configuration")
    parser.add_argument(
        "--worker-limit", type=int, default=2000, help="microbatches per run with workers (0: the whole epoch)"
    )
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats  # --quick only proves the script runs and judges its targets

    began = time.perf_counter()
    torch.manual_seed(0)
    corpus = load_corpus()
    dataset = TokenDataset(corpus)
    print(corpus.describe())
    print(
        f"microbatch m={MICROBATCH}, G={GLOBAL_BATCH}, ours sorts windows of {SORT_BUFFER}; "
        f"{repeats} interleaved repeats; torch {torch.__version__}"
    )
    print(
        f"{'workers':>7} {'microbatches/run':>16} {'loader':<16} {'best us/mb':>10} {'median':>8} "
        f"{'best ratio':>10} {'median ratio':>12} {'paired ratio':>12}"
    )
    verdicts: list[tuple[bool, str]] = []
    for num_workers in (0, 2):
        # With workers every batch crosses a process boundary (~1 ms each here), so a whole epoch per run would
        # take minutes; a fixed prefix, worker start-up included, measures the same per-microbatch cost.
        if args.quick:
            limit: int | None = 100
        else:
            limit = args.worker_limit or None if num_workers else None
        configs = {
            "bare": bare(dataset, num_workers),
            "ours (sorted)": ours(dataset, num_workers, SORT_BUFFER),
            "ours (unsorted)": ours(dataset, num_workers, None),
        }
        names = list(configs)
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(repeats):
            rotation = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in rotation:
                times[name].append(time_epoch(configs[name](repeat), limit))
        base_best, base_median = min(times["bare"]), statistics.median(times["bare"])
        for name in names:
            best, median = min(times[name]), statistics.median(times[name])
            # Paired: each run against the bare run of the same repeat (close in time), so slow phases of a
            # shared machine cancel out; the median of those ratios is the verdict's figure.
            paired = statistics.median(ours_ / bare_ for ours_, bare_ in zip(times[name], times["bare"]))
            print(
                f"{num_workers:>7} {limit or 'epoch':>16} {name:<16} {best * 1e6:>10.1f} {median * 1e6:>8.1f} "
                f"{best / base_best:>10.3f} {median / base_median:>12.3f} {paired:>12.3f}"
            )
            if name != "bare":
                verdicts.append(
                    (paired <= TARGET, f"{name}, {num_workers} workers: paired ratio {paired:.3f} (target <= {TARGET})")
                )
    print_verdicts(verdicts)
    print(f"elapsed {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
