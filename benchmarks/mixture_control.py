"""Mixture-controller benchmark: what a live controller costs a step of the demo model, and whether it moves shares.

Run: ``python benchmarks/mixture_control.py`` (a few minutes on 2 cores; ``--quick`` for a smoke test). Nothing is
downloaded: the demo tokenizer and corpus (``easy``: documents that repeat one of 4 sentences of the demo corpus, which
the model learns in a few steps; ``hard``: standard-library source), written to a temporary folder.

1. **Overhead**, side by side: the demo model (``TinyGPT``, returning its per-token losses) trained on the two
   sources under fixed equal weights and under ``LossProportional(every=5)``, alternately, ``--rounds`` fits of
   ``--steps`` steps each, in-process streams. Measured: the median step time of each (after the first 3 steps),
   and inside the controlled fits the training thread's CPU time in the controller's own work (the callback's
   per-microbatch sums and per-update decision, the journaled plan's lookups), as a share of those fits' step time
   (both configurations save a checkpoint half-way). Target: the own work
   < 0.5 % of a step (the side-by-side ratio is printed too; on shared cores it varies by more than that).
2. **Shares**: the controlled fit's journal: ``hard`` (higher loss) gains share from the first update on.
3. **Exact resume**: the controlled fit resumed from its checkpoint half-way trains the same rows in every step
   (digests of ``input_ids``) and ends with the same journal (target: identical).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from common import print_verdicts
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_d9d import PretrainingDataModule
from lightning_d9d.core.digest import digest
from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.datamodules.pretraining import mixture_control
from lightning_d9d.demo.model import TinyGPT, _Tokens
from lightning_d9d.demo_data.parquet import build_demo_parquet
from lightning_d9d.mixtures import LossProportional
from lightning_d9d.streaming.plans import mixture_journal

TARGET = 0.005


class LossReportingGPT(TinyGPT):
    """The demo model returning ``{"loss", "token_losses"}``: the same cross entropy, unreduced then summed."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        tokens = _Tokens.of(batch)  # packed rows: attention stays inside each document
        logits = self(tokens.input_ids, tokens.attention_mask, tokens.position_ids, tokens.document_ids)
        token_losses = F.cross_entropy(
            logits.flatten(0, 1).float(), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view_as(batch.targets)
        count = (batch.targets != IGNORE_INDEX).sum()
        return {"loss": self.step_loss(token_losses.sum(), count, batch.step_target_tokens),
                "token_losses": token_losses}  # fmt: skip


class Clock(pl.Callback):
    """Each optimizer step's end time and each step's row digests."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.rows: dict[int, list[str]] = {}
        self._step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.ends.append(time.perf_counter())
        self._step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, *_: Any) -> None:
        self.rows.setdefault(trainer.global_step, []).extend(digest(r.numpy().tobytes()) for r in batch.input_ids)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        if trainer.global_step != self._step:  # an optimizer step ended
            self._step = trainer.global_step
            self.ends.append(time.perf_counter())

    def step_times(self, skip: int = 3) -> list[float]:
        return [b - a for a, b in zip(self.ends[skip:], self.ends[skip + 1 :])]


class OwnWork:
    """CPU seconds the training thread spends in the controller's own code, summed (wrapped methods of the classes
    the DataModule uses): thread CPU time, so a wait for the interpreter lock held by the streams' reader threads,
    which any code of the training thread pays, is not counted as the controller's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        self.wrapped.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self.wrapped):
            setattr(owner, name, original)


def write_sources(root: Path) -> tuple[dict[str, str], str]:
    built = build_demo_parquet()
    sentences = [" ".join(sentence.split()[:12]) for sentence in
                 pq.read_table(built.files["prose"][0]).column("text").to_pylist()[:4]]  # fmt: skip
    easy = root / "easy"
    easy.mkdir(parents=True, exist_ok=True)
    documents = [(sentences[i % 4] + " ") * (3 + i % 5) for i in range(2000)]
    pq.write_table(pa.table({"text": documents}), easy / "easy.parquet", row_group_size=64)
    return {"easy": str(easy), "hard": built.files["code"]}, built.tokenizer_path


