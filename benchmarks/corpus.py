"""Shared real corpus for the benchmarks: Python's own standard library, cut into functions.

What it is: every ``.py`` file of this interpreter's standard library (tests included; ~1,800 files, ~31 MB),
cut into one document per ``def`` line: a document runs from a ``def`` (any indentation) to the next one, so
it holds a function plus whatever module or class code follows it. Tokens are whitespace-separated words,
mapped to integer ids in order of first appearance. This gives ~60 K documents with the heavy tail of real
code (median ~20 tokens, p99 ~300, max ~5,000) without downloading anything.

Why cut by a regular expression and not ``ast``: parsing all of the stdlib with ``ast`` takes minutes on two
cores; the line scan takes ~1 s and gives the same shape of distribution.

The token ids are cached (``$LIGHTNING_D9D_CACHE/bench`` or ``~/.cache/lightning_d9d/bench``, keyed by the
Python version and this file's format version) and written by atomic rename, so concurrent benchmark
processes never read a half-written cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_d9d.demo_data.corpus import stdlib_sources

# Bump when the corpus recipe changes: it is part of the cache key.
_FORMAT_VERSION = 1
_DEF_LINE = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]", re.MULTILINE)
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
PAD_ID = 0  # ids start at 1, so 0 is free for padding


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents as one flat token-id array: document ``i`` is ``token_ids[offsets[i]:offsets[i + 1]]``."""

    token_ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len(offsets) == num_documents + 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def describe(self) -> str:
        """One line naming the corpus and its length distribution."""
        return (
            f"corpus: Python {sys.version.split()[0]} stdlib .py files cut at every def, whitespace tokens; "
            + describe_lengths(self.lengths)
        )


def describe_lengths(lengths: np.ndarray) -> str:
    """N, tokens, median, p99 and max: what a padding figure must be judged against."""
    return (
        f"N={len(lengths):,} docs, {int(lengths.sum()):,} tokens, median {np.median(lengths):.0f}, "
        f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max():,}"
    )


def _cache_path() -> Path:
    root = os.environ.get("LIGHTNING_D9D_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "lightning_d9d"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return base / "bench" / f"stdlib-defs-v{_FORMAT_VERSION}-py{python}.npz"


def _documents() -> list[str]:
    """The stdlib's source (tests included) cut at every ``def`` line, in a deterministic (sorted) file order."""
    documents: list[str] = []
    for source in stdlib_sources(_SKIPPED_DIRS):
        starts = [match.start() for match in _DEF_LINE.finditer(source)]
        documents.extend(source[a:b] for a, b in zip(starts, [*starts[1:], len(source)]))
    return documents


def _build() -> Corpus:
    vocabulary: dict[str, int] = {}
    ids: list[int] = []
    offsets = [0]
    for document in _documents():
        for word in document.split():
            ids.append(vocabulary.setdefault(word, len(vocabulary) + 1))
        offsets.append(len(ids))
    return Corpus(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64))


def load_corpus() -> Corpus:
    """The cached corpus, built on first use (~5 s on 2 cores)."""
    path = _cache_path()
    if path.exists():
        with np.load(path) as saved:
            return Corpus(saved["token_ids"], saved["offsets"])
    corpus = _build()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, token_ids=corpus.token_ids, offsets=corpus.offsets)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return corpus


def load_demo_corpus() -> Corpus:
    """The package's demo corpus (Python help topics + stdlib docstrings) in its own BPE tokens.

    A second, natural-language-like real corpus beside the code corpus: lighter tail, what the demo trains on.
    """
    from datasets import load_from_disk
    from tokenizers import Tokenizer

    from lightning_d9d.demo_data.corpus import build_demo_corpus

    built = build_demo_corpus()
    tokenizer = Tokenizer.from_file(built.tokenizer_path)
    # The built corpus' train split holds demo_texts()'s train documents: read, not parsed again from the stdlib
    # with ``ast`` (seconds on 2 cores).
    train = load_from_disk(built.dataset_path)["train"]["text"]
    documents = [np.asarray(encoding.ids, dtype=np.int32) + 1 for encoding in tokenizer.encode_batch_fast(train)]
    offsets = np.concatenate([[0], np.cumsum([len(document) for document in documents])])
    return Corpus(np.concatenate(documents), offsets.astype(np.int64))


def every_kth(corpus: Corpus, documents: int) -> Corpus:
    """About ``documents`` documents of ``corpus``, evenly spaced (a smoke test's corpus: the length distribution of
    the whole, which the first documents of one stdlib module would not have)."""
    picked = range(0, len(corpus), max(1, len(corpus) // documents))
    parts = [corpus.token_ids[corpus.offsets[i] : corpus.offsets[i + 1]] for i in picked]
    offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])]).astype(np.int64)
    return Corpus(np.concatenate(parts), offsets)


class TokenDataset(Dataset):
    """Map-style dataset of the corpus: ``dataset[i]`` is document ``i``'s token ids as an int64 tensor.

    ``sort_key(i)`` (its length) is the d9d ``DatasetImplementingSortKeyProtocol`` hook that
    ``D9DDataModule(sort_key=None)`` picks up.

    Args:
        corpus: the documents.
        max_tokens: truncate documents to this many tokens (what a pipeline with a context length does);
            ``None`` keeps them whole.
    """

    def __init__(self, corpus: Corpus, max_tokens: int | None = None):
        self.token_ids = torch.from_numpy(corpus.token_ids.astype(np.int64))
        self.offsets = corpus.offsets
        self.lengths = corpus.lengths if max_tokens is None else np.minimum(corpus.lengths, max_tokens)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.token_ids[start : start + int(self.lengths[index])]

    def sort_key(self, index: int) -> int:
        return int(self.lengths[index])


def pad_collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad a microbatch to its longest sample (what a causal-LM collate does), keeping the true lengths."""
    lengths = torch.tensor([len(sample) for sample in samples])
    input_ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=PAD_ID)
    return {"input_ids": input_ids, "lengths": lengths}
