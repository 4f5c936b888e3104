"""The one digest: parts NUL-separated, files as one part, the incremental form equal to the one-call form (the
values are stored in checkpoints' fingerprints, so they must not change)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from lightning_d9d.core.digest import DIGITS, Hasher, digest, file_digest


def test_parts_are_separated_and_the_hasher_gives_the_same_digest(tmp_path: Path) -> None:
    assert digest("ab", "c") == hashlib.sha256(b"ab\0c\0").hexdigest()[:DIGITS] != digest("a", "bc")
    assert Hasher().add("ab").add(b"c").hexdigest() == digest("ab", "c")
    fed = Hasher()
    for piece in (b"a", b"b"):
        fed.feed(piece)
    fed.end_part()
    assert fed.add("c").hexdigest() == digest("ab", "c"), "a part fed in pieces is that part"
    path = tmp_path / "file.bin"
    path.write_bytes(bytes(range(256)) * 9000)  # over one 1 MiB block
    assert file_digest(path) == hashlib.sha256(path.read_bytes() + b"\0").hexdigest()[:DIGITS]
