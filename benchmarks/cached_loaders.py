"""Cached loaders: PretrainingDataModule with a filled token cache against the memory system's limit and its peers.

Run: ``python benchmarks/cached_loaders.py`` (about 8 minutes on 2 cores, 15 with both peers and ``--old-tree``;
``--quick`` for a smoke test: a tiny corpus, every configuration in this process, figures meaningless). Nothing is
downloaded: the corpus is the stdlib text that ``benchmarks/streaming.py`` uses (help topics, then source files),
one parquet file, a byte-level BPE trained on it, and a token cache filled by two passes of ``concat`` before
anything is timed. Method and figures: ``docs/benchmarks_streaming.md`` (*Cached loaders*).

Configurations, each in a process of its own, started once and frozen (``SIGSTOP``) outside its own windows:

* ``PretrainingDataModule`` (K 16, or ``--num-streams``; seq_len 1024, G 64, m 8) reading the filled cache:
  ``concat`` and ``bestfit_split`` with ``--workers`` DataLoader workers and in-process (``num_workers=0``);
* the limit: a bare loop copying blocks of ``m`` rows of the same rows (concat's, as raw ids in a uint16 memmap)
  into ``[m, seq_len + 1]`` int64 tensors, in ``--workers`` processes at once and in one;
* optional peers, where importable (they pull torchvision, so they are no dependency of this package): litdata
  (``StreamingDataset`` + ``TokensLoader`` over the same rows written by ``optimize``) and mosaicml-streaming
  (``StreamingDataset`` over the same rows written as MDS), batches of ``m`` rows converted to int64, in-process and
  with ``--workers`` workers; one that is not installed, or cannot run here, is skipped with a note;
* with ``--old-tree DIR``, another checkout's DataModule (cached ``concat`` and ``bestfit_split`` with workers and
  in-process, the tokenizing ``concat`` pass with workers) beside this one's: the regression check.

Timing: ``--rounds`` rounds; in each, every configuration runs one window of ``--seconds`` (whole steps or batches;
a tokenizing pass's windows last ``--tokenizing-seconds``: it makes a few steps a second), in one order in even
rounds and the reverse in odd ones. Every loader counts rows × seq_len tokens. Each figure is a ratio of two
configurations' rates in the same round; its min / median / max over the rounds is printed. Targets: cached concat
in the training process (``num_workers=0``) >= 1.0x litdata in-process (where installed); cached concat >= 10 % of
the bare copy loop with as many processes (in-process against one, ``--workers`` workers against as many); cached
bestfit_split >= 0.8x cached concat (with workers); with ``--old-tree``, the tokenizing pass >= 0.95x the old
checkout's. Rows: the first steps are identical with workers and in-process (and, with ``--old-tree``, in both
checkouts).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# A child run for another checkout (--old-tree) imports lightning_d9d from there; everything else from this one.
_TREE = os.environ.get("D9D_BENCH_TREE") or str(Path(__file__).resolve().parents[1])
sys.path.insert(0, _TREE)
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import Child, Inline, in_child, print_verdicts
from streaming import stdlib_corpus

PEER_TARGET, LIMIT_TARGET, SPLIT_TARGET, TOKENIZING_TARGET = 1.0, 0.10, 0.8, 0.95
DIGEST_STEPS = 2  # steps whose rows each DataModule configuration digests at its start (untimed)


# ------------------------------------------------------------------------------------------------ runners
def _datamodule(files: str, tokenizer: str, packing: str, workers: int, cache: str | None, shape: dict):
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=shape["seq_len"], global_batch_size=shape["global_batch"],
        microbatch_size=shape["microbatch"], packing=packing, num_workers=workers, steps_per_epoch=10**9,
        pin_memory=False, token_cache=cache, num_streams=shape["num_streams"],
    )  # fmt: skip
    dm.setup("fit")
    return dm


class OursRun:
    """``PretrainingDataModule(...).train_dataloader()`` iterated step by step; its first steps digested."""

    def __init__(self, files: str, tokenizer: str, packing: str, workers: int, cache: str | None, shape: dict,
                 **_: object):  # fmt: skip
        self.dm = _datamodule(files, tokenizer, packing, workers, cache, shape)
        self.per_step, self.seq_len = self.dm.microbatches_per_step, shape["seq_len"]
        self.batches = iter(self.dm.train_dataloader())
        digest, start = hashlib.sha256(), time.perf_counter()
        for _ in range(DIGEST_STEPS * self.per_step):
            batch = next(self.batches)
            for tensor in (batch.input_ids, batch.targets, batch.position_ids, batch.cu_seqlens):
                digest.update(tensor.numpy().tobytes())
        self.info = {"digest": digest.hexdigest(), "start_s": time.perf_counter() - start}

    def window(self, seconds: float) -> dict:
        rows, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(self.per_step):
                rows += len(next(self.batches))
        return {"tokens": rows * self.seq_len, "elapsed": time.perf_counter() - start}

    def close(self) -> None:
        self.dm.teardown("fit")


def _copy_blocks(path: str, capacity: int, microbatch: int, first: int, seconds: float) -> tuple[int, float]:
    """Copy blocks of ``microbatch`` rows of the memmap into int64 tensors for ``seconds``: (rows, elapsed)."""
    rows = np.memmap(path, np.uint16, "r").reshape(-1, capacity)
    last = len(rows) - microbatch
    at, copied, start = first % (last + 1), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(64):
            batch = torch.from_numpy(rows[at : at + microbatch].astype(np.int64))
            copied += len(batch)
            at = at + microbatch if at + microbatch <= last else 0
    return copied, time.perf_counter() - start


def _copier(conn, path: str, capacity: int, microbatch: int, first: int) -> None:
    while (seconds := conn.recv()) is not None:
        conn.send(_copy_blocks(path, capacity, microbatch, first, seconds))


class MemmapRun:
    """The limit: ``processes`` processes (0: this one) copying memmap blocks into int64 tensors at once."""

    def __init__(self, rows_path: str, capacity: int, shape: dict, processes: int, **_: object):
        self.args = (rows_path, capacity, shape["microbatch"])
        self.seq_len, self.conns, self.processes = shape["seq_len"], [], []
        share = len(np.memmap(rows_path, np.uint16, "r")) // capacity // max(1, processes)
        context = multiprocessing.get_context("fork")
        for i in range(processes):
            ours, theirs = context.Pipe()
            process = context.Process(target=_copier, args=(theirs, *self.args, i * share), daemon=True)
            process.start()
            self.conns.append(ours)
            self.processes.append(process)
        self.info: dict = {}

    def window(self, seconds: float) -> dict:
        if not self.conns:
            rows, elapsed = _copy_blocks(*self.args, 0, seconds)
            return {"tokens": rows * self.seq_len, "elapsed": elapsed}
        for conn in self.conns:
            conn.send(seconds)
        done = [conn.recv() for conn in self.conns]
        return {"tokens": sum(r for r, _ in done) * self.seq_len, "elapsed": max(e for _, e in done)}

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            conn.send(None)
            process.join()


class PeerRun:
    """A peer's loader over the same rows, endless (a new epoch where one ends), batches converted to int64."""

    def __init__(self, peer: str, peer_dir: str, capacity: int, shape: dict, workers: int, peer_path: list[str],
                 **_: object):  # fmt: skip
        sys.path[:0] = [entry for entry in peer_path if entry not in sys.path]
        self.loader = (_litdata_loader if peer == "litdata" else _mosaic_loader)(peer_dir, capacity, shape, workers)
        self.seq_len, self.batches = shape["seq_len"], iter(self.loader)
        self._next()
        self.info: dict = {}

    def _next(self) -> torch.Tensor:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        return (batch["tokens"] if isinstance(batch, dict) else batch).to(torch.int64)

    def window(self, seconds: float) -> dict:
        rows, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            rows += len(self._next())
        return {"tokens": rows * self.seq_len, "elapsed": time.perf_counter() - start}

    def close(self) -> None:
        self.batches = None


