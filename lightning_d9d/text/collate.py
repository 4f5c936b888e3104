"""Collate: a microbatch of token-id samples into a causal-LM batch, padded or flattened (padding-free).

``CausalLMCollator`` pads to the longest sample, rounded up to ``pad_to_multiple_of``; ``FlatteningCollator``
concatenates the samples into one row with per-document ``position_ids`` and ``cu_seqlens`` (each document padded
to ``2·cp`` under context parallelism). Labels follow Hugging Face: the ids, ``-100`` where nothing is predicted.

Trade-off: padding spends compute on padded positions; flattening wastes none but needs varlen attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from lightning_d9d.core.checks import positive_int
from lightning_d9d.core.hf_inputs import hf_attention_inputs
from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.parallel.context_parallel import flatten_for_cp


@dataclasses.dataclass
class TextBatch:
    """One causal-LM microbatch, ``B`` samples padded to ``T`` positions (Hugging Face labels: the model shifts).

    Attributes:
        step_label_tokens: next-token targets of the whole step over all ranks: divide the summed loss by it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    step_label_tokens: int | None = None

    def pin_memory(self) -> TextBatch:
        """Pinned copy, so a plain ``DataLoader(pin_memory=True)`` pins this dataclass too."""
        return pin_batch(self)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.attention_mask.sum())

    @property
    def label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def padding_fraction(self) -> float:
        """Share of the ``B × T`` positions that are padding."""
        return 1.0 - self.num_tokens / max(self.attention_mask.numel(), 1)


@dataclasses.dataclass
class CPTextBatch(TextBatch):
    """A context-parallel rank's slice of a :class:`TextBatch` (``cp_shard_batch``): every per-position field holds
    this rank's zigzag pieces, which are not contiguous, so the slice also carries what a model cannot infer.

    Attributes:
        position_ids: each kept position's index in its padded row (what a model uses without ``position_ids``).
        shift_labels: each kept position's next label (``-100`` at a row's end): the loss takes these (Hugging
            Face: ``shift_labels=``), since shifting ``labels`` inside the slice would pair different pieces.
    """

    position_ids: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None


# What cp_shard_batch makes of a TextBatch: a plain class attribute, so that it is no dataclass field (nor a
# ClassVar entry among __dataclass_fields__, which code walking a batch's fields would meet).
TextBatch.context_parallel_slice = CPTextBatch  # type: ignore[attr-defined]


@dataclasses.dataclass
class FlatBatch:
    """One padding-free causal-LM microbatch: its documents concatenated into one ``[1, T]`` row.

    Attributes:
        cu_seqlens: ``int32 [D + 1]`` cumulative document lengths from 0.
        step_label_tokens: next-token targets of the whole step over all ranks.
        cu_seqlens_padded: cumulative padded lengths (CP); ``None`` given: set to ``cu_seqlens``.
        shift_labels: ``None``; a context-parallel slice (``cp_shard_batch``) gets each position's next label.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    step_label_tokens: int | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens_padded is None:
            self.cu_seqlens_padded = self.cu_seqlens.clone()

    def pin_memory(self) -> FlatBatch:
        return pin_batch(self)

    @property
    def num_tokens(self) -> int:
        """Real tokens in the row."""
        return int(self.cu_seqlens[-1])

    @property
    def num_documents(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def flash_attention_kwargs(self) -> dict[str, Any]:
        """The varlen keyword arguments Hugging Face models accept beside ``position_ids``."""
        return {
            "cu_seq_lens_q": self.cu_seqlens_padded,
            "cu_seq_lens_k": self.cu_seqlens_padded,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def hf_inputs(self, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM's ``model(**...)`` that keep the row's documents apart.

        ``input_ids``, ``position_ids``, ``use_cache=False``, the mask or varlen arguments ``attn_implementation``
        reads (``lightning_d9d/core/hf_inputs.py``) and ``labels`` (unshifted, ``-100`` at each document's first token:
        the model's own shift pairs no two documents).

        Args:
            attn_implementation: the model's ``config._attn_implementation`` (``eager``, ``sdpa``,
                ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``).
            dtype: the model's floating dtype (the ``eager`` mask is added to its attention scores).

        Raises:
            ValueError: an unknown ``attn_implementation``; a context-parallel slice (``shift_labels`` set: the
                model needs the whole row).
        """
        if self.shift_labels is not None:
            raise ValueError(
                "hf_inputs needs the whole row, not a context-parallel slice (shift_labels is set): call it before "
                "cp_shard_batch"
            )
        bounds = self.cu_seqlens_padded if self.cu_seqlens_padded is not None else self.cu_seqlens
        inputs = hf_attention_inputs(self.input_ids, self.position_ids, bounds, attn_implementation, dtype)
        return inputs | {"labels": self.labels}


