"""PartAttribute: a DataModule attribute that belongs to one of the parts the DataModule owns; HandedLoaders: the
part that remembers the loaders a DataModule handed out, so that they are closed when replaced, at teardown and on
error.

DataModules here are composed of parts (the data-parallel layout, the observation, a corpus, a run plan, ...) that
own their state; users keep calling the DataModule's own names (``dm.seq_len``, ``dm.data_step(s)``). Each such name
is declared once in the class body, ``seq_len = PartAttribute("settings")``, and reads the part's attribute of the
same (or the given) name; a ``SettablePartAttribute`` writes it too. The part stays the only owner, and a reader
sees in one line where a name lives. The loaders are held weakly: a loader that refers back to its DataModule must
not keep it alive.

Trade-off: a descriptor instead of a property per name, so the name's documentation is the part's, not repeated on
the DataModule.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, TypeVar


class ClosableLoader(Protocol):
    def close(self) -> None: ...


Loader = TypeVar("Loader", bound=ClosableLoader)


class PartAttribute:
    """A DataModule attribute that is one of its parts' (``part.name``), read through. Like a method, it may be
    shadowed on an instance (a test's spy); ``SettablePartAttribute`` writes through instead.

    Args:
        part: the DataModule's attribute holding the part.
        name: the part's attribute (default: the name it is declared under).
    """

    def __init__(self, part: str, name: str | None = None):
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(getattr(owner, self.part), self.name)


class SettablePartAttribute(PartAttribute):
    """A ``PartAttribute`` whose assignment on the DataModule sets the part's attribute."""

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(getattr(owner, self.part), self.name, value)


class HandedLoaders:
    """The loaders a DataModule handed out, one per kind (``"train"``, ``"val/0"``, ...), held weakly."""

    def __init__(self) -> None:
        self._loaders: dict[str, weakref.ref] = {}

    def get(self, kind: str) -> Any:
        """The live loader of ``kind`` handed out, else ``None``."""
        ref = self._loaders.get(kind)
        return None if ref is None else ref()

    def track(self, loader: Loader, kind: str = "train") -> Loader:
        """Remember ``loader``, closing the previous one of its kind (its workers exit now)."""
        previous = self.get(kind)
        if previous is not None:
            previous.close()
        self._loaders[kind] = weakref.ref(loader)
        return loader

    def close(self) -> None:
        """Stop every loader handed out (their workers exit now, not at garbage collection)."""
        loaders, self._loaders = self._loaders, {}
        for ref in loaders.values():
            loader = ref()
            if loader is not None:
                loader.close()
