"""Collate: pad a microbatch of token-id samples into a causal-LM batch.

Algorithm: the samples of a microbatch (consecutive in length-sorted order, so of similar length) are padded
to the longest one, rounded up to ``pad_to_multiple_of``; the attention mask marks real tokens and the labels
mark the positions that have a next-token target.

Trade-off: padding costs compute on the padded positions; the length sorting of the map-style order keeps it
small, and rounding up to a multiple of 8 buys tensor-core friendly shapes for a few more padded positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from lightning_d9d.checks import positive_int
from lightning_d9d.device.pin import pin_batch

IGNORE_INDEX = -100
"""Label of positions without a target (padding and each document's last token); PyTorch's CE default."""


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