def _litdata_loader(peer_dir: str, capacity: int, shape: dict, workers: int):
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    dataset = StreamingDataset(peer_dir, item_loader=TokensLoader(block_size=capacity), shuffle=False)
    return StreamingDataLoader(dataset, batch_size=shape["microbatch"], num_workers=workers, drop_last=True,
                               persistent_workers=workers > 0)  # fmt: skip


def _mosaic_loader(peer_dir: str, capacity: int, shape: dict, workers: int):
    mosaic = _import_mosaic()
    dataset = mosaic.StreamingDataset(local=peer_dir, batch_size=shape["microbatch"], shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=shape["microbatch"], num_workers=workers, drop_last=True,
                                       persistent_workers=workers > 0)  # fmt: skip


def _import_mosaic():
    """mosaicml-streaming's package is named ``streaming``, like this folder's streaming.py: import it in its stead
    (only in a process that needs nothing more of this folder's)."""
    here = Path(__file__).resolve().parent
    for name in [name for name in sys.modules if name == "streaming" or name.startswith("streaming.")]:
        del sys.modules[name]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    try:
        import streaming as mosaic
    finally:
        sys.path[:] = saved
    return mosaic


# ------------------------------------------------------------------------------------------------ the data
def _fill(conn, files: str, tokenizer: str, cache: str, shape: dict, steps: int) -> None:
    """Two passes of concat with an empty cache (every stream reads all its units); the first pass's rows."""
    multiprocessing.set_start_method(None, force=True)  # workers start as a training script's do
    dm = _datamodule(files, tokenizer, "concat", shape["workers"], cache, shape)
    rows, batches = [], iter(dm.train_dataloader())
    for i in range(2 * steps * dm.microbatches_per_step):
        batch = next(batches)
        if i < steps * dm.microbatches_per_step:
            rows.append(torch.cat([batch.input_ids, batch.targets[:, -1:]], dim=1).numpy().astype(np.uint16))
    units = dm.train_spec.sources[0].units
    covered = dm.train_spec.sources[0].cache.coverage(units).cached
    dm.teardown("fit")
    conn.send({"rows": np.concatenate(rows).tobytes(), "covered": covered, "units": len(units)})


