"""Digest: the one content hash every fingerprint, cache key and identity of this package uses.

Algorithm: SHA-256 over the parts (strings UTF-8 encoded, each followed by a NUL so that ``("ab", "c")`` and
``("a", "bc")`` differ), shown as its first 16 hex digits; a file is hashed in 1 MiB blocks.

Trade-off: 64 bits shown are plenty to tell versions of the same data apart (a fingerprint compares two values,
it is no collision-resistant identity); the full hash costs nothing more but would clutter every message.
"""

from __future__ import annotations

import hashlib
import os

DIGITS = 16


class Hasher:
    """:func:`digest` built up piece by piece: ``add(*parts)`` hashes whole parts (each followed by a NUL),
    ``feed(chunk)`` one part that arrives in pieces, ended by ``end_part()``; ``hexdigest()`` as :func:`digest`."""

    def __init__(self) -> None:
        self._hashed = hashlib.sha256()

    def add(self, *parts: str | bytes) -> Hasher:
        """Hash whole parts (strings UTF-8 encoded)."""
        for part in parts:
            self._hashed.update(part.encode() if isinstance(part, str) else part)
            self._hashed.update(b"\0")
        return self

    def feed(self, chunk: bytes) -> None:
        """Hash the next piece of the current part."""
        self._hashed.update(chunk)

    def end_part(self) -> None:
        """End the part that ``feed`` hashed."""
        self._hashed.update(b"\0")

    def hexdigest(self) -> str:
        return self._hashed.hexdigest()[:DIGITS]


def digest(*parts: str | bytes) -> str:
    """The hex digest of ``parts`` (see the module docstring)."""
    return Hasher().add(*parts).hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """The hex digest of a file's bytes (one part)."""
    hashed = Hasher()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            hashed.feed(block)
    hashed.end_part()
    return hashed.hexdigest()
