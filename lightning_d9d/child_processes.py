"""Child processes that end with their parent: no tokenizing pool outlives a killed training process.

``datasets.Dataset.map(num_proc=N)`` forks a pool of N workers and a manager process. They wait on pipes that
they hold both ends of, so when the parent dies without running its clean-up (SIGKILL, or SIGTERM without a
Python handler: the default action ends the process at once) none of them ever sees end-of-file: they keep
running, re-parented to init, and hold memory and cores until someone kills them by hand.

Algorithm: while ``children_exit_with_parent()`` is active, every process this process forks runs, right after
the fork, ``exit_with_parent``: on Linux it asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, which covers the window between fork and the first task too); where that is not
available, a daemon thread polls ``os.getppid()`` once a second and exits when the parent changed. A process
whose parent already died before the request exits at once.

Trade-off: the kernel signal is bound to the *thread* that forked the child, so a pool created by a thread
that ends before the pool would take its workers down with it; ``Dataset.map`` creates and joins its pool in
the calling thread, which outlives it. Children started with the ``spawn`` method (no fork) are not covered
by the fork hook; ``exit_with_parent`` can be called from their own code instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 1.0
_active = 0  # > 0 while some caller wants its forked children bound; read in the child right after fork
_hook_registered = False
_lock = threading.Lock()
_bound_pid: int | None = None
_forker_pid: int | None = None  # set just before each fork, so the child knows whom it must outlive no longer


@contextlib.contextmanager
def children_exit_with_parent() -> Iterator[None]:
    """Within the block, every process forked from this one ends when this one ends (see the module docstring)."""
    global _active, _hook_registered
    with _lock:
        if not _hook_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
            _hook_registered = True
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1


def _before_fork() -> None:
    global _forker_pid
    _forker_pid = os.getpid()


def _after_fork_in_child() -> None:
    if _active > 0:
        exit_with_parent(_forker_pid)


def exit_with_parent(parent: int | None = None) -> None:
    """Make this process end when its parent ends; idempotent per process.

    Args:
        parent: the parent's pid as the parent saw it (exits at once if that process is already gone);
            ``None``: the current parent.
    """
    global _bound_pid
    if _bound_pid == os.getpid():
        return
    _bound_pid = os.getpid()
    parent = os.getppid() if parent is None else parent
    if not _request_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent,), name="exit-with-parent", daemon=True).start()
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect
        os._exit(1)


def _request_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux; False where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_SECONDS)
    os._exit(1)


def exit_with_process(pid: int) -> None:
    """End this process when process ``pid`` ends, whoever this process's parent is.

    A worker started by a forkserver is the forkserver's child, and the forkserver lives as long as any of its
    children holds its liveness pipe (each does): neither a parent-death signal nor a watch of the parent ever
    fires when the training process that asked for the worker is killed. A daemon thread waits on the process
    itself instead (a pidfd where the kernel has them, else a poll once a second).

    Args:
        pid: the process to outlive no longer (exits at once if it is already gone).
    """
    threading.Thread(target=_wait_for_exit, args=(pid,), name="exit-with-process", daemon=True).start()


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has ended
    else:
        while _alive(pid):
            time.sleep(_POLL_SECONDS)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
