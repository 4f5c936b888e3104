"""Streaming benchmark: PretrainingDataModule's K-stream loaders vs the bare tokenizer and nanochat's loaders.

Run: ``python benchmarks/streaming.py`` (~30 min on 2 cores; ``--help`` for sizes, ``--quick`` for a smoke
test). Nothing is downloaded: the corpus is the Python standard library's own ``.py`` sources plus the
``pydoc_data`` help topics, written to parquet here, and the tokenizer is a byte-level BPE trained here on that
text. Results and how to read them: ``docs/benchmarks_streaming.md``.

Two corpora from the same text: *long* (one document per file/topic, many longer than a row) and *short* (the
same text split at blank lines). Settings: ``seq_len`` 1024, microbatch 8, global batch 64, the default
``num_streams`` (K = 16) and best-fit buffer (1000), world size 1. Configurations, each in a process of its own:

* ``bare``: ``Tokenizer.encode_batch_fast`` over the documents in memory (all cores), tokens produced per s;
* the public path ``PretrainingDataModule(...).train_dataloader()`` iterated, for ``concat``, ``bestfit`` and
  ``bestfit_split``, with ``--workers`` DataLoader workers (each tokenizes on one core; default: the cores this
  process may use, as many as the bare tokenizer's pool) and in-process (``num_workers=0``: the tokenizer's own
  pool uses every core); *useful* tokens per s: document tokens in the rows handed out (padding excluded);
* ``nanochat concat`` / ``nanochat best-fit``: straightforward ports of nanochat's loaders (a deque of tokens; a
  Python scan of a 1000-document buffer per pick, dropping the cropped remainder), in-process.

Timing. Every configuration starts once (its first step is reported, untimed) and is then frozen (``SIGSTOP`` of
its process group, DataLoader workers included) except during its own windows, which are interleaved round by
round: bare first and last in every round, the loaders in between, in one order in even rounds and in the reverse
order in odd ones (a window's place in the round biases it, so every loader gets the same mean place; run an even
number of rounds). So the machine's other load hits all configurations alike, an idle configuration costs nothing,
and a configuration's windows are contiguous slices of one run (no read-ahead piles up while it waits). A window
runs whole optimizer steps for at least ``--seconds`` (``--long-seconds``); its tokens come from ``stream_stats()``
(as of the steps handed out, so rows the workers prefetched are not counted). Figures:

* *pooled*: a configuration's tokens over all its windows / their time (what the verdicts use: a window's
  read-ahead at its edges, up to two tokenizer chunks per stream, averages out over a run, not over a window);
* *median per round*: each loader against the better bare window of its own round, the median over rounds;
* ``bare vs bare``: bare's first-slot windows against its last-slot ones (pooled), the noise floor of every
  ratio;
* ``own work / tokenizer's`` (Linux): in-process concat's CPU per token in this package's Python threads
  (reading, laying out, packing, the consumer) beyond bare's (the call itself), as a share of the tokenizer
  threads' CPU per token.

Then, untimed: packing quality over ``--quality-steps`` steps (waste: padding + dropped tokens; rows that start
with BOS; documents cut: cropped, split, or, for concat, spanning a row boundary), each stream's state size,
peak RSS of the training process and its workers, and the first batch after a resume from a state saved by the
2-worker run (best-fit buffers then hold the corpus's longest documents) on other layouts: another
``num_workers`` and ``microbatch_size``, and other world sizes (a DataModule whose ``data_parallel`` topology is
that of a rank of a larger job); each resumed step is compared with the uninterrupted run's rows.

``--first-batch`` times only fresh starts instead: each packing, the corpus alone and as a mixture of its documents
dealt to ``--sources`` sources (2), each in a process of its own (in this one with ``--inline``, as ``--quick``
sets) with its DataLoader workers started as a training script's are, from ``iter(train_dataloader())`` to the
first microbatch (``setup`` timed apart), with best-fit buffers growing as a fresh stream's do
(``--buffer-start``/``--buffer-growth`` to try other sizes) and, unless ``--skip-full``, full before the first
row; target: the first batch within 5 s.
"""

from __future__ import annotations

import argparse
import glob
import io
import itertools
import multiprocessing
import os
import pickle
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

# A child run for another checkout (--old-tree) imports lightning_d9d from there; everything else from this one.
_TREE = os.environ.get("D9D_BENCH_TREE") or str(Path(__file__).resolve().parents[1])
sys.path.insert(0, _TREE)
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import Child, Inline, in_child, print_verdicts, process_kib

BOS = "<|bos|>"
PACKINGS = ("concat", "bestfit", "bestfit_split")
# Resume layouts (rank, world size, num_workers, microbatch_size); the saved run is rank 0 of 1 with --workers
# workers and microbatch 8. "W" stands for --workers.
LAYOUTS = (
    ("same layout", 0, 1, "W", 8),
    ("num_workers 0, microbatch 4", 0, 1, 0, 4),
    ("rank 1 of 2, microbatch 8", 1, 2, "W", 8),
    ("rank 3 of 4, num_workers 0, microbatch 16", 3, 4, 0, 16),
)
# --quick: one layout that changes the world size, num_workers and microbatch_size at once (every resharding path,
# one resume per packing).
QUICK_LAYOUTS = (("rank 1 of 2, num_workers 0, microbatch 4", 1, 2, 0, 4),)
FIRST_BATCH_S = 5.0  # target: the first batch of a fresh start (setup excluded)


# ------------------------------------------------------------------------------------------------ corpus
def stdlib_texts(max_mb: float) -> list[str]:
    """Help topics, then stdlib sources (tests excluded), in a fixed order, up to ``max_mb`` MB of text."""
    import pydoc_data.topics

    def texts():  # lazily: a small corpus (--quick) reads a few files, not the whole stdlib
        yield from pydoc_data.topics.topics.values()
        root = sysconfig.get_paths()["stdlib"]
        for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
            if "site-packages" in path:
                continue
            with open(path, encoding="utf-8", errors="replace") as file:
                yield file.read()

    out, size = [], 0
    for text in texts():
        if size > max_mb * 1e6:
            break
        out.append(text)
        size += len(text)
    return out


def write_corpus(directory: Path, docs: list[str], row_group_size: int) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs}), directory / "part-000.parquet", row_group_size=row_group_size)
    return str(directory)


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS], show_progress=False))
    return tok


