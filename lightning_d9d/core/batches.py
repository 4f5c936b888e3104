"""What a batch holds, counted the same way everywhere (``inspect`` and the logged tokens/s): real tokens and rows'
sources. Real tokens are the ``attention_mask``'s sum, else the positions with a target, else every position of
a 2-D ``input_ids``; other shapes give ``None``, never a guess. Count on the host copy: counting a CUDA tensor
syncs the device.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.core.tokens import IGNORE_INDEX


def count_tokens(batch: Any) -> tuple[int, int] | None:
    """(real tokens, positions) of a microbatch or a pack, or ``None`` for a batch of no known shape."""
    if _is_pack(batch):
        parts = [count_tokens(part) for part in batch]
        if any(part is None for part in parts):
            return None
        return sum(p[0] for p in parts), sum(p[1] for p in parts)  # type: ignore[index]
    mask = _field(batch, "attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum()), mask.numel()
    targets = _field(batch, "targets")
    if isinstance(targets, torch.Tensor) and targets.dim() == 2:
        return int((targets != IGNORE_INDEX).sum()), targets.numel()
    # Packed rows without targets have no padding: every position is a token.
    ids = _field(batch, "input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids.numel(), ids.numel()
    return None


def row_sources(batch: Any) -> list[int]:
    """Each row's source index (a pack's rows in order); none for batches without ``sources``."""
    if _is_pack(batch):
        return [source for part in batch for source in row_sources(part)]
    sources = _field(batch, "sources")
    return sources.tolist() if isinstance(sources, torch.Tensor) else []


def _is_pack(batch: Any) -> bool:
    """A list (or plain tuple) of microbatches; a named tuple is one microbatch."""
    return isinstance(batch, (list, tuple)) and bool(batch) and not hasattr(batch, "_fields")


def _field(batch: Any, name: str) -> Any:
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)
