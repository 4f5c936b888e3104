"""Buffer rows: a best-fit buffer's saved rows at one block, built only when something reads them.

A best-fit state names every buffered piece by an int64 row (``bestfit.META_COLUMNS``, in insertion order), and a
stream makes a state after every block. Building that table at every block (about a thousand rows per stream)
costs more than packing the block, yet only a checkpoint, the provenance ledger or a test ever reads it. So a
block's :class:`BufferRows` holds the rows at an earlier block and the change since (the rows pushed, the insertion
numbers popped); reading it walks back to the nearest built table and applies the changes at once. What crosses
from a worker is that change (:meth:`BufferRows.change_from`), and the training process chains it the same way.
Trade-off: a chain keeps its changes alive, so every ``LINKS``-th link is built at once: a build per ``LINKS``
blocks bounds both the memory held and the cost of the first read.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from lightning_d9d.streaming.packing.rows import kept_rows

WIDTH = 8  # len(bestfit.META_COLUMNS)
LINKS = 64  # changes a chain holds at most before a link is built
_SERIALS = itertools.count(1)


def _empty_rows() -> np.ndarray:
    return np.zeros((0, WIDTH), np.int64)


class BufferRows:
    """A best-fit buffer's rows at one block: a table (``(pieces, 8)`` int64, ascending insertion numbers), or the
    rows at the block before and the pieces pushed (rows, in insertion order) and popped (insertion numbers) since.

    ``serial`` names this link and ``prior`` the one it follows (0: none), so a change can be sent where the
    receiver holds that prior link.
    """

    __slots__ = ("_before", "_links", "_table", "popped", "prior", "pushed", "serial")

    def __init__(
        self,
        table: np.ndarray | None = None,
        before: BufferRows | None = None,
        pushed: np.ndarray | None = None,
        popped: np.ndarray | None = None,
    ):
        self._table, self._before, self.pushed, self.popped = table, before, pushed, popped
        self.serial, self.prior = next(_SERIALS), 0 if before is None else before.serial
        self._links = 0 if before is None else before._links + 1
        if self._links >= LINKS:
            self.table()

    @classmethod
    def of(cls, table: Any) -> BufferRows:
        """Rows given as a table (anything ``np.asarray`` makes a ``(pieces, 8)`` int64 array of)."""
        table = np.asarray(table, np.int64)
        return cls(table.reshape(-1, WIDTH) if table.size == 0 else table)

    @classmethod
    def empty(cls) -> BufferRows:
        return cls(_empty_rows())

    def after(self, pushed: np.ndarray, popped: np.ndarray) -> BufferRows:
        """The rows after pushing ``pushed`` (rows with insertion numbers above every one here, ascending) and popping
        the pieces numbered ``popped`` (each here or pushed with them)."""
        return BufferRows(None, self, pushed, popped)

    def table(self) -> np.ndarray:
        """The rows as a table (built now where it was not: from the nearest built link, every change at once)."""
        table = self._table
        if table is None:
            chain, link = [], self
            while link._table is None:
                chain.append(link)
                link = link._before
            chain.reverse()
            table = applied(link._table, [c.pushed for c in chain], [c.popped for c in chain])
            # Later links stop here and count their chain from here; earlier ones may be freed.
            self._table, self._before, self._links = table, None, 0
        return table

    @property
    def built(self) -> bool:
        """Whether the table is built (reading it costs nothing more)."""
        return self._table is not None

    def change_from(self, prior: BufferRows | None) -> tuple[np.ndarray, np.ndarray] | np.ndarray | None:
        """What a receiver holding ``prior`` needs to hold this: ``None`` (it is ``prior``), ``(pushed, popped)``
        (this follows ``prior``), or the table."""
        if prior is self:
            return None
        if prior is not None and self.prior == prior.serial:
            return self.pushed, self.popped
        return self.table()

    def received(self, change: tuple[np.ndarray, np.ndarray] | np.ndarray | None) -> BufferRows:
        """The rows :meth:`change_from` described, received by the holder of this link (its ``prior``)."""
        if change is None:
            return self
        if isinstance(change, np.ndarray):
            return BufferRows.of(change)
        return self.after(*change)

    def __len__(self) -> int:
        return len(self.table())

    def __reduce__(self) -> tuple:
        return BufferRows.of, (self.table(),)


def received(prior: BufferRows | None, change: Any) -> BufferRows:
    """:meth:`BufferRows.received` where the receiver may hold nothing yet (then ``change`` is a table)."""
    if prior is None:
        return BufferRows.of(change)
    return prior.received(change)


def applied(table: np.ndarray, pushed: list[np.ndarray], popped: list[np.ndarray]) -> np.ndarray:
    """``table``'s rows, then every pushed row, less the popped insertion numbers (each present once)."""
    rows = np.concatenate([table, *pushed]) if any(len(p) for p in pushed) else table
    gone = np.concatenate(popped) if any(len(p) for p in popped) else None
    if gone is None:
        return rows
    # The rows are sorted by insertion number (a table's are, and every push numbers above it), so each popped
    # piece is found by bisection.
    keep = np.ones(len(rows), bool)
    keep[np.searchsorted(rows[:, 0], gone)] = False
    return kept_rows(rows, keep, rows[:0])
