"""Token cache benchmark: a pass over a corpus read from the token cache against the same pass tokenizing.

Run: ``python benchmarks/cached_pass.py`` (``--quick`` for a smoke test: a tiny corpus, ``bestfit_split`` only,
seq_len 256, G 16, two passes per run, all in this process; its figures are meaningless). The corpus is the stdlib
text that ``benchmarks/streaming.py`` uses (help topics, then source files: long documents), as one parquet file,
and a byte-level BPE trained on it. For each packing, in this process's children with the same settings
(``--workers`` DataLoader workers, K 16, seq_len 1024, G 64, m 8):

1. three passes without a cache (tokenizing), two with an empty cache (tokenizing and storing: every stream reads
   all its units), then three with the cache they filled (reading it), and three more with the units' content keys
   given (what the cached pass costs without its content check: no read and hash of a unit's stored text before
   its entry is looked up), three runs of each, in pairs: useful tokens (document tokens in rows) per second over
   the passes after the first (steady state), side by side (cached: the median run; the check's cost: one minus
   the median of the pairs' ratios); then, per unit, the content check's time beside the entry load's, each the
   best of 5 rounds in one process;
2. the first batch of a resume from the cache: a state saved half-way through, loaded by a fresh DataModule whose
   workers start from scratch, timed from ``iter()`` to the first batch, in ``--resumes`` fresh processes (min /
   median / max);
3. the cache's size on disk beside the parquet file's.

Targets: the cached pass >= 10x the tokenizing pass's useful tokens/s (``concat`` and ``bestfit_split``), the first
batch of a cached resume <= 0.3 s (median). Rows are checked to be the same in the three passes (digest of every
batch). ``--resume-only`` fills the cache (two passes) and times the resumes alone, in ``--resumes`` rounds, each
resume in a fresh process, the order reversed every other round; with ``--peer-path`` (as in
``benchmarks/cached_loaders.py``), beside the same resume of its optional peers where importable: the first
packing's rows of a pass written for litdata (and mosaicml-streaming), a state of its loader (``--workers``
workers, batches of m rows) saved after half those rows, and its first batch after ``load_state_dict`` in a fresh
process, timed the same way and checked to be the batch the saving run got next; the ratios ours / peer's are of
the same round. A peer not installed, or that cannot run here, is skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from cached_loaders import _import_mosaic, _litdata_loader, peer_data, ratios, spread
from common import in_child, print_verdicts
from streaming import stdlib_corpus

SPEEDUP_TARGET = 10.0
RESUME_FIRST_BATCH_S = 0.3
PASSES = 3  # per measured run: the first warms up (best-fit buffers fill, workers start), the others are timed
CACHED_PASSES = 8  # cached passes are short: more of them to time
PAIRS = 3  # cached runs with and without the content check
# --quick only proves the script runs and judges its targets: one warm-up and one timed pass per run are enough.
QUICK_PASSES = 2


def _datamodule(files: str, tokenizer: str, packing: str, cache: str | None, args: dict):
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(
        files, tokenizer, seq_len=args["seq_len"], global_batch_size=args["global_batch"],
        microbatch_size=args["microbatch"], packing=packing, num_workers=args["workers"],
        steps_per_epoch=args["steps"], bos_token="<|bos|>", pin_memory=False, token_cache=cache,
    )  # fmt: skip
    dm.setup("fit")
    return dm


@contextlib.contextmanager
def _known_keys(dm, given: bool) -> Iterator[None]:
    """Where ``given``, every unit's content key up front (as a cache trusting its files would): the content check
    left out. Patched on the class, before the loader's workers fork, so they inherit it; undone after."""
    from lightning_d9d.streaming.sources.source import RowGroupIndex

    if not given:
        yield
        return
    keys = {tuple(source.index.files): [source.index.content_key(g) for g in range(len(source.index))]
            for source in dm.train_spec.sources}  # fmt: skip
    real = RowGroupIndex.content_key
    RowGroupIndex.content_key = lambda self, group: keys[tuple(self.files)][group]
    try:
        yield
    finally:
        RowGroupIndex.content_key = real