def _write_peer(conn, peer: str, rows_path: str, capacity: int, out: str, peer_path: list[str]) -> None:
    """Write the rows in ``peer``'s format; ``("ok", out)``, or ``("error", why)`` where the peer cannot."""
    sys.path[:0] = [entry for entry in peer_path if entry not in sys.path]
    try:
        (_write_litdata if peer == "litdata" else _write_mosaic)(rows_path, capacity, out)
        conn.send(("ok", out))
    except Exception as error:
        conn.send(("error", f"{type(error).__name__}: {error}".splitlines()[0][:200]))


def _write_litdata(rows_path: str, capacity: int, out: str) -> None:
    from functools import partial

    from litdata import TokensLoader, optimize

    count = len(np.memmap(rows_path, np.uint16, "r")) // capacity
    optimize(fn=partial(_litdata_rows, rows_path=rows_path, capacity=capacity), inputs=list(range(0, count, 1024)),
             output_dir=out, chunk_size=capacity * 4096, item_loader=TokensLoader(), num_workers=1,
             verbose=False, start_method="fork")  # fmt: skip


def _litdata_rows(first: int, rows_path: str, capacity: int):
    rows = np.memmap(rows_path, np.uint16, "r").reshape(-1, capacity)
    for row in rows[first : first + 1024]:
        yield torch.from_numpy(np.array(row))


def _write_mosaic(rows_path: str, capacity: int, out: str) -> None:
    mosaic = _import_mosaic()
    rows = np.memmap(rows_path, np.uint16, "r").reshape(-1, capacity)
    with mosaic.MDSWriter(out=out, columns={"tokens": f"ndarray:uint16:{capacity}"}, size_limit=1 << 26) as writer:
        for row in rows:
            writer.write({"tokens": np.array(row)})


PEERS = {"litdata": "litdata", "mosaic": "mosaicml-streaming"}  # name -> distribution


