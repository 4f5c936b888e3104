"""Tokenize: raw text from any ``datasets`` source into a cached, memory-mapped table of token ids.

One batched ``Dataset.map`` writes ``input_ids`` and ``token_counts``, truncating to ``max_length`` and dropping
documents under two tokens; its fingerprint hashes the data, the tokenizer and every setting but the tokenizer
backend, which gives the same ids (resolved on the split's first documents, guarded by ``tokenizers`` on a share).

Trade-off: truncation drops a long document's tail but keeps the sort key the true length.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from lightning_d9d.core.child_processes import children_exit_with_parent
from lightning_d9d.tokenization.backends import REFERENCE, BackendGuard, backend_for, resolve_backend
from lightning_d9d.tokenization.tokenizer import load_tokenizer, pad_token_id, read_tokenizer, tokenizer_digest

# Bump when the tokenization recipe changes, so caches written by an older recipe are not reused.
_TOKENIZE_RECIPE_VERSION = 1
# Documents of the split that a fast backend must encode as tokenizers does before it is used, each cut to an
# equal share of the characters: the check is of many documents' kinds of text, and tokenizers' encoding of long
# ones would cost more than the fast backend saves.
_BACKEND_SAMPLE = 256
_BACKEND_SAMPLE_CHARS = 400_000
MIN_TOKENS = 2
"""Documents with fewer tokens have no next-token target and are dropped."""
# Extensions that name a single data file and the datasets builder that reads it.
_BUILDER_BY_EXTENSION = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """One tokenized split (columns ``input_ids`` and ``token_counts``), its tokenizer's pad id, and the tokenizer
    backend that encoded it with why (``(name, reason)``)."""

    dataset: Any
    pad_token_id: int
    backend: tuple[str, str] = (REFERENCE, "asked for")


def tokenized_split(
    dataset_path: str,
    split: str,
    tokenizer_path: str,
    text_column: str,
    max_length: int,
    data_files: Any = None,
    cache_dir: str | None = None,
    num_proc: int | None = None,
    name: str | None = None,
    tokenizer_backend: str = "auto",
) -> TokenizedSplit:
    """Load one split and tokenize it, or open the cached result of an earlier run with the same inputs.

    Args:
        dataset_path: anything ``datasets.load_dataset`` accepts, a data file, or a ``save_to_disk`` folder.
        max_length: documents are truncated to this many tokens (special tokens included).
        name: the dataset's name in messages (default: ``dataset_path``).
        tokenizer_backend: ``"auto"``, ``"tokenizers"`` or a fast backend by name (lightning_d9d.tokenization.backends).

    Raises:
        ValueError: a source, split, column or tokenizer that cannot be read, or no document of 2 or more tokens;
            a ``TokenizerBackendError`` for a named backend that cannot serve the tokenizer.
        TokenizerBackendMismatch: a fast backend gave other ids than ``tokenizers`` for a guarded document.
    """
    name = name or dataset_path
    raw = _load_text_split(dataset_path, split, text_column, data_files, cache_dir, name)
    tokenized, backend = _tokenize_cached(
        raw, tokenizer_path, text_column, max_length, num_proc, name, split, tokenizer_backend
    )
    if len(tokenized) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} has no document of {MIN_TOKENS} or more tokens")
    # Read the padding setting from the file as saved: load_tokenizer's copy has padding switched off.
    return TokenizedSplit(
        tokenized.with_format("numpy", columns=["input_ids"]), pad_token_id(read_tokenizer(tokenizer_path)), backend
    )


def _load_text_split(path: str, split: str, text_column: str, data_files: Any, cache_dir: str | None, name: str) -> Any:
    """The raw split, checked to be non-empty and to hold text in ``text_column``."""
    raw = load_raw_split(path, split, data_files, cache_dir, name)
    if text_column not in raw.column_names:
        raise ValueError(
            f"text_column {text_column!r} is not a column of dataset {name!r} split {split!r}; "
            f"its columns are {raw.column_names}"
        )
    _check_text_column(raw, text_column, name, split)
    if len(raw) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    return raw


def _tokenize_cached(
    raw: Any,
    tokenizer_path: str,
    text_column: str,
    max_length: int,
    num_proc: int | None,
    name: str,
    split: str,
    tokenizer_backend: str = "auto",
) -> Any:
    """``raw`` tokenized by one batched map, under a fingerprint of its inputs' content, and the backend used."""
    from datasets.fingerprint import Hasher

    digest = tokenizer_digest(tokenizer_path)
    tokenizer_json = load_tokenizer(
        tokenizer_path, digest, max_length
    ).to_str()  # a bad file fails here, before any map
    per_text = _BACKEND_SAMPLE_CHARS // _BACKEND_SAMPLE
    sample = lambda: [text[:per_text] for text in raw[:_BACKEND_SAMPLE][text_column] if text]  # noqa: E731
    backend = resolve_backend(tokenizer_backend, tokenizer_json, sample, max_length, add_special_tokens=True)
    tokenize = _TokenizeBatch(tokenizer_path, digest, text_column, max_length, backend[0])
    # datasets would fingerprint the function by pickling it, which sees the tokenizer's path but not its
    # content: an edited tokenizer.json would silently reuse stale token ids. Hash the content instead.
    fingerprint = Hasher.hash([raw._fingerprint, digest, max_length, text_column, _TOKENIZE_RECIPE_VERSION])
    desc = f"Tokenizing {Path(name).name or name} [{split}]"
    return cached_batched_map(raw, tokenize, fingerprint, desc, num_proc=num_proc), backend


