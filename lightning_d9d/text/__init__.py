"""The text path: tokenize a text dataset once (``tokenize``) and collate its samples into microbatches, padded or
flattened (``collate``)."""

from __future__ import annotations

from lightning_d9d.text.collate import (
    IGNORE_INDEX,
    CausalLMCollator,
    CPTextBatch,
    FlatBatch,
    FlatteningCollator,
    TextBatch,
)

__all__ = ["IGNORE_INDEX", "CPTextBatch", "CausalLMCollator", "FlatBatch", "FlatteningCollator", "TextBatch"]