def stdlib_corpus(root: Path, mb: float, vocab: int) -> tuple[list[str], str, str, Tokenizer]:
    """The stdlib corpus of the cached benchmarks: ``mb`` MB of text as one parquet file in row groups of 64 documents
    under ``root / "data"``, and a byte-level BPE of ``vocab`` tokens trained on it, saved as ``root /
    "tokenizer.json"``: ``(texts, files, tokenizer path, tokenizer)``."""
    texts = stdlib_texts(mb)
    files = write_corpus(root / "data", texts, row_group_size=64)
    tok = train_tokenizer(texts, vocab)
    tokenizer = str(root / "tokenizer.json")
    tok.save(tokenizer)
    return texts, files, tokenizer, tok


def _index(files: str):
    from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files

    return RowGroupIndex.scan(resolve_files(files), "text")


# ------------------------------------------------------------------------------------------------ nanochat ports
def ref_document_batches(index, batch_size: int):
    """nanochat's document_batches for rank 0 of 1, forever; row groups in a seeded order per pass (nanochat
    reads files in order), so that every loader tokenizes the same documents."""
    from lightning_d9d.streaming.sources.source import pass_order

    for pass_index in itertools.count():
        for group in pass_order(len(index), 0, pass_index).tolist():
            docs = index.read_texts(group)
            for i in range(0, len(docs), batch_size):
                yield docs[i : i + batch_size]


def ref_concat(index, tok: Tokenizer, bos: int, B: int, T: int, batch_size: int, stats: dict):
    """nanochat's original loader: a deque of tokens, B*T+1 popped per batch."""
    batches = ref_document_batches(index, batch_size)
    needed = B * T + 1
    token_buffer: deque = deque()
    while True:
        while len(token_buffer) < needed:
            token_lists = [[bos, *e.ids] for e in tok.encode_batch_fast(next(batches), add_special_tokens=False)]
            for tokens in token_lists:
                token_buffer.extend(tokens)
                stats["tokenized"] += len(tokens)
        tokens = [token_buffer.popleft() for _ in range(needed)]
        scratch = torch.tensor(tokens, dtype=torch.long)
        stats["emitted"] += needed
        yield scratch[:-1].view(B, T), scratch[1:].view(B, T)


def ref_bestfit(index, tok: Tokenizer, bos: int, B: int, T: int, batch_size: int, stats: dict, buffer_size: int):
    """nanochat's best-fit loader: Python scan of the buffer per pick, cropped remainder dropped."""
    batches = ref_document_batches(index, batch_size)
    row_capacity = T + 1
    doc_buffer: list[list[int]] = []

    def refill_buffer() -> None:
        for tokens in ([bos, *e.ids] for e in tok.encode_batch_fast(next(batches), add_special_tokens=False)):
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


# ------------------------------------------------------------------------------------------------ CPU and memory
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


