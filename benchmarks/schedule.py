"""Schedule benchmark: a run whose global batch size and seq_len change, at each of its shapes, against fixed-shape
runs at that shape; and the first batch of a resume at a boundary against a fixed-shape resume.

Run: ``python benchmarks/schedule.py`` (``--quick`` for a smoke test: a tiny corpus, short phases, in this process;
its figures are meaningless). The corpus is ``benchmarks/streaming.py``'s stdlib text as one parquet file and a
byte-level BPE trained on it, read through a filled token cache (so the figures are the loader's own work, not the
tokenizer's), ``--workers`` DataLoader workers, K 16, m 8. The scheduled run has three phases of about the same
tokens each: (G 32, seq_len 512), (G 64, seq_len 512) from a batch ramp, (G 64, seq_len 1024) from a length change.
Each fixed-shape run trains one of those shapes from a fresh start; its first steps (best-fit buffers filling) are
not timed, while the scheduled run's phases are timed whole (the carry-over at their start included).

Each round runs, in fresh processes, the scheduled run and the three fixed ones in an order that alternates
between rounds; the figures are min / median / max over the rounds of the per-round ratio. Targets: useful tokens/s
of the scheduled run at each shape >= 0.95x the fixed-shape run's (``concat`` and ``bestfit_split``); the first
batch of a resume at the seq_len boundary no slower than a fixed-shape resume (ratio <= 1, median); the resumed
step's rows identical to the uninterrupted run's; padding at each shape within 0.25 percentage points of the
fixed-shape run's (the rows are the same every round, so padding is reported once).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import in_child, print_verdicts
from streaming import stdlib_corpus

THROUGHPUT_TARGET = 0.95
PADDING_MARGIN = 0.0025  # the scheduled run's padding at a shape may exceed the fixed run's by this much
RESUME_TARGET = 1.0
SHAPES = [(32, 512), (64, 512), (64, 1024)]  # (G, seq_len) of the three phases
WARMUP_ROWS_PER_STREAM = 256  # a fresh best-fit buffer is full after about 248 rows per stream


def _datamodule(files: str, tokenizer: str, packing: str, cache: str, sizes, seq_lens, steps: int, args: dict):
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=seq_lens, global_batch_size=sizes, microbatch_size=8, packing=packing,
        num_workers=args["workers"], steps_per_epoch=steps, bos_token="<|bos|>", pin_memory=False, token_cache=cache,
        num_streams=16,
    )  # fmt: skip
    dm.setup("fit")
    return dm


def _run(conn, files: str, tokenizer: str, packing: str, cache: str, schedule: dict, args: dict) -> None:
    """In a fresh process: the steps of ``schedule``; per timed stretch ``(first, stop)``, useful tokens/s; the state
    at ``schedule["save_at"]`` and a digest of the rows of that step."""
    multiprocessing.set_start_method(None, force=True)  # workers start as a training script's do
    dm = _datamodule(files, tokenizer, packing, cache, schedule["sizes"], schedule["seq_lens"], schedule["steps"],
                     args)  # fmt: skip
    batches = iter(dm.train_dataloader())
    marks: dict[int, tuple[float, int, int]] = {}
    wanted = {step for stretch in schedule["timed"] for step in stretch}
    state, digest = None, hashlib.sha256()
    for step in range(schedule["steps"]):
        if step in wanted:
            stats = dm.stream_stats()
            marks[step] = (time.perf_counter(), stats["emitted"], stats["padding"])
        if step == schedule["save_at"]:
            state = dm.state_dict()
        for _ in range(dm.microbatches_at(step)):
            batch = next(batches)
            if step == schedule["save_at"]:
                digest.update(batch.input_ids.numpy().tobytes())
    stats = dm.stream_stats()
    marks[schedule["steps"]] = (time.perf_counter(), stats["emitted"], stats["padding"])
    dm.teardown("fit")
    rates, padding = [], []
    for first, stop in schedule["timed"]:
        (t0, e0, p0), (t1, e1, p1) = marks[first], marks[stop]
        rates.append((e1 - e0) / (t1 - t0))
        padding.append((p1 - p0) / max(1, (e1 - e0) + (p1 - p0)))
    saved = io.BytesIO()
    torch.save(state, saved)  # bytes: tensors through a pipe would outlive this process as shared memory
    conn.send({"rates": rates, "padding": padding, "state": saved.getvalue(), "digest": digest.hexdigest()})


def _resume(conn, files: str, tokenizer: str, packing: str, cache: str, schedule: dict, state: bytes,
            args: dict) -> None:  # fmt: skip
    """In a fresh process: a DataModule resumed from ``state``: seconds to its first batch, a digest of its step."""
    multiprocessing.set_start_method(None, force=True)
    dm = _datamodule(files, tokenizer, packing, cache, schedule["sizes"], schedule["seq_lens"], schedule["steps"],
                     args)  # fmt: skip
    dm.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    start = time.perf_counter()
    batches = iter(dm.train_dataloader())
    first = next(batches)
    elapsed = time.perf_counter() - start
    digest = hashlib.sha256(first.input_ids.numpy().tobytes())
    for _ in range(dm.microbatches_at(schedule["save_at"]) - 1):
        digest.update(next(batches).input_ids.numpy().tobytes())
    dm.teardown("fit")
    conn.send({"seconds": elapsed, "digest": digest.hexdigest()})


def schedules(phase_tokens: float, warmup_rows: int = WARMUP_ROWS_PER_STREAM) -> tuple[dict, list[dict]]:
    """The scheduled run (three phases of about ``phase_tokens`` positions each) and one fixed run per shape, whose
    first ``warmup_rows`` rows per stream are not timed."""
    lengths = [max(8, round(phase_tokens / (g * n))) for g, n in SHAPES]
    lengths[0] += _warmup(SHAPES[0][0], warmup_rows)  # the scheduled run's first steps fill its buffers too
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    total = sum(lengths)
    scheduled = {
        "sizes": [[starts[0], SHAPES[0][0]], [starts[1], SHAPES[1][0]]],
        "seq_lens": [[starts[0], SHAPES[0][1]], [starts[2], SHAPES[2][1]]],
        "steps": total,
        "timed": [(_warmup(SHAPES[0][0], warmup_rows), starts[1]), (starts[1], starts[2]), (starts[2], total)],
        "save_at": starts[2],  # the seq_len boundary
    }
    fixed = []
    for (g, n), length in zip(SHAPES, lengths):
        warmup = _warmup(g, warmup_rows)
        fixed.append({"sizes": g, "seq_lens": n, "steps": warmup + length, "timed": [(warmup, warmup + length)],
                      "save_at": warmup + length // 2})  # fmt: skip
    return scheduled, fixed


def _warmup(global_batch_size: int, rows_per_stream: int) -> int:
    return -(-rows_per_stream // (global_batch_size // 16))


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def _round(files: str, tokenizer: str, packing: str, cache: str, scheduled: dict, fixed: list[dict], args: dict,
           flip: bool, inline: bool) -> tuple[list[float], float, bool, list[tuple[float, float]]]:  # fmt: skip
    """One round: per shape, scheduled / fixed useful tokens/s; scheduled / fixed resume seconds; rows identical;
    per shape, the scheduled and the fixed run's padding."""
    runs = [("scheduled", scheduled), *((f"fixed{i}", f) for i, f in enumerate(fixed))]
    results = {}
    for name, schedule in reversed(runs) if flip else runs:
        results[name] = in_child(_run, files, tokenizer, packing, cache, schedule, args, inline=inline)
    ratios = [results["scheduled"]["rates"][i] / results[f"fixed{i}"]["rates"][0] for i in range(len(SHAPES))]
    at = in_child(_resume, files, tokenizer, packing, cache, scheduled, results["scheduled"]["state"], args,
                  inline=inline)  # fmt: skip
    plain = in_child(_resume, files, tokenizer, packing, cache, fixed[2], results["fixed2"]["state"], args,
                     inline=inline)  # fmt: skip
    padding = [(results["scheduled"]["padding"][i], results[f"fixed{i}"]["padding"][0]) for i in range(len(SHAPES))]
    return ratios, at["seconds"] / plain["seconds"], at["digest"] == results["scheduled"]["digest"], padding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--phase-tokens",
        type=float,
        default=36e6,
        help="row positions per phase (a phase of a few seconds at least: shorter ones are noise)",
    )
    parser.add_argument("--packings", default="concat,bestfit_split")
    parser.add_argument("--quick", action="store_true", help="a tiny corpus, short phases, in process (smoke test)")
    options = parser.parse_args()
    if options.quick:
        options.mb, options.rounds, options.phase_tokens, options.packings = 0.3, 1, 2e5, "bestfit_split"
    args = {"workers": options.workers}
    root = Path(tempfile.mkdtemp(prefix="schedule-"))
    try:
        texts, files, tokenizer, _ = stdlib_corpus(root, options.mb, 1024 if options.quick else 8192)
        scheduled, fixed = schedules(options.phase_tokens, 8 if options.quick else WARMUP_ROWS_PER_STREAM)
        print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} MB of text; phases (G, seq_len) "
              f"{SHAPES} of {[b - a for a, b in scheduled['timed'][1:]]} steps after the first; {options.workers} "
              f"workers, {options.rounds} rounds; figures: min / median / max over the rounds")  # fmt: skip
        print(f"{'packing':<15}{'shape':<14}{'scheduled / fixed tok/s':>26}{'padding scheduled':>20}{'fixed':>8}")
        verdicts = []
        for packing in options.packings.split(","):
            cache = str(root / f"cache-{packing}")
            fill = {**fixed[2], "steps": fixed[2]["steps"] * 2, "timed": [(0, 1)], "save_at": 0}
            in_child(_run, files, tokenizer, packing, cache, fill, args, inline=options.quick)  # fills the cache
            rounds = [_round(files, tokenizer, packing, cache, scheduled, fixed, args, bool(r % 2), options.quick)
                      for r in range(options.rounds)]  # fmt: skip
            for i, shape in enumerate(SHAPES):
                ratios = [ratios[i] for ratios, _, _, _ in rounds]
                scheduled_pad, fixed_pad = rounds[0][3][i]  # the rows are the same every round
                print(f"{packing:<15}{shape!s:<14}{_spread(ratios):>26}{100 * scheduled_pad:>19.2f}%"
                      f"{100 * fixed_pad:>7.2f}%")  # fmt: skip
                verdicts.append((scheduled_pad <= fixed_pad + PADDING_MARGIN,
                                 f"{packing} at {shape}: padding {100 * scheduled_pad:.2f} % scheduled, "
                                 f"{100 * fixed_pad:.2f} % at that fixed shape (target <= fixed + "
                                 f"{100 * PADDING_MARGIN:.2f} pp)"))  # fmt: skip
                verdicts.append((statistics.median(ratios) >= THROUGHPUT_TARGET,
                                 f"{packing} at {shape}: scheduled / fixed-shape useful tokens/s "
                                 f"{statistics.median(ratios):.3f} (target >= {THROUGHPUT_TARGET})"))  # fmt: skip
            resume = [ratio for _, ratio, _, _ in rounds]
            print(f"{packing:<15}{'resume':<14}{_spread(resume):>26}  (first batch at the boundary / fixed-shape)")
            verdicts += [
                (statistics.median(resume) <= RESUME_TARGET, f"{packing}: first batch of a resume at the seq_len "
                 f"boundary / of a fixed-shape resume {statistics.median(resume):.3f} (target <= {RESUME_TARGET})"),
                (all(same for _, _, same, _ in rounds), f"{packing}: the resumed boundary step's rows equal the "
                 "uninterrupted run's (target: identical)"),
            ]  # fmt: skip
        print_verdicts(verdicts)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
