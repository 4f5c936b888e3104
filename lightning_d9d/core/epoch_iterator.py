"""Epoch iterators that start lazily and stop their worker processes deterministically.

An epoch starts at its first ``next()`` (Lightning probes ``iter()`` before resume state loads). Iterators hold no
reference cycle and close when freed, and an ``atexit`` hook closes the rest. A worker forked by
:func:`forking_workers` freezes what it inherits (``gc.freeze``), so no finalizer of the parent's garbage ever runs
in it; collecting that garbage before every fork instead took a full collection of the parent's heap (hundreds of
milliseconds with torch and Lightning loaded), and every resume pays for its forks.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

from lightning_d9d.core.child_processes import children_exit_with_parent

# Objects with a ``close()`` that must run before interpreter shutdown if they are still open then.
_open_at_exit: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(closable: Any) -> None:
    """Have ``closable.close()`` run at interpreter exit if ``closable`` is still alive then (held weakly)."""
    _open_at_exit.add(closable)


@atexit.register
def _close_all_at_exit() -> None:
    # atexit hooks run last-registered first, so this runs before multiprocessing's own hook (imported earlier,
    # by torch) reaps the workers, and before any module global is cleared.
    for closable in list(_open_at_exit):
        closable.close()


class EpochIterator:
    """Defers calling ``factory`` for the epoch's batch generator to the first ``next()``, and closes it when freed."""

    def __init__(self, factory: Callable[[], Generator[Any, None, None]]):
        self._factory: Callable[[], Generator[Any, None, None]] | None = factory
        self._batches: Generator[Any, None, None] | None = None
        close_at_exit(self)

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            if self._factory is None:
                raise StopIteration
            self._batches, self._factory = self._factory(), None
        return next(self._batches)

    def close(self) -> None:
        self._factory = None
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()

    def __del__(self) -> None:
        self.close()


class OneIterationAtATime:
    """A loader of independent epoch iterations: a new one stops the previous one's workers."""

    _live: weakref.ref | None = None

    def start_iteration(self, batches: Callable[[], Generator[Any, None, None]]) -> EpochIterator:
        self.close()
        epoch_iterator = EpochIterator(batches)
        self._live = weakref.ref(epoch_iterator)  # weak: the iterator must be freed as soon as its loop drops it
        return epoch_iterator

    def close(self) -> None:
        """Stop the epoch iteration in progress, if any (its worker processes exit now)."""
        live, self._live = self._live, None
        epoch_iterator = live() if live is not None else None
        if epoch_iterator is not None:
            epoch_iterator.close()


class ResumedByDataModule:
    """A training loader whose position is its DataModule's state (so Lightning does not warn on mid-epoch saves)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the DataModule restored the position."""


def shutdown_workers(iterator: Iterator[Any] | None) -> None:
    """Stop a torch DataLoader iterator's worker processes now (a no-op for in-process iterators)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


_FREEZE_IN_CHILD = [False]  # set while forking_workers() is open: a child forked then freezes what it inherits


def _freeze_inherited() -> None:
    if _FREEZE_IN_CHILD[0]:
        _FREEZE_IN_CHILD[0] = False
        gc.freeze()


os.register_at_fork(after_in_child=_freeze_inherited)


@contextlib.contextmanager
def forking_workers() -> Iterator[None]:
    """Processes forked inside (a DataLoader's workers) never collect what they inherit: nothing of this process's,
    garbage or not, is finalized in them (and their collections touch none of its pages, so fewer are copied);
    and they end when this process ends, even killed (``child_processes``)."""
    _FREEZE_IN_CHILD[0] = True
    try:
        with children_exit_with_parent():
            yield
    finally:
        _FREEZE_IN_CHILD[0] = False
