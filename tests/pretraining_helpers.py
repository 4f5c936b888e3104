"""Test data for the pretraining stages: real parquet files and a real tokenizer trained on their text."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

BOS = "<|bos|>"
WORDS = [f"w{chr(97 + i)}{chr(97 + j)}" for i in range(26) for j in range(8)]  # 208 distinct "words"


def make_docs(
    n: int, seed: int = 0, long_every: int = 7, max_words: int = 60, long_words: int = 400, empties: bool = True
) -> list[str | None]:
    """Documents of random words; every ``long_every``-th is long; some are empty or null."""
    rng = random.Random(seed)
    docs: list[str | None] = []
    for i in range(n):
        if empties and i % 23 == 5:
            docs.append(None if i % 2 else "")
            continue
        length = rng.randint(long_words // 2, long_words) if i % long_every == 3 else rng.randint(1, max_words)
        docs.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return docs


def write_parquet(
    directory: Path, docs: list[str | None], files: int = 3, row_group_size: int = 20, column: str = "text"
) -> list[Path]:
    """Split ``docs`` over ``files`` parquet files with small row groups."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    paths = []
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        path = directory / f"part-{f:03d}.parquet"
        pq.write_table(
            pa.table({column: pa.array(part, pa.string()), "id": list(range(len(part)))}),
            path,
            row_group_size=row_group_size,
        )
        paths.append(path)
    return paths


def train_tokenizer(docs: list[str | None], path: Path | None = None, bos: str | None = BOS) -> Tokenizer:
    """A WordLevel tokenizer over the documents' own words (decoding joins words with spaces)."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = ["<unk>"] + ([bos] if bos else [])
    tok.train_from_iterator(
        [d for d in docs if d], trainers.WordLevelTrainer(special_tokens=special, show_progress=False)
    )
    if path is not None:
        tok.save(str(path))
    return tok
