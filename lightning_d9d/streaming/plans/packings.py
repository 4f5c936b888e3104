"""Packings: the packing strategies by name, and how a best-fit buffer grows as a stream starts.

A strategy registers itself here when its module is imported (``lightning_d9d.streaming`` imports every one), so
a plan can name a packing without importing a packer: plans sit below the packing stage. Trade-off: a strategy
is known only once its module has been imported, which importing any streaming module does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_d9d.streaming.packing.rows import Packing

PACKINGS: dict[str, Packing] = {}
"""The packing strategies by name, in the order they registered (``streaming/packing/``)."""


def register_packing(packing: Packing) -> Packing:
    """Make ``packing`` known by its name (one name, one strategy)."""
    known = PACKINGS.setdefault(packing.name, packing)
    if known is not packing:
        raise ValueError(f"packing {packing.name!r} is registered twice")
    return packing


def packing_of(name: Any) -> Packing:
    """The packing strategy named ``name`` (ValueError naming the valid ones)."""
    packing = PACKINGS.get(name) if isinstance(name, str) else None
    if packing is None:
        raise ValueError(f"packing={name!r} is not valid: use one of {list(PACKINGS)}")
    return packing


@dataclass(frozen=True)
class BufferGrowth:
    """How a best-fit buffer grows as a stream starts: before each row it is topped up to
    ``min(buffer_size, start + rows_taken * per_row)``, a function of the rows packed only (never of time or host).

    Raises:
        ValueError: a negative field, or a growing buffer that starts empty.
    """

    start: int = 8
    per_row: int = 4

    def __post_init__(self) -> None:
        if self.start < 0 or self.per_row < 0 or (self.per_row and not self.start):
            raise ValueError(
                f"buffer growth start={self.start}, per_row={self.per_row}: both must be >= 0 (per_row 0: no "
                "growth) and a growing buffer must start at >= 1"
            )

    def size(self, buffer_size: int, rows_taken: int) -> int:
        """The buffer's size before a stream's row ``rows_taken`` (from 0)."""
        if not self.per_row:
            return buffer_size
        return min(buffer_size, self.start + rows_taken * self.per_row)


FULL_BUFFER = BufferGrowth(0, 0)  # no growth: the full buffer from the first row
