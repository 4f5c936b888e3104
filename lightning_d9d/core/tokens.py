"""Token conventions every path shares: the label that trains nothing, and positions that restart where a document
(or a row) starts, computed with one ``np.repeat`` (no Python loop over tokens).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label of a position with nothing to predict; PyTorch's cross-entropy default."""


def restart_positions(starts: np.ndarray) -> np.ndarray:
    """``int64 (rows, width)``: each token's distance from the last start at or before it; column 0 always starts.

    Args:
        starts: a boolean ``(rows, width)`` mask the caller no longer needs (column 0 set in place).
    """
    rows, width = starts.shape
    size = rows * width
    flat = starts.reshape(-1)
    flat[::width] = True
    start_at = np.flatnonzero(flat)
    last_start = np.repeat(start_at, np.diff(start_at, append=size))
    return (np.arange(size, dtype=np.int64) - last_start).reshape(rows, width)


def cu_seqlens_of(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of a batch whose ``position_ids`` restart at 0 at every sequence start."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
