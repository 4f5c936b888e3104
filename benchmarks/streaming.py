"""Streaming benchmark: PretrainingDataModule's token streams vs the bare tokenizer and the reference loaders.

Run: ``python benchmarks/streaming.py`` (~8 min on 2 cores; ``--help`` for sizes, ``--quick`` for a smoke
test). Nothing is downloaded: the corpus is the Python standard library's own ``.py`` sources plus the
``pydoc_data`` help topics, written to parquet here, and the tokenizer is a byte-level BPE trained here on that
text.

Two corpora from the same text: *long* (one document per file/topic, many longer than a row) and *short* (the
same text split at blank lines). For each, side by side in one process, best of ``--runs`` runs, each timed
from its first batch for ``--long-seconds`` / ``--seconds`` (the in-process stream's tokenizer batch of 128 long
documents is ~0.6 M tokens, so its rows come in bursts and need the longer window; workers cap each call at 256K
characters, ~75K tokens):

* ``bare``: ``Tokenizer.encode_batch_fast`` over the documents in memory (all cores), tokens produced per s;
* ``DataModule``: the public path, ``PretrainingDataModule(..., num_workers=W).train_dataloader()`` iterated
  (each worker tokenizes on one core; ``--workers`` defaults to the cores this process may use, as many as the
  bare tokenizer's pool), tokens *emitted in rows* per s;
* ``in-process stream``: ``token_stream.TokenStream`` in this process (what ``num_workers=0`` runs; the
  tokenizer's own pool uses all cores);
* ``ref concat`` / ``ref bestfit``: straightforward ports of the reference loader (nanochat's deque concat
  loader; its best-fit with a Python scan of a 1000-document buffer, dropping the cropped remainder).

Best-fit drops the remainder of every cropped document, so it emits only a share of what it tokenizes (its
*yield*); the targets are ``concat >= 0.9 x bare``, ``bestfit >= 0.85 x yield x concat`` and ``bestfit >=
ref bestfit``, and on short documents ``bestfit >= 0.8 x concat``, each checked for both paths. The
in-process stream's window opens and closes at tokenizer-batch boundaries (``timed``), so it holds whole
tokenizer batches; the DataModule's counts what the training process received (``stream_stats()``), so rows
its workers prefetched are not counted. The machine's other load moves all figures (on a shared 2-core VM, the
same bare run varies by up to 20 %); configurations are interleaved run by run so that it hits them alike
(best of runs is kept). Three figures show how large that noise is and what our own code costs:

* ``bare vs bare``: the bare tokenizer runs first and last in every round; the ratio of the two slots' bests
  is the noise floor of every other ratio;
* ``median per round``: each concat run against the better bare run of its own round, the median over rounds
  (hardly moved by slow drifts in the machine's load);
* ``CPU per token by thread`` (Linux): the tokenizer's own threads vs this process's Python threads (reading,
  laying out, packing; for ``bare``, only the call itself), so "nothing else may cost more than 10 %" is
  measured directly as (our Python threads - bare's call) / the tokenizer threads' CPU per token.

It also times the first batch after a resume from a state taken at the end of the bestfit run (its buffer then
holds the corpus's longest documents).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_verdicts

from lightning_d9d.datamodules.pretraining import PretrainingDataModule
from lightning_d9d.streaming.packing import BestFitPacker
from lightning_d9d.streaming.source import RowGroupIndex, pass_order, resolve_files
from lightning_d9d.streaming.stream import StreamSpec, TokenStream
from lightning_d9d.streaming.tokenize import load_tokenizer

BOS = "<|bos|>"


# ------------------------------------------------------------------------------------------------ corpus
def stdlib_texts(max_mb: float) -> list[str]:
    """Help topics, then stdlib sources (tests excluded), in a fixed order, up to ``max_mb`` MB of text."""
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
        if "site-packages" in path:
            continue
        with open(path, encoding="utf-8", errors="replace") as file:
            texts.append(file.read())
    out, size = [], 0
    for text in texts:
        if size > max_mb * 1e6:
            break
        out.append(text)
        size += len(text)
    return out


def write_corpus(directory: Path, docs: list[str], row_group_size: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), directory / "part-000.parquet", row_group_size=row_group_size)
    return resolve_files(str(directory))


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS], show_progress=False))
    return tok


# ------------------------------------------------------------------------------------------------ reference ports
def ref_document_batches(index: RowGroupIndex, batch_size: int):
    """nanochat's document_batches for rank 0 of 1, forever; row groups in the same per-pass order as our
    stream's (the reference reads files in order), so that every loader tokenizes the same documents."""
    for pass_index in itertools.count():
        for group in pass_order(len(index), 0, pass_index).tolist():
            docs = index.read_texts(group)
            for i in range(0, len(docs), batch_size):
                yield docs[i : i + batch_size]


