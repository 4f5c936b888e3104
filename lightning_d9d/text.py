"""TextDataModule: raw text (any ``datasets`` source) → cached token ids → sorted, padded causal-LM microbatches.

Algorithm:
1. ``prepare_data`` (once per node) loads the text with ``datasets`` (a hub name, a folder or file of
   parquet/json/csv/text, or a ``save_to_disk`` folder) and tokenizes it with one batched ``Dataset.map``
   (optionally ``num_proc`` processes, with datasets' progress bar) into two columns, ``input_ids`` and
   ``token_counts``. Documents are truncated to ``max_length`` tokens; documents with fewer than two tokens are
   dropped (they have no next-token target, and length sorting would gather them into all-padding microbatches).
   The map's fingerprint is derived from the raw data's fingerprint, the tokenizer file's SHA-256, max_length,
   the text column and this module's recipe version, so datasets' cache is hit on every later run and missed
   exactly when one of them changes.
2. ``setup`` (every rank) runs the same map, which now only opens the cached Arrow file (memory-mapped).
3. D9DDataModule orders, sorts, shards and packs; the sort keys are the ``token_counts`` column, read once as
   a whole (vectorised).
4. :class:`CausalLMCollator` pads each microbatch to its longest sample (rounded up to ``pad_to_multiple_of``)
   and builds the attention mask and the already shifted labels of a :class:`TextBatch`.

Trade-off: truncation keeps the first ``max_length`` tokens of a long document and drops the rest, which is the
usual fine-tuning convention and keeps one document per row (so the sort key is the true length); for
pretraining on long documents, packing several documents into full rows wastes nothing and needs no padding
(see the pretraining DataModule). Padding costs compute, which the length sorting of D9DDataModule keeps small.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt

from lightning_d9d.datamodule import D9DDataModule
from lightning_d9d.demo_corpus import DEMO, build_demo_corpus
from lightning_d9d.pin import pin_batch
from lightning_d9d.validation import positive_int

IGNORE_INDEX = -100
"""Label of positions without a target (padding and each document's last token); PyTorch's CE default."""

# Bump when the tokenization recipe changes, so caches written by an older recipe are not reused.
_TOKENIZE_RECIPE_VERSION = 1
_MIN_TOKENS = 2
# Extensions that name a single data file and the datasets builder that reads it.
_BUILDER_BY_EXTENSION = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}
_PAD_TOKEN_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|endoftext|>", "</s>", "<eos>")


@dataclasses.dataclass
class TextBatch:
    """One causal-LM microbatch, ``B`` samples padded to ``T`` positions.

    Label convention (already shifted, so the model does not shift): ``labels[b, t] = input_ids[b, t + 1]`` when
    both positions ``t`` and ``t + 1`` are real tokens, else ``-100`` (ignored by ``F.cross_entropy``). The last
    real token of every sample and all padding have ``-100``. The loss is then simply
    ``F.cross_entropy(logits.flatten(0, 1), labels.flatten())``.

    Attributes:
        input_ids: ``int64 [B, T]`` token ids, padding filled with the tokenizer's pad id.
        attention_mask: ``int64 [B, T]``, 1 at real tokens, 0 at padding.
        labels: ``int64 [B, T]`` next-token targets as described above.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def pin_memory(self) -> TextBatch:
        """Pinned copy; lets a plain ``torch.utils.data.DataLoader(pin_memory=True)`` pin this dataclass too."""
        return pin_batch(self)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.attention_mask.sum())

    @property
    def padding_fraction(self) -> float:
        """Share of the ``B × T`` positions that are padding."""
        return 1.0 - self.num_tokens / max(self.attention_mask.numel(), 1)