def fit(args: argparse.Namespace, files: dict, tokenizer: str, folder: Path, controller: Any, steps: int,
        ckpt_path: str | None = None, every_n: int | None = None) -> tuple[Clock, PretrainingDataModule]:  # fmt: skip
    dm = PretrainingDataModule(
        train_files=files, tokenizer=tokenizer, bos_token="<eos>", seq_len=args.seq_len,
        global_batch_size=args.global_batch, microbatch_size=8, num_streams=4, num_workers=0,
        packing="bestfit_split", steps_per_epoch=10_000, bestfit_buffer_size=64, mixture_controller=controller,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LossReportingGPT(vocab_size=4096, max_positions=args.seq_len, width=args.width, num_layers=2,
                             num_heads=4, warmup_steps=2)  # fmt: skip
    clock = Clock()
    callbacks: list[pl.Callback] = [clock]
    if every_n:
        callbacks.append(ModelCheckpoint(dirpath=str(folder), filename="{step}", every_n_train_steps=every_n,
                                         save_top_k=-1))  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                         enable_checkpointing=bool(every_n), default_root_dir=str(folder))  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return clock, dm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each fit")
    parser.add_argument("--rounds", type=int, default=2, help="fits of each configuration, alternating")
    parser.add_argument("--every", type=int, default=5, help="the controller's update interval")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 12 steps, one round, a narrower model")
    args = parser.parse_args()
    if args.quick:  # only proves the script runs and judges its targets: the timing figures are meaningless
        args.steps, args.rounds, args.every, args.width, args.global_batch = 12, 1, 3, 32, 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the two cores: one for the model, one for the tokenizer's pool
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)  # the smoke test runs other scripts in this interpreter after this one


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="mixture-control-") as tmp:
        root = Path(tmp)
        files, tokenizer = write_sources(root)
        fixed_steps: list[float] = []
        live_steps: list[float] = []
        own, journal, live_clock = OwnWork(), None, None
        for number in range(args.rounds):
            clock, _ = fit(args, files, tokenizer, root / f"fixed{number}", None, args.steps, every_n=args.steps // 2)
            fixed_steps += clock.step_times()
            before = own.seconds
            own.wrap(mixture_control.MixtureControlCallback, "on_train_batch_end")
            own.wrap(mixture_journal.JournaledPlan, "segment")
            try:
                controller = LossProportional(every=args.every)
                live_clock, dm = fit(args, files, tokenizer, root / f"live{number}", controller, args.steps,
                                     every_n=args.steps // 2)  # fmt: skip
            finally:
                own.restore()
            times = live_clock.step_times()
            live_steps += times
            journal = dm.mixture_journal
            share = (own.seconds - before) / (live_clock.ends[-1] - live_clock.ends[0])
            print(f"round {number}: own work {1000 * (own.seconds - before) / args.steps:.3f} ms/step, "
                  f"{100 * share:.3f} % of the controlled fit's steps")  # fmt: skip
        fixed_median, live_median = statistics.median(fixed_steps), statistics.median(live_steps)
        total_live = sum(live_steps)
        print(f"demo model width {args.width}, seq_len {args.seq_len}, global batch {args.global_batch}, "
              f"{args.steps} steps x {args.rounds} rounds, LossProportional(every={args.every})")  # fmt: skip
        print(f"{'configuration':<22} {'median step ms':>15}")
        print(f"{'fixed weights':<22} {1000 * fixed_median:>15.1f}")
        print(f"{'LossProportional':<22} {1000 * live_median:>15.1f}")
        # Not the controller's overhead: the controlled fit trains another mix, whose rows hold other documents.
        print(f"controlled / fixed median step time: {live_median / fixed_median:.3f}x (another mix of rows)")
        own_share = own.seconds / (total_live + 3 * args.rounds * live_median)  # the warm-up steps ran too
        print("journal (update step: hard share, easy / hard window loss):")
        for entry in journal:
            stats = entry["inputs"]["stats"]
            losses = [stats[n]["loss_sum"] / max(1, stats[n]["tokens"]) for n in ("easy", "hard")]
            shares = entry["shares"]
            hard = float(Fraction(shares["hard"])) if shares else None
            print(f"  {entry['update_step']:>4}: {hard if hard is None else round(hard, 4)}, "
                  f"{losses[0]:.3f} / {losses[1]:.3f}")  # fmt: skip
        hard_shares = [float(Fraction(e["shares"]["hard"])) for e in journal if e["shares"]]

        half = args.steps // 2
        ckpt = root / f"live{args.rounds - 1}" / f"step={half}.ckpt"
        resumed, rdm = fit(args, files, tokenizer, root / "resumed", LossProportional(every=args.every), args.steps,
                           ckpt_path=str(ckpt))  # fmt: skip
        same_rows = [resumed.rows.get(s) for s in range(half, args.steps)] == [
            live_clock.rows.get(s) for s in range(half, args.steps)
        ] and all(resumed.rows.get(s) for s in range(half, args.steps))
        print_verdicts([
            (own_share < TARGET, f"controller's own work / step time = {100 * own_share:.3f} % (target < "
                                 f"{100 * TARGET:.1f} %)"),
            (bool(hard_shares) and min(hard_shares) > 0.5, f"hard source's share at every update "
             f"{[round(s, 3) for s in hard_shares]} (target > 0.5: the higher-loss source gains share)"),
            (same_rows, f"resumed at step {half}: every step's rows as the uninterrupted run's (target: identical)"),
            (rdm.mixture_journal == journal, "resumed journal == uninterrupted journal (target: identical)"),
        ])  # fmt: skip


if __name__ == "__main__":
    main()