def ref_concat(index: RowGroupIndex, tok: Tokenizer, bos: int, B: int, T: int, batch_size: int, stats: dict):
    """nanochat's original loader: a deque of tokens, B*T+1 popped per batch."""
    batches = ref_document_batches(index, batch_size)
    needed = B * T + 1
    token_buffer: deque = deque()
    while True:
        while len(token_buffer) < needed:
            token_lists = [[bos, *e.ids] for e in tok.encode_batch_fast(next(batches))]
            for tokens in token_lists:
                token_buffer.extend(tokens)
                stats["tokenized"] += len(tokens)
        tokens = [token_buffer.popleft() for _ in range(needed)]
        scratch = torch.tensor(tokens, dtype=torch.long)
        stats["emitted"] += needed
        yield scratch[:-1].view(B, T), scratch[1:].view(B, T)


def ref_bestfit(
    index: RowGroupIndex,
    tok: Tokenizer,
    bos: int,
    B: int,
    T: int,
    batch_size: int,
    stats: dict,
    buffer_size: int = 1000,
):
    """nanochat's best-fit loader: Python scan of the buffer per pick, cropped remainder dropped."""
    batches = ref_document_batches(index, batch_size)
    row_capacity = T + 1
    doc_buffer: list[list[int]] = []

    def refill_buffer() -> None:
        for tokens in ([bos, *e.ids] for e in tok.encode_batch_fast(next(batches))):
            doc_buffer.append(tokens)
            stats["tokenized"] += len(tokens)

    row_buffer = torch.empty((B, row_capacity), dtype=torch.long)
    while True:
        for row_idx in range(B):
            pos = 0
            while pos < row_capacity:
                while len(doc_buffer) < buffer_size:
                    refill_buffer()
                remaining = row_capacity - pos
                best_idx, best_len = -1, 0
                for i, doc in enumerate(doc_buffer):
                    doc_len = len(doc)
                    if doc_len <= remaining and doc_len > best_len:
                        best_idx, best_len = i, doc_len
                if best_idx >= 0:
                    doc = doc_buffer.pop(best_idx)
                    row_buffer[row_idx, pos : pos + len(doc)] = torch.tensor(doc, dtype=torch.long)
                    pos += len(doc)
                else:
                    shortest_idx = min(range(len(doc_buffer)), key=lambda i: len(doc_buffer[i]))
                    doc = doc_buffer.pop(shortest_idx)
                    row_buffer[row_idx, pos : pos + remaining] = torch.tensor(doc[:remaining], dtype=torch.long)
                    stats["cropped"] += len(doc) - remaining
                    pos += remaining
        stats["emitted"] += B * row_capacity
        yield row_buffer[:, :-1].clone(), row_buffer[:, 1:].clone()


# ------------------------------------------------------------------------------------------------ timing
def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; all CPUs where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def proc_stat(path: str) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds: utime + stime)`` from a Linux ``/proc/.../stat`` file; None if unreadable."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None


def thread_cpu() -> tuple[float, float] | None:
    """CPU seconds so far of ``(this process's Python threads, its other threads)``; None off Linux.

    The other threads are the tokenizer's (Rust) pool; the Python threads are the caller's: the consumer, the
    stream's reader and the thread that calls ``encode_batch_fast`` (converting its inputs and outputs).
    Threads that have ended are not counted, so take both readings while the loader runs.
    """
    python_ids = {t.native_id for t in threading.enumerate()}
    ours = other = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        stat = proc_stat(f"/proc/self/task/{tid}/stat")
        if stat is None:
            continue
        if int(tid) in python_ids:
            ours += stat[1]
        else:
            other += stat[1]
    return ours, other


