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


def digest(*parts: str | bytes) -> str:
    """The hex digest of ``parts`` (see the module docstring)."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode() if isinstance(part, str) else part)
        hashed.update(b"\0")
    return hashed.hexdigest()[:DIGITS]


def file_digest(path: str | os.PathLike) -> str:
    """The hex digest of a file's bytes."""
    hashed = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            hashed.update(block)
    hashed.update(b"\0")
    return hashed.hexdigest()[:DIGITS]
