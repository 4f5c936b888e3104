"""Progress bars for the slow parts of ``setup``: reading many footers, scanning large JSONL files, sampling a
corpus to estimate one pass.

Algorithm: a bar is a ``tqdm`` bar, shown only where someone can watch it and where it is worth drawing: stderr is
a terminal, the work is at least a given size (a few files, a large file), this is the job's first process
(rank 0: ``torch.distributed``'s rank once it is initialised, else the ``RANK``/``LOCAL_RANK``/``NODE_RANK``
variables launchers set) and not a DataLoader worker. Everywhere else the same call gives a disabled ``tqdm``,
which only counts, so callers need no branch of their own. Bars are not left behind (``leave=False``): setup's
messages stay readable.

Trade-off: the other ranks do the same work without a bar, so a rank that is much slower than rank 0 (another
storage region) goes unseen; and a job logged to a file (no terminal) shows no bar at all rather than lines of
carriage returns.
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
    """Whether a bar for ``work`` (files, bytes, row groups) is drawn here: at least ``minimum`` of it, stderr a
    terminal, rank 0 and not a DataLoader worker."""
    return work >= minimum and _on_terminal() and _first_process()


def progress(items: Iterable[T], total: int, desc: str, unit: str, minimum: int | None = None) -> Iterable[T]:
    """``items`` with a bar of ``total`` where :func:`shows_progress` says so, else ``items`` as they are.

    Args:
        items: what is worked through.
        total: how many there are (or, for work that may end early, how many there are at most).
        desc: what is being done, shown before the bar.
        unit: the name of one item.
        minimum: fewer than this many: no bar (``None``: ``MIN_ITEMS``).
    """
    if not shows_progress(total, MIN_ITEMS if minimum is None else minimum):
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def byte_progress(total: int, desc: str, minimum: int | None = None) -> tqdm:
    """A bar over ``total`` bytes (``update(n)`` as they are read), disabled where :func:`shows_progress` says so.

    Args:
        total: the bytes to read.
        desc: what is being read.
        minimum: fewer bytes than this: no bar (``None``: ``MIN_SCAN_BYTES``).
    """
    disable = not shows_progress(total, MIN_SCAN_BYTES if minimum is None else minimum)
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, dynamic_ncols=True,
        disable=disable,
    )  # fmt: skip


def count_progress(total: int, desc: str, unit: str, work: int) -> tqdm:
    """A bar over ``total`` items (``update(n)`` as they are done), drawn where :func:`shows_progress` says so of
    ``work`` against ``MIN_ITEMS`` (work counted otherwise than the bar: reads, where the bar counts rows)."""
    disable = not shows_progress(work, MIN_ITEMS)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, disable=disable)


def _on_terminal() -> bool:
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def _first_process() -> bool:
    """Rank 0 of the job and not a DataLoader worker (whose output would interleave with the main process's)."""
    import torch.distributed as dist
    import torch.utils.data

    if torch.utils.data.get_worker_info() is not None:
        return False
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return all(os.environ.get(name, "0") in ("", "0") for name in _RANK_VARIABLES)
