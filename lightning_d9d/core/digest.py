"""Digest: the one content hash every fingerprint, cache key and identity of this package uses.

Algorithm: SHA-256 over the parts (strings UTF-8 encoded, each followed by a NUL so that ``("ab", "c")`` and
``("a", "bc")`` differ), shown as its first 16 hex digits; a file is hashed in 1 MiB blocks. SHA-256 rather than
BLAKE2b: CPUs with SHA extensions hash it faster (measured in docs/token_cache.md), and one algorithm serves every
use.

Trade-off: 64 bits shown are plenty to tell versions of the same data apart (a fingerprint compares two values,
it is no collision-resistant identity); the full hash costs nothing more but would clutter every message. A
*content key* (what names a token cache entry) is an identity among many: it shows 128 bits, so that no two
contents ever share one by accident.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

DIGITS = 16
CONTENT_DIGITS = 32


class Hasher:
    """:func:`digest` built up piece by piece: ``add(*parts)`` hashes whole parts (each followed by a NUL),
    ``feed(chunk)`` one part that arrives in pieces, ended by ``end_part()``; ``hexdigest()`` as :func:`digest`."""

    def __init__(self, digits: int = DIGITS) -> None:
        self._hashed, self._digits = hashlib.sha256(), digits

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
        return self._hashed.hexdigest()[: self._digits]


def hasher() -> Any:
    """A fresh incremental SHA-256 (``update`` as bytes arrive, ``hexdigest`` at the end): a stored file's digest."""
    return hashlib.sha256()


def digest(*parts: str | bytes, digits: int = DIGITS) -> str:
    """The hex digest of ``parts`` (see the module docstring), ``digits`` long."""
    return Hasher(digits).add(*parts).hexdigest()


def content_key(*parts: str | bytes) -> str:
    """A content key: the digest of ``parts`` at ``CONTENT_DIGITS`` hex digits."""
    return digest(*parts, digits=CONTENT_DIGITS)


def file_digest(path: str | os.PathLike) -> str:
    """The hex digest of a file's bytes (one part)."""
    hashed = Hasher()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            hashed.feed(block)
    hashed.end_part()
    return hashed.hexdigest()
