"""Golden rows: the digest of every batch ~30 DataModule configurations yield, so a change of rows cannot pass unseen.

Each configuration builds its DataModules through the public API over data this script makes (documents from a
seeded ``random.Random``, a WordLevel tokenizer whose vocabulary is written out, parquet and JSONL files), drives
their loaders directly as Lightning would (``setup`` → ``load_state_dict`` → ``train_dataloader`` → iterate), and
digests the FULL sequence of microbatches: every field of every batch in order — its name, dtype, shape and bytes
(SHA-256). ``tests/test_golden_rows.py`` recomputes them and compares with ``row_digests.json``.

Run ``python tests/golden/make_row_digests.py`` to compare, ``--write`` to regenerate ``row_digests.json`` (only in
a commit that says why the rows changed), ``--only NAME ...`` for some configurations. ``--write-checkpoints``
makes the checkpoint fixtures (``checkpoint_fixtures.py``); they are written once by the code of their day and
must keep resuming, so they are not regenerated with the digests.

Trade-off: a digest says *that* rows changed, not how; the per-batch digests at least name the first batch that
differs. Data and tokenizer are built, not shipped, so a ``pyarrow`` or ``tokenizers`` upgrade that changed the
files' bytes would show here as a change of rows (the rows themselves only depend on the rows of the files).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import random
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]  # tests/ (support.py) and the repository root

from support import RankDataModule  # a simulated data-parallel rank (the tests' topology helper)

from lightning_d9d import D9DDataModule, PretrainingDataModule, TextDataModule

GOLDEN = HERE / "row_digests.json"
BOS = "<|bos|>"
WORDS = [f"{a}{b}{c}" for a in "bdgklmnprstvz" for b in "aeiou" for c in "nrs"]  # 195 words, one token each


# ------------------------------------------------------------------------------------------------ data
def documents(n: int, seed: int, short: int = 40, long: int = 300, long_every: int | None = 7) -> list[str | None]:
    """``n`` documents of seeded random words; every ``long_every``-th is long (``long // 2`` to ``long`` words), a
    few are empty or null (they must be dropped)."""
    rng = random.Random(seed)
    docs: list[str | None] = []
    for i in range(n):
        if i % 29 == 11:
            docs.append(None if i % 2 else "")
            continue
        is_long = long_every is not None and i % long_every == 3
        count = rng.randint(long // 2, long) if is_long else rng.randint(1, short)
        docs.append(" ".join(rng.choice(WORDS) for _ in range(count)))
    return docs


def write_parquet(folder: Path, docs: list[str | None], files: int = 2, row_group_size: int = 16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        table = pa.table({"text": pa.array(part, pa.string()), "id": list(range(len(part)))})
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=row_group_size)
    return folder


def write_jsonl(folder: Path, docs: list[str | None], files: int = 2, compress: bool = False) -> Path:
    """``docs`` as JSON lines (gzip members written with mtime 0: the same bytes on every run)."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    for f in range(files):
        text = "".join(
            json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[f * per_file : (f + 1) * per_file])
        )
        if compress:
            (folder / f"part-{f:03d}.jsonl.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            (folder / f"part-{f:03d}.jsonl").write_text(text)
    return folder


def tokenizer() -> Tokenizer:
    """WordLevel over whitespace-split words with its vocabulary written out (a trained one may order tied words
    differently from one process to the next)."""
    vocab = {"<unk>": 0, BOS: 1, "<pad>": 2, "<eos>": 3} | {word: 4 + i for i, word in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def make_data(root: Path) -> Path:
    """Every corpus the configurations read, under ``root``."""
    tokenizer().save(str(root / "tokenizer.json"))
    write_parquet(root / "mixed", documents(240, seed=1))
    write_parquet(root / "short", documents(240, seed=2, short=12, long_every=None), row_group_size=24)
    write_parquet(root / "long", documents(60, seed=3, short=200, long=900, long_every=2), row_group_size=8)
    write_parquet(root / "a", documents(160, seed=4, short=30, long_every=5))
    write_parquet(root / "b", documents(120, seed=5, short=20, long_every=None), files=3, row_group_size=10)
    write_parquet(root / "val", documents(60, seed=6), files=1)
    write_jsonl(root / "jsonl", documents(200, seed=7))
    write_jsonl(root / "jsonl_gz", documents(200, seed=8), compress=True)
    texts = [d for d in documents(120, seed=9, short=30, long=90, long_every=6) if d]
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


# ------------------------------------------------------------------------------------------------ digests
def _parts(value: Any, name: str) -> Iterable[bytes]:
    """Every field of a batch in order: its name, dtype and shape, then its bytes."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        yield f"{name}:{array.dtype}:{tuple(array.shape)};".encode()
        yield array.numpy().tobytes() if array.dtype != torch.bfloat16 else array.view(torch.int16).numpy().tobytes()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield f"{name}:{type(value).__name__};".encode()
        for field in dataclasses.fields(value):
            yield from _parts(getattr(value, field.name), f"{name}.{field.name}")
    elif isinstance(value, dict):
        yield f"{name}:dict{sorted(value)};".encode()
        for key in sorted(value):
            yield from _parts(value[key], f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        yield f"{name}:{type(value).__name__}[{len(value)}];".encode()
        for i, item in enumerate(value):
            yield from _parts(item, f"{name}[{i}]")
    elif value is None or isinstance(value, (bool, int, float, str, np.integer)):
        yield f"{name}={value!r};".encode()
    else:
        raise TypeError(f"golden digests cannot hash {name} of type {type(value).__name__}")


def _shape(value: Any) -> str:
    """The shapes of a batch's tensors of two or more dimensions (rows), for the reader of a failure."""
    if isinstance(value, torch.Tensor):
        return "x".join(map(str, value.shape))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return ",".join(f"{k}:{_shape(v)}" for k, v in sorted(value.items()) if _rows(v))
    if isinstance(value, (list, tuple)):
        return "[" + ";".join(_shape(v) for v in value) + "]"
    return ""


def _rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2


def digest_batches(batches: list[Any]) -> dict[str, Any]:
    """The golden entry of a sequence of batches: their count, the SHA-256 of all of them in order, each one's
    digest (the first 16 hex digits) and the distinct shapes in order of appearance."""
    whole, each, shapes = hashlib.sha256(), [], []
    for batch in batches:
        one = hashlib.sha256()
        for part in _parts(batch, "batch"):
            one.update(part)
            whole.update(part)
        each.append(one.hexdigest()[:16])
        shape = _shape(batch)
        if shape not in shapes:
            shapes.append(shape)
    return {"batches": len(batches), "sha256": whole.hexdigest(), "per_batch": each, "shapes": shapes}


# ------------------------------------------------------------------------------------------------ driving
BASE = dict(seq_len=32, global_batch_size=8, microbatch_size=2, num_streams=4, num_workers=0, steps_per_epoch=8,
            bestfit_buffer_size=12, tokenizer_batch_size=8, data_wait_warning=None)  # fmt: skip
STEPS = 8


def pretraining(root: Path, world: int = 1, rank: int = 0, **options: Any) -> PretrainingDataModule:
    """A set-up PretrainingDataModule over ``root``'s data: ``BASE`` with ``options``; ``train``/``val`` name folders of
    ``root`` (a dict of them: a mixture)."""
    options = BASE | options
    train = options.pop("train", "mixed")
    options["train_files"] = (
        {k: str(root / v) for k, v in train.items()} if isinstance(train, dict) else str(root / train)
    )
    if "val" in options:
        options["val_files"] = str(root / options.pop("val"))
    if options.get("token_cache"):
        options["token_cache"] = str(root / options["token_cache"])
    dm = RankDataModule(tokenizer=str(root / "tokenizer.json"), world=world, rank=rank, **options)
    dm.setup("fit")
    return dm


def train_batches(dm: Any, stop: int, start: int = 0) -> list[Any]:
    """The microbatches of steps ``[start, stop)`` of ``dm``'s training loader (at ``start`` after a resume)."""
    count = dm.batches_before(0, stop) - dm.batches_before(0, start)
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(count)]
    dm.close_loaders()
    return batches


def epoch_batches(dm: Any, epochs: int = 1) -> list[Any]:
    """Every microbatch of ``epochs`` whole epochs of a map-style DataModule's training loader."""
    batches = []
    for _ in range(epochs):
        batches += list(dm.train_dataloader())
    dm.close_loaders()
    return batches


def until(dm: Any, step: int) -> tuple[list[Any], dict[str, Any]]:
    """The microbatches of the first ``step`` steps of ``dm``'s loader, and ``dm.state_dict()`` then (mid-epoch)."""
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(dm.batches_before(0, step))]
    state = dm.state_dict()
    dm.close_loaders()
    return batches, state