@dataclasses.dataclass
class CausalLMCollator:
    """Pad a list of ``{"input_ids": 1-D ints}`` samples into a :class:`TextBatch`.

    Picklable (a plain dataclass), so it runs in DataLoader worker processes.

    Args:
        pad_token_id: id written at padding positions (masked out, so any valid id works).
        pad_to_multiple_of: round the padded length up to a multiple of this (8 suits tensor cores).
        padding_side: ``"right"`` (tokens first) or ``"left"`` (padding first, for generation-style models).

    Raises:
        ValueError: a non-positive ``pad_to_multiple_of`` or an unknown ``padding_side``.
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int = 8
    padding_side: Literal["left", "right"] = "right"

    def __post_init__(self) -> None:
        positive_int("pad_to_multiple_of", self.pad_to_multiple_of)
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")

    def __call__(self, samples: Sequence[dict[str, Any]]) -> TextBatch:
        sequences = [np.asarray(sample["input_ids"], dtype=np.int64) for sample in samples]
        lengths = np.fromiter((len(sequence) for sequence in sequences), dtype=np.int64, count=len(sequences))
        longest = int(lengths.max(initial=0))
        width = max(-(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of, 1)
        positions = np.arange(width)
        if self.padding_side == "right":
            real = positions[None, :] < lengths[:, None]
        else:
            real = positions[None, :] >= (width - lengths)[:, None]
        input_ids = np.full((len(sequences), width), self.pad_token_id, dtype=np.int64)
        # Row-major order of the True cells equals the concatenated samples' order, on either padding side.
        input_ids[real] = np.concatenate(sequences) if sequences else np.empty(0, dtype=np.int64)
        labels = np.full_like(input_ids, IGNORE_INDEX)
        has_target = real[:, :-1] & real[:, 1:]
        labels[:, :-1] = np.where(has_target, input_ids[:, 1:], IGNORE_INDEX)
        return TextBatch(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(real.astype(np.int64)),
            labels=torch.from_numpy(labels),
        )


class TextDataModule(D9DDataModule):
    """Causal-LM batches from raw text: ``datasets`` + a ``tokenizers`` tokenizer, on top of D9DDataModule.

    Same order, sharding, packing, exact resume and transfer as :class:`D9DDataModule`; the datasets are the
    tokenized splits, sorted by their ``token_counts`` column. ``dataset="demo"`` / ``tokenizer="demo"`` select
    the corpus and tokenizer built from Python's own documentation (:mod:`lightning_d9d.demo_corpus`).

    Args:
        dataset: anything ``datasets.load_dataset`` accepts (a hub name, a folder of parquet/json/csv/text
            files), a single such file, a ``save_to_disk`` folder (Dataset or DatasetDict), or ``"demo"``.
        tokenizer: path of a ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``), or ``"demo"``. Its
            post-processor decides special tokens (e.g. an end-of-document token); padding settings are ignored.
        text_column: the column holding the text.
        split: the training split (datasets split syntax such as ``"train[:90%]"`` works for loaded datasets).
        val_split: optional validation split, evaluated exactly once per validation run.
        data_files: passed to ``load_dataset`` (e.g. a glob) when ``dataset`` is a builder name or folder.
        max_length: documents are truncated to this many tokens (special tokens included).
        global_batch_size: samples per optimizer step over all ranks and accumulation.
        microbatch_size: samples per forward/backward on one rank.
        sort_buffer_size: samples sorted by length together (``None``: no sorting); 16×G or more pads least.
        num_workers: DataLoader worker processes (does not change the order).
        seed: the order's seed.
        pad_to_multiple_of: padded length is rounded up to a multiple of this.
        padding_side: ``"right"`` or ``"left"``.
        num_proc: processes for tokenization in ``prepare_data`` (``None``: one).
        cache_dir: datasets cache folder for ``load_dataset`` (``None``: datasets' default,
            ``$HF_DATASETS_CACHE``). Tokenized splits of a ``save_to_disk`` folder are cached next to it.
        shuffle: ``False`` keeps dataset order.
        pin_memory: ``None`` pins exactly when training on CUDA.
        yield_packs: each batch is the list of one optimizer step's microbatches (for manual optimization).
        on_order_mismatch: resuming from a checkpoint of another order (seed, data, G, buffer): ``"raise"``, or
            ``"restart_epoch"`` to start that epoch over with the new order.

    Raises:
        ValueError: non-positive sizes, an unknown ``padding_side`` (at construction; the CLI rejects them while
            parsing); a missing text column, an empty split, a dataset that cannot be loaded (in
            ``prepare_data``/``setup``).
        FileNotFoundError: a tokenizer file or local dataset path that does not exist.
    """

    def __init__(
        self,
        dataset: str = "demo",
        tokenizer: str = "demo",
        text_column: str = "text",
        split: str = "train",
        val_split: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        max_length: PositiveInt = 2048,
        global_batch_size: PositiveInt = 256,
        microbatch_size: PositiveInt = 4,
        sort_buffer_size: PositiveInt | None = 16384,
        num_workers: NonNegativeInt = 2,
        seed: int = 0,
        pad_to_multiple_of: PositiveInt = 8,
        padding_side: Literal["left", "right"] = "right",
        num_proc: PositiveInt | None = None,
        cache_dir: str | None = None,
        shuffle: bool = True,
        pin_memory: bool | None = None,
        yield_packs: bool = False,
        on_order_mismatch: Literal["raise", "restart_epoch"] = "raise",
    ):
        self.max_length = positive_int("max_length", max_length)
        if num_proc is not None:
            positive_int("num_proc", num_proc)
        if tokenizer != DEMO and not Path(tokenizer).expanduser().is_file():
            raise FileNotFoundError(f"tokenizer file {tokenizer!r} does not exist (expected a tokenizer.json)")
        _check_local_path(dataset)
        self.dataset, self.tokenizer = dataset, tokenizer
        self.text_column, self.split, self.val_split, self.data_files = text_column, split, val_split, data_files
        self.num_proc, self.cache_dir = _plain_int(num_proc), cache_dir
        self.collator = CausalLMCollator(pad_to_multiple_of=int(pad_to_multiple_of), padding_side=padding_side)
        super().__init__(
            train_dataset=functools.partial(self._tokenized_split, "split"),
            collate_fn=self.collator,
            # Plain ints: the CLI passes jsonargparse's int subclasses, which would end up in the checkpoint's
            # state and make it unloadable with torch.load(weights_only=True).
            global_batch_size=_plain_int(global_batch_size),
            microbatch_size=_plain_int(microbatch_size),
            sort_buffer_size=_plain_int(sort_buffer_size),
            sort_key="token_counts",
            val_dataset=functools.partial(self._tokenized_split, "val_split") if val_split is not None else None,
            seed=_plain_int(seed),
            shuffle=shuffle,
            num_workers=_plain_int(num_workers),
            pin_memory=pin_memory,
            yield_packs=yield_packs,
            on_order_mismatch=on_order_mismatch,
        )

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, special tokens included (builds the demo corpus if selected)."""
        path = self.resolved_paths()[1]
        tokenizer = _load_tokenizer(path, _file_sha256(path), self.max_length)
        return int(tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def longest_padded_length(self) -> int:
        """The longest ``T`` a batch can have: ``max_length`` rounded up to ``pad_to_multiple_of``."""
        multiple = self.collator.pad_to_multiple_of
        return -(-self.max_length // multiple) * multiple

    # ------------------------------------------------------------------ loading and tokenization
    def resolved_paths(self) -> tuple[str, str]:
        """(dataset, tokenizer file) with ``"demo"`` replaced by the built demo corpus' paths."""
        dataset, tokenizer = self.dataset, self.tokenizer
        if DEMO in (dataset, tokenizer):
            corpus = build_demo_corpus()
            dataset = corpus.dataset_path if dataset == DEMO else dataset
            tokenizer = corpus.tokenizer_path if tokenizer == DEMO else tokenizer
        return dataset, str(Path(tokenizer).expanduser())

    def _tokenized_split(self, which: Literal["split", "val_split"]) -> Any:
        """Load split ``getattr(self, which)`` and tokenize it, or open the cached result of an earlier run."""
        from datasets.fingerprint import Hasher

        split = getattr(self, which)
        dataset_path, tokenizer_path = self.resolved_paths()
        raw = _load_raw_split(dataset_path, split, self.data_files, self.cache_dir, self.dataset)
        if self.text_column not in raw.column_names:
            raise ValueError(
                f"text_column {self.text_column!r} is not a column of dataset {self.dataset!r} split {split!r}; "
                f"its columns are {raw.column_names}"
            )
        if len(raw) == 0:
            raise ValueError(f"dataset {self.dataset!r} split {split!r} is empty")
        tokenizer_digest = _file_sha256(tokenizer_path)
        tokenize = _TokenizeBatch(tokenizer_path, tokenizer_digest, self.text_column, self.max_length)
        # datasets would fingerprint the function by pickling it, which sees the tokenizer's path but not its
        # content: an edited tokenizer.json would silently reuse stale token ids. Hash the content instead.
        fingerprint = Hasher.hash(
            [raw._fingerprint, tokenizer_digest, self.max_length, self.text_column, _TOKENIZE_RECIPE_VERSION]
        )
        tokenized = raw.map(
            tokenize,
            batched=True,
            batch_size=1_000,
            num_proc=self.num_proc,
            remove_columns=raw.column_names,
            new_fingerprint=fingerprint,
            desc=f"Tokenizing {Path(self.dataset).name or self.dataset} [{split}]",
        )
        if len(tokenized) == 0:
            raise ValueError(
                f"dataset {self.dataset!r} split {split!r} has no document of {_MIN_TOKENS} or more tokens"
            )
        self.collator.pad_token_id = _pad_token_id(tokenizer_path, tokenizer_digest)
        # Samples are {"input_ids": np.ndarray}; D9DDataModule reads token_counts itself, as a whole column.
        return tokenized.with_format("numpy", columns=["input_ids"])


@dataclasses.dataclass
class _TokenizeBatch:
    """The batched map function: texts → truncated token ids and their counts (picklable for num_proc)."""

    tokenizer_path: str
    tokenizer_digest: str
    text_column: str
    max_length: int

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        tokenizer = _load_tokenizer(self.tokenizer_path, self.tokenizer_digest, self.max_length)
        texts = [text if isinstance(text, str) else "" for text in batch[self.text_column]]
        ids = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
        kept = [row for row in ids if len(row) >= _MIN_TOKENS]
        return {"input_ids": kept, "token_counts": [len(row) for row in kept]}


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, digest: str, max_length: int) -> Any:
    """The tokenizer at ``path``, cached per process; ``digest`` (its content hash) keys out edited files."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    tokenizer.no_padding()  # a tokenizer.json saved with padding on would pad every document to one length
    tokenizer.enable_truncation(max_length)  # keeps the post-processor's special tokens within max_length
    return tokenizer


def _pad_token_id(tokenizer_path: str, digest: str) -> int:
    tokenizer = _load_tokenizer(tokenizer_path, digest, 1)
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    for token in _PAD_TOKEN_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return 0  # any id works: padding is masked out of attention and labels


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _load_raw_split(path: str, split: str, data_files: Any, cache_dir: str | None, name: str) -> Any:
    """Open one split of raw text from a saved dataset, a single data file, or anything load_dataset takes.

    Raises:
        ValueError: the source cannot be loaded, lacks the split, or is empty (naming ``name`` and the split).
    """
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


def _check_local_path(dataset: str) -> None:
    """A value written as a path (absolute, ./, ../, ~) must exist; hub names like ``org/name`` are not paths."""
    if dataset == DEMO:
        return
    looks_like_path = dataset.startswith(("/", "./", "../", "~", ".\\", "..\\"))
    if looks_like_path and not Path(dataset).expanduser().exists():
        raise FileNotFoundError(f"dataset path {dataset!r} does not exist")


def _plain_int(value: Any) -> Any:
    """``int(value)`` for int subclasses (and numpy ints) so they pickle as plain ints; other values unchanged."""
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
