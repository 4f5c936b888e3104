"""Child processes that end with their parent: no tokenizing pool or DataLoader worker outlives a killed trainer.

``Dataset.map(num_proc=N)`` workers hold both ends of their pipes, so after a SIGKILL of the parent they never
see end-of-file and run on; a DataLoader worker checks its parent only between batches, so one busy reading (or
blocked) holds its files for as long as that takes. Within ``children_exit_with_parent()`` every forked child
asks for ``PR_SET_PDEATHSIG`` (SIGKILL when the parent dies), or, where that is unavailable or the fork came from
a thread other than the main one, starts a thread that polls ``getppid``.

Trade-off: the kernel signal is bound to the forking *thread*, so it is used only for forks from the main thread
(which lives as long as the process); a fork from another thread pays a thread and up to a second's delay instead
of dying with that thread. ``spawn`` children are not covered (a forkserver's: ``exit_with_process``).
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
_forked_from_main = True  # whether that fork came from the main thread (the only one the kernel signal may follow)


@contextlib.contextmanager
def children_exit_with_parent() -> Iterator[None]:
    """Within the block, every process forked from this one ends when this one ends."""
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
    global _forker_pid, _forked_from_main
    _forker_pid = os.getpid()
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if _active > 0:
        exit_with_parent(_forker_pid, kernel_signal=_forked_from_main)


def exit_with_parent(parent: int | None = None, kernel_signal: bool = True) -> None:
    """Make this process end when its parent ends; idempotent per process.

    Args:
        parent: the parent's pid as the parent saw it (exits at once if it is gone); ``None``: the current parent.
        kernel_signal: ask for ``PR_SET_PDEATHSIG`` (only right when the forking thread lives as long as the
            parent); ``False``: a thread polls ``getppid``.
    """
    global _bound_pid
    if _bound_pid == os.getpid():
        return
    _bound_pid = os.getpid()
    parent = os.getppid() if parent is None else parent
    if not (kernel_signal and _request_parent_death_signal()):
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

    A forkserver's child outlives the training process otherwise, so a thread waits on ``pid`` itself.

    Args:
        pid: the process to watch (exits at once if it is gone).
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