def plain(**options: Any) -> Callable[[Path], list[Any]]:
    return lambda root: train_batches(pretraining(root, **options), STEPS)


def resumed(at: int, world: int = 1, then: dict[str, Any] | None = None, **options: Any) -> Callable:
    """Steps before ``at`` of one run, then ``STEPS - at`` steps of new DataModules (``world`` ranks, rank by rank,
    ``then``'s changes) that loaded its state at step ``at``."""

    def run(root: Path) -> list[Any]:
        before, state = until(pretraining(root, **options), at)
        after = []
        for rank in range(world):
            dm = pretraining(root, world=world, rank=rank, **(options | (then or {})))
            dm.load_state_dict(state)
            after += train_batches(dm, STEPS, at)
        return before + after

    return run


def two_ranks(**options: Any) -> Callable[[Path], list[Any]]:
    return lambda root: [b for rank in range(2) for b in train_batches(pretraining(root, 2, rank, **options), STEPS)]


def cached(**options: Any) -> Callable[[Path], list[Any]]:
    """A run that fills a token cache over more than one pass of a small corpus (later passes read what the first
    kept), then a fresh DataModule over the same cache (tokens only from it)."""

    def run(root: Path) -> list[Any]:
        cache = "cache-" + "-".join(str(v) for v in options.values() if isinstance(v, str))
        opts = {"token_cache": cache, "train": "short", "steps_per_epoch": 12} | options
        return train_batches(pretraining(root, **opts), 12) + train_batches(pretraining(root, **opts), 12)

    return run