def cached_batched_map(raw: Any, function: Any, fingerprint: str, desc: str, **map_kwargs: Any) -> Any:
    """``raw.map(function)`` in batches, keeping only the columns ``function`` returns, cached under ``fingerprint``."""
    with children_exit_with_parent():  # a killed parent must not leave the map's worker pool running
        return raw.map(
            function,
            batched=True,
            batch_size=1_000,
            remove_columns=raw.column_names,
            new_fingerprint=fingerprint,
            desc=desc,
            **map_kwargs,
        )


def _check_text_column(raw: Any, text_column: str, name: str, split: str) -> None:
    """Raise ValueError unless the column holds strings (a list column would tokenize as empty)."""
    feature = raw.features[text_column]
    dtype = getattr(feature, "dtype", None)
    if dtype not in ("string", "large_string"):
        raise ValueError(
            f"text_column {text_column!r} of dataset {name!r} split {split!r} has type {feature}; it must hold "
            "strings (one document per row): pick the text column, or join list items into one string first"
        )


@dataclasses.dataclass
class _TokenizeBatch:
    tokenizer_path: str
    tokenizer_digest: str
    text_column: str
    max_length: int
    backend: str = REFERENCE

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # The loaded tokenizer's JSON, so that every backend reads the file as tokenizers loaded it.
        tokenizer_json = load_tokenizer(self.tokenizer_path, self.tokenizer_digest, self.max_length).to_str()
        encoder = backend_for(self.backend, tokenizer_json, self.max_length)
        texts = [text if text is not None else "" for text in batch[self.text_column]]  # nulls are empty
        encoded = encoder.encode(texts, add_special_tokens=True)
        guard = BackendGuard(self.backend, tokenizer_json)
        if guard.active:
            picked = guard.picks(0, np.arange(len(texts))).tolist()
            reference = backend_for(REFERENCE, tokenizer_json, self.max_length)
            guard.check(
                [texts[i] for i in picked],
                [encoded[i].ids for i in picked],
                [f"the document {texts[i][:60]!r}" for i in picked],
                lambda chosen: reference.encode(chosen, add_special_tokens=True),
            )
        counts = encoded.counts
        kept = np.flatnonzero(counts >= MIN_TOKENS)
        bounds = encoded.offsets.tolist()
        ids = encoded.ids.astype(np.int64)  # the column's type as before backends: int64
        return {
            "input_ids": [ids[bounds[i] : bounds[i + 1]] for i in kept.tolist()],
            "token_counts": counts[kept].tolist(),
        }


def load_raw_split(path: str, split: str, data_files: Any, cache_dir: str | None, name: str) -> Any:
    """Open one split of raw text from a saved dataset, a data file, or anything ``load_dataset`` takes."""
    import datasets

    local = Path(path).expanduser()
    if local.is_dir() and ((local / "dataset_dict.json").exists() or (local / "state.json").exists()):
        return _load_saved_split(local, split, name)
    # datasets cannot build an empty split (it fails with unrelated messages, or a bare StopIteration), so
    # recognise empty local files first and say so.
    if local.is_file() and local.stat().st_size == 0:
        raise ValueError(f"dataset {name!r} split {split!r} is empty (the file has no data)")
    if local.is_dir() and data_files is None:
        files = [child for child in local.rglob("*") if child.is_file() and not child.name.startswith(".")]
        if files and all(child.stat().st_size == 0 for child in files):
            raise ValueError(f"dataset {name!r} split {split!r} is empty (all its files are empty)")
    try:
        if local.is_file():
            builder = _BUILDER_BY_EXTENSION.get(local.suffix.lower())
            if builder is None:
                raise ValueError(f"unknown data file type {local.suffix!r} (known: {sorted(_BUILDER_BY_EXTENSION)})")
            return datasets.load_dataset(builder, data_files=str(local), split=split, cache_dir=cache_dir)
        source = str(local) if local.exists() else path
        return datasets.load_dataset(source, data_files=data_files, split=split, cache_dir=cache_dir)
    except (
        FileNotFoundError,
        ConnectionError,
        ValueError,
        StopIteration,
        datasets.exceptions.DatasetNotFoundError,
        datasets.exceptions.DatasetGenerationError,
    ) as error:
        raise ValueError(f"could not load split {split!r} of dataset {name!r}: {error!r}") from error


def _load_saved_split(folder: Path, split: str, name: str) -> Any:
    """A split of a ``save_to_disk`` folder (a DatasetDict, or a single Dataset serving ``split="train"``)."""
    import datasets

    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ValueError(f"split {split!r} is not in saved dataset {name!r}; its splits are {splits}")
        folder = folder / split
    elif split != "train":
        raise ValueError(
            f"saved dataset {name!r} is a single Dataset without splits; it serves only split='train', got {split!r}"
        )
    if not json.loads((folder / "state.json").read_text()).get("_data_files"):
        # datasets.load_from_disk fails with an IndexError on a saved dataset of zero rows.
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    return datasets.load_from_disk(str(folder))


def check_local_path(dataset: str) -> None:
    """Raise FileNotFoundError if a value written as a path (absolute, ./, ../, ~) does not exist."""
    looks_like_path = dataset.startswith(("/", "./", "../", "~", ".\\", "..\\"))
    if looks_like_path and not Path(dataset).expanduser().exists():
        raise FileNotFoundError(f"dataset path {dataset!r} does not exist")
