"""Token budgets: how full and how even microbatches are, what planning 10⁷ samples costs, and demo tokens/s.

What is measured, side by side in one run:

1. **Tokens per microbatch** on two real corpora: the demo corpus (Python help topics + stdlib docstrings, BPE
   tokens, truncated to 512) and the heavy-tailed stdlib-code corpus of ``benchmarks/corpus.py`` (cut at every
   ``def``, whitespace tokens, truncated to a 1,024 context), one epoch each (``--epochs`` for more), through
   ``D9DDataModule.train_dataloader_for_rank(0, 1)`` — the real collated microbatches:

   * fixed-size   — sample counts, ``microbatch_size = m`` padded, length-sorted (buffer 16·G): today's path;
   * HF-flatten   — what ``DataCollatorWithFlattening`` gets from a shuffled loader: ``m`` random samples
     concatenated per microbatch (simulated: a seeded permutation cut into runs of ``m``);
   * budget-pad   — ``global_batch_tokens``/``microbatch_tokens``, padded (``count × longest <= budget``);
   * budget-free  — the same budgets, ``padding_free=True`` (sum of lengths ``<= budget``).

   ``m`` is ``microbatch_tokens / mean length`` rounded, so every column computes on about as many positions
   per microbatch on average. Per column: the positions a microbatch computes on (padded slots, or flattened
   tokens), their spread (max / mean over the epoch's microbatches, the memory a step must be sized for), the
   real share of those positions, and for the budgets the fill: real tokens / ``microbatch_tokens``. The padded
   budget is planned with ``pad_to_multiple_of=1`` (the target); the figure with 8 is printed beside it.
2. **Planning cost**: ``D9DDataModule(IndexDataset(10⁷) with a numpy-backed length column, sort_key="length",
   global_batch_tokens=…)``, ``setup("fit")`` in a fresh subprocess per padding mode — reading every length
   (Arrow ``take``, a block at a time), the checks, the digest, and planning epoch 0; then planning epoch 1.
   Memory is the peak RSS growth during ``setup`` (``VmHWM`` reset just before), the length column itself
   excluded (it exists before, as a memory-mapped dataset column would).
3. **Demo training tokens/s on CPU**: ``TinyGPT`` (the demo config's sizes) trained by a Lightning Trainer on
   ``TextDataModule("demo", max_length=96)`` with sample counts (G=32, m=8), a padded token budget (4,096 /
   1,024) and the padding-free one; real tokens per second of wall time from the second step on, one intra-op
   thread (``--threads``): on a shared 2-core machine more threads than free cores make the pool spin. The
   three modes run interleaved, in rounds; the ratio reported is the median of the per-round ratios.

Targets: padding-free fill >= 98 %, padded budget real tokens >= 92 % of the budget, on both
corpora; planning 10⁷ samples <= 10 s and <= 200 MB.

Run: ``python benchmarks/token_budget.py`` (~3 min on 2 cores) or ``--quick`` (a smoke test: every kth
document of each corpus (4,000 in all), 10⁵ samples planned in this process, 1 timed training step per mode;
its figures are meaningless).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import print_verdicts
from corpus import TokenDataset, describe_lengths, every_kth, load_corpus, load_demo_corpus, pad_collate

from lightning_d9d import D9DDataModule

FILL_TARGET = 0.98
PADDED_TARGET = 0.92
PLAN_SECONDS, PLAN_MB = 10.0, 200.0
PLAN_SIZE = 10**7
# --quick only proves the script runs and judges every target: a slice of each corpus and a small plan suffice.
QUICK_DOCUMENTS = 4000
QUICK_PLAN_SIZE = 10**5
# (name, corpus loader, max_tokens, microbatch_tokens, microbatches per step, sort buffer)
CORPORA = [
    ("demo corpus (BPE, max 512)", load_demo_corpus, 512, 4096, 8, 4096),
    ("stdlib code (heavy tail, max 1024)", load_corpus, 1024, 8192, 8, 16384),
]


def flat_collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate a microbatch into one row (what a flattening collator does), keeping the true lengths."""
    return {"input_ids": torch.cat(samples)[None], "lengths": torch.tensor([len(sample) for sample in samples])}


def microbatch_figures(batches: Any) -> tuple[np.ndarray, np.ndarray]:
    """(positions computed on, real tokens) of every microbatch."""
    positions, real = [], []
    for batch in batches:
        positions.append(batch["input_ids"].numel())
        real.append(int(batch["lengths"].sum()))
    return np.asarray(positions), np.asarray(real)


