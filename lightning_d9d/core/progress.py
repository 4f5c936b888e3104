"""Progress bars for the slow parts of ``setup``, drawn only on rank 0, on a terminal, for enough work and never in
a DataLoader worker; elsewhere the same call gives a disabled ``tqdm``, so callers need no branch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")

# Fewer files than this read quickly enough that a bar would only flash by.
MIN_ITEMS = 8
# A JSONL file smaller than this scans in a few seconds at most.
MIN_SCAN_BYTES = 256 << 20
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK")


def shows_progress(work: float, minimum: float) -> bool:
    """Whether a bar for ``work`` is drawn here."""
    return work >= minimum and _on_terminal() and _first_process()


def progress(items: Iterable[T], total: int, desc: str, unit: str, minimum: int | None = None) -> Iterable[T]:
    """``items`` with a bar of ``total`` where :func:`shows_progress` says so.

    Args:
        items: what is worked through.
        total: how many there are (at most).
        desc: shown before the bar.
        unit: the name of one item.
        minimum: fewer than this: no bar (``None``: ``MIN_ITEMS``).
    """
    if not shows_progress(total, MIN_ITEMS if minimum is None else minimum):
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def byte_progress(total: int, desc: str, minimum: int | None = None) -> tqdm:
    """A bar over ``total`` bytes (``update(n)`` as they are read); ``minimum``: ``MIN_SCAN_BYTES``."""
    disable = not shows_progress(total, MIN_SCAN_BYTES if minimum is None else minimum)
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, dynamic_ncols=True,
        disable=disable,
    )  # fmt: skip


def count_progress(total: int, desc: str, unit: str, work: int) -> tqdm:
    """A bar over ``total`` items, drawn where ``work`` reaches ``MIN_ITEMS``."""
    disable = not shows_progress(work, MIN_ITEMS)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, disable=disable)


def _on_terminal() -> bool:
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def _first_process() -> bool:
    """Rank 0 of the job and not a DataLoader worker."""
    import torch.distributed as dist
    import torch.utils.data

    if torch.utils.data.get_worker_info() is not None:
        return False
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return all(os.environ.get(name, "0") in ("", "0") for name in _RANK_VARIABLES)