def _pass(
    conn, files: str, tokenizer: str, packing: str, cache: str | None, args: dict, passes: int, keys: bool = False,
    rows: bool = False,
) -> None:  # fmt: skip
    """In a fresh process: ``passes × args["steps"]`` steps; the rows of the first ``args["steps"]`` digested, a
    state saved half-way through them; useful tokens/s over the passes after the first (steady: best-fit buffers
    full, workers running); the cache's coverage at the end. ``keys``: the content keys given (:func:`_known_keys`);
    ``rows``: the first pass's rows (inputs and the last target, ``seq_len + 1`` uint16 ids each) sent as well."""
    multiprocessing.set_start_method(None, force=True)  # workers start as a training script's do
    dm = _datamodule(files, tokenizer, packing, cache, {**args, "steps": passes * args["steps"]})
    per_pass = args["steps"] * dm.microbatches_per_step
    digest, state, start, before, kept = hashlib.sha256(), None, time.perf_counter(), 0, []
    with _known_keys(dm, keys):
        for i, batch in enumerate(dm.train_dataloader()):
            if i < per_pass:
                digest.update(batch.input_ids.numpy().tobytes())
                if rows:
                    kept.append(torch.cat([batch.input_ids, batch.targets[:, -1:]], dim=1).to(torch.uint16))
            if i == per_pass // 2 - 1:
                state = dm.state_dict()
            if i == per_pass - 1:  # the timed part starts after the first pass
                start, before = time.perf_counter(), dm.stream_stats()["emitted"]
    elapsed = time.perf_counter() - start
    useful = dm.stream_stats()["emitted"] - before
    covered = sum(source.cache.coverage(source.units).cached for source in dm.train_spec.sources if source.cache)
    units = len(dm.train_spec.sources[0].units)
    dm.teardown("fit")
    saved = io.BytesIO()
    torch.save(state, saved)  # bytes: tensors through a pipe would outlive this process as shared memory
    conn.send({"tokens_per_s": useful / elapsed, "digest": digest.hexdigest(), "state": saved.getvalue(),
               "covered": covered, "units": units,
               "rows": torch.cat(kept).numpy().tobytes() if rows else None})  # fmt: skip


def _resume(conn, files: str, tokenizer: str, packing: str, cache: str, state: bytes, args: dict) -> None:
    """In a fresh process: a DataModule resumed from ``state``; seconds from ``iter()`` to its first batch."""
    multiprocessing.set_start_method(None, force=True)
    dm = _datamodule(files, tokenizer, packing, cache, args)
    dm.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    start = time.perf_counter()
    next(iter(dm.train_dataloader()))
    conn.send(time.perf_counter() - start)
    dm.teardown("fit")


def _resumes(files: str, tokenizer: str, packing: str, cache: str, state: bytes, args: dict, repeats: int,
             inline: bool) -> tuple[float, float, float]:  # fmt: skip
    """Min / median / max seconds to the first batch of ``repeats`` resumes from ``state``, each in a fresh process."""
    times = [in_child(_resume, files, tokenizer, packing, cache, state, args, inline=inline) for _ in range(repeats)]
    return min(times), statistics.median(times), max(times)


def _resume_verdict(packing: str, resume: tuple[float, float, float]) -> tuple[bool, str]:
    return (resume[1] <= RESUME_FIRST_BATCH_S, f"{packing}: first batch of a cached resume, median {resume[1]:.2f} s "
            f"(min {resume[0]:.2f}, max {resume[2]:.2f}; target <= {RESUME_FIRST_BATCH_S} s)")  # fmt: skip