def cpu_split(before, after, tokens: int) -> dict:
    """Nanoseconds of CPU per token in Python threads and in the tokenizer's threads between two readings."""
    if before is None or after is None or tokens <= 0:
        return {}
    return {"python_ns": (after[0] - before[0]) / tokens * 1e9, "pool_ns": (after[1] - before[1]) / tokens * 1e9}


def timed(iterator, seconds: float, marker) -> dict:
    """Time a loader between two tokenizer-batch boundaries, at least ``seconds`` apart.

    ``marker()`` changes exactly when the loader pulls a new tokenizer batch. The window opens at the first
    boundary after the first batch and closes at the first boundary after ``seconds``, so it holds whole
    tokenizer batches (no batch tokenized before the window is counted in it).
    """
    next(iterator)
    previous = marker()
    while marker() == previous:  # open at a boundary
        next(iterator)
    threads_before = thread_cpu()
    start, cpu, opened, batches = time.perf_counter(), time.process_time(), marker(), 0
    previous = opened
    while True:
        next(iterator)
        batches += 1
        now, current = time.perf_counter(), marker()
        if (current != previous and now - start >= seconds) or now - start >= 8 * seconds:
            break
        previous = current
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    threads_after = thread_cpu()
    if hasattr(iterator, "close"):
        iterator.close()
    return {
        "elapsed": elapsed,
        "cpu": cpu,
        "batches": batches,
        "opened": opened,
        "threads": (threads_before, threads_after),
    }


def measure_bare(tok: Tokenizer, docs: list[str], batch_size: int, seconds: float) -> dict:
    # The loaders' call (no post-processor tokens: they prepend BOS themselves); its first batch is untimed, like
    # the loaders' (their window starts after it).
    tok.encode_batch_fast(docs[:batch_size], add_special_tokens=False)
    threads_before = thread_cpu()
    tokens, start, cpu, i = 0, time.perf_counter(), time.process_time(), batch_size
    while time.perf_counter() - start < seconds:
        batch = docs[i : i + batch_size] or docs[:batch_size]
        i = i + batch_size if i + batch_size < len(docs) else 0
        encodings = tok.encode_batch_fast(batch, add_special_tokens=False)
        tokens += sum(map(len, encodings)) + len(batch)  # + BOS, as the loaders count
    rate = tokens / (time.perf_counter() - start)
    return {
        "tps": rate,
        "work": rate,
        "work_cpu": tokens / (time.process_time() - cpu),
        **cpu_split(threads_before, thread_cpu(), tokens),
    }


def measure_ours(spec: StreamSpec, seconds: float) -> dict:
    stream, last = iter(TokenStream(spec, 0)), {}

    def batches():
        for batch in stream:
            last["state"] = batch[1]
            yield batch

    iterator = batches()
    marks = {}

    def marker():
        state = last["state"]
        marks.setdefault(state["docs"], state)  # the state at each boundary
        return state["docs"]

    run = timed(iterator, seconds, marker)
    s0, s1 = marks[run["opened"]], last["state"]
    emitted = s1["emitted"] - s0["emitted"]
    tokenized = s1["tokens"] - s0["tokens"]
    return {
        "tps": emitted / run["elapsed"],
        "work": tokenized / run["elapsed"],
        "work_cpu": tokenized / run["cpu"],
        "state": s1,
        **cpu_split(*run["threads"], tokenized),
    }


def process_tree_cpu() -> float:
    """CPU seconds so far of this process and its live children (the DataLoader workers); off Linux, this
    process alone."""
    total = time.process_time()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return total
    for pid in pids:
        stat = proc_stat(f"/proc/{pid}/stat")
        if stat is not None and stat[0] == os.getpid():
            total += stat[1]
    return total


