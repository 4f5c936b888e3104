"""Provenance benchmark: which documents trained a random step of a 10⁵-step run, answered from the ledger's
records by a short replay, and what the records cost.

Run: ``python benchmarks/provenance.py`` (``--quick`` for a smoke test: a tiny corpus and a short run; its figures
are meaningless). The corpus is ``benchmarks/streaming.py``'s stdlib text and a byte-level BPE trained on it, with a
filled token cache. In this process, without a Trainer:

1. a run of ``--steps`` optimizer steps (10⁵; G 16 rows of seq_len 128, K 16, ``bestfit_split``), the ledger
   recording every stream every ``--every`` steps (500); the inputs of a few random steps are kept;
2. for each of those steps, a fresh DataModule (setup included) answers ``dm.provenance(step)``: seconds, and
   whether the pieces, re-tokenized from their documents, rebuild the step's inputs exactly;
3. the same query at the benchmarks' usual shape (G 64, seq_len 1024) for the step just before a record, the
   longest replay (``--every`` - 1 steps);
4. the records' size on disk, per 10⁵ steps.

Targets: a query <= 5 s with a filled token cache; the rebuilt inputs identical.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import print_verdicts
from streaming import stdlib_corpus

QUERY_TARGET_S = 5.0


def datamodule(files: str, tokenizer: str, root: Path, shape: tuple[int, int], steps: int, every: int):
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=shape[1], global_batch_size=shape[0], microbatch_size=shape[0],
        packing="bestfit_split", num_workers=0, steps_per_epoch=steps, bos_token="<|bos|>", pin_memory=False,
        token_cache=str(root / "cache"), provenance_dir=str(root / f"ledger-{shape[0]}x{shape[1]}"),
        provenance_every=every, num_streams=16,
    )  # fmt: skip
    dm.setup("fit")
    return dm


def train(dm, steps: int, keep: set[int]) -> tuple[dict[int, np.ndarray], float]:
    """``steps`` steps of one rank (one microbatch each); the inputs of the steps in ``keep``; seconds."""
    batches, kept, start = iter(dm.train_dataloader()), {}, time.perf_counter()
    for step in range(steps):
        batch = next(batches)
        if step in keep:
            kept[step] = batch.input_ids.numpy().copy()
    elapsed = time.perf_counter() - start
    dm.close_loaders()
    return kept, elapsed


def query(make, step: int, want: np.ndarray | None) -> tuple[float, float, bool]:
    """Seconds of setup, seconds of ``provenance(step)``, and whether its pieces rebuild ``want``."""
    start = time.perf_counter()
    dm = make()
    setup = time.perf_counter() - start
    start = time.perf_counter()
    # The run trained past its last record, which a fresh DataModule cannot know: the steps are asked for explicitly.
    pieces = dm.provenance(step, untrained=True)
    answered = time.perf_counter() - start
    if want is None:
        return setup, answered, True
    rows = np.full((dm.global_batch_size_at(step), dm.seq_len_at(step) + 1), dm.train_spec.sources[0].pad_id)
    documents: dict = {}
    for piece in pieces:
        key = (piece.source, piece.file, piece.row_group, piece.document_row)
        tokens = documents.setdefault(key, dm.document(piece)["tokens"])
        rows[piece.batch_row, piece.column : piece.column + piece.length] = tokens[piece.start : piece.stop]
    return setup, answered, bool(np.array_equal(rows[:, :-1], want))


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--queries", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny corpus and a short run (smoke test)")
    options = parser.parse_args()
    if options.quick:
        options.mb, options.steps, options.every, options.queries = 0.3, 300, 50, 2
    root = Path(tempfile.mkdtemp(prefix="provenance-"))
    try:
        texts, files, tokenizer, _ = stdlib_corpus(root, options.mb, 1024 if options.quick else 8192)
        small, usual = (16, 128), (16, 256) if options.quick else (64, 1024)
        fill = datamodule(files, tokenizer, root, usual, 10**9, 10**9)  # one pass fills the token cache
        train(fill, max(20, int(sum(map(len, texts)) / 3 / (usual[0] * usual[1]))), set())
        shutil.rmtree(root / f"ledger-{usual[0]}x{usual[1]}", ignore_errors=True)
        rng = random.Random(0)
        asked = sorted(rng.sample(range(options.every, options.steps), options.queries))
        long_run = datamodule(files, tokenizer, root, small, options.steps, options.every)
        kept, elapsed = train(long_run, options.steps, set(asked))
        ledger = root / f"ledger-{small[0]}x{small[1]}"
        per_1e5 = _size(ledger) / options.steps * 1e5
        print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} MB of text; a run of {options.steps} "
              f"steps (G {small[0]}, seq_len {small[1]}) in {elapsed:.0f} s, records every {options.every} steps: "
              f"{per_1e5 / 2**20:.1f} MiB per 10^5 steps")  # fmt: skip
        print(f"{'step':>8}{'setup s':>10}{'provenance s':>14}{'rebuilt':>9}")
        results = []
        for step in asked:
            setup, answered, same = query(
                lambda: datamodule(files, tokenizer, root, small, options.steps, options.every), step, kept[step]
            )
            results.append((setup, answered, same))
            print(f"{step:>8}{setup:>10.2f}{answered:>14.2f}{'yes' if same else 'NO':>9}")
        # The usual shape: records every --every steps, the step before the second record (the longest replay).
        steps = 2 * options.every
        usual_run = datamodule(files, tokenizer, root, usual, steps, options.every)
        kept_usual, _ = train(usual_run, steps, {steps - 1})
        setup, answered, same = query(
            lambda: datamodule(files, tokenizer, root, usual, steps, options.every), steps - 1, kept_usual[steps - 1]
        )
        usual_size = _size(root / f"ledger-{usual[0]}x{usual[1]}") / steps * 1e5
        print(f"G {usual[0]}, seq_len {usual[1]}: step {steps - 1} ({options.every - 1} steps of replay) setup "
              f"{setup:.2f} s, provenance {answered:.2f} s, rebuilt {'yes' if same else 'NO'}; records "
              f"{usual_size / 2**20:.1f} MiB per 10^5 steps")  # fmt: skip
        worst = max([answered] + [r[1] for r in results])
        print_verdicts([
            (worst <= QUERY_TARGET_S, f"provenance of a random step of a {options.steps}-step run, worst "
             f"{worst:.2f} s (target <= {QUERY_TARGET_S:.0f} s)"),
            (all(r[2] for r in results) and same, "the pieces rebuild every queried step's inputs (target: identical)"),
        ])  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
