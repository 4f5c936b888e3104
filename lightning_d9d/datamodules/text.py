"""TextDataModule: raw text (any ``datasets`` source) → cached token ids → sorted causal-LM microbatches.

``prepare_data`` tokenizes each split once per node into a cache that ``setup`` memory-maps on every rank;
D9DDataModule then orders, sorts by ``token_counts``, shards and packs. Fine-tuning rows get loss masks.

Trade-off: tokenizing ahead costs a pass before the first step, but gives the lengths that sorting and resume need.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_d9d.core.checks import plain_int, positive_int
from lightning_d9d.datamodules.base import OnOrderMismatch
from lightning_d9d.datamodules.d9d import D9DDataModule
from lightning_d9d.datamodules.observability import DEFAULT_DATA_WAIT_WARNING
from lightning_d9d.demo_data.conversations import DEMO_CHAT, build_demo_conversations
from lightning_d9d.demo_data.corpus import DEMO, build_demo_corpus
from lightning_d9d.parallel.topology import DataParallelSetting
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator
from lightning_d9d.text.finetune import FineTuningOptions, FineTuningState
from lightning_d9d.text.formats import Columns
from lightning_d9d.text.sft_schedule import FineTuningFingerprint, LabelCountSchedule
from lightning_d9d.text.tokenize import check_local_path, tokenized_split
from lightning_d9d.tokenization.backends import TokenizerBackendError, backend_names
from lightning_d9d.tokenization.tokenizer import (
    check_tokenizer_file,
    load_tokenizer,
    pad_token_id,
    read_tokenizer,
    tokenizer_digest,
)


class TextDataModule(D9DDataModule):
    """Causal-LM batches (``TextBatch``, or ``FlatBatch`` if ``padding_free``) from raw text or fine-tuning rows.

    Args:
        dataset: anything ``datasets.load_dataset`` accepts, a data file, a ``save_to_disk`` folder, or ``"demo"``.
        tokenizer: a ``tokenizer.json`` path, or ``"demo"``.
        text_column: the column holding the text.
        split, val_split: the training split and an optional validation split.
        data_files: passed to ``load_dataset``.
        max_length: tokens per sample at most (special tokens included).
        global_batch_size, microbatch_size: samples per optimizer step over all ranks, and per microbatch.
        sort_buffer_size: samples sorted by length together (``None``: none).
        num_workers: DataLoader worker processes.
        seed, shuffle: the order's seed; ``shuffle=False`` keeps dataset order.
        pad_to_multiple_of, padding_side: the padded length's rounding, and ``"right"``/``"left"``.
        num_proc: processes tokenizing in ``prepare_data``.
        cache_dir: the datasets cache folder.
        pin_memory: ``None``: pin when training on CUDA.
        yield_packs: each batch is one step's list of microbatches.
        on_order_mismatch: a checkpoint of another order: ``"raise"`` or ``"restart_epoch"``.
        global_batch_tokens, microbatch_tokens: token budgets per step and per microbatch.
        padding_free: one flattened row per microbatch; token budgets only.
        format: ``None`` detects it; ``"text"``, ``"prompt_completion"`` or ``"messages"``.
        prompt_column, completion_column, messages_column: the fine-tuning formats' columns.
        chat_template: a Jinja string, ``.jinja`` file or ``tokenizer_config.json``; ``None``: the tokenizer's.
        loss_on: ``"all"``, ``"completion"``, ``"assistant"``, ``"last_assistant"``; ``None``: the format's.
        truncation: a fine-tuning sample over ``max_length``: ``"error"``, ``"drop"`` or ``"keep_start"``.
        eos_token: the token ending string completions; ``None``: found from the tokenizer.
        context_parallel_size: the CP size batches are laid out for.
        data_parallel, verify_peers, data_wait_warning: see ``D9DDataModule``.
        tokenizer_backend: what encodes plain text (``format="text"``; never changes an id): ``"auto"`` (the
            fastest installed backend giving ``tokenizers``' ids on the split's first documents), ``"tokenizers"``
            or a fast backend by name (``"fastokens"``); fine-tuning formats use ``tokenizers`` (they need offsets).
            docs/tokenizer_backends.md.

    Raises:
        ValueError: a bad setting, or data that cannot be loaded, tokenized or fitted.
        FileNotFoundError: a tokenizer, local dataset or ``chat_template`` file that does not exist.
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
        global_batch_size: PositiveInt | None = None,
        microbatch_size: PositiveInt | None = None,
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
        on_order_mismatch: OnOrderMismatch = "raise",
        global_batch_tokens: PositiveInt | None = None,
        microbatch_tokens: PositiveInt | None = None,
        padding_free: bool = False,
        format: Literal["text", "prompt_completion", "messages"] | None = None,
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        messages_column: str = "messages",
        chat_template: str | None = None,
        loss_on: Literal["all", "completion", "assistant", "last_assistant"] | None = None,
        truncation: Literal["error", "drop", "keep_start"] = "drop",
        eos_token: str | None = None,
        context_parallel_size: PositiveInt = 1,
        data_parallel: DataParallelSetting = None,
        verify_peers: NonNegativeInt = 0,
        data_wait_warning: float | None = DEFAULT_DATA_WAIT_WARNING,
        tokenizer_backend: str = "auto",
    ):
        self.max_length, self.num_proc = _checked_arguments(dataset, tokenizer, max_length, num_proc)
        if tokenizer_backend not in backend_names():
            raise TokenizerBackendError(
                f"tokenizer_backend={tokenizer_backend!r} is not a tokenizer backend: pass one of {backend_names()}"
            )
        self.tokenizer_backend = tokenizer_backend
        self.tokenizer_backend_in_use: tuple[str, str] | None = None  # (backend, why) of plain text, after setup
        columns, demo = Columns(text_column, prompt_column, completion_column, messages_column), tokenizer == DEMO
        self.finetuning = FineTuningOptions(format, columns, chat_template, loss_on, truncation, demo, eos_token)
        self.sft, self.dataset, self.tokenizer, self.cache_dir = FineTuningState(), dataset, tokenizer, cache_dir
        self.text_column, self.split, self.val_split, self.data_files = text_column, split, val_split, data_files
        self.context_parallel_size = _checked_context_parallel(context_parallel_size, pad_to_multiple_of, padding_free)
        self.padded_collator, self.collator = _collators(
            pad_to_multiple_of, padding_side, padding_free, self.context_parallel_size
        )
        # Plain ints: jsonargparse's int subclasses in the checkpoint's state fail torch.load(weights_only=True).
        super().__init__(
            train_dataset=functools.partial(self._tokenized_split, "split"), collate_fn=self.collator,
            global_batch_size=plain_int(global_batch_size), microbatch_size=plain_int(microbatch_size),
            sort_buffer_size=plain_int(sort_buffer_size), sort_key="token_counts",
            val_dataset=functools.partial(self._tokenized_split, "val_split") if val_split is not None else None,
            seed=plain_int(seed), shuffle=shuffle, num_workers=plain_int(num_workers), pin_memory=pin_memory,
            yield_packs=yield_packs, on_order_mismatch=on_order_mismatch,
            global_batch_tokens=plain_int(global_batch_tokens), microbatch_tokens=plain_int(microbatch_tokens),
            padding_free=padding_free, pad_to_multiple_of=None if padding_free else int(pad_to_multiple_of),
            data_parallel=data_parallel, verify_peers=plain_int(verify_peers), data_wait_warning=data_wait_warning,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, special tokens included."""
        path = self.resolved_paths()[1]
        tokenizer = load_tokenizer(path, tokenizer_digest(path), self.max_length)
        return int(tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def longest_padded_length(self) -> int:
        """``max_length``, rounded up to ``pad_to_multiple_of`` when padded."""
        if self.padding_free:
            return self.max_length
        multiple = self.padded_collator.pad_to_multiple_of
        return -(-self.max_length // multiple) * multiple

    # ------------------------------------------------------------------ loading and tokenization
    def resolved_paths(self) -> tuple[str, str]:
        """(dataset, tokenizer file), ``"demo"`` replaced by the demo corpus' paths."""
        dataset, tokenizer = self.dataset, self.tokenizer
        if dataset == DEMO_CHAT:
            dataset = build_demo_conversations()
        if DEMO in (dataset, tokenizer):
            corpus = build_demo_corpus()
            dataset = corpus.dataset_path if dataset == DEMO else dataset
            tokenizer = corpus.tokenizer_path if tokenizer == DEMO else tokenizer
        return dataset, str(Path(tokenizer).expanduser())

    def _tokenized_split(self, which: Literal["split", "val_split"]) -> Any:
        dataset_path, tokenizer_path = self.resolved_paths()
        recipe, sft = self.finetuning.split(
            dataset_path, getattr(self, which), tokenizer_path, self.max_length, name=self.dataset,
            data_files=self.data_files, cache_dir=self.cache_dir, num_proc=self.num_proc,
        )  # fmt: skip
        if sft is not None:
            self.sft.record(which, recipe, sft)
            _set_pad_token_id(self, pad_token_id(read_tokenizer(tokenizer_path)))
            return sft.dataset
        tokenized = tokenized_split(
            dataset_path, getattr(self, which), tokenizer_path, self.text_column, self.max_length,
            data_files=self.data_files, cache_dir=self.cache_dir, num_proc=self.num_proc, name=self.dataset,
            tokenizer_backend=self.tokenizer_backend,
        )  # fmt: skip
        if tokenized.backend != self.tokenizer_backend_in_use:
            self.tokenizer_backend_in_use = tokenized.backend
            rank_zero_info(f"lightning-d9d: tokenizer backend {tokenized.backend[0]} ({tokenized.backend[1]})")
        _set_pad_token_id(self, tokenized.pad_token_id)
        return tokenized.dataset

    # ------------------------------------------------------------------ fine-tuning data
    @property
    def dropped_samples(self) -> int:
        """Training rows dropped by ``truncation`` or with nothing to train (after setup)."""
        return self.sft.counts.get("split", (0, 0))[0]

    @property
    def truncated_samples(self) -> int:
        return self.sft.counts.get("split", (0, 0))[1]

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        recipe = self.sft.recipes.get("split")
        if recipe is None or self.sft.label_counts is None:
            return
        self.schedule = LabelCountSchedule(self.schedule, self.sft.label_counts)
        self.fingerprint = FineTuningFingerprint(
            order=self.fingerprint,
            format=recipe.format,
            loss_on=recipe.loss_on.value,  # a plain str: checkpoints load with weights_only=True
            truncation=recipe.truncation,
            chat_template=recipe.template.digest if recipe.template is not None else None,
        )
        for which, (dropped, truncated) in self.sft.counts.items():
            if not (dropped or truncated):
                continue  # nothing to report: every row trains whole
            rank_zero_warn(
                f"{'training' if which == 'split' else 'validation'} split {getattr(self, which)!r}: {dropped} rows "
                f"dropped (longer than max_length={self.max_length} under truncation={recipe.truncation!r}, or "
                f"nothing to train), {truncated} cut to max_length (their trained tokens past it lost)"
            )


def _checked_arguments(dataset: str, tokenizer: str, max_length: Any, num_proc: Any) -> tuple[int, int | None]:
    """``max_length`` and ``num_proc`` as plain ints, and the local paths checked to exist."""
    checked_max_length = positive_int("max_length", max_length)
    if num_proc is not None:
        positive_int("num_proc", num_proc)
    if tokenizer != DEMO:
        check_tokenizer_file(tokenizer)
    if dataset not in (DEMO, DEMO_CHAT):
        check_local_path(dataset)
    return checked_max_length, plain_int(num_proc)


def _checked_context_parallel(context_parallel_size: Any, pad_to_multiple_of: Any, padding_free: bool) -> int:
    """``context_parallel_size`` as a plain int, checked against ``pad_to_multiple_of`` when padded."""
    size = positive_int("context_parallel_size", context_parallel_size)
    multiple = positive_int("pad_to_multiple_of", pad_to_multiple_of)
    if size > 1 and not padding_free and multiple % (2 * size):
        raise ValueError(
            f"pad_to_multiple_of={multiple} is not a multiple of 2 × context_parallel_size = {2 * size}: a padded "
            f"sequence must split into equal chunks over the {size} context-parallel ranks; use "
            f"pad_to_multiple_of={math.lcm(multiple, 2 * size)}"
        )
    return size


def _collators(
    pad_to_multiple_of: int, padding_side: Literal["left", "right"], padding_free: bool, context_parallel_size: int
) -> tuple[CausalLMCollator, CausalLMCollator | FlatteningCollator]:
    """The padding collator and the collator batches use (a flattening one when padding-free)."""
    padded = CausalLMCollator(pad_to_multiple_of=int(pad_to_multiple_of), padding_side=padding_side)
    return padded, FlatteningCollator(context_parallel_size=context_parallel_size) if padding_free else padded


def _set_pad_token_id(dm: TextDataModule, value: int) -> None:
    dm.padded_collator.pad_token_id = value
    if isinstance(dm.collator, FlatteningCollator):
        dm.collator.pad_token_id = value