def with_validation(**options: Any) -> Callable[[Path], list[Any]]:
    def run(root: Path) -> list[Any]:
        dm = pretraining(root, val="val", val_steps=4, **options)
        val = list(dm.val_dataloader())
        dm.close_loaders()
        return train_batches(dm, 4) + val

    return run


def excluded(root: Path) -> list[Any]:
    """A resume at step 3 that excludes the documents of stream 0's rows of step 4 (named by ``dm.provenance``)."""
    options = dict(packing="bestfit_split")
    pieces = pretraining(root, **options).provenance(range(3, 6))
    chosen = sorted(
        {(p.source, p.file, p.row_group, p.document_row) for p in pieces if p.step == 4 and p.batch_row < 2}
    )
    assert chosen, "no document to exclude"
    then = {"exclude_documents": [list(ref) for ref in chosen]}
    return resumed(3, then=then, **options)(root)


# D9DDataModule: a map-style dataset of heavy-tailed lengths, padded per microbatch.
class Lengths(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int = 0):
        self.lengths = np.clip(np.random.default_rng(seed).lognormal(3.0, 1.0, size).astype(np.int64), 1, 400)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "tokens": torch.arange(int(self.lengths[index])) + index}

    def sort_key(self, index: int) -> int:
        return int(self.lengths[index])


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample["tokens"])] = sample["tokens"]
    return {"ids": torch.tensor([s["id"] for s in samples]), "tokens": tokens}