def measure_datamodule(
    files: list[str],
    tokenizer: Tokenizer,
    packing: str,
    num_workers: int,
    B: int,
    T: int,
    batch_size: int,
    seconds: float,
) -> dict:
    """The public path: ``PretrainingDataModule(...).train_dataloader()``, iterated as Lightning would.

    Timed from its first batch of every stream (one per worker) for ``seconds``: the workers' start-up is untimed,
    like bare's first call, and every stream's counters are known when the window opens. Tokens tokenized are
    read from ``stream_stats()`` (as of the batches consumed, so batches the workers prefetched are not
    counted). CPU is this process plus its workers.
    """
    dm = PretrainingDataModule(
        files,
        tokenizer,
        seq_len=T,
        global_batch_size=B,
        microbatch_size=B,
        packing=packing,
        num_workers=num_workers,
        steps_per_epoch=10**9,
        tokenizer_batch_size=batch_size,
        pin_memory=False,
    )
    dm.setup("fit")
    iterator = iter(dm.train_dataloader())
    for _ in range(max(1, num_workers)):
        next(iterator)
    before, cpu, start = dm.stream_stats(), process_tree_cpu(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(iterator)
    elapsed, after = time.perf_counter() - start, dm.stream_stats()
    cpu = process_tree_cpu() - cpu
    dm.teardown("fit")
    del iterator
    emitted, tokenized = after["emitted"] - before["emitted"], after["tokens"] - before["tokens"]
    return {"tps": emitted / elapsed, "work": tokenized / elapsed, "work_cpu": tokenized / cpu}


def measure_ref(loader, index, tok, bos, B, T, batch_size, seconds) -> dict:
    stats = {"tokenized": 0, "emitted": 0, "cropped": 0}
    marks = {}

    def marker():
        marks.setdefault(stats["tokenized"], dict(stats))
        return stats["tokenized"]

    run = timed(loader(index, tok, bos, B, T, batch_size, stats), seconds, marker)
    s0 = marks[run["opened"]]
    tokenized = stats["tokenized"] - s0["tokenized"]
    emitted = stats["emitted"] - s0["emitted"]
    return {"tps": emitted / run["elapsed"], "work": tokenized / run["elapsed"], "work_cpu": tokenized / run["cpu"]}


def long_run_yield(tok: Tokenizer, docs: list[str], capacity: int, buffer_size: int = 1000) -> float:
    """Best-fit's steady-state yield on this corpus: the real packer run over 20 buffers' worth of documents
    drawn (seeded) from the corpus's length distribution (lengths estimated from chars with a tokenized
    sample's chars/token), counting only documents that left the buffer. A short timed window cannot show it:
    a 1000-document buffer takes most of a small corpus to fill and keeps the longest documents."""
    sample = docs[:: max(1, len(docs) // 300)]
    ratio = sum(map(len, sample)) / sum(len(e) + 1 for e in tok.encode_batch_fast(sample))
    lengths = [max(1, round(len(d) / ratio)) + 1 for d in docs]
    rng = np.random.default_rng(0)
    order = rng.choice(np.asarray(lengths), size=20 * buffer_size).tolist()
    packer, fed = BestFitPacker(capacity, buffer_size), iter(order)
    zeros = np.zeros(capacity, np.int32)

    def refill() -> None:
        length = next(fed)
        packer.add(zeros[: min(length, capacity)], length, (0, 0))

    try:
        while True:
            packer.take(1, refill)
    except StopIteration:
        pass
    left_buffer = packer.tokens_emitted + packer.tokens_cropped
    return packer.tokens_emitted / max(1, left_buffer)


def time_resume(spec: StreamSpec, state: dict) -> float:
    start = time.perf_counter()
    iterator = iter(TokenStream(spec, 0, state))
    next(iterator)
    elapsed = time.perf_counter() - start
    iterator.close()
    return elapsed


# ------------------------------------------------------------------------------------------------ main
PATHS = (("dm_", "DataModule, {workers} workers"), ("", "in-process stream"))  # result-key prefix, label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=40.0, help="at most this many MB of stdlib text in the corpus")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--tokenizer-batch", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run, short documents")
    parser.add_argument(
        "--long-seconds",
        type=float,
        default=8.0,
        help="timed seconds per run, long documents (an in-process tokenizer batch of them is ~0.6 M "
        "tokens, so rows come in bursts: a short window measures the bursts, not the rate)",
    )
    parser.add_argument("--runs", type=int, default=4, help="runs per configuration (best is kept)")
    parser.add_argument(
        "--workers",
        type=int,
        default=available_cores(),
        help="DataLoader workers of the DataModule path (default: the cores this process may use, "
        "as many as the bare tokenizer uses)",
    )
    parser.add_argument("--skip-ref", action="store_true", help="skip the reference ports")
    parser.add_argument("--quick", action="store_true", help="a 2 MB corpus, 1 short run each (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.seconds, args.long_seconds, args.runs, args.vocab = 2.0, 0.3, 0.3, 1, 2048

    texts = stdlib_texts(args.mb)
    short = [p for t in texts for p in t.split("\n\n") if p.strip()]
    print(
        f"corpus: {len(texts)} long documents / {len(short)} short, {sum(map(len, texts)) / 1e6:.1f} MB; "
        f"{available_cores()} cores; seq_len={args.seq_len}, microbatch={args.microbatch}, "
        f"DataModule num_workers={args.workers}"
    )
    t0 = time.perf_counter()
    tok = train_tokenizer(texts[:: max(1, len(texts) // 300)], args.vocab)  # a sample is enough for a BPE
    print(f"tokenizer: byte-level BPE, vocab {args.vocab}, trained in {time.perf_counter() - t0:.1f}s")
    bos = tok.token_to_id(BOS)
    # The very tokenizer object the streams use (parsed once per process from the same JSON), so that bare and
    # ours share one vocabulary cache and differ only in what happens around encode_batch_fast.
    shared_tok = load_tokenizer(tok.to_str())
    B, T, tb = args.microbatch, args.seq_len, args.tokenizer_batch
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, docs, rg, seconds in (("long", texts, 128, args.long_seconds), ("short", short, 1024, args.seconds)):
            # Smaller row groups where needed, so that every worker's stream gets at least four (on 2 cores they
            # stay 128 and 1,024 documents; on many cores the in-process and reference loaders see them too).
            files = write_corpus(Path(tmp) / name, docs, min(rg, max(1, len(docs) // (4 * args.workers))))
            index = RowGroupIndex.scan(files, "text")
            # The bare tokenizer gets the documents in the order our stream reads them (pass 0, seed 0).
            in_order = [t for g in pass_order(len(index), 0, 0).tolist() for t in index.read_texts(g) if t]

            def spec(packing: str, index: RowGroupIndex = index) -> StreamSpec:
                return StreamSpec(
                    index=index,
                    tokenizer_json=tok.to_str(),
                    bos_id=bos,
                    seq_len=T,
                    microbatch_size=B,
                    packing=packing,
                    seed=0,
                    shuffle=True,
                    num_streams=1,
                    tokenizer_batch_size=tb,
                    buffer_size=1000,
                )

            r = results[name] = {}
            # Interleave configurations run by run, so machine noise hits them alike; bare runs first and last.
            keys = ("bare", "dm_concat", "dm_bestfit", "concat", "bestfit", "ref_concat", "ref_bestfit", "bare_again")
            runs: dict[str, list] = {k: [] for k in keys}
            for _ in range(args.runs):
                runs["bare"].append(measure_bare(shared_tok, in_order, tb, seconds))
                for packing in ("concat", "bestfit"):
                    runs[f"dm_{packing}"].append(
                        measure_datamodule(files, tok, packing, args.workers, B, T, tb, seconds)
                    )
                    runs[packing].append(measure_ours(spec(packing), seconds))
                if not args.skip_ref:
                    runs["ref_concat"].append(measure_ref(ref_concat, index, tok, bos, B, T, tb, seconds))
                    runs["ref_bestfit"].append(measure_ref(ref_bestfit, index, tok, bos, B, T, tb, seconds))
                runs["bare_again"].append(measure_bare(shared_tok, in_order, tb, seconds))
            slower, faster = sorted((best(runs["bare"]), best(runs["bare_again"])))
            r["noise_floor"] = slower / faster
            # Per round, each loader against the better of that round's two bare runs: the median of these paired
            # ratios is hardly moved by slow drifts in the machine's load (best-of is the headline).
            round_bare = [max(a["tps"], b["tps"]) for a, b in zip(runs["bare"], runs["bare_again"])]
            r["paired"] = {
                key: float(np.median([v["tps"] / b for v, b in zip(runs[key], round_bare)]))
                for key in ("dm_concat", "concat")
            }
            runs["bare"] += runs.pop("bare_again")  # bare's best is over both slots: conservative for ours
            for key, values in runs.items():
                if values:
                    r[key] = max(values, key=lambda v: v["tps"])
                    r[key].update(median_cpu_split(values))
                    r[key]["all_tps"] = [v["tps"] for v in values]
            r["yield"] = long_run_yield(tok, docs, T + 1)
            r["resume_s"] = time_resume(spec("bestfit"), r["bestfit"]["state"])
            r["resume_concat_s"] = time_resume(spec("concat"), r["concat"]["state"])
            report(name, r, args.workers)
    print("\nsummary (rows tokens/s; bare: tokens/s the tokenizer produces):")
    for name, r in results.items():
        line = ", ".join(f"{k} {v['tps'] / 1e3:.0f}K" for k, v in r.items() if isinstance(v, dict) and "tps" in v)
        print(f"  {name}: {line}; bestfit yield {r['yield']:.2f}")
    print_verdicts(verdicts(results, args.workers))


def best(values: list[dict]) -> float:
    return max(v["tps"] for v in values)


def median_cpu_split(values: list[dict]) -> dict:
    """Per-thread CPU per token, median over runs (hardly moved by other processes, unlike tokens/s)."""
    split = [v for v in values if "python_ns" in v]
    if not split:
        return {}
    return {k: float(np.median([v[k] for v in split])) for k in ("python_ns", "pool_ns")}


def own_share(r: dict, key: str) -> float | None:
    """CPU our Python threads add per token, beyond bare's call itself, as a share of the tokenizer's own."""
    if "python_ns" not in r[key] or "python_ns" not in r["bare"]:
        return None
    return (r[key]["python_ns"] - r["bare"]["python_ns"]) / r["bare"]["pool_ns"]


def verdicts(results: dict, workers: int) -> list[tuple[bool, str]]:
    out = []
    for name, r in results.items():
        for prefix, label in PATHS:
            label = label.format(workers=workers)
            concat, bestfit = r[prefix + "concat"], r[prefix + "bestfit"]
            ratio = concat["tps"] / r["bare"]["tps"]
            paired = r["paired"][prefix + "concat"]
            out.append(
                (
                    ratio >= 0.9,
                    f"{name}, {label}: concat {ratio:.2f}x the bare tokenizer (target >= 0.90; "
                    f"median per round {paired:.2f}; bare vs bare {r['noise_floor']:.2f})",
                )
            )
            steady = bestfit["work"] / concat["work"]
            out.append((steady >= 0.85, f"{name}, {label}: bestfit {steady:.2f} x yield x concat (target >= 0.85)"))
            if name == "short":
                rows = bestfit["tps"] / concat["tps"]
                out.append((rows >= 0.8, f"{name}, {label}: bestfit rows {rows:.2f}x concat (target >= 0.80)"))
            if "ref_bestfit" in r:
                vs_ref = bestfit["work"] / r["ref_bestfit"]["work"]
                out.append(
                    (
                        vs_ref >= 1.0,
                        f"{name}, {label}: bestfit tokenizes {vs_ref:.2f}x the reference best-fit (target >= 1.00)",
                    )
                )
        share = own_share(r, "concat")
        if share is not None:
            out.append(
                (
                    share < 0.10,
                    f"{name}: concat's own Python work {share:.1%} of the tokenizer's CPU per token (target < 10 %)",
                )
            )
        resume = max(r["resume_s"], r["resume_concat_s"])
        out.append((resume < 3.0, f"{name}: first batch after a resume {resume:.2f}s (target < 3 s)"))
    return out


def report(name: str, r: dict, workers: int) -> None:
    bare, y = r["bare"]["tps"], r["yield"]
    print(
        f"\n== {name} documents ==   best-fit long-run yield {y:.2f}: cropping drops {1 - y:.0%} of the "
        "tokenizer's work (the reference's best-fit drops the same remainders)"
    )
    print("                                   rows tokens/s   tokenized/s   tokenized/CPU-s")
    labels = (
        ("dm_concat", f"concat, DataModule {workers} workers"),
        ("dm_bestfit", f"bestfit, DataModule {workers} w."),
        ("concat", "concat, in-process stream"),
        ("bestfit", "bestfit, in-process stream"),
        ("ref_concat", "ref concat"),
        ("ref_bestfit", "ref bestfit"),
    )
    for key, label in labels:
        if key in r:
            print(
                f"  {label:<30} {r[key]['tps'] / 1e3:10.0f}K {r[key]['work'] / 1e3:12.0f}K "
                f"{r[key]['work_cpu'] / 1e3:14.0f}K"
            )
    print(f"  {'bare tokenizer':<30} {'':>11} {bare / 1e3:12.0f}K {r['bare']['work_cpu'] / 1e3:14.0f}K")
    print("  every run, K tokens/s (rows; bare: tokenized; bare lists its first-slot runs, then its last-slot runs):")
    for key in ("bare", "dm_concat", "dm_bestfit", "concat", "bestfit"):
        print(f"    {key:<10} " + " ".join(f"{v / 1e3:.0f}" for v in r[key]["all_tps"]))
    print(f"  bare vs bare, the noise floor of every ratio: {r['noise_floor']:.2f}")
    for key, label in PATHS:
        concat, bestfit = r[key + "concat"], r[key + "bestfit"]
        print(f"  -- {label.format(workers=workers)}")
        print(
            f"  concat / bare                          {concat['tps'] / bare:.2f}  (target >= 0.90; median per "
            f"round {r['paired'][key + 'concat']:.2f}; per CPU-s: {concat['work_cpu'] / r['bare']['work_cpu']:.2f})"
        )
        print(
            f"  bestfit / (yield x concat), steady     {bestfit['work'] / concat['work']:.2f}  (target >= 0.85; "
            "= bestfit's tokenizing rate / concat's)"
        )
        if name == "short":
            rows, window_yield = bestfit["tps"] / concat["tps"], bestfit["tps"] / bestfit["work"]
            print(
                f"  bestfit / concat, rows                 {rows:.2f}  (target >= 0.80; = the line above x bestfit's "
                f"rows / tokenized in the window, {window_yield:.2f}: documents longer than a row pile up in its "
                "buffer, as in the reference)"
            )
        if "ref_bestfit" in r:
            print(
                f"  bestfit / ref bestfit, tokenizing      {bestfit['work'] / r['ref_bestfit']['work']:.2f}  "
                f"(target >= 1.00; rows in the window: {bestfit['tps'] / r['ref_bestfit']['tps']:.2f})"
            )
            print(f"  concat / ref concat                    {concat['tps'] / r['ref_concat']['tps']:.2f}")
    if "python_ns" in r["bare"]:
        print("  in-process, CPU per token (median)   Python threads   tokenizer threads   own work / tokenizer's")
        for key, label in (("bare", "bare tokenizer"), ("concat", "ours concat"), ("bestfit", "ours bestfit")):
            share = own_share(r, key) if key != "bare" else None
            print(
                f"    {label:<28} {r[key]['python_ns']:10.0f} ns {r[key]['pool_ns']:15.0f} ns"
                + (f" {share:18.1%}" if share is not None else "   (the call itself)")
            )
    print(f"  first batch after a resume: bestfit {r['resume_s']:.2f}s, concat {r['resume_concat_s']:.2f}s")


if __name__ == "__main__":
    main()
