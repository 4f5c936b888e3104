"""Helpers shared by the scale benchmarks: a dataset of any length that costs nothing, and peak-RSS probes."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


class IndexDataset:
    """A map-style dataset of ``size`` samples whose sample ``i`` is ``i``: O(1) memory for any size.

    It isolates the cost of the order and the loader from the cost of reading data.

    Args:
        size: the dataset length (e.g. 10⁹).
        column: an optional numpy-backed sort-key column (e.g. a ``np.memmap``), exposed the way a Hugging
            Face dataset exposes one (``column_names`` and an Arrow table ``data`` wrapping the array without a
            copy), so that ``D9DDataModule(sort_key="length")`` gathers a window's keys with Arrow ``take``
            instead of calling Python per index.
    """

    def __init__(self, size: int, column: np.ndarray | None = None):
        self.size = size
        self.column_names = ["length"] if column is not None else None
        # pa.array over a numeric numpy array shares its buffer: a memmap stays on disk until pages are read.
        self.data = pa.table({"length": pa.array(column)}) if column is not None else None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def process_kib(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` memory field in KiB (``VmRSS``: now; ``VmHWM``: peak since the last reset)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5), so a later peak belongs to what ran after."""
    Path("/proc/self/clear_refs").write_text("5")


def print_verdicts(verdicts: list[tuple[bool, str]]) -> None:
    """One ``PASS: …`` / ``FAIL: …`` line per (passed, description) against a target."""
    for passed, text in verdicts:
        print(f"{'PASS' if passed else 'FAIL'}: {text}")


class _Here:
    """The pipe end a target sends its result through when it runs in this process."""

    def send(self, value: object) -> None:
        self.value = value


def in_child(target: Callable[..., None], *args: object, inline: bool = False) -> Any:
    """``target(conn, *args)`` in a fresh spawned interpreter, returning what it sends through ``conn``;
    ``inline`` runs it in this process (a smoke test: a spawned interpreter pays seconds of imports)."""
    if inline:
        here = _Here()
        target(here, *args)
        return here.value
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=target, args=(child, *args))
    process.start()
    result = parent.recv()
    process.join()
    return result