def _peer_loader(peer: str, peer_dir: str, args: dict, peer_path: list[str]):
    """``peer``'s loader over the rows written for it, with ``args["workers"]`` workers, batches of m rows."""
    sys.path[:0] = [entry for entry in peer_path if entry not in sys.path]
    if peer == "litdata":
        return _litdata_loader(peer_dir, args["seq_len"] + 1, args, args["workers"])
    mosaic = _import_mosaic()
    dataset = mosaic.StreamingDataset(local=peer_dir, batch_size=args["microbatch"], shuffle=False)
    # Mosaic's own DataLoader counts the samples it yields: its state_dict is where that count resumes.
    return mosaic.StreamingDataLoader(dataset, batch_size=args["microbatch"], num_workers=args["workers"],
                                      drop_last=True)  # fmt: skip


def _batch_digest(batch) -> str:
    return hashlib.sha256((batch["tokens"] if isinstance(batch, dict) else batch).numpy().tobytes()).hexdigest()


def _peer_state(conn, peer: str, peer_dir: str, args: dict, batches: int, peer_path: list[str]) -> None:
    """In a fresh process: ``peer``'s loader state after ``batches`` batches, and the digest of the batch after."""
    multiprocessing.set_start_method(None, force=True)
    loader = _peer_loader(peer, peer_dir, args, peer_path)
    batch_iter = iter(loader)
    for _ in range(batches):
        next(batch_iter)
    state = loader.state_dict()
    conn.send({"state": state, "next": _batch_digest(next(batch_iter))})


def _peer_resume(conn, peer: str, peer_dir: str, args: dict, state: dict, peer_path: list[str]) -> None:
    """In a fresh process: ``peer``'s loader restored from ``state``; seconds from ``iter()`` to its first batch,
    and that batch's digest."""
    multiprocessing.set_start_method(None, force=True)
    loader = _peer_loader(peer, peer_dir, args, peer_path)
    loader.load_state_dict(state)
    start = time.perf_counter()
    batch = next(iter(loader))
    conn.send((time.perf_counter() - start, _batch_digest(batch)))


def _peer_resumes(root: Path, rows: bytes, args: dict, peer_path: list[str], quick: bool):
    """``rows`` written for each installed peer that can run here, and a state of its loader saved after half of
    them: ``(runs, nexts, notes)``: ``peer -> _peer_resume's arguments``, ``peer -> digest of the batch the saving
    run got next``, a note for each peer skipped."""
    rows_path = root / "rows.u16"
    rows_path.write_bytes(rows)
    capacity = args["seq_len"] + 1
    written, notes = peer_data(root, str(rows_path), capacity, peer_path, quick)
    batches = len(rows) // (2 * capacity) // args["microbatch"] // 2  # half the rows (uint16: 2 bytes an id)
    runs, nexts = {}, {}
    for peer, peer_dir in written.items():
        saved = in_child(_peer_state, peer, peer_dir, args, batches, peer_path, inline=quick)
        runs[peer], nexts[peer] = (_peer_resume, peer, peer_dir, args, saved["state"], peer_path), saved["next"]
    return runs, nexts, notes


def _resume_only(options: argparse.Namespace, files: str, tokenizer: str, args: dict, root: Path, inline: bool):
    """The resumes alone, ours and the peers', in interleaved rounds; their verdicts."""
    packings, runs, rows = options.packings.split(","), {}, b""
    for packing in packings:
        cache = str(root / f"cache-{packing}")
        filled = in_child(_pass, files, tokenizer, packing, cache, args, 2, False, packing == packings[0],
                          inline=inline)  # fmt: skip
        runs[packing] = (_resume, files, tokenizer, packing, cache, filled["state"], args)
        rows = filled["rows"] or rows
    peers, nexts, notes = _peer_resumes(root, rows, args, options.peer_path, options.quick)
    for note in notes:
        print(f"note: {note}")
    runs.update(peers)
    times: dict[str, list[float]] = {label: [] for label in runs}
    firsts: dict[str, set[str]] = {peer: set() for peer in peers}
    for round_index in range(options.resumes):
        for label in list(runs) if round_index % 2 == 0 else list(runs)[::-1]:
            target, *rest = runs[label]
            result = in_child(target, *rest, inline=inline)
            times[label].append(result[0] if label in peers else result)
            if label in peers:
                firsts[label].add(result[1])
    print(f"first batch of a resume, {options.resumes} fresh processes each ({options.workers} workers), seconds:")
    for label, values in times.items():
        print(f"  {label:<15}" + " ".join(f"{value:.2f}" for value in spread(values)) + "  (min median max)")
    verdicts = [_resume_verdict(packing, spread(times[packing])) for packing in packings]
    for peer in peers:
        for packing in packings:
            low, mid, high = ratios(times, packing, peer)
            print(f"  {packing} / {peer} (same round): median {mid:.2f}x (min {low:.2f}, max {high:.2f})")
        verdicts.append((firsts[peer] == {nexts[peer]}, f"{peer}: the first batch of every resume is the one the "
                         "saving run got next (target: identical)"))  # fmt: skip
    return verdicts