D9D_BASE = dict(global_batch_size=8, microbatch_size=2, sort_buffer_size=32, num_workers=0, data_wait_warning=None)


def d9d(size: int = 120, **options: Any) -> D9DDataModule:
    dm = D9DDataModule(Lengths(size), pad_collate, **(D9D_BASE | options))
    dm.setup("fit")
    return dm


def d9d_epochs(**options: Any) -> Callable[[Path], list[Any]]:
    return lambda root: epoch_batches(d9d(**options), epochs=2)


def d9d_resumed(root: Path) -> list[Any]:
    before, state = until(d9d(), 5)
    again = d9d()
    again.load_state_dict(state)
    return before + epoch_batches(again, 1)


def text(root: Path, **options: Any) -> TextDataModule:
    options = dict(
        dataset=str(root / "text.jsonl"), tokenizer=str(root / "tokenizer.json"), max_length=64, global_batch_size=8,
        microbatch_size=2, sort_buffer_size=32, num_workers=0, cache_dir=str(root / "hf_cache"),
        data_wait_warning=None,
    ) | options  # fmt: skip
    dm = TextDataModule(**options)
    dm.prepare_data()
    dm.setup("fit")
    return dm


FLAT = dict(padding_free=True, global_batch_size=None, microbatch_size=None, global_batch_tokens=256,
            microbatch_tokens=64)  # fmt: skip


def text_resumed(root: Path) -> list[Any]:
    before, state = until(text(root, **FLAT), 3)
    dm = text(root, **FLAT)
    dm.load_state_dict(state)
    return before + epoch_batches(dm)


# ------------------------------------------------------------------------------------------------ configurations
PHASES = dict(seq_len=[[0, 32], [3, 48]], global_batch_size=[[0, 8], [5, 16]])
MIX = dict(train={"a": "a", "b": "b"})
CONFIGURATIONS: dict[str, Callable[[Path], list[Any]]] = {
    "pretraining/concat": plain(packing="concat"),
    "pretraining/bestfit": plain(packing="bestfit"),
    "pretraining/bestfit_split": plain(packing="bestfit_split"),
    "pretraining/concat/workers2": plain(packing="concat", num_workers=2),
    "pretraining/bestfit_split/workers2": plain(packing="bestfit_split", num_workers=2),
    "pretraining/bestfit/cp2": plain(packing="bestfit", context_parallel_size=2),
    "pretraining/bestfit_split/cp2": plain(packing="bestfit_split", context_parallel_size=2),
    "pretraining/concat/cp2": plain(packing="concat", context_parallel_size=2),
    "pretraining/bestfit/g_phases": plain(packing="bestfit", global_batch_size=[[0, 8], [3, 16], [6, 8]]),
    "pretraining/bestfit_split/g_by_tokens": plain(
        packing="bestfit_split", global_batch_size=[{"from_tokens": 0, "value": 8}, {"from_tokens": 700, "value": 16}]
    ),
    "pretraining/concat/seq_len_phases": plain(packing="concat", seq_len=[[0, 32], [4, 16]]),
    "pretraining/bestfit_split/phases": plain(packing="bestfit_split", **PHASES),
    "pretraining/mixture": plain(packing="bestfit", weights={"a": 0.75, "b": 0.25}, **MIX),
    "pretraining/mixture/weight_phases": plain(
        packing="concat", weights=[[0, {"a": 1, "b": 1}], [3, {"b": 1}], [5, {"a": 3, "b": 1}]], **MIX
    ),
    "pretraining/concat/token_cache": cached(packing="concat"),
    "pretraining/bestfit_split/token_cache": cached(packing="bestfit_split"),
    "pretraining/mixture/token_cache": cached(packing="bestfit", weights={"a": 0.5, "b": 0.5}, **MIX),
    "pretraining/concat/resume": resumed(3, packing="concat"),
    "pretraining/bestfit/resume": resumed(3, packing="bestfit"),
    "pretraining/bestfit_split/resume/phases": resumed(4, packing="bestfit_split", **PHASES),
    "pretraining/mixture/resume": resumed(4, packing="bestfit_split", weights={"a": 0.6, "b": 0.4}, **MIX),
    "pretraining/bestfit/elastic_1_to_2_workers2": resumed(3, world=2, then={"num_workers": 2}, packing="bestfit"),
    "pretraining/concat/world2": two_ranks(packing="concat", microbatch_size=1),
    "pretraining/bestfit/skip_data": resumed(2, then={"skip_data": [[2, 4]]}, packing="bestfit"),
    "pretraining/bestfit_split/exclude_documents": excluded,
    "pretraining/concat/short_documents": plain(packing="concat", train="short"),
    "pretraining/bestfit/long_documents": plain(packing="bestfit", train="long"),
    "pretraining/bestfit_split/long_documents": plain(packing="bestfit_split", train="long"),
    "pretraining/bestfit/max_document_chars": plain(packing="bestfit", max_document_chars=400),
    "pretraining/concat/jsonl": plain(packing="concat", train="jsonl"),
    "pretraining/bestfit_split/jsonl_gzip": plain(packing="bestfit_split", train="jsonl_gz"),
    "pretraining/bestfit/validation": with_validation(packing="bestfit"),
    "d9d/padded": d9d_epochs(),
    "d9d/token_budget_packs": d9d_epochs(
        global_batch_size=None, microbatch_size=None, global_batch_tokens=1024, microbatch_tokens=256, yield_packs=True
    ),
    "d9d/resume": d9d_resumed,
    "text/padded": lambda root: epoch_batches(text(root)),
    "text/padding_free/resume": text_resumed,
}


