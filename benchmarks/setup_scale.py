"""Setup benchmark: ``PretrainingDataModule.setup`` over 10,000 small JSONL files against 10 files of the same text.

Run: ``python benchmarks/setup_scale.py`` (``--quick`` for a smoke test: 200 files against 4, one round, all in
this process; its figures are meaningless). Nothing is downloaded: the text is the standard library's
(``benchmarks/streaming.py``), cut at line ends into documents of at most ``--doc-chars`` characters, written in
order to ``--files`` JSONL files and, the same documents in the same order, to ``--few`` files; the tokenizer is a
byte-level BPE trained here on a sample. Every setup runs in a fresh spawned process (imports not timed), the two
corpora back to back (in turn first) in each of ``--rounds`` rounds, in three configurations:

* no token cache: every JSONL file is scanned;
* a token cache folder, first setup: every file scanned, the layouts written (one record for the list);
* the same folder again: the layouts read from that record.

Each figure is the median over rounds of the seconds ``setup("fit")`` took. Target: in every configuration the
many files set up within 3x the time of the few (so setup grows with the text, not with the number of files).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from common import in_child, print_verdicts
from streaming import BOS, stdlib_texts, train_tokenizer

TARGET = 3.0
CONFIGURATIONS = ("no cache", "cache, first", "cache, again")


def documents(mb: float, doc_chars: int) -> list[str]:
    """The stdlib text cut at line ends into documents of at most ``doc_chars`` characters."""
    out = []
    for text in stdlib_texts(mb):
        piece = ""
        for line in text.splitlines(keepends=True):
            if piece and len(piece) + len(line) > doc_chars:
                out.append(piece)
                piece = ""
            piece += line[:doc_chars]
        if piece.strip():
            out.append(piece)
    return out


def write_jsonl(directory: Path, docs: list[str], files: int) -> str:
    """``docs`` in order over ``files`` JSONL files of (nearly) equal document counts."""
    directory.mkdir(parents=True)
    for number in range(files):
        part = docs[number * len(docs) // files : (number + 1) * len(docs) // files]
        with open(directory / f"part-{number:05d}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": text}) + "\n" for text in part)
    return str(directory)


def _setup(conn, files: str, tokenizer: str, cache: str | None) -> None:
    """In a fresh process: seconds ``setup("fit")`` takes."""
    multiprocessing.set_start_method(None, force=True)
    from lightning_d9d import PretrainingDataModule

    dm = PretrainingDataModule(files, tokenizer, seq_len=1024, global_batch_size=64, microbatch_size=8,
                               num_workers=2, bos_token=BOS, pin_memory=False, token_cache=cache)  # fmt: skip
    start = time.perf_counter()
    dm.setup("fit")
    conn.send(time.perf_counter() - start)


def measure(root: Path, corpora: dict[int, str], tokenizer: str, rounds: int, inline: bool) -> dict:
    """``{(files, configuration): [seconds per round]}``."""
    times: dict[tuple[int, str], list[float]] = {}
    for round_ in range(rounds):
        for configuration in CONFIGURATIONS:
            # The two corpora back to back, in turn first, so the machine's load meets both alike.
            for count in list(corpora)[:: 1 if round_ % 2 == 0 else -1]:
                folder = None if configuration == "no cache" else root / f"cache-{count}-{round_}"
                seconds = in_child(_setup, corpora[count], tokenizer, folder and str(folder), inline=inline)
                times.setdefault((count, configuration), []).append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=10_000, help="the many files")
    parser.add_argument("--few", type=int, default=10, help="the few files holding the same text")
    parser.add_argument("--mb", type=float, default=16.0, help="MB of stdlib text in each corpus")
    parser.add_argument("--doc-chars", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="200 files against 4, one round, in this process")
    options = parser.parse_args()
    if options.quick:
        options.files, options.few, options.mb, options.rounds = 200, 4, 0.5, 1
    root = Path(tempfile.mkdtemp(prefix="setup-scale-"))
    try:
        docs = documents(options.mb, options.doc_chars)
        tokenizer = str(root / "tokenizer.json")
        train_tokenizer(docs[:2000], 1024 if options.quick else 4096).save(tokenizer)
        corpora = {count: write_jsonl(root / f"files-{count}", docs, count) for count in (options.few, options.files)}
        print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB of text, as {options.few} and as "
              f"{options.files} JSONL files; {options.rounds} round(s), median seconds of setup('fit')")  # fmt: skip
        times = measure(root, corpora, tokenizer, options.rounds, inline=options.quick)
        print(f"{'files':>8}" + "".join(f"{name:>16}" for name in CONFIGURATIONS))
        medians = {key: statistics.median(values) for key, values in times.items()}
        for count in corpora:
            print(f"{count:>8}" + "".join(f"{medians[(count, name)]:>15.2f}s" for name in CONFIGURATIONS))
        ratios = {name: medians[(options.files, name)] / medians[(options.few, name)] for name in CONFIGURATIONS}
        print(f"{'ratio':>8}" + "".join(f"{ratios[name]:>15.2f}x" for name in CONFIGURATIONS))
        extra = options.files - options.few
        per_file = {name: (medians[(options.files, name)] - medians[(options.few, name)]) / extra * 1e3
                    for name in CONFIGURATIONS}  # fmt: skip
        print(f"{'ms/file':>8}" + "".join(f"{per_file[name]:>14.3f}ms" for name in CONFIGURATIONS) + "  (the many's "
              "extra seconds per extra file)")  # fmt: skip
        print_verdicts([
            (ratio <= TARGET, f"{name}: setup of {options.files} files / of {options.few} files holding the same "
             f"text {ratio:.2f}x (target <= {TARGET:.0f}x)")
            for name, ratio in ratios.items()
        ])  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
