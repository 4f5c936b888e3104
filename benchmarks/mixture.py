"""Mixture benchmark: a weighted mixture of two sources vs the same files as one corpus, side by side.

Run: ``python benchmarks/mixture.py`` (a few minutes on 2 cores; ``--quick`` for a smoke test). Nothing is
downloaded: the data are the demo corpus' parquet shards (``prose``: Python's help topics and docstrings;
``code``: standard-library source), written on first use, and the demo tokenizer.

Configurations, over the same files and tokenizer, ``bestfit_split``, K = 4, in this process
(``num_workers=0`` by default: the tokenizer's pool uses every core; ``--workers`` for DataLoader workers):

* ``single corpus``: ``train_files=[prose files..., code files...]``;
* ``mixture``: ``train_files={"prose": ..., "code": ...}`` with ``weights={"prose": 0.5, "code": 0.5}``: every
  stream hosts one sub-stream per source and every step takes the planned rows of each.

Timing: both loaders start (their first step, untimed: the best-fit buffers fill), then run in alternating
windows of at least ``--seconds`` each, whole optimizer steps, the order reversed every round (so both get the
same mean place in a round); a window's tokens are the document tokens of the rows handed out (``emitted`` of
``stream_stats()``, padding excluded). The figure is pooled: all of a configuration's tokens over all its
windows' time. The idle loader's read-ahead is bounded (a few tokenizer chunks per stream), so it does not
compete with the measured one for long.

Target: mixture tokens/s >= 0.95 x single-corpus tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_verdicts

from lightning_d9d import PretrainingDataModule
from lightning_d9d.demo_data.parquet import build_demo_parquet

TARGET = 0.95


class Loader:
    """One configuration's training loader, run a window at a time."""

    def __init__(self, name: str, train_files, weights, args: argparse.Namespace, tokenizer: str):
        self.name = name
        self.dm = PretrainingDataModule(
            train_files=train_files, tokenizer=tokenizer, bos_token="<eos>", seq_len=args.seq_len,
            global_batch_size=args.global_batch, microbatch_size=8, num_streams=4, num_workers=args.workers,
            packing="bestfit_split", steps_per_epoch=1_000_000, bestfit_buffer_size=args.buffer, weights=weights,
        )  # fmt: skip
        self.dm.setup("fit")
        self.batches = iter(self.dm.train_dataloader())
        self.tokens = 0
        self.seconds = 0.0
        start = time.perf_counter()
        self.step()
        self.first_step = time.perf_counter() - start

    def step(self) -> None:
        for _ in range(self.dm.microbatches_per_step):
            next(self.batches)

    def window(self, seconds: float) -> None:
        before = self.dm.stream_stats()["emitted"]
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.step()
        self.seconds += time.perf_counter() - start
        self.tokens += self.dm.stream_stats()["emitted"] - before

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def close(self) -> None:
        self.batches.close()
        self.dm.close_loaders()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of windows (even: each order as often)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--buffer", type=int, default=200, help="bestfit_buffer_size")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 0.2 s windows, 2 rounds")
    args = parser.parse_args()
    if args.quick:  # only proves the script runs and judges its target: the figures are meaningless
        args.seconds, args.rounds, args.seq_len, args.buffer, args.global_batch = 0.2, 2, 128, 32, 16
    built = build_demo_parquet()
    prose, code = built.files["prose"], built.files["code"]
    loaders = [
        Loader("single corpus", prose + code, None, args, built.tokenizer_path),
        Loader("mixture", {"prose": prose, "code": code}, {"prose": 0.5, "code": 0.5}, args, built.tokenizer_path),
    ]
    for round_index in range(args.rounds):
        for loader in loaders if round_index % 2 == 0 else loaders[::-1]:
            loader.window(args.seconds)
    single, mixture = loaders
    print(f"seq_len {args.seq_len}, global batch {args.global_batch}, K = 4, bestfit_split, workers {args.workers}")
    print(f"{'configuration':<16} {'first step s':>13} {'tokens/s':>12} {'seconds':>9}")
    for loader in loaders:
        print(f"{loader.name:<16} {loader.first_step:>13.2f} {loader.rate:>12,.0f} {loader.seconds:>9.1f}")
    shares = mixture.dm.source_stats()
    print("mixture rows per source: " + ", ".join(f"{name} {stats['rows']}" for name, stats in shares.items()))
    ratio = mixture.rate / single.rate if single.rate else 0.0
    print_verdicts([(ratio >= TARGET, f"mixture / single-corpus tokens/s = {ratio:.3f} (target >= {TARGET})")])
    for loader in loaders:
        loader.close()


if __name__ == "__main__":
    main()
