"""Helpers shared by the benchmarks: a dataset of any length that costs nothing, peak-RSS probes, verdict lines,
and runners in processes of their own, frozen between the windows that time them."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


class IndexDataset:
    """A map-style dataset of ``size`` samples whose sample ``i`` is ``i``: O(1) memory for any size.

    It isolates the cost of the order and the loader from the cost of reading data.

    Args:
        size: the dataset length (e.g. 10⁹).
        column: an optional numpy-backed sort-key column (e.g. a ``np.memmap``), exposed the way a Hugging
            Face dataset exposes one (``column_names`` and an Arrow table ``data`` wrapping the array without a
            copy), so that ``D9DDataModule(sort_key="length")`` gathers a window's keys with Arrow ``take``
            instead of calling Python per index.
    """

    def __init__(self, size: int, column: np.ndarray | None = None):
        self.size = size
        self.column_names = ["length"] if column is not None else None
        # pa.array over a numeric numpy array shares its buffer: a memmap stays on disk until pages are read.
        self.data = pa.table({"length": pa.array(column)}) if column is not None else None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def process_kib(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` memory field in KiB (``VmRSS``: now; ``VmHWM``: peak since the last reset)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5), so a later peak belongs to what ran after."""
    Path("/proc/self/clear_refs").write_text("5")


def print_verdicts(verdicts: list[tuple[bool, str]]) -> None:
    """One ``PASS: …`` / ``FAIL: …`` line per (passed, description) against a target."""
    for passed, text in verdicts:
        print(f"{'PASS' if passed else 'FAIL'}: {text}")


class _Here:
    """The pipe end a target sends its result through when it runs in this process."""

    def send(self, value: object) -> None:
        self.value = value


def in_child(target: Callable[..., None], *args: object, inline: bool = False) -> Any:
    """``target(conn, *args)`` in a fresh spawned interpreter, returning what it sends through ``conn``;
    ``inline`` runs it in this process (a smoke test: a spawned interpreter pays seconds of imports)."""
    if inline:
        here = _Here()
        target(here, *args)
        return here.value
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=target, args=(child, *args))
    process.start()
    child.close()  # the child's end lives in the child only: its exit without a result ends recv() at once
    try:
        result = parent.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"{target.__name__} exited with code {process.exitcode} without a result") from None
    process.join()
    return result


class Inline:
    """A runner in this process (``--quick``: no process start-up to pay, timings meaningless anyway)."""

    def __init__(self, factory: Callable[..., Any], cfg: dict):
        self.runner = factory(**cfg)
        self.info = self.runner.info

    def call(self, command: str, *args: object) -> object:
        return getattr(self.runner, command)(*args)

    def close(self) -> None:
        self.runner.close()


def _serve(conn, factory: Callable[..., Any], cfg: dict) -> None:
    os.setpgrp()  # its own process group, DataLoader workers included, so it can be frozen as one
    # A spawned process defaults to spawning its own children; a training script's DataLoader workers start the
    # platform's default way (fork on Linux), so these do too.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    try:
        runner = factory(**cfg)
        conn.send(("ok", runner.info))
        while True:
            command, args = conn.recv()
            if command == "quit":
                break
            conn.send(("ok", getattr(runner, command)(*args)))
        runner.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


_CHILDREN: list[Child] = []


class Child:
    """``factory(**cfg)`` (a runner class: ``info``, ``close()`` and the methods ``call`` names) in a fresh spawned
    process with ``environment`` added to this one's, frozen (``SIGSTOP`` of its process group) between calls."""

    def __init__(self, factory: Callable[..., Any], cfg: dict, environment: dict[str, str] | None = None):
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        previous = {name: os.environ.get(name) for name in environment or {}}
        os.environ.update(environment or {})
        try:
            # Not a daemon: daemonic processes may not start DataLoader workers.
            self.process = context.Process(target=_serve, args=(theirs, factory, cfg))
            self.process.start()
        finally:
            for name, value in previous.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        theirs.close()
        _CHILDREN.append(self)
        self.info = self._receive()
        self._signal(signal.SIGSTOP)

    def _receive(self) -> object:
        tag, value = self.conn.recv()
        if tag == "error":
            raise RuntimeError(f"benchmark child failed:\n{value}")
        return value

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def call(self, command: str, *args: object) -> object:
        self._signal(signal.SIGCONT)
        try:
            self.conn.send((command, args))
            return self._receive()
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        try:
            self.conn.send(("quit", ()))
            self.process.join(120)
        except (BrokenPipeError, OSError):
            pass
        if self.process.is_alive():
            self._signal(signal.SIGKILL)
            self.process.join()
        if self in _CHILDREN:
            _CHILDREN.remove(self)


@atexit.register
def _kill_children() -> None:
    for child in list(_CHILDREN):
        child._signal(signal.SIGCONT)
        child._signal(signal.SIGKILL)