def _lookups(conn, files: str, tokenizer: str, cache: str, args: dict, rounds: int) -> None:
    """In a fresh process: per unit, the seconds its content check takes (read and hash its stored text chunk) and
    those its entry's load takes (read, CRC-32s, structure checks), each the best of ``rounds`` interleaved rounds;
    and the bytes hashed per unit."""
    from lightning_d9d.streaming.sources.content import text_chunk

    dm = _datamodule(files, tokenizer, "concat", cache, args)
    source = dm.train_spec.sources[0]
    index, units = source.index, source.units
    checks, loads = [float("inf")] * len(units), [float("inf")] * len(units)
    hashed = 0
    for _ in range(rounds):
        for unit, (group, start, stop) in enumerate(zip(units.group.tolist(), units.start.tolist(),
                                                        units.stop.tolist())):  # fmt: skip
            began = time.perf_counter()
            key = index.content_key(group)
            checked = time.perf_counter()
            found = source.cache.cache.load(*source.cache._where(group), start, stop, key)
            loaded = time.perf_counter()
            assert found is not None, "every unit is cached"
            index._taken(group)  # drop the bytes kept for a read that does not follow
            checks[unit], loads[unit] = min(checks[unit], checked - began), min(loads[unit], loaded - checked)
    for group in units.group.tolist():
        metadata = index._handle(int(index.file_of[group]))[0].metadata
        hashed += text_chunk(metadata, int(index.group_in_file[group]), index.text_column).length
    conn.send({"check": sum(checks) / len(units), "load": sum(loads) / len(units), "bytes": hashed / len(units)})


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--packings", default="concat,bestfit_split")
    parser.add_argument("--resumes", type=int, default=5, help="resumes timed per packing, each a fresh process")
    parser.add_argument("--resume-only", action="store_true", help="fill the cache, then time the resumes alone")
    parser.add_argument(
        "--peer-path",
        default="",
        help=f"with --resume-only: folders ({os.pathsep}-separated) the peers are imported from, first, in their "
        "processes only (an install kept out of this environment)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny corpus, bestfit_split, in process (smoke test)")
    options = parser.parse_args()
    options.peer_path = [entry for entry in options.peer_path.split(os.pathsep) if entry]
    mb = 0.1 if options.quick else options.mb
    args = {"seq_len": 1024, "global_batch": 64, "microbatch": 8, "workers": options.workers}
    passes, cached_passes, inline = PASSES, CACHED_PASSES, options.quick
    if options.quick:
        options.packings = "bestfit_split"
        args.update(seq_len=256, global_batch=16)
        passes = cached_passes = QUICK_PASSES
        options.resumes = 1
    root = Path(tempfile.mkdtemp(prefix="cached-pass-"))
    try:
        texts, files, tokenizer, tok = stdlib_corpus(root, mb, 1024 if options.quick else 8192)
        tokens = sum(len(e) + 1 for e in tok.encode_batch_fast(texts))
        args["steps"] = max(4, int(tokens // (args["global_batch"] * (args["seq_len"] + 1))))  # about one pass
        parquet_mb = _size(root / "data") / 1e6
        print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} MB of text, {tokens / 1e6:.2f} M "
              f"tokens, parquet {parquet_mb:.1f} MB; {args['steps']} steps of {args['global_batch']} rows x "
              f"{args['seq_len'] + 1} tokens, {options.workers} workers")  # fmt: skip
        if options.resume_only:
            print_verdicts(_resume_only(options, files, tokenizer, args, root, inline))
            return
        print(f"{'packing':<15}{'tokenizing tok/s':>18}{'filling tok/s':>15}{'cached tok/s':>15}"
              f"{'cached / tok':>14}{'no check tok/s':>16}{'check costs':>13}{'resume 1st s':>14}"
              f"{'cache MB':>10}")  # fmt: skip
        verdicts = []
        for packing in options.packings.split(","):
            cache = root / f"cache-{packing}"
            plain = in_child(_pass, files, tokenizer, packing, None, args, passes, inline=inline)
            # two passes with an empty cache: every stream reads all its units, so the cache is full after
            filling = in_child(_pass, files, tokenizer, packing, str(cache), args, 2, inline=inline)
            # The cached pass with and without its content check, one right after the other, in PAIRS pairs (the
            # order swapped in every other pair): the median of the pairs' ratios.
            checked, unchecked = [], []
            for pair in range(1 if inline else PAIRS):
                for keys in (False, True) if pair % 2 == 0 else (True, False):
                    run = in_child(_pass, files, tokenizer, packing, str(cache), args, cached_passes, keys,
                                   inline=inline)  # fmt: skip
                    (unchecked if keys else checked).append(run)
            cached = checked[0]
            resume = _resumes(files, tokenizer, packing, str(cache), cached["state"], args, options.resumes, inline)
            same = plain["digest"] == filling["digest"] == cached["digest"] == unchecked[0]["digest"]
            cached_rate = statistics.median(run["tokens_per_s"] for run in checked)
            unchecked_rate = statistics.median(run["tokens_per_s"] for run in unchecked)
            pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(checked, unchecked)]
            speedup, check = cached_rate / plain["tokens_per_s"], 1 - statistics.median(pairs)
            cache_mb = _size(cache) / 1e6
            print(f"{packing:<15}{plain['tokens_per_s']:>18,.0f}{filling['tokens_per_s']:>15,.0f}"
                  f"{cached_rate:>15,.0f}{speedup:>13.1f}x{unchecked_rate:>16,.0f}{100 * check:>12.1f}%"
                  f"{resume[1]:>14.2f}{cache_mb:>10.1f}")  # fmt: skip
            verdicts += [
                (same, f"{packing}: the same rows tokenizing, filling, cached and cached without the content check "
                 "(target: identical)"),
                (speedup >= SPEEDUP_TARGET, f"{packing}: cached / tokenizing useful tokens/s {speedup:.1f}x "
                 f"(target >= {SPEEDUP_TARGET:.0f}x)"),
                _resume_verdict(packing, resume),
            ]  # fmt: skip
            print(f"  cache / parquet size: {cache_mb / parquet_mb:.2f}; units cached after filling: "
                  f"{filling['covered']} of {filling['units']}")  # fmt: skip
            if packing == options.packings.split(",")[0]:
                lookup = in_child(_lookups, files, tokenizer, str(cache), args, 1 if inline else 5, inline=inline)
                print(f"  per unit: content check {lookup['check'] * 1e3:.2f} ms ({lookup['bytes'] / 1e3:.0f} kB of "
                      f"stored text read and hashed, {lookup['bytes'] / lookup['check'] / 1e6:.0f} MB/s), entry load "
                      f"{lookup['load'] * 1e3:.2f} ms: the check is {lookup['check'] / lookup['load']:.2f}x a "
                      "lookup's own cost")  # fmt: skip
        print_verdicts(verdicts)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