def columns(dataset: TokenDataset, budget: int, per_step: int, buffer: int, epochs: int) -> dict[str, Any]:
    lengths = dataset.lengths
    samples = max(1, round(budget / lengths.mean()))
    global_batch = samples * per_step
    figures: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def run(name: str, **options: Any) -> None:
        dm = D9DDataModule(dataset, options.pop("collate", pad_collate), sort_buffer_size=buffer, **options)
        dm.setup("fit")
        parts = [microbatch_figures(dm.train_dataloader_for_rank(0, 1, epoch)) for epoch in range(epochs)]
        figures[name] = (np.concatenate([p for p, _ in parts]), np.concatenate([r for _, r in parts]))

    run("fixed-size", global_batch_size=global_batch, microbatch_size=samples)
    order = np.concatenate([np.random.default_rng(epoch).permutation(len(lengths)) for epoch in range(epochs)])
    runs = order[: len(order) // samples * samples].reshape(-1, samples)
    hf_tokens = lengths[runs].sum(axis=1)
    figures["HF-flatten"] = (hf_tokens, hf_tokens)
    tokens = {"global_batch_tokens": per_step * budget, "microbatch_tokens": budget}
    run("budget-pad", **tokens, pad_to_multiple_of=1)
    run("budget-pad/8", **tokens, pad_to_multiple_of=8)
    run("budget-free", **tokens, padding_free=True, collate=flat_collate)
    return {"samples": samples, "figures": figures}


def table(name: str, dataset: TokenDataset, budget: int, per_step: int, buffer: int, epochs: int) -> list:
    result = columns(dataset, budget, per_step, buffer, epochs)
    print(f"\n[{name}] {describe_lengths(dataset.lengths)}")
    print(
        f"microbatch_tokens={budget}, {per_step} microbatches per step, buffer {buffer}; fixed-size and HF-flatten "
        f"use m={result['samples']} samples per microbatch"
    )
    print(f"{'':>13} {'microbatches':>12} {'positions':>10} {'max/mean':>9} {'min/mean':>9} {'real':>8} {'fill':>8}")
    verdicts = []
    for column, (positions, real) in result["figures"].items():
        fill = real.sum() / (len(real) * budget) if column.startswith("budget") else None
        fill_text = f"{fill:8.2%}" if fill is not None else f"{'-':>8}"
        print(
            f"{column:>13} {len(positions):>12,} {positions.mean():>10,.0f} {positions.max() / positions.mean():>9.3f} "
            f"{positions.min() / positions.mean():>9.3f} {real.sum() / positions.sum():>8.2%} {fill_text}"
        )
        if column == "budget-free":
            verdicts.append((fill >= FILL_TARGET, f"padding-free fill, {name} = {fill:.2%} (target >= 98%)"))
        if column == "budget-pad":
            verdicts.append((fill >= PADDED_TARGET, f"padded budget real tokens, {name} = {fill:.2%} (target >= 92%)"))
    return verdicts


# ---------------------------------------------------------------------------------------------- planning cost
def plan_child(size: int, padding_free: bool) -> dict[str, Any]:
    """Set up a token-budget DataModule over ``size`` samples in this fresh process; return time and memory."""
    from common import IndexDataset, process_kib, reset_peak_rss

    rng = np.random.default_rng(0)
    column = np.clip(rng.lognormal(np.log(200), 1.0, size), 2, 4096).astype(np.int32)
    dataset = IndexDataset(size, column)
    dm = D9DDataModule(
        dataset, sort_key="length", global_batch_tokens=64 * 8192, microbatch_tokens=8192,
        padding_free=padding_free, sort_buffer_size=16384, pad_to_multiple_of=1, pin_memory=False,
    )  # fmt: skip
    before = process_kib("VmRSS")
    reset_peak_rss()
    began = time.perf_counter()
    dm.setup("fit")
    set_up = time.perf_counter() - began
    peak = process_kib("VmHWM") - before
    began = time.perf_counter()
    dm.plan.epoch(1)
    return {
        "setup_s": set_up,
        "epoch_s": time.perf_counter() - began,
        "peak_mb": peak / 1024,
        "steps": dm.steps_in_epoch(0),
        "fill": dm.plan.describe(0)["fill"],
    }


def planning(size: int, in_process: bool = False) -> list:
    print(f"\nplanning {size:,} samples (log-normal lengths, median 200, max 4096; microbatch_tokens 8192, P = 64)")
    print(f"{'mode':>13} {'setup s':>8} {'epoch s':>8} {'peak MB':>8} {'steps':>7} {'fill':>8}")
    verdicts = []
    for padding_free in (False, True):
        if in_process:  # a smoke test: this process's peak memory, reset before the set-up, stands for a fresh one's
            figures = plan_child(size, padding_free)
        else:
            done = subprocess.run(
                [sys.executable, __file__, "--plan-child", str(size), str(int(padding_free))],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).parent,
            )
            figures = json.loads(done.stdout.strip().splitlines()[-1])
        mode = "padding-free" if padding_free else "padded"
        print(
            f"{mode:>13} {figures['setup_s']:>8.2f} {figures['epoch_s']:>8.2f} {figures['peak_mb']:>8.1f} "
            f"{figures['steps']:>7,} {figures['fill']:>8.2%}"
        )
        verdicts.append(
            (
                figures["setup_s"] <= PLAN_SECONDS,
                f"{mode} setup at {size:.0e} = {figures['setup_s']:.2f} s (target <= 10 s)",
            )
        )
        verdicts.append(
            (
                figures["peak_mb"] <= PLAN_MB,
                f"{mode} setup memory at {size:.0e} = {figures['peak_mb']:.0f} MB (target <= 200 MB)",
            )
        )
    return verdicts


