"""Token conventions every path shares: the label that trains nothing, and positions that restart where a
document (or a row) starts.

Algorithm: positions are each token's distance from the last start at or before it in its row, computed with one
``np.repeat`` of each start over the run it opens (no Python loop over tokens); ``cu_seqlens`` are the offsets of
those starts in the flattened batch, with its length at the end (flash-attention's varlen convention).

Trade-off: starts are given as a boolean mask (BOS tokens, or a packer's flags), so a caller pays one comparison
over its tokens to say where documents begin.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label (or target) of a position with nothing to predict: padding, a document's first token; PyTorch's CE default."""


def restart_positions(starts: np.ndarray) -> np.ndarray:
    """Each token's distance from the last start at or before it in its row; column 0 always starts.

    Args:
        starts: a boolean ``(rows, width)`` mask the caller no longer needs (its column 0 is set in place).

    Returns:
        ``(rows, width)`` int64 positions.
    """
    rows, width = starts.shape
    size = rows * width
    flat = starts.reshape(-1)
    flat[::width] = True
    start_at = np.flatnonzero(flat)
    last_start = np.repeat(start_at, np.diff(start_at, append=size))
    return (np.arange(size, dtype=np.int64) - last_start).reshape(rows, width)


def cu_seqlens_of(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of a batch whose positions restart at 0 at every sequence start.

    Args:
        position_ids: ``(rows, width)`` positions (each row starts a sequence).

    Returns:
        int32 offsets of every sequence start in the flattened batch, with its total length appended, and the
        longest sequence's length.
    """
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
