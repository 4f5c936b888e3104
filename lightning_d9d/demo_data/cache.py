"""A cached build of the demo data: written once per machine, never seen half-written.

Under a file lock the build fills a staging folder, writes its ``COMPLETE`` marker last and publishes it by
atomic rename; a folder without a marker is rebuilt. Concurrent ranks wait for the one that builds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPLETE = "COMPLETE"


def build_once(root: Path, name: str, write: Callable[[Path], str]) -> Path:
    """``root/name``, built by ``write`` unless a complete build is there (safe from every rank).

    Args:
        root: the cache folder (created if missing).
        name: the build's folder name, its cache key.
        write: fills the staging folder given and returns the text of its ``COMPLETE`` marker.
    """
    from filelock import FileLock

    target = root / name
    if (target / COMPLETE).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if (target / COMPLETE).exists():  # another process built it while we waited for the lock
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            marker = write(staging)
            (staging / COMPLETE).write_text(marker)
            if target.exists():  # a stale, incomplete build from a killed process
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target