# ---------------------------------------------------------------------------------------------- demo tokens/s
def demo_throughput(steps: int, rounds: int) -> None:
    """Real tokens/s of the demo model per mode, the modes interleaved in rounds (the machine's load drifts)."""
    import lightning.pytorch as pl

    from lightning_d9d import TextDataModule
    from lightning_d9d.demo.model import TinyGPT

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.started: float | None = None
            self.tokens = 0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 1 and self.started is None:
                self.started = time.perf_counter()  # from the second step: no start-up in the figure
            if self.started is not None:
                mask = getattr(batch, "attention_mask", None)
                self.tokens += int(mask.sum()) if mask is not None else batch.input_ids.numel()

    settings = {
        "sample counts (G=32, m=8)": {"global_batch_size": 32, "microbatch_size": 8},
        "budget, padded": {"global_batch_tokens": 4096, "microbatch_tokens": 1024},
        "budget, padding-free": {"global_batch_tokens": 4096, "microbatch_tokens": 1024, "padding_free": True},
    }
    print(
        f"\ndemo training on CPU ({torch.get_num_threads()} thread): TinyGPT width 128, 2 layers, max_length 96; "
        f"{rounds} round(s) of {steps} steps after the first per mode; real tokens/s"
    )
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, options in settings.items():
            dm = TextDataModule(dataset="demo", tokenizer="demo", max_length=96, sort_buffer_size=512,
                                num_workers=0, **options)  # fmt: skip
            torch.manual_seed(0)
            model = TinyGPT(vocab_size=4096, max_positions=96, width=128, num_layers=2, num_heads=4)
            clock = Clock()
            trainer = pl.Trainer(
                accelerator="cpu", max_steps=steps + 1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                limit_val_batches=0, callbacks=[clock],
            )  # fmt: skip
            trainer.fit(model, datamodule=dm)
            rates[name].append(clock.tokens / (time.perf_counter() - clock.started))
    for name, values in rates.items():
        print(f"{name:>28}: {np.median(values):>9,.0f} tokens/s (rounds: {', '.join(f'{v:,.0f}' for v in values)})")
    ratios = np.asarray(rates["budget, padding-free"]) / np.asarray(rates["budget, padded"])
    print(
        f"padding-free / padded tokens/s: median {np.median(ratios):.2f} of per-round ratios "
        f"(range {ratios.min():.2f}-{ratios.max():.2f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_DOCUMENTS} documents per corpus, 10⁵ samples planned in this process, "
        "one round of 1 timed training step",
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs per corpus column")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the training figures")
    parser.add_argument("--plan-child", nargs=2, type=int, metavar=("SIZE", "PADDING_FREE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_child:
        print(json.dumps(plan_child(args.plan_child[0], bool(args.plan_child[1]))))
        return 0
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    verdicts = []
    for name, load, max_tokens, budget, per_step, buffer in CORPORA:
        corpus = every_kth(load(), QUICK_DOCUMENTS) if args.quick else load()
        verdicts += table(name, TokenDataset(corpus, max_tokens), budget, per_step, buffer, args.epochs)
    verdicts += planning(QUICK_PLAN_SIZE, in_process=True) if args.quick else planning(PLAN_SIZE)
    demo_throughput(1 if args.quick else 20, 1 if args.quick else 3)
    print()
    print_verdicts(verdicts)
    print(f"\nelapsed {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