def peer_data(root: Path, rows_path: str, capacity: int, peer_path: list[str], quick: bool):
    """The rows written for each installed peer that can run here, and a note for each one skipped."""
    written, notes = {}, []
    for peer, distribution in PEERS.items():
        if next(iter(importlib.metadata.distributions(name=distribution, path=[*peer_path, *sys.path])), None) is None:
            notes.append(f"{peer}: not installed (pip install {distribution}, or --peer-path); skipped")
            continue
        if peer == "mosaic" and quick:
            notes.append("mosaic: skipped by --quick (its package `streaming` would replace this folder's here)")
            continue
        tag, value = in_child(_write_peer, peer, rows_path, capacity, str(root / peer), peer_path, inline=quick)
        if tag == "ok":
            written[peer] = value
        else:
            notes.append(f"{peer}: cannot run here ({value}); skipped")
    return written, notes


# ------------------------------------------------------------------------------------------------ the rounds
LABELS = {
    "concat_w": "concat, {w} workers", "split_w": "bestfit_split, {w} workers",
    "concat_ip": "concat, in-process", "split_ip": "bestfit_split, in-process",
    "memmap_w": "memmap copy loop, {w} processes", "memmap_1": "memmap copy loop, 1 process",
    "litdata_ip": "litdata, in-process", "litdata_w": "litdata, {w} workers",
    "mosaic_ip": "mosaic, in-process", "mosaic_w": "mosaic, {w} workers",
    "tok_concat_w": "concat tokenizing, {w} workers", "old_tok_concat_w": "old: concat tokenizing, {w} workers",
    "old_concat_w": "old: concat, {w} workers", "old_split_w": "old: bestfit_split, {w} workers",
    "old_concat_ip": "old: concat, in-process", "old_split_ip": "old: bestfit_split, in-process",
}  # fmt: skip


def configurations(args: argparse.Namespace, data: dict) -> dict[str, tuple]:
    """``key -> (runner, cfg, tree)`` of every configuration of this run."""
    w, cache = args.workers, data["cache"]
    ours = {"files": data["files"], "tokenizer": data["tokenizer"], "shape": data["shape"]}
    rows = {"rows_path": data["rows_path"], "capacity": data["capacity"], "shape": data["shape"]}
    configs = {
        "concat_w": (OursRun, {**ours, "packing": "concat", "workers": w, "cache": cache}, None),
        "split_w": (OursRun, {**ours, "packing": "bestfit_split", "workers": w, "cache": cache}, None),
        "concat_ip": (OursRun, {**ours, "packing": "concat", "workers": 0, "cache": cache}, None),
        "split_ip": (OursRun, {**ours, "packing": "bestfit_split", "workers": 0, "cache": cache}, None),
        "memmap_w": (MemmapRun, {**rows, "processes": w}, None),
        "memmap_1": (MemmapRun, {**rows, "processes": 0}, None),
    }
    for peer, peer_dir in data["peers"].items():
        for key, workers in ((f"{peer}_ip", 0), (f"{peer}_w", w)):
            cfg = {**rows, "peer": peer, "peer_dir": peer_dir, "workers": workers, "peer_path": args.peer_path}
            configs[key] = (PeerRun, cfg, None)
    if args.old_tree:  # the two tokenizing passes last and side by side: they see the same load in every round
        old = args.old_tree
        for key, packing, workers, key_cache, tree in (
            ("old_concat_w", "concat", w, cache, old), ("old_split_w", "bestfit_split", w, cache, old),
            ("old_concat_ip", "concat", 0, cache, old), ("old_split_ip", "bestfit_split", 0, cache, old),
            ("tok_concat_w", "concat", w, None, None),
            ("old_tok_concat_w", "concat", w, None, old),
        ):  # fmt: skip
            configs[key] = (OursRun, {**ours, "packing": packing, "workers": workers, "cache": key_cache}, tree)
    return configs


