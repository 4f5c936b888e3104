"""TextDataModule: raw text (any ``datasets`` source) → cached token ids → sorted causal-LM microbatches, padded
or padding-free.

Pipeline: ``prepare_data`` (once per node) tokenizes the split with one batched ``datasets.map``
(:mod:`lightning_d9d.text.tokenize`); ``setup`` (every rank) opens that cache, memory-mapped; D9DDataModule
orders, sorts (by the ``token_counts`` column, read as a whole), shards and packs — by sample counts or by
token budgets; the collator (:mod:`lightning_d9d.text.collate`) pads each microbatch, or with
``padding_free=True`` flattens it into one row. Every batch carries ``step_label_tokens``, its optimizer step's
predicted tokens over all ranks, and Hugging Face-style labels (the model shifts). ``dataset="demo"`` /
``tokenizer="demo"`` select the demo corpus (:mod:`lightning_d9d.demo.corpus`), built on first use from text
that ships with Python.

Fine-tuning data (prompt/completion or conversations, detected from the columns) is tokenized with loss masks
instead (:mod:`lightning_d9d.text.finetune`): its samples carry their own labels, which the collators keep, and each
step's ``step_label_tokens`` counts only trained targets (:mod:`lightning_d9d.text.sft_schedule`).

Trade-off: tokenizing ahead of training (once, cached) costs a pass over the data before the first step, but
makes the lengths known, which is what length sorting and exact resume build on; streams that tokenize on the
fly are the pretraining DataModule's job.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Literal

from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_d9d.checks import plain_int, positive_int
from lightning_d9d.datamodules.base import OnOrderMismatch
from lightning_d9d.datamodules.d9d import D9DDataModule
from lightning_d9d.demo.conversations import DEMO_CHAT, build_demo_conversations
from lightning_d9d.demo.corpus import DEMO, build_demo_corpus
from lightning_d9d.text.collate import CausalLMCollator, FlatteningCollator
from lightning_d9d.text.finetune import FineTuningOptions, FineTuningState
from lightning_d9d.text.formats import Columns
from lightning_d9d.text.sft_schedule import FineTuningFingerprint, LabelCountSchedule
from lightning_d9d.text.tokenize import check_local_path, file_sha256, load_tokenizer, tokenized_split
from lightning_d9d.tokenizer import check_tokenizer_file, pad_token_id, read_tokenizer
from lightning_d9d.topology import DataParallelSetting


class TextDataModule(D9DDataModule):
    """Causal-LM batches from raw text: ``datasets`` + a ``tokenizers`` tokenizer, on top of D9DDataModule.

    Same order, sharding, packing, exact resume and transfer as :class:`D9DDataModule`; the datasets are the
    tokenized splits, sorted by their ``token_counts`` column. Pass exactly one of ``global_batch_size``
    (sample counts) and ``global_batch_tokens`` (token budgets). Batches are
    :class:`~lightning_d9d.text.collate.TextBatch` (padded) or :class:`~lightning_d9d.text.collate.FlatBatch`
    (``padding_free=True``), both with Hugging Face-style ``labels`` and ``step_label_tokens``.

    Loss normalisation: a model that sums its token losses over a microbatch and divides by
    ``step_label_tokens`` trains on the exact per-token mean of the optimizer step. DDP/FSDP average gradients
    over the D data-parallel replicas (``dm.dp_size``; tensor-parallel peers compute the same loss, so they do not
    count) and Lightning's automatic optimization divides each microbatch's loss by ``accumulate_grad_batches``
    (M), so return ``loss_sum / step_label_tokens × D × M`` (manual optimization with ``yield_packs``: × D);
    Hugging Face models: ``num_items_in_batch=step_label_tokens``, then × D × M. Under context parallelism each
    CP rank sums the loss of its slice, and gradients are averaged over D × CP processes: × D × CP × M.

    ``dataset="demo"`` / ``tokenizer="demo"`` select the corpus and tokenizer built from Python's own
    documentation (:mod:`lightning_d9d.demo_corpus`); ``dataset="demo-chat"`` a conversation set made from it.

    Fine-tuning data: a split with a ``messages`` (or ShareGPT ``conversations``) column, or ``prompt`` and
    ``completion`` columns, is tokenized with loss masks (labels ``-100`` where not trained); conversations are
    rendered with the chat template. ``dropped_samples`` / ``truncated_samples`` count what ``truncation`` did to
    the training split (logged at ``setup``).

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
        global_batch_size: samples per optimizer step over all ranks and accumulation (sample counts).
        microbatch_size: samples per forward/backward on one rank (sample counts; default 4).
        sort_buffer_size: samples sorted by length together (``None``: no sorting); 16×G or more pads least.
            With token budgets: samples packed together per window.
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
        global_batch_tokens: tokens per optimizer step over all ranks and accumulation (token budgets).
        microbatch_tokens: tokens per microbatch: sample count × longest sample rounded up to
            ``pad_to_multiple_of`` when padded, the sum of lengths when padding-free; at least the longest
            document (``max_length`` bounds it).
        padding_free: one flattened row per microbatch (``FlatBatch``: ``input_ids``, ``labels``,
            ``position_ids`` restarting per document, ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``).
            Token budgets only.
        format: ``None`` detects it from the columns; ``"text"``, ``"prompt_completion"`` or ``"messages"``.
        prompt_column, completion_column, messages_column: column names of the fine-tuning formats.
        chat_template: a Jinja template string, a ``.jinja`` file or a ``tokenizer_config.json``; ``None``:
            ``chat_template.jinja`` or ``tokenizer_config.json`` next to the tokenizer file.
        loss_on: trained tokens: ``"all"``, ``"completion"`` (prompt/completion), ``"assistant"`` (every
            assistant turn with its end-of-turn token), ``"last_assistant"``; ``None``: all / completion /
            assistant by format.
        truncation: a fine-tuning sample longer than ``max_length``: ``"error"``, ``"drop"`` (counted) or
            ``"keep_start"`` (cut, counted). A sample left with nothing to train is always dropped (counted).
            Text keeps its first ``max_length`` tokens, as before.
        eos_token: the token ending every prompt/completion string completion (trained with it); ``None``: the
            ``eos_token`` of the ``tokenizer_config.json`` (or ``special_tokens_map.json``) next to the tokenizer
            file, else the special token its post-processor appends, else a usual EOS of its vocabulary. String
            completions with none of these are refused: trained without an end token, a model never learns to
            stop. Completions given as messages end with the template's end-of-turn token instead.
        context_parallel_size: the CP size batches are laid out for (1: none). Padding-free, every document is
            padded to a multiple of ``2 × context_parallel_size`` (labels ``-100``, positions continuing) and
            counted so in ``microbatch_tokens``, which must be a multiple of it; padded, ``pad_to_multiple_of``
            must be a multiple of it. Slice each batch per CP rank with
            :func:`lightning_d9d.context_parallel.cp_shard_batch` (docs/model_parallelism.md).
        data_parallel, verify_peers: which processes share data, and the opt-in peer check (see
            :class:`D9DDataModule`).

    Raises:
        ValueError: non-positive sizes, an unknown ``padding_side`` (at construction; the CLI rejects them while
            parsing); a missing text column, an empty split, a dataset that cannot be loaded (in
            ``prepare_data``/``setup``). Fine-tuning: an unknown ``format``/``loss_on``/``truncation`` (at
            construction); columns of no format, a ``loss_on`` the format lacks, a chat template that cannot be
            parsed or uses an undefined special token, a bad row (naming it: missing value, unknown role, a
            template that raises, no assistant turn, a turn that cannot be located), a row over ``max_length``
            under ``truncation="error"``, no row left to train, prompt/completion strings with a tokenizer that
            has no EOS token or an ``eos_token`` it lacks (in ``prepare_data``/``setup``). A
            ``context_parallel_size`` whose ``2 × context_parallel_size`` does not divide ``microbatch_tokens``
            (padding-free) or ``pad_to_multiple_of`` (padded), naming both (at construction); a document whose
            padded length exceeds ``microbatch_tokens`` (in ``setup``).
        FileNotFoundError: a tokenizer file, local dataset path or ``chat_template`` file that does not exist.
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
    ):
        self.max_length, self.num_proc = _checked_arguments(dataset, tokenizer, max_length, num_proc)
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
            data_parallel=data_parallel, verify_peers=plain_int(verify_peers),
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, special tokens included (builds the demo corpus if selected)."""
        path = self.resolved_paths()[1]
        tokenizer = load_tokenizer(path, file_sha256(path), self.max_length)
        return int(tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def longest_padded_length(self) -> int:
        """The longest document a batch row can hold (positions restart per document when padding-free):
        ``max_length``, rounded up to ``pad_to_multiple_of`` when padded."""
        if self.padding_free:
            return self.max_length
        multiple = self.padded_collator.pad_to_multiple_of
        return -(-self.max_length // multiple) * multiple

    # ------------------------------------------------------------------ loading and tokenization
    def resolved_paths(self) -> tuple[str, str]:
        """(dataset, tokenizer file) with ``"demo"`` replaced by the built demo corpus' paths."""
        dataset, tokenizer = self.dataset, self.tokenizer
        if dataset == DEMO_CHAT:
            dataset = build_demo_conversations()
        if DEMO in (dataset, tokenizer):
            corpus = build_demo_corpus()
            dataset = corpus.dataset_path if dataset == DEMO else dataset
            tokenizer = corpus.tokenizer_path if tokenizer == DEMO else tokenizer
        return dataset, str(Path(tokenizer).expanduser())

    def _tokenized_split(self, which: Literal["split", "val_split"]) -> Any:
        """Load split ``getattr(self, which)`` and tokenize it, or open the cached result of an earlier run."""
        dataset_path, tokenizer_path = self.resolved_paths()
        recipe, sft = self.finetuning.split(
            dataset_path,
            getattr(self, which),
            tokenizer_path,
            self.max_length,
            name=self.dataset,
            data_files=self.data_files,
            cache_dir=self.cache_dir,
            num_proc=self.num_proc,
        )
        if sft is not None:
            self.sft.record(which, recipe, sft)
            _set_pad_token_id(self, pad_token_id(read_tokenizer(tokenizer_path)))
            return sft.dataset
        tokenized = tokenized_split(
            dataset_path,
            getattr(self, which),
            tokenizer_path,
            self.text_column,
            self.max_length,
            data_files=self.data_files,
            cache_dir=self.cache_dir,
            num_proc=self.num_proc,
            name=self.dataset,
        )
        _set_pad_token_id(self, tokenized.pad_token_id)
        return tokenized.dataset

    # ------------------------------------------------------------------ fine-tuning data
    @property
    def dropped_samples(self) -> int:
        """Training rows dropped by ``truncation`` or for having nothing to train (0 for text; after setup)."""
        return self.sft.counts.get("split", (0, 0))[0]

    @property
    def truncated_samples(self) -> int:
        """Training rows cut to ``max_length`` (``truncation="keep_start"``; after setup)."""
        return self.sft.counts.get("split", (0, 0))[1]

    def setup(self, stage: str | None = None) -> None:
        """As D9DDataModule's; loss-masked data also counts each step's trained targets and fingerprints the
        fine-tuning settings."""
        super().setup(stage)
        recipe = self.sft.recipes.get("split")
        if recipe is None or self.sft.label_counts is None:
            return
        self.schedule = LabelCountSchedule(self.schedule, self.sft.label_counts)
        self.fingerprint = FineTuningFingerprint(
            order=self.fingerprint,
            format=recipe.format,
            loss_on=recipe.loss_on,
            truncation=recipe.truncation,
            chat_template=recipe.template.digest if recipe.template is not None else None,
        )
        for which, (dropped, truncated) in self.sft.counts.items():
            report = rank_zero_warn if dropped or truncated else rank_zero_info
            report(
                f"{'training' if which == 'split' else 'validation'} split {getattr(self, which)!r}: {dropped} rows "
                f"dropped (longer than max_length={self.max_length} under truncation={recipe.truncation!r}, or "
                f"nothing to train), {truncated} cut to max_length (their trained tokens past it lost)"
            )


