"""Setup benchmark: construct + ``setup("fit")`` of a PretrainingDataModule with a filled token cache, against the same
without a cache.

Run: ``python benchmarks/setup_time.py`` (``--quick`` for a smoke test: a tiny corpus, ``concat``, one round, all in
this process; its figures are meaningless). The corpus is the one ``benchmarks/cached_pass.py`` reads: the stdlib
text of ``benchmarks/streaming.py`` as one parquet file in row groups of 64 documents, and a byte-level BPE of 8,192
tokens trained on it (K 16, seq_len 1024, G 64, m 8, 2 workers). A token cache is filled first (a DataModule reads
until the cache holds every unit). Then, for each packing, every configuration is set up in a fresh spawned process
(imports not timed; the clock runs from the constructor to the end of ``setup("fit")``), one after another in each
of ``--rounds`` rounds, their order rotated by one every round:

* ``no cache``: the pass estimated from a tokenized sample (about 8 Mi characters);
* ``filled cache``: the pass counted from the cache's count record (written by the first count);
* ``first count``: the same cache with its count record deleted: the entries' headers are read, the record written;
* ``epoch given``: ``steps_per_epoch`` given, no cache: nothing counted.

Figures: min / median / max seconds over the rounds, and the ratio filled cache / no cache per round (min / median
/ max). Targets: the filled cache's setup <= 0.1x the one without a cache (median ratio) and <= 0.5 s (median).
Checks: with the filled cache no document is tokenized and every unit is counted (the pass's tokens are exact), and
every round of a configuration sizes the same epoch.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import in_child, print_verdicts
from streaming import stdlib_corpus

RATIO_TARGET, SECONDS_TARGET = 0.1, 0.5
CONFIGURATIONS = ("no cache", "filled cache", "first count", "epoch given")


def _options(args: dict, packing: str) -> dict:
    return dict(seq_len=args["seq_len"], global_batch_size=args["global_batch"], microbatch_size=args["microbatch"],
                num_workers=args["workers"], packing=packing, bos_token="<|bos|>", pin_memory=False)  # fmt: skip


def _fill(conn, files: str, tokenizer: str, cache: str, args: dict) -> None:
    """In a fresh process: read with ``cache`` until it holds every unit; the batches read."""
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(files, tokenizer, token_cache=cache, steps_per_epoch=10**6,
                               **_options(args, "concat"))  # fmt: skip
    dm.setup("fit")
    source = dm.train_spec.sources[0]
    wanted, read = int((~source.index.text_free[source.units.group]).sum()), 0
    batches = iter(dm.train_dataloader())
    while True:
        try:
            if source.cache.coverage(source.units).cached == wanted:
                break
        except OSError:  # a folder being made by a store meanwhile
            pass
        for _ in range(8):
            next(batches)
        read += 8
    dm.teardown("fit")
    conn.send(read)


def _setup(conn, files: str, tokenizer: str, packing: str, configuration: str, cache: str, args: dict) -> None:
    """In a fresh process: seconds from the constructor to the end of ``setup("fit")``, the epoch it sized, the
    documents it tokenized (every call of the tokenizing function, counted) and whether its pass was exact."""
    from lightning_d9d import PretrainingDataModule
    from lightning_d9d.streaming.streams import estimate

    tokenized = []
    encode = estimate.encode_documents
    estimate.encode_documents = lambda tok, texts: tokenized.extend(texts) or encode(tok, texts)
    if configuration == "first count":
        for record in Path(cache).glob("*/counts"):
            shutil.rmtree(record)
    uses_cache = configuration in ("filled cache", "first count")
    start = time.perf_counter()
    dm = PretrainingDataModule(files, tokenizer, token_cache=cache if uses_cache else None,
                               steps_per_epoch=1000 if configuration == "epoch given" else None,
                               **_options(args, packing))  # fmt: skip
    dm.setup("fit")
    seconds = time.perf_counter() - start
    exact = dm.corpus.train._counts is not None and dm.corpus.train.exact
    estimate.encode_documents = encode
    conn.send({"seconds": seconds, "steps": dm.steps_per_epoch, "tokenized": len(tokenized), "exact": exact})


def measure(files: str, tokenizer: str, cache: str, packing: str, args: dict, rounds: int, inline: bool) -> dict:
    """``{configuration: [run of each round]}``, the configurations interleaved, their order rotated every round."""
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
    in_child(_setup, files, tokenizer, packing, "first count", cache, args, inline=inline)  # writes the record
    for round_ in range(rounds):
        order = CONFIGURATIONS[round_ % len(CONFIGURATIONS) :] + CONFIGURATIONS[: round_ % len(CONFIGURATIONS)]
        for name in order:
            runs[name].append(in_child(_setup, files, tokenizer, packing, name, cache, args, inline=inline))
    return runs


def _spread(values: list[float], unit: str = "s") -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} {unit}"


def report(packing: str, runs: dict) -> list[tuple[bool, str]]:
    seconds = {name: [run["seconds"] for run in runs[name]] for name in CONFIGURATIONS}
    for name in CONFIGURATIONS:
        print(f"{packing:<15}{name:<15}{_spread(seconds[name]):>28}{runs[name][0]['steps']:>10}"
              f"{sum(run['tokenized'] for run in runs[name]) // len(runs[name]):>14,}")  # fmt: skip
    ratios = [f / n for f, n in zip(seconds["filled cache"], seconds["no cache"])]
    first = [f / n for f, n in zip(seconds["first count"], seconds["no cache"])]
    print(f"  filled cache / no cache per round: {_spread(ratios, 'x')}; first count / no cache: {_spread(first, 'x')}")
    filled, median = runs["filled cache"], statistics.median(seconds["filled cache"])
    ratio = statistics.median(ratios)
    same = all(len({run["steps"] for run in runs[name]}) == 1 for name in CONFIGURATIONS)
    return [
        (ratio <= RATIO_TARGET, f"{packing}: setup with a filled token cache / without a cache {ratio:.3f}x (median of "
         f"{len(ratios)} rounds; target <= {RATIO_TARGET}x)"),
        (median <= SECONDS_TARGET, f"{packing}: setup with a filled token cache {median:.3f} s (median; target <= "
         f"{SECONDS_TARGET} s)"),
        (all(run["tokenized"] == 0 and run["exact"] for run in filled + runs["first count"]),
         f"{packing}: with a filled cache nothing is tokenized and every unit is counted (target: exact)"),
        (same, f"{packing}: every round of a configuration sizes the same epoch (target: identical)"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--packings", default="concat,bestfit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny corpus, concat, one round, in this process")
    options = parser.parse_args()
    args = {"seq_len": 1024, "global_batch": 64, "microbatch": 8, "workers": options.workers}
    if options.quick:
        options.mb, options.packings, options.rounds = 0.1, "concat", 1
        args.update(seq_len=256, global_batch=16, workers=0)
    root = Path(tempfile.mkdtemp(prefix="setup-time-"))
    try:
        texts, files, tokenizer, _ = stdlib_corpus(root, options.mb, 1024 if options.quick else 8192)
        cache = str(root / "cache")
        began = time.perf_counter()
        batches = in_child(_fill, files, tokenizer, cache, args, inline=options.quick)
        print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} MB of text; token cache filled in "
              f"{time.perf_counter() - began:.1f} s ({batches} batches); {options.rounds} round(s), each setup in a "
              f"fresh process")  # fmt: skip
        print(f"{'packing':<15}{'setup':<15}{'min / median / max':>28}{'epoch':>10}{'tokenized':>14}")
        verdicts = []
        for packing in options.packings.split(","):
            runs = measure(files, tokenizer, cache, packing, args, options.rounds, inline=options.quick)
            verdicts += report(packing, runs)
        print_verdicts(verdicts)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
