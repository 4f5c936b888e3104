"""What a batch holds, counted the same way everywhere: its real tokens and its rows' sources.

``lightning-d9d inspect`` reports tokens and padding per step from these counts, and the DataModules' callback
logs ``data/tokens_per_s`` from them, so both read a batch alike. A batch is a dict, a dataclass or a named tuple
with tensor fields, or a list of such (a pack of microbatches, ``yield_packs=True``).

Algorithm: real tokens are the ``attention_mask``'s sum where the batch has one (padded batches); else, for rows
with ``targets`` (packed pretraining rows), the positions whose target is not ``IGNORE_INDEX`` (padding and the
position before a continuation chunk have none); else every position of a 2-D ``input_ids`` (packed rows that
carry no targets, padding-free flattened rows).

Trade-off: counting reads the mask or targets, so it belongs on the host copy of a batch (a count of a CUDA
tensor makes the host wait for the device); the callback counts before the batch is moved (see
:mod:`lightning_d9d.datamodules.observability`). Batches of other shapes are not counted (``None``), never
guessed at.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.tokens import IGNORE_INDEX


def count_tokens(batch: Any) -> tuple[int, int] | None:
    """(real tokens, positions) of a batch, or ``None`` for a batch without ``attention_mask``, ``targets`` or
    2-D ``input_ids``.

    Args:
        batch: a microbatch (dict, dataclass or named tuple of tensors) or a list of them (a pack).
    """
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
    """Each row's source index (a ``PretrainingBatch``'s ``sources``; a pack's rows in order); none for batches
    without a ``sources`` tensor."""
    if _is_pack(batch):
        return [source for part in batch for source in row_sources(part)]
    sources = _field(batch, "sources")
    return sources.tolist() if isinstance(sources, torch.Tensor) else []


def _is_pack(batch: Any) -> bool:
    """A list (or plain tuple) of microbatches; a named tuple is one microbatch."""
    return isinstance(batch, (list, tuple)) and bool(batch) and not hasattr(batch, "_fields")


def _field(batch: Any, name: str) -> Any:
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)