def child_pids() -> list[int]:
    """This process's live child processes (its DataLoader workers); empty off Linux."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    return [pid for pid in pids if (stat := proc_stat(f"/proc/{pid}/stat")) is not None and stat[0] == os.getpid()]


def process_tree_cpu() -> float:
    """CPU seconds so far of this process and its live children; off Linux, this process alone."""
    total = time.process_time()
    for pid in child_pids():
        stat = proc_stat(f"/proc/{pid}/stat")
        if stat is not None:
            total += stat[1]
    return total


def thread_cpu() -> tuple[float, float] | None:
    """CPU seconds so far of ``(this process's Python threads, its other threads)``; None off Linux.

    The other threads are the tokenizer's (Rust) pool; the Python threads are the caller's: the consumer, the
    streams' readers and the thread that calls ``encode_batch_fast`` (converting its inputs and outputs).
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


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` memory field in KiB, 0 where unreadable (a worker may have exited)."""
    try:
        return process_kib(field, pid)
    except (OSError, KeyError):
        return 0


def peak_rss() -> dict:
    """Peak RSS (VmHWM) of this process and of its live children, in MiB."""
    workers = [status_kib(pid, "VmHWM") / 1024 for pid in child_pids()]
    return {"main_mib": status_kib(os.getpid(), "VmHWM") / 1024, "workers_mib": workers}


# ------------------------------------------------------------------------------------------------ runners
class BareRun:
    """The bare tokenizer over the documents in memory, in the order one pass of the streams reads them."""

    def __init__(self, files: str, tokenizer: str, batch_size: int, **_: object):
        from lightning_d9d.streaming.sources.source import pass_order

        index = _index(files)
        self.docs = [t for g in pass_order(len(index), 0, 0).tolist() for t in index.read_texts(g) if t]
        self.tok, self.batch_size, self.i = Tokenizer.from_file(tokenizer), batch_size, 0
        self.tok.encode_batch_fast(self.docs[:batch_size], add_special_tokens=False)  # untimed, like first steps
        self.info: dict = {}

    def window(self, seconds: float) -> dict:
        docs, size = self.docs, self.batch_size
        threads_before, cpu, tokens = thread_cpu(), process_tree_cpu(), 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = docs[self.i : self.i + size]
            self.i = self.i + size if self.i + size < len(docs) else 0
            encodings = self.tok.encode_batch_fast(batch, add_special_tokens=False)
            tokens += sum(map(len, encodings)) + len(batch)  # + BOS, as the loaders count
        elapsed = time.perf_counter() - start
        return {
            "elapsed": elapsed,
            "useful": tokens,
            "work": tokens,
            "cpu": process_tree_cpu() - cpu,
            "threads": (threads_before, thread_cpu()),
        }

    def close(self) -> None:
        pass


class RefRun:
    """A nanochat port; windows open and close when it pulls a tokenizer batch, so they hold whole batches."""

    def __init__(self, files: str, tokenizer: str, kind: str, seq_len: int, microbatch: int, batch_size: int,
                 buffer: int, **_: object):  # fmt: skip
        tok = Tokenizer.from_file(tokenizer)
        self.stats = {"tokenized": 0, "emitted": 0, "cropped": 0}
        args = (_index(files), tok, tok.token_to_id(BOS), microbatch, seq_len, batch_size, self.stats)
        self.it = ref_concat(*args) if kind == "concat" else ref_bestfit(*args, buffer_size=buffer)
        start = time.perf_counter()
        next(self.it)
        self.info = {"first_step_s": time.perf_counter() - start}

    def window(self, seconds: float) -> dict:
        stats, it = self.stats, self.it
        first = stats["tokenized"]
        while stats["tokenized"] == first:  # open right after a tokenizer batch
            next(it)
        s0, threads_before, cpu, start = dict(stats), thread_cpu(), process_tree_cpu(), time.perf_counter()
        while True:
            before = stats["tokenized"]
            next(it)
            now = time.perf_counter() - start
            if (stats["tokenized"] != before and now >= seconds) or now >= 8 * seconds:
                break
        return {
            "elapsed": time.perf_counter() - start,
            "useful": stats["emitted"] - s0["emitted"],
            "work": stats["tokenized"] - s0["tokenized"],
            "cropped": stats["cropped"] - s0["cropped"],
            "cpu": process_tree_cpu() - cpu,
            "threads": (threads_before, thread_cpu()),
        }

    def quality(self, _steps: int) -> dict:
        s = self.stats
        return {"cropped": s["cropped"], "emitted": s["emitted"], "tokenized": s["tokenized"]}

    def close(self) -> None:
        self.it.close()


def _datamodule(files: str, tokenizer: str, packing: str, workers: int, seq_len: int, global_batch: int,
                microbatch: int, batch_size: int, buffer: int, num_streams: int | None, rank: int = 0,
                world_size: int = 1):  # fmt: skip
    """A PretrainingDataModule, as data-parallel rank ``rank`` of ``world_size`` (its owned streams, M and layout
    checks follow): a ``DataParallelTopology`` setting, which a DataModule without a Trainer honours."""
    from lightning_d9d.datamodules.pretraining import PretrainingDataModule
    from lightning_d9d.parallel.topology import DataParallelTopology

    kwargs = {"num_streams": num_streams} if num_streams else {}
    topology = DataParallelTopology(dp_rank=rank, dp_size=world_size, process_rank=rank, world_size=world_size)
    return PretrainingDataModule(
        files,
        tokenizer,
        seq_len=seq_len,
        global_batch_size=global_batch,
        microbatch_size=microbatch,
        packing=packing,
        num_workers=workers,
        steps_per_epoch=10**9,
        tokenizer_batch_size=batch_size,
        bestfit_buffer_size=buffer,
        pin_memory=False,
        data_parallel=topology,
        **kwargs,
    )


def _apply_patches(patches: dict) -> None:
    """Set ``module.attribute`` values (diagnostic variants: --variant); workers forked later inherit them."""
    import importlib

    for target, value in patches.items():
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, value)


def _rows_of(batches: list) -> np.ndarray:
    """A step's rows as int64 ``(rows, 3 * seq_len)``: inputs, targets and position ids side by side."""
    return np.concatenate(
        [np.concatenate([b.input_ids.numpy(), b.targets.numpy(), b.position_ids.numpy()], axis=1) for b in batches]
    )


class DataModuleRun:
    """The public path: ``PretrainingDataModule(...).train_dataloader()``, iterated as Lightning would."""

    def __init__(self, files: str, tokenizer: str, packing: str, workers: int, seq_len: int, global_batch: int,
                 microbatch: int, batch_size: int, buffer: int, num_streams: int | None = None,
                 patches: dict | None = None, **_: object):  # fmt: skip
        _apply_patches(patches or {})
        self.dm = _datamodule(files, tokenizer, packing, workers, seq_len, global_batch, microbatch, batch_size,
                              buffer, num_streams)  # fmt: skip
        start = time.perf_counter()
        self.dm.setup("fit")
        setup_s = time.perf_counter() - start
        self.per_step = global_batch // microbatch
        self.iterator = iter(self.dm.train_dataloader())
        start = time.perf_counter()
        self.step()
        self.info = {"setup_s": setup_s, "first_step_s": time.perf_counter() - start}

    def step(self) -> list:
        return [next(self.iterator) for _ in range(self.per_step)]

    def window(self, seconds: float) -> dict:
        dm = self.dm
        s0, threads_before, cpu, steps = dm.stream_stats(), thread_cpu(), process_tree_cpu(), 0
        start = time.perf_counter()
        while True:
            self.step()
            steps += 1
            if time.perf_counter() - start >= seconds:
                break
        elapsed, s1 = time.perf_counter() - start, dm.stream_stats()
        return {
            "elapsed": elapsed,
            "steps": steps,
            "useful": s1["emitted"] - s0["emitted"],
            "work": s1["tokens"] - s0["tokens"],
            "cpu": process_tree_cpu() - cpu,
            "threads": (threads_before, thread_cpu()),
        }

    def quality(self, steps: int) -> dict:
        """Rows that start with BOS / hold none, over ``steps`` steps; the streams' counters since their start."""
        bos = self.dm.train_spec.bos_id
        rows = bos_start = no_bos = bos_tokens = 0
        for _ in range(steps):
            for batch in self.step():
                is_bos = batch.input_ids.numpy() == bos
                rows += len(is_bos)
                bos_start += int(is_bos[:, 0].sum())
                no_bos += int((~is_bos.any(axis=1)).sum())
                bos_tokens += int(is_bos.sum())
        counters = self.dm.stream_stats()
        buffered = 0
        for state in self.dm.position.states.values():
            buffered += sum(len(source.packing.buffer) for source in state.sources.values())
        return {"rows": rows, "bos_start": bos_start, "no_bos": no_bos, "bos_tokens": bos_tokens,
                "counters": counters, "buffered": buffered}  # fmt: skip

    def state(self) -> dict:
        """The checkpointed data state at this step boundary, its size per stream, and the next step's rows."""
        state = self.dm.state_dict()
        committed = self.dm.position.committed[2]
        sizes = [len(pickle.dumps(s.to_dict(), protocol=pickle.HIGHEST_PROTOCOL)) for s in committed.values()]
        saved = io.BytesIO()
        torch.save(state, saved)
        return {"state": state, "sizes": sizes, "checkpoint_bytes": saved.tell(), "rows": _rows_of(self.step())}

    def rss(self) -> dict:
        return peak_rss()

    def close(self) -> None:
        self.dm.teardown("fit")


class ResumeRun:
    """A fresh DataModule on another layout, restored from a saved state: the time to its first batch."""

    def __init__(self, files: str, tokenizer: str, packing: str, seq_len: int, global_batch: int, batch_size: int,
                 buffer: int, state: dict, rows: np.ndarray, layout: tuple, num_streams: int | None = None,
                 **_: object):  # fmt: skip
        _label, rank, world_size, workers, microbatch = layout
        dm = _datamodule(files, tokenizer, packing, workers, seq_len, global_batch, microbatch, batch_size, buffer,
                         num_streams, rank, world_size)  # fmt: skip
        start = time.perf_counter()
        dm.setup("fit")
        setup_s = time.perf_counter() - start
        start = time.perf_counter()
        dm.load_state_dict(state)
        iterator = iter(dm.train_dataloader())
        batches = [next(iterator)]
        first_s = time.perf_counter() - start
        batches += [next(iterator) for _ in range(dm.microbatches_per_step - 1)]
        dm.teardown("fit")
        share = len(rows) // world_size
        expected = rows[rank * share : (rank + 1) * share]
        got = _rows_of(batches)

        def multiset(a: np.ndarray) -> list[bytes]:
            return sorted(row.tobytes() for row in a)

        self.info = {"setup_s": setup_s, "first_s": first_s, "match": multiset(got) == multiset(expected)}

    def close(self) -> None:
        pass


RUNNERS = {"bare": BareRun, "ref": RefRun, "dm": DataModuleRun, "resume": ResumeRun}


# ------------------------------------------------------------------------------------------------ processes
def start_runner(kind: str, cfg: dict, inline: bool, tree: str | None = None) -> Inline | Child:
    """Runner ``kind`` in this process (``inline``) or in a fresh one frozen between calls (another checkout's
    ``lightning_d9d`` where ``tree`` is given)."""
    if inline:
        return Inline(RUNNERS[kind], cfg)
    return Child(RUNNERS[kind], cfg, {"D9D_BENCH_TREE": tree or _TREE})


# ------------------------------------------------------------------------------------------------ figures
def pooled(windows: list[dict], key: str = "useful") -> float:
    return sum(w[key] for w in windows) / sum(w["elapsed"] for w in windows)


def rates(windows: list[dict], key: str = "useful") -> list[float]:
    return [w[key] / w["elapsed"] for w in windows]


def cpu_split(windows: list[dict]) -> dict:
    """Per-thread CPU per token tokenized, pooled over windows (Linux): Python threads vs the tokenizer's."""
    python = pool = tokens = 0.0
    for w in windows:
        before, after = w["threads"]
        if before is None or after is None:
            return {}
        python += after[0] - before[0]
        pool += after[1] - before[1]
        tokens += w["work"]
    return {"python_ns": python / tokens * 1e9, "pool_ns": pool / tokens * 1e9} if tokens else {}


def own_share(r: dict, key: str) -> float | None:
    """CPU our Python threads add per token, beyond bare's call itself, as a share of the tokenizer's own."""
    ours, bare = r["split"].get(key, {}), r["split"]["bare"]
    if "python_ns" not in ours or "python_ns" not in bare or not bare["pool_ns"]:
        return None
    return (ours["python_ns"] - bare["python_ns"]) / bare["pool_ns"]


def long_run_yield(tok: Tokenizer, docs: list[str], capacity: int, buffer_size: int) -> float:
    """Best-fit's steady-state yield on this corpus: the real packer run over 20 buffers' worth of documents
    drawn (seeded) from the corpus's length distribution (lengths estimated from chars with a tokenized
    sample's chars/token), counting only documents that left the buffer."""
    from lightning_d9d.streaming.packing.bestfit import BestFitPacker

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
    counters = packer.counters
    return counters.emitted / max(1, counters.emitted + counters.cropped)


def quality_figures(q: dict, packing: str, capacity: int) -> dict:
    """Waste, rows that start with BOS and documents cut, from the rows and the streams' counters."""
    c = q["counters"]
    row_tokens = c["rows"] * capacity
    dropped = c["cropped"]
    if packing == "concat":
        # A row that begins inside a document is a cut through it; a row without any document start lies inside
        # one document, which was counted at the row before, so each cut document counts once.
        cut = (q["rows"] - q["bos_start"] - q["no_bos"]) / max(1, q["bos_tokens"])
    elif packing == "bestfit":
        cut = c["crops"] / max(1, c["docs"] - q["buffered"])
    else:
        cut = c["split_docs"] / max(1, c["docs"])
    return {
        "waste_rows": (c["padding"] + dropped) / max(1, row_tokens),
        "waste_tokenized": (c["padding"] + dropped) / max(1, c["emitted"] + c["padding"] + dropped),
        "bos_start": q["bos_start"] / max(1, q["rows"]),
        "cut": cut,
        "rows": c["rows"],
        "sampled_rows": q["rows"],
    }


# ------------------------------------------------------------------------------------------------ one corpus
def run_corpus(name: str, files: str, tok: Tokenizer, texts: list[str], args: argparse.Namespace) -> dict:
    seconds = args.long_seconds if name == "long" else args.seconds
    base = {"files": files, "tokenizer": args.tokenizer_path, "seq_len": args.seq_len,
            "global_batch": args.global_batch, "microbatch": args.microbatch, "batch_size": args.tokenizer_batch,
            "buffer": args.buffer, "num_streams": args.num_streams}  # fmt: skip
    configs: dict[str, tuple[str, dict, str | None]] = {"bare": ("bare", {}, None)}
    for path, workers in (("w", args.workers), ("ip", 0)):
        for packing in PACKINGS:
            configs[f"{path}_{packing}"] = ("dm", {"packing": packing, "workers": workers}, None)
    if not args.skip_ref:
        configs["ref_concat"] = ("ref", {"kind": "concat"}, None)
        configs["ref_bestfit"] = ("ref", {"kind": "bestfit"}, None)
    for packing in args.compare_packings:
        if args.old_tree and packing != "bestfit_split":
            configs[f"old_w_{packing}"] = ("dm", {"packing": packing, "workers": args.workers}, args.old_tree)
        if args.compare_k:
            cfg = {"packing": packing, "workers": args.workers, "num_streams": args.compare_k}
            configs[f"k{args.compare_k}_w_{packing}"] = ("dm", cfg, None)
    for label, patches in args.variant:
        for packing in args.compare_packings:
            cfg = {"packing": packing, "workers": args.workers, "patches": patches}
            configs[f"{label}_w_{packing}"] = ("dm", cfg, None)

    r: dict = {"windows": {key: [] for key in configs}, "bare_last": [], "info": {}}
    handles: dict = {}
    try:
        for key, (kind, cfg, tree) in configs.items():  # one at a time: start-up figures are not shared
            start = time.perf_counter()
            handles[key] = start_runner(kind, {**base, **cfg}, args.inline, tree)
            r["info"][key] = {**handles[key].info, "start_s": time.perf_counter() - start}
            print(f"  started {key}: {_fmt_info(r['info'][key])}", flush=True)
        loaders = [key for key in configs if key != "bare"]
        for round_index in range(args.runs):
            r["windows"]["bare"].append(handles["bare"].call("window", seconds))
            # Forward, then backward: a loader's place in the round biases its windows (the same code measures
            # faster late in a round than right after bare), so every loader gets the same mean place.
            for key in loaders if round_index % 2 == 0 else loaders[::-1]:
                r["windows"][key].append(handles[key].call("window", seconds))
            r["bare_last"].append(handles["bare"].call("window", seconds))
            line = " ".join(f"{k} {rates(v)[-1] / 1e3:.0f}K" for k, v in r["windows"].items())
            print(f"  round {round_index + 1}: {line}, bare again {rates(r['bare_last'])[-1] / 1e3:.0f}K", flush=True)
        r["quality"] = {}
        for key in configs:
            if key.startswith(("w_", "ip_", "ref_")):
                r["quality"][key] = handles[key].call("quality", args.quality_steps)
        r["rss"] = {key: handles[key].call("rss") for key in configs if key.startswith(("w_", "ip_"))}
        r["states"] = {packing: handles[f"w_{packing}"].call("state") for packing in PACKINGS}
    finally:
        for handle in handles.values():
            handle.close()
    r["resume"] = {}
    for packing in PACKINGS:
        saved = r["states"][packing]
        for layout in QUICK_LAYOUTS if args.quick else LAYOUTS:
            layout = tuple(args.workers if v == "W" else v for v in layout)
            cfg = {**base, "packing": packing, "state": saved["state"], "rows": saved["rows"], "layout": layout}
            r["resume"][(packing, layout[0])] = start_runner("resume", cfg, args.inline).info
    r["yield"] = long_run_yield(tok, texts, args.seq_len + 1, args.buffer)
    return r


def _fmt_info(info: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in info.items() if isinstance(v, float))


def figures(r: dict) -> dict:
    """Pooled rates, per-round ratios and medians, the noise floor."""
    w = r["windows"]
    bare_all = w["bare"] + r["bare_last"]
    f: dict = {"bare": pooled(bare_all), "rate": {}, "work": {}, "work_cpu": {}, "round": {}, "split": {}}
    first, last = pooled(w["bare"]), pooled(r["bare_last"])
    f["noise_floor"] = min(first, last) / max(first, last)
    round_bare = [max(a, b) for a, b in zip(rates(w["bare"]), rates(r["bare_last"]))]
    for key, windows in w.items():
        if key == "bare":
            windows = bare_all
        f["rate"][key] = pooled(windows)
        f["work"][key] = pooled(windows, "work")
        f["work_cpu"][key] = sum(x["work"] for x in windows) / max(1e-9, sum(x["cpu"] for x in windows))
        f["split"][key] = cpu_split(windows)
        if key != "bare":
            f["round"][key] = {"useful": rates(windows), "work": rates(windows, "work"), "bare": round_bare}
    return f


def paired_median(f: dict, key: str, other: str | None = None, what: str = "useful", other_what: str = "useful"):
    """Median over rounds of key's rate / other's rate in the same round (other: the round's better bare)."""
    mine = f["round"][key][what]
    theirs = f["round"][key]["bare"] if other is None else f["round"][other][other_what]
    return float(np.median([a / b for a, b in zip(mine, theirs)]))


def ratio(f: dict, key: str, other: str, what: str = "useful", other_what: str = "useful") -> tuple[float, float]:
    """(pooled ratio, median per round) of two configurations' rates."""
    table = {"useful": f["rate"], "work": f["work"]}
    return table[what][key] / table[other_what][other], paired_median(f, key, other, what, other_what)


PATHS = (("w", "DataModule, {workers} workers"), ("ip", "in-process (num_workers=0)"))


def verdicts(results: dict, args: argparse.Namespace) -> list[tuple[bool, str]]:
    out = []
    for name, r in results.items():
        f, q = r["figures"], r["qualities"]
        concat_bare = f["rate"]["w_concat"] / f["bare"]
        out.append(
            (
                concat_bare >= 0.9,
                f"{name}, DataModule {args.workers} workers: concat {concat_bare:.2f}x the bare tokenizer (target >= "
                f"0.90; median per round {paired_median(f, 'w_concat'):.2f}; bare vs bare {f['noise_floor']:.2f})",
            )
        )
        for prefix, label in PATHS:
            label = label.format(workers=args.workers)
            pooled_ratio, median = ratio(f, f"{prefix}_bestfit", f"{prefix}_concat", "work", "work")
            out.append(
                (
                    pooled_ratio >= 0.85,
                    f"{name}, {label}: bestfit tokenizes {pooled_ratio:.2f}x concat's rate, i.e. rows "
                    f"{pooled_ratio:.2f} x yield x concat (target >= 0.85; median per round {median:.2f})",
                )
            )
            if "ref_bestfit" in f["rate"]:
                pooled_ratio, median = ratio(f, f"{prefix}_bestfit", "ref_bestfit", "work", "work")
                out.append(
                    (
                        pooled_ratio >= 1.0,
                        f"{name}, {label}: bestfit tokenizes {pooled_ratio:.2f}x nanochat's best-fit port (target "
                        f">= 1.00; median per round {median:.2f})",
                    )
                )
            if name == "short":
                pooled_ratio, median = ratio(f, f"{prefix}_bestfit", f"{prefix}_concat")
                out.append(
                    (
                        pooled_ratio >= 0.8,
                        f"{name}, {label}: bestfit rows {pooled_ratio:.2f}x concat's (target >= 0.80; median per "
                        f"round {median:.2f})",
                    )
                )
            pooled_ratio, median = ratio(f, f"{prefix}_bestfit_split", f"{prefix}_concat")
            out.append(
                (
                    pooled_ratio >= 0.9,
                    f"{name}, {label}: bestfit_split useful tokens/s {pooled_ratio:.2f}x concat's (target >= 0.90; "
                    f"median per round {median:.2f})",
                )
            )
            if "ref_bestfit" in f["rate"]:
                pooled_ratio, median = ratio(f, f"{prefix}_bestfit_split", "ref_bestfit")
                out.append(
                    (
                        pooled_ratio >= 2.0,
                        f"{name}, {label}: bestfit_split useful tokens/s {pooled_ratio:.2f}x nanochat's best-fit "
                        f"port (target >= 2.00; median per round {median:.2f})",
                    )
                )
        waste = q["w_bestfit_split"]["waste_rows"]
        out.append(
            (
                waste <= 0.01,
                f"{name}: bestfit_split padding + dropped {waste:.2%} of row tokens (target <= 1 %; buffer "
                f"{args.buffer}, {q['w_bestfit_split']['rows']} rows)",
            )
        )
        for packing in PACKINGS:
            resumes = {label: v for (p, label), v in r["resume"].items() if p == packing}
            worst = max(v["first_s"] for v in resumes.values())
            out.append(
                (
                    worst <= 3.0,
                    f"{name}, {packing}: first batch after a resume {worst:.2f}s at worst over {len(resumes)} "
                    "layouts (target <= 3 s)",
                )
            )
        matches = [v["match"] for v in r["resume"].values()]
        out.append(
            (
                all(matches),
                f"{name}: {sum(matches)} of {len(matches)} resumed steps train the uninterrupted run's rows (target: "
                "all)",
            )
        )
        sizes = {packing: max(r["states"][packing]["sizes"]) / 1024 for packing in PACKINGS}
        worst = max(sizes.values())
        shown = ", ".join(f"{p} {v:.1f}" for p, v in sizes.items())
        out.append(
            (
                worst <= 64,
                f"{name}: state {worst:.1f} KiB per stream at worst ({shown}; buffer {args.buffer}; target <= 64 KiB)",
            )
        )
        share = own_share(f, "ip_concat")
        if share is not None:
            out.append(
                (
                    share < 0.10,
                    f"{name}: in-process concat's own Python work {share:.1%} of the tokenizer's CPU per token "
                    "(target < 10 %)",
                )
            )
    return out


LABELS = {
    "w_concat": "concat, {w} workers",
    "w_bestfit": "bestfit, {w} workers",
    "w_bestfit_split": "bestfit_split, {w} workers",
    "ip_concat": "concat, in-process",
    "ip_bestfit": "bestfit, in-process",
    "ip_bestfit_split": "bestfit_split, in-process",
    "ref_concat": "nanochat concat port",
    "ref_bestfit": "nanochat best-fit port",
}


def report(name: str, r: dict, args: argparse.Namespace) -> None:
    f, q, bare = r["figures"], r["qualities"], r["figures"]["bare"]
    print(
        f"\n== {name} documents ==   best-fit long-run yield {r['yield']:.2f}: cropping drops {1 - r['yield']:.0%} "
        "of the tokenizer's work (nanochat's best-fit drops the same remainders)"
    )
    print(
        "                                  useful tok/s  x bare (median/round)  tokenized/s  tokenized/CPU-s  "
        "first step"
    )
    for key in f["rate"]:
        if key == "bare":
            continue
        label = LABELS.get(key, key).format(w=args.workers)
        print(
            f"  {label:<31} {f['rate'][key] / 1e3:9.0f}K  {f['rate'][key] / bare:5.2f} ({paired_median(f, key):.2f})"
            f"          {f['work'][key] / 1e3:8.0f}K  {f['work_cpu'][key] / 1e3:12.0f}K  "
            f"{r['info'][key].get('first_step_s', 0):8.1f}s"
        )
    print(f"  {'bare tokenizer':<31} {'':>10}  {'':>21}  {bare / 1e3:8.0f}K  {f['work_cpu']['bare'] / 1e3:12.0f}K")
    print("  every window, K useful tokens/s (bare: tokenized; its first-slot windows, then its last-slot ones):")
    for key, windows in r["windows"].items():
        extra = rates(r["bare_last"]) if key == "bare" else []
        print(f"    {key:<18} " + " ".join(f"{v / 1e3:.0f}" for v in rates(windows) + extra))
    print(f"  bare vs bare, the noise floor of every ratio: {f['noise_floor']:.2f}")
    for prefix, label in PATHS:
        print(f"  -- {label.format(workers=args.workers)}: pooled (median per round)")
        rows = [
            ("concat / bare, useful", f"{prefix}_concat", None, "useful", "useful", "0.90" if prefix == "w" else "-"),
            ("bestfit / concat, tokenizing", f"{prefix}_bestfit", f"{prefix}_concat", "work", "work", "0.85"),
            ("bestfit / concat, rows", f"{prefix}_bestfit", f"{prefix}_concat", "useful", "useful",
             "0.80" if name == "short" else "-"),
            ("bestfit / nanochat best-fit, tokenizing", f"{prefix}_bestfit", "ref_bestfit", "work", "work", "1.00"),
            ("bestfit_split / concat, useful", f"{prefix}_bestfit_split", f"{prefix}_concat", "useful", "useful",
             "0.90"),
            ("bestfit_split / nanochat best-fit, useful", f"{prefix}_bestfit_split", "ref_bestfit", "useful", "useful",
             "2.00"),
            ("concat / nanochat concat, useful", f"{prefix}_concat", "ref_concat", "useful", "useful", "-"),
        ]  # fmt: skip
        for text, key, other, what, other_what, target in rows:
            if other is not None and other not in f["rate"]:
                continue
            if other is None:
                value, median = f["rate"][key] / bare, paired_median(f, key)
            else:
                value, median = ratio(f, key, other, what, other_what)
            print(f"    {text:<44} {value:5.2f} ({median:.2f})   target {target}")
    extras = [key for key in f["rate"] if key.startswith(("old_", "k")) or key.split("_w_")[0] in args.variant_labels]
    if extras:
        print("  -- comparisons (same rounds): pooled useful tokens/s vs the default configuration (median per round)")
        for key in extras:
            packing = key.split("_w_", 1)[1]
            value, median = ratio(f, key, f"w_{packing}")
            print(f"    {key:<30} {f['rate'][key] / 1e3:7.0f}K  {value:5.2f}x w_{packing} ({median:.2f})")
    print("  packing quality (counters since each stream's start; BOS and concat's cuts over the rows sampled):")
    print("    configuration                 waste/rows  waste/tokenized  rows from BOS  documents cut   rows")
    for key, v in q.items():
        print(
            f"    {LABELS.get(key, key).format(w=args.workers):<29} {v['waste_rows']:9.2%}"
            f"  {v['waste_tokenized']:14.2%}"
            f"  {v['bos_start']:12.1%}  {v['cut']:12.1%}  {v['rows']:6d}"
        )
    print(f"  first batch after a resume from the {args.workers}-worker run's state "
          "(s; setup before it, s; rows as uninterrupted)")  # fmt: skip
    for (packing, label), v in r["resume"].items():
        print(f"    {packing:<14} {label:<44} {v['first_s']:6.2f}  (setup {v['setup_s']:5.1f})  {v['match']}")
    print("  state per stream (pickled StreamState.to_dict()), KiB: max / mean; torch.save'd data state / K")
    for packing, saved in r["states"].items():
        sizes = np.asarray(saved["sizes"]) / 1024
        print(
            f"    {packing:<14} {sizes.max():6.1f} / {sizes.mean():6.1f}   "
            f"{saved['checkpoint_bytes'] / 1024 / len(sizes):6.1f}"
        )
    print("  peak RSS (VmHWM), MiB: training process + its workers (each counts pages it shares with the others)")
    for key, v in r["rss"].items():
        workers = " + ".join(f"{x:.0f}" for x in v["workers_mib"]) or "-"
        total = v["main_mib"] + sum(v["workers_mib"])
        print(f"    {LABELS.get(key, key).format(w=args.workers):<29} {v['main_mib']:6.0f} + {workers}  = {total:6.0f}")
    if "python_ns" in f["split"]["bare"]:
        print("  in-process, CPU per token (pooled)   Python threads   tokenizer threads   own work / tokenizer's")
        for key, label in (("bare", "bare tokenizer"), ("ip_concat", "concat"), ("ip_bestfit", "bestfit"),
                           ("ip_bestfit_split", "bestfit_split")):  # fmt: skip
            split = f["split"].get(key, {})
            if "python_ns" not in split:
                continue
            share = own_share(f, key) if key != "bare" else None
            print(
                f"    {label:<32} {split['python_ns']:10.0f} ns {split['pool_ns']:15.0f} ns"
                + (f" {share:18.1%}" if share is not None else "   (the call itself)")
            )
    print("  start-up, s (setup: footers + pass estimate; first step: every stream's first block):")
    for key, info in r["info"].items():
        print(f"    {key:<22} {_fmt_info(info)}")


# ------------------------------------------------------------------------------------------------ main
def _variant(text: str) -> tuple[str, dict]:
    """``LABEL:module.attr=value[,module.attr=value]`` -> (label, {target: value})."""
    label, _, assignments = text.partition(":")
    patches = {}
    for item in assignments.split(","):
        target, _, value = item.partition("=")
        patches[target.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return label, patches


# ------------------------------------------------------------------------------------------- first batch
def _first_batch_child(conn, files: object, args: dict, packing: str, growth: bool, waste: bool) -> None:
    """In a fresh process: set up a DataModule (world size 1), time its first batch, send the figures."""
    from dataclasses import replace

    # A spawned process inherits "spawn" as its start method, so its DataLoader workers would each import torch
    # again; a training script's workers start by the platform's default (fork on Linux), as here.
    multiprocessing.set_start_method(None, force=True)

    from lightning_d9d.datamodules.pretraining import PretrainingDataModule
    from lightning_d9d.streaming.plans.packings import FULL_BUFFER, BufferGrowth

    weights = {name: 1.0 for name in files} if isinstance(files, dict) else None
    dm = PretrainingDataModule(
        files, args["tokenizer"], seq_len=args["seq_len"], global_batch_size=args["global_batch"],
        microbatch_size=args["microbatch"], packing=packing, num_workers=args["workers"], steps_per_epoch=10**9,
        tokenizer_batch_size=args["batch_size"], bestfit_buffer_size=args["buffer"], pin_memory=False,
        weights=weights,
    )  # fmt: skip
    start = time.perf_counter()
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    # growing: the package's default growth, or --buffer-start/--buffer-growth; else full from the first row
    default = BufferGrowth()
    start = default.start if args["buffer_start"] is None else args["buffer_start"]
    per_row = default.per_row if args["buffer_growth"] is None else args["buffer_growth"]
    settings = replace(dm.settings, growth=BufferGrowth(start, per_row) if growth else FULL_BUFFER)
    spec = dm.train_spec
    dm.train_spec = replace(spec, sources=tuple(replace(s, settings=settings) for s in spec.sources))
    start = time.perf_counter()
    iterator = iter(dm.train_dataloader())
    next(iterator)
    first_s = time.perf_counter() - start
    result = {"first_s": first_s, "setup_s": setup_s, "waste": None}
    if waste:
        steps = args["steps"]
        for _ in range(steps * dm.microbatches_per_step - 1):  # on to where the buffers are grown
            next(iterator)
        before = dm.stream_stats()
        for _ in range(steps // 2 * dm.microbatches_per_step):  # a window of grown buffers
            next(iterator)
        after = dm.stream_stats()
        emitted, padding, cropped = (after[k] - before[k] for k in ("emitted", "padding", "cropped"))
        result["waste"] = (padding + cropped) / max(1, emitted + padding + cropped)
    dm.teardown("fit")
    conn.send(result)


def first_batch(corpora: dict[str, tuple[str, dict[str, str]]], args: argparse.Namespace) -> None:
    """The first batch of a fresh start, each packing, one corpus and a mixture of ``--sources`` parts of it,
    each in a process of its own (DataLoader workers started from scratch), with growing buffers and with buffers
    full from the first row; and ``bestfit_split``'s waste (padding) over ``--grown-steps`` / 2 steps once the
    buffers are full (after ``--grown-steps`` steps), both ways."""
    settings = {"tokenizer": args.tokenizer_path, "seq_len": args.seq_len, "global_batch": args.global_batch,
                "microbatch": args.microbatch, "workers": args.workers, "batch_size": args.tokenizer_batch,
                "buffer": args.buffer, "steps": args.grown_steps, "buffer_start": args.buffer_start,
                "buffer_growth": args.buffer_growth}  # fmt: skip
    from lightning_d9d.streaming.plans.packings import BufferGrowth

    start, per_row = BufferGrowth().start, BufferGrowth().per_row
    start = start if args.buffer_start is None else args.buffer_start
    per_row = per_row if args.buffer_growth is None else args.buffer_growth
    print(
        f"\nfirst batch of a fresh start, world size 1, {args.workers} workers, default K, buffer {args.buffer} "
        f"(growing: {start} + {per_row} per row):"
    )
    verdicts = []
    for name, (single, mixture) in corpora.items():
        for packing in args.packings.split(","):
            for label, files in (("single", single), (f"mixture of {len(mixture)}", mixture)):
                waste = packing == "bestfit_split" and label == "single" and args.grown_steps > 0
                grown = in_child(_first_batch_child, files, settings, packing, True, waste, inline=args.inline)
                verdicts.append((grown["first_s"] <= FIRST_BATCH_S, f"{name}, {packing}, {label}: first batch of "
                                 f"a fresh start {grown['first_s']:.1f}s (target <= {FIRST_BATCH_S:g} s)"))  # fmt: skip
                line = (
                    f"  {name}, {packing}, {label}: first batch {grown['first_s']:.1f}s (setup {grown['setup_s']:.1f}s)"
                )
                if packing != "concat" and not args.skip_full:
                    full = in_child(_first_batch_child, files, settings, packing, False, waste, inline=args.inline)
                    line += f" (buffer full from the first row: {full['first_s']:.1f}s)"
                    if waste:
                        line += (f"; waste of steps {args.grown_steps}..{args.grown_steps * 3 // 2}: "
                                 f"{grown['waste']:.2%} (full from the first row: {full['waste']:.2%})")  # fmt: skip
                print(line, flush=True)
    print()
    print_verdicts(verdicts)


def _arguments() -> argparse.Namespace:
    """The command line, with ``--quick``'s settings applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=40.0, help="at most this many MB of stdlib text in the corpus")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=1000, help="best-fit buffer (documents; pieces for split)")
    parser.add_argument("--tokenizer-batch", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per window, short documents")
    parser.add_argument("--long-seconds", type=float, default=8.0, help="seconds per window, long documents")
    parser.add_argument("--runs", type=int, default=4, help="rounds: windows per configuration")
    parser.add_argument("--quality-steps", type=int, default=50, help="steps whose rows are inspected (untimed)")
    parser.add_argument(
        "--workers",
        type=int,
        default=available_cores(),
        help="DataLoader workers of the DataModule path (default: the cores this process may use, "
        "as many as the bare tokenizer uses)",
    )
    parser.add_argument("--skip-ref", action="store_true", help="skip the nanochat ports")
    parser.add_argument("--corpora", default="long,short", help="which corpora to run (comma-separated)")
    parser.add_argument("--old-tree", help="also run the DataModule of this checkout (e.g. an older commit)")
    parser.add_argument("--num-streams", type=int, help="K of every DataModule (default: the package's)")
    parser.add_argument("--compare-k", type=int, default=0, help="also run the workers path with this num_streams")
    parser.add_argument("--compare-packings", default="concat,bestfit_split", help="packings of the comparisons")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        help="also run the workers path with module attributes set, LABEL:module.attr=value[,...] "
        "(e.g. pf32:lightning_d9d.streaming.loading.loader._PREFETCH_PER_PROCESS=32)",
    )
    parser.add_argument("--inline", action="store_true", help="every configuration in this process (--first-batch too)")
    parser.add_argument(
        "--first-batch", action="store_true", help="only time the first batch of fresh starts (and grown waste)"
    )
    parser.add_argument("--grown-steps", type=int, default=70, help="--first-batch: steps until buffers are full")
    parser.add_argument("--buffer-start", type=int, help="--first-batch: a growing buffer's start (default: ours)")
    parser.add_argument("--buffer-growth", type=int, help="--first-batch: its growth per row (default: ours)")
    parser.add_argument("--packings", default=",".join(PACKINGS), help="--first-batch: which packings to run")
    parser.add_argument("--skip-full", action="store_true", help="--first-batch: not with buffers full at once")
    parser.add_argument("--sources", type=int, default=2, help="--first-batch: sources of the mixture")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 0.5 MB corpus of short documents, seq_len 256, global batch 16, K 4, small buffers, 1 short round, "
        "inline (smoke test: its figures are meaningless)",
    )
    args = parser.parse_args()
    if args.quick:
        # Only proves that every configuration still runs and every target is judged: as small as that allows (K 4:
        # fewer streams to start, and to join at teardown, in each of the DataModules set up here).
        args.mb, args.seconds, args.long_seconds, args.runs, args.vocab = 0.5, 0.1, 0.1, 1, 1024
        args.buffer, args.quality_steps, args.inline, args.corpora = 16, 1, True, "short"
        args.seq_len, args.global_batch, args.num_streams = 256, 16, 4
    return args


def main() -> None:
    args = _arguments()
    args.compare_packings = [p for p in args.compare_packings.split(",") if p]
    args.variant_labels = {label for label, _ in args.variant}

    texts = stdlib_texts(args.mb)
    short = [p for t in texts for p in t.split("\n\n") if p.strip()]
    print(
        f"corpus: {len(texts)} long documents / {len(short)} short, {sum(map(len, texts)) / 1e6:.1f} MB; "
        f"{available_cores()} cores; seq_len={args.seq_len}, microbatch={args.microbatch}, global batch "
        f"{args.global_batch}, best-fit buffer {args.buffer}, DataModule num_workers={args.workers}"
    )
    t0 = time.perf_counter()
    tok = train_tokenizer(texts[:: max(1, len(texts) // 300)], args.vocab)  # a sample is enough for a BPE
    print(f"tokenizer: byte-level BPE, vocab {args.vocab}, trained in {time.perf_counter() - t0:.1f}s")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.tokenizer_path = str(Path(tmp) / "tokenizer.json")
        tok.save(args.tokenizer_path)
        corpora = {"long": (texts, 128), "short": (short, 1024)}
        if args.first_batch:
            written = {}
            for name in args.corpora.split(","):
                docs, group_size = corpora[name]
                group_size = min(group_size, max(1, len(docs) // (4 * 16)))
                parts = {f"s{k}": docs[k :: args.sources] for k in range(args.sources)}  # documents dealt in turn
                mixture = {k: write_corpus(Path(tmp) / name / k, v, group_size) for k, v in parts.items()}
                written[name] = (write_corpus(Path(tmp) / name / "all", docs, group_size), mixture)
            first_batch(written, args)
            return
        for name in args.corpora.split(","):
            docs, group_size = corpora[name]
            # Smaller row groups where needed, so that every stream gets several (on 2 cores they stay 128 and
            # 1,024 documents).
            files = write_corpus(Path(tmp) / name, docs, min(group_size, max(1, len(docs) // (4 * 16))))
            print(f"\n{name} documents: starting the configurations, then {args.runs} rounds", flush=True)
            r = results[name] = run_corpus(name, files, tok, docs, args)
            r["figures"] = figures(r)
            r["qualities"] = {
                key: quality_figures(v, key.split("_", 1)[1], args.seq_len + 1)
                for key, v in r["quality"].items()
                if not key.startswith("ref_")
            }
            for key in ("ref_bestfit",):
                if key in r["quality"]:
                    v = r["quality"][key]
                    r["qualities"][key] = {
                        "waste_rows": v["cropped"] / max(1, v["emitted"]),
                        "waste_tokenized": v["cropped"] / max(1, v["emitted"] + v["cropped"]),
                        "bos_start": 1.0,
                        "cut": float("nan"),
                        "rows": v["emitted"] // (args.seq_len + 1),
                    }
            report(name, r, args)
    print("\nsummary (pooled useful tokens/s; bare: tokens/s the tokenizer produces):")
    for name, r in results.items():
        line = ", ".join(f"{k} {v / 1e3:.0f}K" for k, v in r["figures"]["rate"].items())
        print(f"  {name}: {line}; bestfit yield {r['yield']:.2f}")
    print_verdicts(verdicts(results, args))


if __name__ == "__main__":
    main()