def start_all(configs: dict, inline: bool) -> tuple[dict, dict, list[str]]:
    """Every configuration started (one at a time); a peer that fails to start is skipped with a note."""
    handles, infos, notes = {}, {}, []
    for key, (runner, cfg, tree) in configs.items():
        started = time.perf_counter()
        try:
            handles[key] = Inline(runner, cfg) if inline else Child(runner, cfg, {"D9D_BENCH_TREE": tree or _TREE})
        except Exception as error:
            if runner is not PeerRun:
                raise
            notes.append(f"{key}: failed to start ({str(error).strip().splitlines()[-1][:200]}); skipped")
            continue
        infos[key] = {**handles[key].info, "started_s": time.perf_counter() - started}
        print(f"  started {key} in {infos[key]['started_s']:.1f} s", flush=True)
    return handles, infos, notes


def run_rounds(handles: dict, rounds: int, seconds: float, tokenizing_seconds: float) -> dict[str, list[float]]:
    """Tokens/s of every configuration in every round; the order reverses every other round."""
    rates: dict[str, list[float]] = {key: [] for key in handles}
    keys = list(handles)
    for round_index in range(rounds):
        for key in keys if round_index % 2 == 0 else keys[::-1]:
            window = handles[key].call("window", tokenizing_seconds if "tok_" in key else seconds)
            rates[key].append(window["tokens"] / window["elapsed"])
        print(f"  round {round_index + 1}: " + ", ".join(f"{k} {v[-1] / 1e6:.1f}M" for k, v in rates.items()),
              flush=True)  # fmt: skip
    return rates


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), float(np.median(values)), max(values)


def ratios(rates: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float] | None:
    """Min / median / max over rounds of a's rate over b's in the same round (None: either did not run)."""
    if a not in rates or b not in rates:
        return None
    return spread([x / y for x, y in zip(rates[a], rates[b])])


RATIOS = (  # (a, b, target of a's rate / b's in the same round, or None: printed only)
    ("concat_ip", "litdata_ip", PEER_TARGET), ("concat_ip", "memmap_1", LIMIT_TARGET),
    ("concat_w", "memmap_w", LIMIT_TARGET), ("split_w", "concat_w", SPLIT_TARGET),
    ("split_ip", "concat_ip", None), ("concat_w", "litdata_ip", None), ("concat_w", "litdata_w", None),
    ("concat_ip", "mosaic_ip", None), ("concat_w", "mosaic_w", None), ("litdata_ip", "memmap_1", None),
    ("concat_ip", "old_concat_ip", None), ("old_concat_ip", "litdata_ip", None), ("concat_w", "old_concat_w", None),
    ("split_w", "old_split_w", None), ("old_split_w", "old_concat_w", None), ("split_ip", "old_split_ip", None),
    ("tok_concat_w", "old_tok_concat_w", TOKENIZING_TARGET),
)  # fmt: skip


SAME_ROWS = (  # configurations whose first steps' batches must be identical
    ("concat_w", "concat_ip"), ("split_w", "split_ip"), ("concat_w", "old_concat_w"), ("concat_ip", "old_concat_ip"),
    ("split_w", "old_split_w"), ("split_ip", "old_split_ip"), ("tok_concat_w", "old_tok_concat_w"),
)  # fmt: skip


def report(rates: dict, infos: dict, workers: int) -> list[tuple[bool, str]]:
    """Print the rates and the ratios; the verdicts against the targets."""
    label = {key: text.format(w=workers) for key, text in LABELS.items()}
    print(f"\n{'configuration':<40}{'min tok/s':>12}{'median':>12}{'max':>12}")
    for key, values in rates.items():
        low, mid, high = spread(values)
        print(f"{label[key]:<40}{low / 1e6:>11.1f}M{mid / 1e6:>11.1f}M{high / 1e6:>11.1f}M")
    print(f"\n{'ratio (same round)':<72}{'min':>8}{'median':>8}{'max':>8}")
    verdicts = []
    for a, b, target in RATIOS:
        figure = ratios(rates, a, b)
        if figure is None:
            continue
        text = f"{label[a]} / {label[b]}"
        print(f"{text:<72}{figure[0]:>8.3f}{figure[1]:>8.3f}{figure[2]:>8.3f}")
        if target is not None:
            verdicts.append((figure[1] >= target, f"{text}: median {figure[1]:.3f}, min {figure[0]:.3f}, max "
                             f"{figure[2]:.3f} (target >= {target})"))  # fmt: skip
    for a, b in SAME_ROWS:
        if a in infos and b in infos:
            same = infos[a]["digest"] == infos[b]["digest"]
            verdicts.append((same, f"the first {DIGEST_STEPS} steps' batches of {label[a]} and {label[b]} "
                             "(target: identical)"))  # fmt: skip
    return verdicts