def _checked_arguments(dataset: str, tokenizer: str, max_length: Any, num_proc: Any) -> tuple[int, int | None]:
    """What TextDataModule checks at construction (D9DDataModule checks the step and order settings).

    Returns:
        ``max_length`` and ``num_proc`` as plain ints (``num_proc`` may be ``None``).

    Raises:
        ValueError: ``max_length`` or ``num_proc`` not a positive integer.
        FileNotFoundError: a tokenizer file or a local dataset path that does not exist.
    """
    checked_max_length = positive_int("max_length", max_length)
    if num_proc is not None:
        positive_int("num_proc", num_proc)
    if tokenizer != DEMO:
        check_tokenizer_file(tokenizer)
    if dataset not in (DEMO, DEMO_CHAT):
        check_local_path(dataset)
    return checked_max_length, plain_int(num_proc)


def _checked_context_parallel(context_parallel_size: Any, pad_to_multiple_of: Any, padding_free: bool) -> int:
    """``context_parallel_size`` as a plain int; padded batches must split into ``2 × cp`` equal chunks.

    Raises:
        ValueError: a non-positive ``context_parallel_size``, or (padded) a ``pad_to_multiple_of`` that is not a
            multiple of ``2 × context_parallel_size``, naming both. (Padding-free budgets are checked by the plan.)
    """
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
    """The padding collator (``setup`` gives it the tokenizer's ``pad_token_id``) and the collator batches use:
    the same one, or a flattening one (laid out for ``context_parallel_size``) when padding-free."""
    padded = CausalLMCollator(pad_to_multiple_of=int(pad_to_multiple_of), padding_side=padding_side)
    return padded, FlatteningCollator(context_parallel_size=context_parallel_size) if padding_free else padded


def _set_pad_token_id(dm: TextDataModule, value: int) -> None:
    """The tokenizer's pad id for padding (and for context-parallel padding of flattened rows)."""
    dm.padded_collator.pad_token_id = value
    if isinstance(dm.collator, FlatteningCollator):
        dm.collator.pad_token_id = value
