"""Huge-document benchmark: peak memory and time of reading, tokenizing and packing one very large document.

Run: ``python benchmarks/huge_document.py`` (a 40 MB document; ``--size-mb 200`` for a larger one, ``--quick`` for a
1.2 MB smoke test in this process, ``--help`` for the rest). Nothing is downloaded: the ordinary documents are the
Python standard library's ``.py`` sources, the huge document is those sources concatenated up to ``--size-mb`` MB
(so it has spaces, as prose and code do), and the tokenizer is a byte-level BPE trained here. Results and how to
read them: ``docs/benchmarks_streaming.md`` and the memory bound in ``docs/streaming.md``.

Corpus: one parquet file; the ordinary documents in row groups of ``--row-group`` documents and the huge one in
a row group of its own. Every configuration runs in a fresh process of its own, which reports its peak RSS
(``getrusage``: ``RUSAGE_SELF`` for the process, ``RUSAGE_CHILDREN`` for its DataLoader workers, read after they
have exited):

* ``whole``: ``Tokenizer.encode`` of the huge document in one call (what tokenizing every document whole costs);
  it is run only where its expected peak (up to 220x the document) fits in ``--memory-gib``;
* ``pieces``: ``long_ids`` (the streams' path for a document over ``LONG_DOCUMENT_CHARS``); where
  ``whole`` ran, its ids are compared with the whole call's (they must be equal: the document has spaces);
* ``PretrainingDataModule(...).train_dataloader()`` with ``concat``, ``bestfit`` and ``bestfit_split``,
  ``num_workers`` 0 and 2, ``num_streams`` 2 (one stream per worker), iterated until the huge document is
  passed: *reached* is the first step whose counters hold the huge document's tokens (the packer took it), and
  *passed* the first step at which every token taken by then is in a row or dropped (``emitted + cropped``).
  Reported: set-up time, the first step, the time to reach and to pass it, and peak RSS. With
  ``--max-document-chars`` below the document's size the streams skip it instead: *passed* is then the first
  step whose counters hold it as ``too_long`` (read and skipped, never tokenized).

The figures are printed side by side, with each configuration's peak RSS over the document's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_TREE = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, _TREE)
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import print_verdicts

BOS = "<|bos|>"
# The huge document starts and ends with these (text found in no ordinary document), so that its first and last
# ids can be found in the rows; its body repeats the ordinary documents.
START, END = "HUGE DOCUMENT BEGINS: qzxv jkwq vvzx.\n", "\nqzxv jkwq vvzx: HUGE DOCUMENT ENDS."
MARK = 8  # ids per marker window
PACKINGS = ("concat", "bestfit", "bestfit_split")
# Bytes of peak RSS per character of one Tokenizer.encode call over a whole document (byte-level BPE), at most:
# the whole-call baseline is skipped where it would not fit in --memory-gib, since a kill would end the run.
WHOLE_CALL_BYTES_PER_CHAR = 220


# ------------------------------------------------------------------------------------------------ corpus
def ordinary_texts(max_mb: float) -> list[str]:
    from streaming import stdlib_texts

    return stdlib_texts(max_mb)


def huge_text(texts: list[str], size_mb: float) -> str:
    """The texts concatenated, repeated, up to ``size_mb`` MB of characters."""
    want, parts, size = int(size_mb * 1e6), [], 0
    while size < want:
        for text in texts:
            parts.append(text)
            size += len(text) + 1
            if size >= want:
                break
    body = "\n".join(parts)[: max(0, want - len(START) - len(END))]
    return START + body + END


def write_corpus(path: Path, docs: list[str], huge: str, row_group: int) -> None:
    schema = pa.schema([("text", pa.large_string())])
    with pq.ParquetWriter(path, schema) as writer:
        half = len(docs) // 2
        writer.write_table(pa.table({"text": pa.array(docs[:half], pa.large_string())}), row_group_size=row_group)
        writer.write_table(pa.table({"text": pa.array([huge], pa.large_string())}), row_group_size=1)
        writer.write_table(pa.table({"text": pa.array(docs[half:], pa.large_string())}), row_group_size=row_group)


def train_tokenizer(texts: list[str], vocab: int, path: Path) -> None:
    from streaming import train_tokenizer as train

    train(texts, vocab).save(str(path))


# ------------------------------------------------------------------------------------------------ children
def peak_mib() -> dict:
    """Peak RSS (ru_maxrss, KiB on Linux) of this process and of its exited, waited-for children, in MiB."""
    return {
        "self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def huge_document(corpus: Path) -> str:
    table = pq.ParquetFile(corpus)
    for group in range(table.num_row_groups):
        if table.metadata.row_group(group).num_rows == 1:
            return table.read_row_group(group, columns=["text"]).column(0)[0].as_py()
    raise ValueError(f"{corpus} has no one-row group: not a corpus written by this script")


def child_whole(args: dict) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args["tokenizer"])
    text = huge_document(Path(args["corpus"]))
    base_mib = rss_mib()
    start = time.perf_counter()
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int32)
    seconds = time.perf_counter() - start
    np.save(args["ids"], ids)
    return {"seconds": seconds, "tokens": len(ids), "base_mib": base_mib, **peak_mib()}


def child_pieces(args: dict) -> dict:
    from tokenizers import Tokenizer

    from lightning_d9d.streaming.tokens.tokenize import LONG_DOCUMENT_CHARS, long_ids
    from lightning_d9d.tokenization.backends import backend_for

    tok = Tokenizer.from_file(args["tokenizer"])
    text = huge_document(Path(args["corpus"]))
    base_mib = rss_mib()
    start = time.perf_counter()
    ids = long_ids(backend_for("tokenizers", tok.to_str()), text, LONG_DOCUMENT_CHARS)
    seconds = time.perf_counter() - start
    np.save(args["pieces_ids"], ids)
    out = {"seconds": seconds, "tokens": len(ids), "base_mib": base_mib, **peak_mib()}
    if os.path.exists(args["ids"]):
        out["equal_to_whole"] = bool(np.array_equal(np.load(args["ids"], mmap_mode="r"), ids))
    return out


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def holds(batch, windows: list[np.ndarray]) -> bool:
    """Whether a row of ``batch`` holds one of the ``windows`` (id sequences)."""
    rows = batch.input_ids.numpy()
    for window in windows:
        rows_at, cols_at = np.nonzero(rows[:, : rows.shape[1] - len(window) + 1] == window[0])
        for r, c in zip(rows_at.tolist(), cols_at.tolist()):
            if np.array_equal(rows[r, c : c + len(window)], window):
                return True
    return False


def child_datamodule(args: dict) -> dict:
    from lightning_d9d.datamodules.pretraining import PretrainingDataModule

    ids = np.load(args["pieces_ids"], mmap_mode="r")
    # Two windows each: a window cut by a row boundary leaves the other whole in one row.
    first = [np.array(ids[:MARK]), np.array(ids[MARK : 2 * MARK])]
    last = [np.array(ids[-2 * MARK : -MARK]), np.array(ids[-MARK:])]
    base_mib = rss_mib()

    dm = PretrainingDataModule(
        args["corpus"],
        args["tokenizer"],
        seq_len=args["seq_len"],
        global_batch_size=args["microbatch"],
        microbatch_size=args["microbatch"],
        packing=args["packing"],
        num_workers=args["workers"],
        num_streams=2,
        steps_per_epoch=10**9,
        pin_memory=False,
        max_document_chars=args["max_document_chars"],
    )
    start = time.perf_counter()
    dm.setup("fit")
    setup_s = time.perf_counter() - start
    iterator = iter(dm.train_dataloader())
    start = time.perf_counter()
    batch = next(iterator)
    first_s = time.perf_counter() - start
    reached_s = passed_s = None
    steps, taken, ends_seen = 1, 0, False
    while passed_s is None and time.perf_counter() - start < args["max_seconds"]:
        if dm.stream_stats()["too_long"]:  # skipped for its length: nothing of it is in flight
            passed_s = time.perf_counter() - start
            break
        if reached_s is None and holds(batch, first):
            reached_s, taken = time.perf_counter() - start, dm.stream_stats()["tokens"]
        ends_seen = ends_seen or (reached_s is not None and holds(batch, last))
        stats = dm.stream_stats()
        # Passed: its last ids are in a row (bestfit crops them) and every token taken by then is in a row or
        # dropped (bestfit_split places a document's pieces in any order).
        out_of_buffers = stats["emitted"] + stats["cropped"] >= taken
        if reached_s is not None and (ends_seen or args["packing"] == "bestfit") and out_of_buffers:
            passed_s = time.perf_counter() - start
            break
        batch = next(iterator)
        steps += 1
    stats = dm.stream_stats()
    dm.teardown("fit")  # the workers exit and are waited for: RUSAGE_CHILDREN then holds their peak
    del iterator
    return {"setup_s": setup_s, "first_s": first_s, "reached_s": reached_s, "passed_s": passed_s, "steps": steps,
            "stats": stats, "base_mib": base_mib, **peak_mib()}  # fmt: skip


def child_corpus(args: dict) -> dict:
    texts = ordinary_texts(args["ordinary_mb"])
    write_corpus(Path(args["corpus"]), texts, huge_text(texts, args["size_mb"]), args["row_group"])
    train_tokenizer(texts[:: max(1, len(texts) // 200)], args["vocab"], Path(args["tokenizer"]))
    return {"docs": len(texts), "mb": sum(map(len, texts)) / 1e6}


CHILDREN = {"corpus": child_corpus, "whole": child_whole, "pieces": child_pieces, "datamodule": child_datamodule}


def run_child(kind: str, args: dict, timeout: float, inline: bool = False) -> dict:
    """``kind`` in a fresh interpreter; its result, or ``{"error": ...}``.

    ``inline`` (``--quick``): in this process instead, its peak RSS meaningless, an error raised (a smoke test
    must fail on it, not print a verdict), and no interpreter start (seconds of imports on 2 cores) paid.
    """
    if inline:
        return CHILDREN[kind](json.loads(json.dumps(args)))
    command = [sys.executable, __file__, "--child", kind, json.dumps(args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ report
def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:7.1f}"


def report(results: dict, size_mb: float) -> list[tuple[bool, str]]:
    mib = size_mb * 1e6 / 2**20
    print(f"\nhuge document: {size_mb:g} MB ({mib:.0f} MiB)")
    print("  configuration                 set-up s  first step s  reached s  passed s   RSS MiB: before  peak  "
          "largest child   (peak - before) / document")  # fmt: skip
    verdicts = []
    for key, r in results.items():
        if "error" in r:
            print(f"  {key:<29} {r['error']}")
            verdicts.append((False, f"{key}: ran to the end (target: no failure, no out-of-memory kill)"))
            continue
        grown = (r["self_mib"] - r["base_mib"]) / mib
        if key in ("whole", "pieces"):
            label = f"{key} (tokenize only)"
            print(f"  {label:<29} {'':>8}  {'':>12}  {'':>9} {_s(r['seconds'])}  {r['base_mib']:15.0f} "
                  f"{r['self_mib']:5.0f}  {'':>13}   {grown:8.1f}x")  # fmt: skip
            continue
        print(
            f"  {key:<29} {_s(r['setup_s'])}  {_s(r['first_s']):>12}  {_s(r['reached_s']):>9} {_s(r['passed_s'])}  "
            f"{r['base_mib']:15.0f} {r['self_mib']:5.0f}  {r['children_mib']:13.0f}   {grown:8.1f}x"
        )
        verdicts.append((r["passed_s"] is not None, f"{key}: passed the huge document (target: within the run)"))
    whole, pieces = results.get("whole", {}), results.get("pieces", {})
    if "self_mib" in whole and "self_mib" in pieces:
        ratio = (whole["self_mib"] - whole["base_mib"]) / max(1.0, pieces["self_mib"] - pieces["base_mib"])
        print(f"  whole call / pieces, peak RSS growth: {ratio:.1f}x;  ids equal: {pieces.get('equal_to_whole')}")
        verdicts.append((bool(pieces.get("equal_to_whole")), "pieces: the ids of one call (target: equal)"))
    return verdicts


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=40.0, help="the huge document's size, MB of characters")
    parser.add_argument("--ordinary-mb", type=float, default=2.0, help="MB of ordinary documents")
    parser.add_argument("--row-group", type=int, default=64, help="ordinary documents per row group")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--microbatch", type=int, default=16)
    parser.add_argument("--packings", default=",".join(PACKINGS))
    parser.add_argument("--workers", default="0,2", help="num_workers values (comma-separated)")
    parser.add_argument("--memory-gib", type=float, default=24.0, help="the machine's memory (whole-call baseline)")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="give up on one configuration after this")
    parser.add_argument("--max-document-chars", default="default",
                        help="PretrainingDataModule's max_document_chars: an integer, 'none' or 'default'")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="a 1.2 MB document, concat, num_workers 0, in this process (smoke test)"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, child_args = args.child
        print(json.dumps(CHILDREN[kind](json.loads(child_args))))
        return
    if args.quick:
        # Just over LONG_DOCUMENT_CHARS (1 Mi characters), so that the streams still take the long-document path.
        args.size_mb, args.ordinary_mb, args.vocab, args.packings, args.workers = 1.2, 0.1, 1024, "concat", "0"
    from lightning_d9d.streaming.tokens.memory import DEFAULT_MAX_DOCUMENT_CHARS

    cap = {"default": DEFAULT_MAX_DOCUMENT_CHARS, "none": None}.get(args.max_document_chars.lower())
    cap = cap if args.max_document_chars.lower() in ("default", "none") else int(args.max_document_chars)
    with tempfile.TemporaryDirectory() as tmp:
        corpus, tokenizer, ids = Path(tmp) / "corpus.parquet", Path(tmp) / "tokenizer.json", Path(tmp) / "ids.npy"
        # In a child: a process's peak RSS passes to the children it starts, so this one never holds the document.
        made = run_child("corpus", {"corpus": str(corpus), "tokenizer": str(tokenizer), "size_mb": args.size_mb,
                                    "ordinary_mb": args.ordinary_mb, "row_group": args.row_group,
                                    "vocab": args.vocab}, args.max_seconds, args.quick)  # fmt: skip
        if "error" in made:
            raise SystemExit(f"writing the corpus failed: {made['error']}")
        print(f"corpus: {made['docs']} ordinary documents ({made['mb']:.1f} MB) + one of "
              f"{args.size_mb:g} MB; byte-level BPE vocab {args.vocab}; seq_len {args.seq_len}, microbatch "
              f"{args.microbatch}, num_streams 2, max_document_chars {cap}; {os.cpu_count()} cores")  # fmt: skip
        common = {"corpus": str(corpus), "tokenizer": str(tokenizer), "ids": str(ids),
                  "pieces_ids": str(Path(tmp) / "pieces.npy")}  # fmt: skip
        results = {}
        if args.size_mb * 1e6 * WHOLE_CALL_BYTES_PER_CHAR < 0.8 * args.memory_gib * 2**30:
            results["whole"] = run_child("whole", common, args.max_seconds, args.quick)
        else:
            print(f"whole-call baseline skipped: about {args.size_mb * WHOLE_CALL_BYTES_PER_CHAR / 1e3:.0f} GB "
                  f"expected, the machine has {args.memory_gib:g} GiB")  # fmt: skip
        results["pieces"] = pieces = run_child("pieces", common, args.max_seconds, args.quick)
        print(f"  whole: {results.get('whole')}\n  pieces: {pieces}", flush=True)
        for packing in args.packings.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                key = f"{packing}, num_workers={workers}"
                child = {**common, "packing": packing, "workers": workers, "seq_len": args.seq_len,
                         "microbatch": args.microbatch, "max_document_chars": cap,
                         "max_seconds": args.max_seconds}  # fmt: skip
                results[key] = run_child("datamodule", child, args.max_seconds + 300, args.quick)
                print(f"  {key}: {results[key]}", flush=True)
        print_verdicts(report(results, args.size_mb))


if __name__ == "__main__":
    main()
