"""A cached build of the demo data: written once per machine, never seen half-written.

Algorithm: ``build_once(root, name, write)`` returns ``root/name`` at once when its ``COMPLETE`` marker exists.
Otherwise it takes the file lock ``root/name.lock``, looks again (another process may have built it while this one
waited), and else lets ``write`` fill a fresh staging folder in ``root``, writes the marker there last, and
publishes the folder by an atomic rename onto ``root/name``. A folder left without a marker by a killed process is
replaced; a staging folder is removed whatever happens.

Trade-off: concurrent processes (DDP ranks, several nodes on a shared file system) wait for the one that builds
instead of building in parallel, and a build killed midway is redone whole rather than resumed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPLETE = "COMPLETE"


def build_once(root: Path, name: str, write: Callable[[Path], str]) -> Path:
    """``root/name``, built by ``write`` unless a complete build is already there (safe to call from every rank).

    Args:
        root: the cache folder (created if missing); the lock and the staging folder go there too.
        name: the build's folder name in ``root``, its cache key.
        write: fills the staging folder it is given and returns the text of its ``COMPLETE`` marker.

    Returns:
        The published folder.
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