# ------------------------------------------------------------------------------------------------ main
def prepare(root: Path, options: argparse.Namespace) -> dict:
    """Corpus, tokenizer, a filled token cache, and the rows concat gave (tiled to ``--peer-rows``) as a memmap."""
    shape = {"seq_len": options.seq_len, "global_batch": options.global_batch, "microbatch": options.microbatch,
             "workers": options.workers, "num_streams": options.num_streams}  # fmt: skip
    texts, files, tokenizer, tok = stdlib_corpus(root, options.mb, options.vocab)
    tokens = sum(len(e) + 1 for e in tok.encode_batch_fast(texts))
    capacity = options.seq_len + 1
    steps = max(4, tokens // (options.global_batch * capacity))  # about one pass
    cache = str(root / "cache")
    filled = in_child(_fill, files, tokenizer, cache, shape, steps, inline=options.quick)
    rows = np.frombuffer(filled["rows"], np.uint16).reshape(-1, capacity)
    rows = np.tile(rows, (-(-options.peer_rows // len(rows)), 1))
    rows_path = str(root / "rows.u16")
    rows.tofile(rows_path)
    print(f"corpus: {len(texts)} documents, {tokens / 1e6:.2f} M tokens; cache filled ({filled['covered']} of "
          f"{filled['units']} units); {len(rows)} rows of {capacity} tokens for the copy loop and the peers",
          flush=True)  # fmt: skip
    return {"files": files, "tokenizer": tokenizer, "cache": cache, "shape": shape, "capacity": capacity,
            "rows_path": rows_path}  # fmt: skip


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, and copy-loop processes")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--num-streams", type=int, default=16, help="K (the DataModule's default: 16)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=6, help="windows per configuration (even: balanced order)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per window")
    parser.add_argument(
        "--tokenizing-seconds",
        type=float,
        default=10.0,
        help="seconds per window of a tokenizing pass (--old-tree; a few steps a second)",
    )
    parser.add_argument("--peer-rows", type=int, default=131072, help="rows the copy loop and the peers cycle over")
    parser.add_argument("--old-tree", help="also run this checkout's DataModule (a regression check)")
    parser.add_argument(
        "--peer-path",
        default="",
        help=f"folders ({os.pathsep}-separated) the peers are imported "
        "from, first, in their processes only (an install kept out of this environment)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny corpus, all in this process (smoke test)")
    options = parser.parse_args()
    options.peer_path = [entry for entry in options.peer_path.split(os.pathsep) if entry]
    if options.quick:
        options.mb, options.vocab, options.seq_len, options.global_batch, options.microbatch = 0.2, 1024, 256, 16, 4
        options.rounds, options.seconds, options.tokenizing_seconds, options.peer_rows = 2, 0.2, 0.2, 256
    return options


def main() -> None:
    options = _arguments()
    root = Path(tempfile.mkdtemp(prefix="cached-loaders-"))
    handles: dict = {}
    try:
        data = prepare(root, options)
        data["peers"], notes = peer_data(root, data["rows_path"], data["capacity"], options.peer_path, options.quick)
        handles, infos, failed = start_all(configurations(options, data), options.quick)
        for note in notes + failed:
            print(f"note: {note}")
        rates = run_rounds(handles, options.rounds, options.seconds, options.tokenizing_seconds)
        print_verdicts(report(rates, infos, options.workers))
    finally:
        for handle in handles.values():
            handle.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
