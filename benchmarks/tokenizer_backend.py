"""Tokenizer backend benchmark: the first pass (no token cache) of the default install against
``tokenizer_backend="tokenizers"``, and against the bare fast tokenizer on the same texts.

Run: ``python benchmarks/tokenizer_backend.py`` (``--quick`` for a smoke test: a tiny corpus, concat only, seq_len
256, G 16, every measurement in this process, one round; its figures are meaningless). The corpus is the stdlib text
of ``benchmarks/streaming.py`` as one parquet file (row groups of 64 documents) and a byte-level BPE of 8,192 tokens
trained on it with the full byte alphabet (as released byte-level tokenizers have; one without it still gets the
same ids from the fast backend, whose batches holding an unknown byte fall back to ``tokenizers``). Measured in
``--rounds`` interleaved rounds (the order reversed every other round), each measurement in a fresh process:

1. per packing (``concat``, ``bestfit_split``), ``--workers`` DataLoader workers, K 16, seq_len 1024, G 64, m 8: useful
   tokens (document tokens in rows) per second over ``--steps`` steps (150: about 3 passes over the corpus, which
   the streams read again, tokenizing it again) after ``--warmup`` steps (70: past a fresh best-fit buffer's growth
   to full, the steady state of a long pass; a shorter window times the start), with
   ``tokenizer_backend="auto"`` (the default install) and ``"tokenizers"``; the rows of both checked identical
   (a digest of every batch read);
2. the bare fast tokenizer (fastokens ``encode_batch_flat``, batches of 128 documents as the streams call it, in one
   process, all cores) over the same texts, three times: tokens per second, BOS included (concat's useful tokens are
   all the tokens); and, as the ceiling of the pass's ratio to it, the same ``concat`` pass reading a filled token
   cache (nothing left to tokenize: a tokenizing pass does all of its work and more, so it cannot be faster);
3. ``setup("fit")`` without a cache and without ``steps_per_epoch`` (the sample estimate of one pass; with "auto"
   the backend's check on a sample of documents and the hostile texts included);
4. ``TextDataModule``'s tokenizing (its batched map over the same texts, max_length 2048, datasets' cache off).

Ratios are taken within a round; min / median / max printed. Targets: the default install >= 4x ``tokenizers`` for
concat and bestfit_split, >= 0.8x the bare fast tokenizer (concat: all tokens are useful); setup and TextDataModule's
tokenizing >= 3x faster. The guard's cost (``--guard-cost``, no target): in one process on one core, the CPU time
of the streams' encoding (``encode_documents`` with the fast backend, chunks of 128 documents) with the guard's
re-encoding by ``tokenizers`` against without it, 7 interleaved rounds (CPU time, so the machine's load counts less).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import in_child, print_verdicts

PASS_TARGET = 4.0
BARE_TARGET = 0.8
SETUP_TARGET = 3.0
TEXT_TARGET = 3.0
BOS = "<|bos|>"


def make_corpus(root: Path, mb: float) -> tuple[str, str, list[str]]:
    """``mb`` MB of stdlib text as parquet under ``root / "data"`` and a byte-level BPE with the full byte alphabet:
    ``(files, tokenizer path, texts)``."""
    from streaming import stdlib_texts, write_corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = stdlib_texts(mb)
    files = write_corpus(root / "data", texts, row_group_size=64)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=[BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tokenizer = str(root / "tokenizer.json")
    tok.save(tokenizer)
    return files, tokenizer, texts


def _datamodule(files: str, tokenizer: str, packing: str, backend: str, args: dict, cache: str | None, steps: int):
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=args["seq_len"], global_batch_size=args["global_batch"],
        microbatch_size=args["microbatch"], packing=packing, num_workers=args["workers"], num_streams=args["streams"],
        steps_per_epoch=steps, bos_token=BOS, pin_memory=False, tokenizer_backend=backend, token_cache=cache,
    )  # fmt: skip
    dm.setup("fit")
    return dm


def _fill_cache(conn, files: str, tokenizer: str, cache: str, args: dict, steps: int) -> None:
    """In a fresh process: ``steps`` steps of concat into an empty token cache (enough for every stream to read all its
    units), the units cached."""
    multiprocessing.set_start_method(None, force=True)
    dm = _datamodule(files, tokenizer, "concat", "auto", args, cache, steps)
    for _ in dm.train_dataloader():
        pass
    units = dm.train_spec.sources[0].units
    covered = dm.train_spec.sources[0].cache.coverage(units).cached
    dm.teardown("fit")
    conn.send((covered, len(units)))


def _pass(conn, files: str, tokenizer: str, packing: str, backend: str, args: dict, cache: str | None = None) -> None:
    """In a fresh process: useful tokens/s over ``args["steps"]`` steps after ``args["warmup"]``, the backend used,
    and a digest of every batch read (``cache``: reading that filled token cache instead of tokenizing)."""
    multiprocessing.set_start_method(None, force=True)  # workers start as a training script's do
    dm = _datamodule(files, tokenizer, packing, backend, args, cache, args["warmup"] + args["steps"])
    per_step = dm.microbatches_per_step
    digest, start, before = hashlib.sha256(), time.perf_counter(), 0
    for i, batch in enumerate(dm.train_dataloader()):
        digest.update(batch.input_ids.numpy().tobytes())
        if i == args["warmup"] * per_step - 1:
            start, before = time.perf_counter(), dm.stream_stats()["emitted"]
    elapsed = time.perf_counter() - start
    useful = dm.stream_stats()["emitted"] - before
    used = dm.tokenizer_backend_in_use
    dm.teardown("fit")
    conn.send({"tokens_per_s": useful / elapsed, "digest": digest.hexdigest(), "backend": used[0]})


def _bare(conn, tokenizer: str, texts: list[str]) -> None:
    """In a fresh process: the fast tokenizer alone over ``texts`` in batches of 128, three times (as the passes read
    the corpus about as often), tokens/s (BOS counted)."""
    import fastokens

    tok = fastokens.Tokenizer.from_file(tokenizer)
    tok.encode_batch_flat(texts[:128])  # untimed: first call
    start, tokens = time.perf_counter(), 0
    for _ in range(3):
        for i in range(0, len(texts), 128):
            batch = texts[i : i + 128]
            tokens += len(tok.encode_batch_flat(batch)[0]) // 4 + len(batch)
    conn.send(tokens / (time.perf_counter() - start))


def _encodings(tokenizer: str, texts: list[str]) -> list:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer).encode_batch_fast(texts)


def _guard_cost(conn, tokenizer: str, texts: list[str], rounds: int) -> None:
    """In a fresh process on one core: per round, the CPU seconds of encoding ``texts`` in chunks of 128 with the
    guard over those without it, minus one."""
    os.environ["FASTOKENS_BPE_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import numpy as np

    from lightning_d9d.streaming.tokens.tokenize import encode_documents
    from lightning_d9d.tokenization.backends import REFERENCE, BackendGuard, backend_for

    tokenizer_json = Path(tokenizer).read_text()
    fast, reference = backend_for("fastokens", tokenizer_json), backend_for(REFERENCE, tokenizer_json)
    guard = BackendGuard("fastokens", tokenizer_json)
    chunks = [texts[i : i + 128] for i in range(0, len(texts), 128)]

    def encode(guarded: bool) -> float:
        start = time.process_time()
        for group, chunk in enumerate(chunks):
            encoded = encode_documents(fast, chunk)
            picked = guard.picks(group, np.arange(len(chunk))).tolist() if guarded else []
            if picked:
                guard.check([chunk[i] for i in picked], [encoded[i].ids for i in picked], ["a document"] * len(picked),
                            lambda chosen: encode_documents(reference, chosen))  # fmt: skip
        return time.process_time() - start

    costs = []
    for r in range(rounds):
        if r % 2 == 0:
            off = encode(False)
            on = encode(True)
        else:
            on = encode(True)
            off = encode(False)
        costs.append(on / off - 1)
    conn.send(costs)


def _setup(conn, files: str, tokenizer: str, backend: str, args: dict) -> None:
    """In a fresh process: seconds of ``setup("fit")`` sizing the epoch from the sample estimate (no cache)."""
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=args["seq_len"], global_batch_size=args["global_batch"],
        microbatch_size=args["microbatch"], num_workers=0, num_streams=args["streams"], bos_token=BOS,
        tokenizer_backend=backend,
    )  # fmt: skip
    start = time.perf_counter()
    dm.setup("fit")
    conn.send(time.perf_counter() - start)


def _text_map(conn, files: str, tokenizer: str, backend: str) -> None:
    """In a fresh process: seconds of TextDataModule's tokenizing map over the corpus (datasets' cache off)."""
    import datasets

    from lightning_d9d.text.tokenize import _load_text_split, _tokenize_cached

    datasets.disable_caching()
    datasets.disable_progress_bars()
    raw = _load_text_split(files, "train", "text", None, tempfile.mkdtemp(), "corpus")
    start = time.perf_counter()
    _tokenize_cached(raw, tokenizer, "text", 2048, None, "corpus", "train", backend)
    conn.send(time.perf_counter() - start)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=12.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--packings", default="concat,bestfit_split")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="steps timed per pass measurement")
    parser.add_argument("--warmup", type=int, default=70, help="steps read before the timed ones")
    parser.add_argument("--guard-cost", action="store_true", help="also concat with the guard off")
    parser.add_argument("--quick", action="store_true", help="a tiny corpus, concat, in process (smoke test)")
    options = parser.parse_args()
    inline = options.quick
    args = {"seq_len": 1024, "global_batch": 64, "microbatch": 8, "streams": 16, "workers": options.workers,
            "steps": options.steps, "warmup": options.warmup}  # fmt: skip
    packings, rounds, mb = options.packings.split(","), options.rounds, options.mb
    if options.quick:
        args.update(seq_len=256, global_batch=16, microbatch=8, streams=4, workers=0, steps=3, warmup=1)
        packings, rounds, mb = ["concat"], 1, 0.1
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as root:
        files, tokenizer, texts = make_corpus(Path(root), mb)
        cache = str(Path(root) / "token_cache")
        corpus_tokens = sum(len(ids) for ids in _encodings(tokenizer, texts))
        fill_steps = 2 * (corpus_tokens // (args["global_batch"] * args["seq_len"]) + 1)  # two passes' worth
        covered, units = in_child(_fill_cache, files, tokenizer, cache, args, fill_steps, inline=inline)
        print(f"corpus: {len(texts)} documents, {corpus_tokens / 1e6:.2f} M tokens; token cache for the ceiling filled "
              f"({covered} of {units} units)")  # fmt: skip
        pass_runs: dict[tuple[str, str], list[dict]] = {}
        ceilings: list[dict] = []
        bare, setups, maps = [], {"auto": [], "tokenizers": []}, {"auto": [], "tokenizers": []}
        configs = [(packing, backend) for packing in packings for backend in ("auto", "tokenizers")]
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for packing, backend in order:
                run = in_child(_pass, files, tokenizer, packing, backend, args, inline=inline)
                pass_runs.setdefault((packing, backend), []).append(run)
            bare.append(in_child(_bare, tokenizer, texts, inline=inline))
            ceilings.append(in_child(_pass, files, tokenizer, "concat", "auto", args, cache, inline=inline))
            for backend in ("auto", "tokenizers") if r % 2 == 0 else ("tokenizers", "auto"):
                setups[backend].append(in_child(_setup, files, tokenizer, backend, args, inline=inline))
                maps[backend].append(in_child(_text_map, files, tokenizer, backend, inline=inline))
        guard_costs = in_child(_guard_cost, tokenizer, texts, 7, inline=inline) if options.guard_cost else None
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    verdicts = []
    print(f"\n{'measurement':44} {'min / median / max':>24}")
    for packing in packings:
        fast, slow = pass_runs[(packing, "auto")], pass_runs[(packing, "tokenizers")]
        used = {run["backend"] for run in fast}
        print(f"{packing + ', default install M tok/s':44} {spread([x['tokens_per_s'] / 1e6 for x in fast]):>24}"
              f"  (backend {', '.join(sorted(used))})")  # fmt: skip
        print(f"{packing + ', tokenizers M tok/s':44} {spread([x['tokens_per_s'] / 1e6 for x in slow]):>24}")
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(fast, slow)]
        print(f"{packing + ', default / tokenizers':44} {spread(ratios):>24}")
        same = all(a["digest"] == b["digest"] for a, b in zip(fast, slow))
        verdicts.append((same, f"{packing}: rows identical under the default install and tokenizers "
                               f"(target: identical)"))  # fmt: skip
        median = statistics.median(ratios)
        verdicts.append((median >= PASS_TARGET, f"{packing}: default install / tokenizers tokenizing pass, median "
                                                f"{median:.2f}x (target >= {PASS_TARGET}x)"))  # fmt: skip
        to_bare = [a["tokens_per_s"] / b for a, b in zip(fast, bare)]
        print(f"{packing + ', default / bare fast tokenizer':44} {spread(to_bare):>24}")
        if packing == "concat":
            ceiling = [a["tokens_per_s"] / b for a, b in zip(ceilings, bare)]
            print(f"{'concat, token cache M tok/s (no tokenizing)':44} "
                  f"{spread([x['tokens_per_s'] / 1e6 for x in ceilings]):>24}")  # fmt: skip
            print(f"{'ceiling: token cache / bare fast tokenizer':44} {spread(ceiling):>24}")
            median, most = statistics.median(to_bare), statistics.median(ceiling)
            verdicts.append((median >= BARE_TARGET, f"concat: default install / bare fast tokenizer, median "
                                                    f"{median:.2f}x (target >= {BARE_TARGET}x; the same pass with "
                                                    f"nothing to tokenize reaches {most:.2f}x)"))  # fmt: skip
            same = all(a["digest"] == c["digest"] for a, c in zip(fast, ceilings))
            verdicts.append((same, "concat: rows identical tokenizing and reading the token cache (target: identical)"))
    print(f"{'bare fast tokenizer M tok/s':44} {spread([x / 1e6 for x in bare]):>24}")
    if guard_costs is not None:
        print(f"{'guard cost, encoding CPU (on / off - 1)':44} {spread(guard_costs):>24}")
    for what, runs, target in (("setup without a cache", setups, SETUP_TARGET),
                               ("TextDataModule tokenizing", maps, TEXT_TARGET)):  # fmt: skip
        print(f"{what + ', default install s':44} {spread(runs['auto']):>24}")
        print(f"{what + ', tokenizers s':44} {spread(runs['tokenizers']):>24}")
        ratios = [b / a for a, b in zip(runs["auto"], runs["tokenizers"])]
        print(f"{what + ', tokenizers / default':44} {spread(ratios):>24}")
        median = statistics.median(ratios)
        verdicts.append((median >= target, f"{what}: default install {median:.2f}x faster than tokenizers, median "
                                           f"(target >= {target}x)"))  # fmt: skip
    print()
    print_verdicts(verdicts)


if __name__ == "__main__":
    main()
