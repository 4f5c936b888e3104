"""Epoch iterators that start lazily and stop their worker processes deterministically.

Two things every training loader of this package needs, in one place:

* **Start at the first ``next()``.** ``iter()`` may run before the resume state is loaded (Lightning probes
  iterability early, e.g. through ``estimated_stepping_batches``), so the position is read only when the first
  batch is really asked for.
* **Resume through the DataModule** (``ResumedByDataModule``): the position is the DataModule's state.
* **Stop on time.** A loop broken off in a notebook, a new loader, ``teardown`` or an exception must stop the
  DataLoader's worker processes there and then. Left to the garbage collector, a suspended generator that
  holds a DataLoader iterator is freed whenever a collection happens to run, possibly inside a worker forked
  later for another loader, where torch's ``__del__`` fails with "can only test a child process". So the epoch
  iterator holds no reference cycle (it is freed the moment the loop drops it), closes its generator when
  freed or closed, and the generator's ``finally`` shuts the workers down; and garbage is collected in this
  process before new workers are forked.
* **Stop before the interpreter tears itself down.** An iterator still open when a script ends (a module
  global, a loop left mid-epoch) would otherwise be closed during interpreter shutdown, after module globals
  were cleared, and its ``finally`` blocks would fail on names that are gone ("Exception ignored in ...").
  Whatever holds workers or threads registers with :func:`close_at_exit`, and an ``atexit`` hook closes what
  is still open while every module is intact (a weak set: registering keeps nothing alive).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

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
    """Defers creating the epoch's batch generator to the first ``next()``, and closes it when freed.

    Args:
        factory: returns the epoch's generator; called once, at the first ``next()``.
    """

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
        """Stop the epoch now: its generator's ``finally`` blocks run (and stop its workers)."""
        self._factory = None
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()

    def __del__(self) -> None:
        self.close()


class OneIterationAtATime:
    """The lifecycle of a loader whose iterations are independent (both map-style loaders, streaming validation):
    one epoch iteration at a time, its workers stopped deterministically.

    A new iteration stops the previous one's workers, and ``close()`` stops the live one (at teardown, when
    training raises): a loop broken off never leaves worker processes for the garbage collector.
    """

    _live: weakref.ref | None = None

    def start_iteration(self, batches: Callable[[], Generator[Any, None, None]]) -> EpochIterator:
        """A new epoch iteration over ``batches()`` (started at its first ``next()``), stopping the previous one."""
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
    """A training loader whose position is its DataModule's state, which Lightning saves in the same checkpoint.

    Having ``state_dict``/``load_state_dict`` tells Lightning that the loader resumes exactly, so it does not warn
    that a mid-epoch checkpoint cannot be resumed; the state itself is empty.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load here: the DataModule restored the position."""


def shutdown_workers(iterator: Iterator[Any] | None) -> None:
    """Stop a torch DataLoader iterator's worker processes now (a no-op for in-process iterators)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def collect_before_fork() -> None:
    """Free this process's unreachable objects before forking workers, so no child inherits them as garbage."""
    gc.collect()