def _sample_labels(samples: Sequence[dict[str, Any]]) -> list[np.ndarray] | None:
    """The samples' own labels, or ``None`` when they carry none."""
    if not samples or "labels" not in samples[0]:
        return None
    return [np.asarray(sample["labels"], dtype=np.int64) for sample in samples]


def _label_tokens(labels: list[np.ndarray] | None, lengths: np.ndarray) -> int:
    """Targets after the model's shift: ``n - 1`` per sample, or its trained labels after position 0."""
    if labels is None:
        return int(np.maximum(lengths - 1, 0).sum())
    return int(sum(int((row[1:] != IGNORE_INDEX).sum()) for row in labels))


def _sequences(samples: Sequence[dict[str, Any]]) -> tuple[list[np.ndarray], np.ndarray]:
    sequences = [np.asarray(sample["input_ids"], dtype=np.int64) for sample in samples]
    lengths = np.fromiter((len(sequence) for sequence in sequences), dtype=np.int64, count=len(sequences))
    return sequences, lengths


@dataclasses.dataclass
class CausalLMCollator:
    """Pad a list of ``{"input_ids": 1-D ints}`` samples into a :class:`TextBatch` (picklable, for workers).

    Raises:
        ValueError: a non-positive ``pad_to_multiple_of`` or an unknown ``padding_side``.
    """

    flattens: ClassVar[bool] = False  # pads each sample to the longest: token budgets count samples × longest
    pad_token_id: int = 0
    pad_to_multiple_of: int = 8
    padding_side: Literal["left", "right"] = "right"

    def __post_init__(self) -> None:
        positive_int("pad_to_multiple_of", self.pad_to_multiple_of)
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")

    def __call__(self, samples: Sequence[dict[str, Any]]) -> TextBatch:
        sequences, lengths = _sequences(samples)
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
        labels = np.where(real, input_ids, IGNORE_INDEX)
        masked = _sample_labels(samples)
        if masked is not None:
            labels[real] = np.concatenate(masked)
        if self.padding_side == "left":
            # A left-padded sample's first token would be predicted from the padding before it.
            first = width - lengths
            starts = first[first < width]
            labels[np.flatnonzero(first < width), starts] = IGNORE_INDEX
        return TextBatch(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(real.astype(np.int64)),
            labels=torch.from_numpy(labels),
            step_label_tokens=_label_tokens(masked, lengths),
        )


@dataclasses.dataclass
class FlatteningCollator:
    """Concatenate ``{"input_ids": 1-D ints}`` samples into one padding-free :class:`FlatBatch` row (picklable).

    Args:
        context_parallel_size: ``cp > 1`` pads each document to a multiple of ``2·cp``.

    Raises:
        ValueError: a ``context_parallel_size`` that is not a positive integer.
    """

    flattens: ClassVar[bool] = True  # one row of concatenated samples: token budgets count the sum of lengths
    context_parallel_size: int = 1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        positive_int("context_parallel_size", self.context_parallel_size)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> FlatBatch:
        if self.context_parallel_size > 1:
            return self._laid_out_for_cp(samples)
        sequences, lengths = _sequences(samples)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total = int(cu_seqlens[-1])
        input_ids = np.concatenate(sequences) if sequences else np.empty(0, dtype=np.int64)
        starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)
        position_ids = np.arange(total, dtype=np.int64) - starts
        masked = _sample_labels(samples)
        labels = np.concatenate(masked) if masked is not None else input_ids.copy()
        labels[cu_seqlens[:-1][lengths > 0]] = IGNORE_INDEX
        return FlatBatch(
            input_ids=torch.from_numpy(input_ids)[None],
            labels=torch.from_numpy(labels)[None],
            position_ids=torch.from_numpy(position_ids)[None],
            cu_seqlens=torch.from_numpy(cu_seqlens),
            max_seqlen=int(lengths.max(initial=0)),
            step_label_tokens=_label_tokens(masked, lengths),
        )

    def _laid_out_for_cp(self, samples: Sequence[dict[str, Any]]) -> FlatBatch:
        sequences, lengths = _sequences(samples)
        masked = _sample_labels(samples)
        row = flatten_for_cp(sequences, self.context_parallel_size, masked, self.pad_token_id)
        return FlatBatch(
            input_ids=torch.from_numpy(row.input_ids)[None],
            labels=torch.from_numpy(row.labels)[None],
            position_ids=torch.from_numpy(row.position_ids)[None],
            cu_seqlens=torch.from_numpy(row.cu_seqlens),
            max_seqlen=row.max_seqlen,
            step_label_tokens=_label_tokens(masked, lengths),
            cu_seqlens_padded=torch.from_numpy(row.cu_seqlens_padded),
        )