def compute(names: Iterable[str] | None = None, root: Path | None = None) -> dict[str, dict[str, Any]]:
    """The golden entries of ``names`` (default: every configuration), over data made under ``root`` (default: a
    temporary folder)."""
    names = list(CONFIGURATIONS if names is None else names)
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"no golden configuration {unknown} (the configurations: {sorted(CONFIGURATIONS)})")
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "rows dropped": the digests say what the rows are
        data = make_data(Path(root or tmp))
        return {name: digest_batches(CONFIGURATIONS[name](data)) for name in names}


def read_golden() -> dict[str, dict[str, Any]]:
    return json.loads(GOLDEN.read_text())["configurations"]


def changed(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> list[str]:
    """One line per configuration whose rows differ from ``want``: its name and where it first differs."""
    lines = []
    for name in got:
        if name not in want:
            lines.append(f"{name}: not in the golden file")
            continue
        a, b = got[name], want[name]
        if a["sha256"] == b["sha256"] and a["batches"] == b["batches"]:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a["per_batch"], b["per_batch"])) if x != y), None)
        where = f"first at batch {first}" if first is not None else "same batches as far as both go"
        lines.append(f"{name}: {a['batches']} batches, golden {b['batches']}; {where}; shapes {a['shapes']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate row_digests.json (say why in the commit)")
    parser.add_argument("--only", nargs="+", help="these configurations only")
    parser.add_argument("--print", action="store_true", help="print every digest as JSON")
    parser.add_argument("--write-checkpoints", action="store_true", help="make the checkpoint fixtures (once)")
    args = parser.parse_args()
    if args.write_checkpoints:
        from checkpoint_fixtures import write_fixtures

        write_fixtures()
        return
    got = compute(args.only)
    if args.print:
        print(json.dumps(got, indent=1))
    if args.write:
        entries = (read_golden() if args.only and GOLDEN.exists() else {}) | got
        note = (
            "Made by tests/golden/make_row_digests.py --write; regenerate only in a commit that says why rows changed."
        )
        GOLDEN.write_text(json.dumps({"note": note, "configurations": entries}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(entries)} configurations")
        return
    lines = changed(got, read_golden())
    print("\n".join(lines) if lines else f"all {len(got)} configurations match the golden file")
    sys.exit(1 if lines else 0)


if __name__ == "__main__":
    main()
