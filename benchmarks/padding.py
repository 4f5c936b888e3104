"""Padding fraction of length-sorted loading vs random order and a d9d-style in-pack shuffle.

What is measured: the fraction of padded slots, ``sum(m · longest − tokens) / sum(m · longest)`` over every
microbatch of an epoch, with microbatch m = 8 and global batch G = 64, for sort buffers G … 64·G, on the real
heavy-tailed corpus of ``benchmarks/corpus.py`` (stdlib functions, whitespace tokens).

How, side by side in one run, averaged over the same epochs (seeds) for each column:

* random    — a random permutation cut into microbatches (no sorting; independent of the buffer).
* d9d-style — what d9d's ``BufferSortedDataset(buffer_size=B, pack_size=G)`` does to a shuffled dataset: each
  window of B samples is sorted by length (random tie-break), cut into packs of G, the packs are shuffled **and
  the samples inside each pack are shuffled**, then microbatches of m are cut. Simulated with numpy (d9d is
  not a dependency); the algorithm follows d9d 0.24's ``_update_buffer_idx``.
* ours      — ``D9DDataModule(sort_buffer_size=B)`` through its public API: the loader of rank 0 of 1
  (``train_dataloader_for_rank``), its real collated microbatches padded to their longest (``pad_collate``).

Targets: ours ≤ 2 % at 16·G, and ≤ ¼ of the d9d-style figure at every buffer from 4·G up.

Run: ``python benchmarks/padding.py`` (full, ~1 min on 2 cores) or ``--quick`` (a smoke test: one epoch of
every kth document, 16,000 in all, fewer buffers; its figures are meaningless).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import print_verdicts
from corpus import TokenDataset, describe_lengths, every_kth, load_corpus, load_demo_corpus, pad_collate

from lightning_d9d import D9DDataModule

MICROBATCH = 8
GLOBAL_BATCH = 64
BUFFER_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
TARGET_AT_16G = 0.02
TARGET_RATIO = 0.25
# Also measured with the tail cut at a context length, as a training pipeline would truncate.
TRUNCATIONS = (512,)
QUICK_DOCUMENTS = 16_000  # --quick only proves the script runs and judges its targets: a sample of the corpus


def padding_of(microbatch_lengths: np.ndarray) -> tuple[int, int]:
    """(padded slots, total slots) of microbatches given as a (count, m) array of sample lengths."""
    total = int(microbatch_lengths.max(axis=1).sum()) * microbatch_lengths.shape[1]
    return total - int(microbatch_lengths.sum()), total


def random_order(lengths: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    usable = len(lengths) // GLOBAL_BATCH * GLOBAL_BATCH  # the same floor(N/G)·G samples the others train
    return padding_of(lengths[rng.permutation(len(lengths))[:usable]].reshape(-1, MICROBATCH))


def d9d_style(lengths: np.ndarray, buffer: int, rng: np.random.Generator) -> tuple[int, int]:
    usable = len(lengths) // GLOBAL_BATCH * GLOBAL_BATCH
    order = rng.permutation(len(lengths))[:usable]  # d9d sorts windows of an (upstream-)shuffled dataset
    served = []
    for start in range(0, usable, buffer):
        window = order[start : start + buffer]
        window = window[np.lexsort((rng.random(len(window)), lengths[window]))]
        packs = window.reshape(-1, GLOBAL_BATCH)[rng.permutation(len(window) // GLOBAL_BATCH)]
        # The in-pack shuffle: every pack's G samples in a fresh random order (argsort of noise per row).
        packs = np.take_along_axis(packs, np.argsort(rng.random(packs.shape), axis=1), axis=1)
        served.append(packs.ravel())
    return padding_of(lengths[np.concatenate(served)].reshape(-1, MICROBATCH))


def sorted_bound(lengths: np.ndarray, buffer: int, rng: np.random.Generator) -> tuple[int, int]:
    """The best any window-sorting order can do: each window sorted, microbatches cut contiguously.

    For a fixed set of samples, cutting the sorted list into consecutive groups of m minimises the sum of
    the groups' maxima, so no order that sorts windows of B can pad less (up to which samples share a window).
    """
    usable = len(lengths) // GLOBAL_BATCH * GLOBAL_BATCH
    order = rng.permutation(len(lengths))[:usable]
    windows = [order[start : start + buffer] for start in range(0, usable, buffer)]
    served = np.concatenate([window[np.argsort(lengths[window], kind="stable")] for window in windows])
    return padding_of(lengths[served].reshape(-1, MICROBATCH))


def ours(dataset: TokenDataset, buffer: int, epoch: int) -> tuple[int, int]:
    datamodule = D9DDataModule(
        dataset, pad_collate, global_batch_size=GLOBAL_BATCH, microbatch_size=MICROBATCH, sort_buffer_size=buffer
    )
    datamodule.setup("fit")
    padded = total = 0
    for batch in datamodule.train_dataloader_for_rank(0, 1, epoch=epoch):
        slots = batch["input_ids"].numel()
        total += slots
        padded += slots - int(batch["lengths"].sum())
    return padded, total


def table(dataset: TokenDataset, multiples: tuple[int, ...], epochs: int) -> list[bool]:
    """Print one padding table for ``dataset`` and its PASS/FAIL lines; return the verdicts."""
    lengths = dataset.lengths
    print(f"{'buffer':>8} {'samples':>8} {'random':>8} {'d9d-style':>10} {'ours':>8} {'ours/d9d':>9} {'bound':>8}")
    results: dict[int, tuple[float, float]] = {}
    for multiple in multiples:
        buffer = multiple * GLOBAL_BATCH
        cells = {name: [0, 0] for name in ("random", "d9d", "ours", "bound")}
        for epoch in range(epochs):
            # One generator per (epoch, buffer) for the simulated columns, so every row is reproducible alone.
            rng = np.random.default_rng((epoch, buffer))
            for name, (padded, total) in (
                ("random", random_order(lengths, rng)),
                ("d9d", d9d_style(lengths, buffer, rng)),
                ("ours", ours(dataset, buffer, epoch)),
                ("bound", sorted_bound(lengths, buffer, rng)),
            ):
                cells[name][0] += padded
                cells[name][1] += total
        fraction = {name: padded / total for name, (padded, total) in cells.items()}
        results[multiple] = (fraction["d9d"], fraction["ours"])
        print(
            f"{f'{multiple}G':>8} {buffer:>8} {fraction['random']:>8.2%} {fraction['d9d']:>10.2%} "
            f"{fraction['ours']:>8.2%} {fraction['ours'] / fraction['d9d']:>9.3f} {fraction['bound']:>8.2%}"
        )

    verdicts = []
    if 16 in results:
        at_16 = results[16][1]
        verdicts.append((at_16 <= TARGET_AT_16G, f"ours at 16G = {at_16:.2%} (target <= {TARGET_AT_16G:.0%})"))
    ratios = {multiple: ours_ / d9d for multiple, (d9d, ours_) in results.items() if multiple >= 4}
    worst = max(ratios, key=ratios.__getitem__)
    verdicts.append(
        (
            ratios[worst] <= TARGET_RATIO,
            f"ours/d9d-style for every buffer >= 4G: worst {ratios[worst]:.3f} at {worst}G (target <= {TARGET_RATIO})",
        )
    )
    print_verdicts(verdicts)
    return [passed for passed, _ in verdicts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one epoch of a corpus sample, buffers G, 4G, 16G, 64G, no truncation"
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs (seeds) averaged per cell")
    args = parser.parse_args()
    epochs = 1 if args.quick else args.epochs
    multiples = (1, 4, 16, 64) if args.quick else BUFFER_MULTIPLES

    began = time.perf_counter()
    print(f"microbatch m={MICROBATCH}, global batch G={GLOBAL_BATCH}, {epochs} epoch(s) per cell; padding fraction.")
    print("bound = each window sorted and cut contiguously, simulated: the least any window sort can pad.")
    code = every_kth(load_corpus(), QUICK_DOCUMENTS) if args.quick else load_corpus()
    corpora = [("stdlib code, cut at every def, whitespace tokens", code)]
    if not args.quick:
        corpora.append(("demo corpus: Python help topics + stdlib docstrings, BPE tokens", load_demo_corpus()))
    for name, corpus in corpora:
        for max_tokens in (None,) if args.quick else (None, *TRUNCATIONS):
            dataset = TokenDataset(corpus, max_tokens)
            label = "whole documents" if max_tokens is None else f"truncated to {max_tokens} tokens (a context length)"
            print(f"\n[{name}; {label}] {describe_lengths(dataset.lengths)}")
            table(dataset, multiples, epochs)
    print(f"\nelapsed {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
