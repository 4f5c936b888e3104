"""The text path: tokenize a text dataset once (``tokenize``) and collate its samples into microbatches, padded or
flattened (``collate``)."""

from __future__ import annotations

from typing import Any

from lightning_d9d.text.collate import IGNORE_INDEX, CausalLMCollator, FlatBatch, FlatteningCollator, TextBatch

__all__ = ["IGNORE_INDEX", "CausalLMCollator", "FlatBatch", "FlatteningCollator", "TextBatch"]


def __getattr__(name: str) -> Any:
    # ``lightning_d9d.text.TextDataModule`` was the class path of the first layout; configs naming it still load.
    if name == "TextDataModule":
        from lightning_d9d.datamodules.text import TextDataModule

        return TextDataModule
    raise AttributeError(f"module 'lightning_d9d.text' has no attribute {name!r}")
