"""Ledger: every stream's state at every N-th optimizer step, kept beside the checkpoints, so that the rows of any
past step can be rebuilt by a short replay instead of one from step 0.

A record is one file per (training step, stream): ``<root>/<step>/<stream>.npz``, the stream's saved state
flattened (integers in one JSON header, arrays compressed), with the run's *lineage* at that step (the data edits
in force). Streams are layout-independent, so any layout writes and reads the same records, and a resumed or
elastically resumed run writes the same bytes for a step again; a record of another lineage (a run resumed
earlier with a skip or an exclusion) is never taken for this one. A record names its own step and stream, so one
copied over another's is told apart; a record that cannot be trusted (missing, truncated, bit-flipped by the zip's
CRC check, empty, another's) is passed over, and a query replays from an earlier one: slower, never wrong. Writes
are atomic and idempotent. Trade-off:
a record costs tens of KiB per stream (a best-fit buffer's rows) every N steps; a larger N answers a query with
a longer replay.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import uuid
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from lightning_d9d.streaming.sources.storage import Storage

DEFAULT_EVERY = 500
_FORMAT = 2
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError)


def flatten(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state as ``{"a/b/c": leaf}``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{path}/"))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def encode(state: Mapping[str, Any], lineage: str, step: int = -1, stream: int = -1, edits: Any = None) -> bytes:
    """A saved stream state (plain values and int arrays) as one compressed ``.npz`` payload, with the lineage, the
    ``(step, stream)`` it is the record of (so a record copied over another's is told apart) and the edits in
    force (so a query by a DataModule that lacks them can say so)."""
    flat = flatten(state)
    names = [k for k, v in flat.items() if isinstance(v, np.ndarray)]
    arrays = {f"a{i}": np.asarray(flat[name]) for i, name in enumerate(names)}
    plain = {k: (int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v)
             for k, v in flat.items() if not isinstance(v, np.ndarray)}  # fmt: skip
    header = {"format": _FORMAT, "lineage": lineage, "step": int(step), "stream": int(stream), "edits": edits,
              "plain": plain, "arrays": names}  # fmt: skip
    buffer = io.BytesIO()
    np.savez_compressed(buffer, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return buffer.getvalue()


def decode_record(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, header)`` of an :func:`encode` payload.

    Raises:
        ValueError: anything else: a truncated, bit-flipped or empty payload, or a record of another format (the
            zip's CRC check catches a flipped bit in a member's data).
    """
    try:
        with np.load(io.BytesIO(payload)) as data:
            header = json.loads(bytes(data["header"]).decode())
            flat = dict(header["plain"])
            for i, name in enumerate(header["arrays"]):
                flat[name] = data[f"a{i}"]
    except (*_UNREADABLE, json.JSONDecodeError) as error:
        raise ValueError(f"not a stream ledger record: {type(error).__name__}: {error}") from error
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        found = header.get("format") if isinstance(header, dict) else header
        raise ValueError(f"a stream ledger record of format {found!r}, not {_FORMAT}")
    return unflatten(flat), header


def decode(payload: bytes) -> tuple[dict[str, Any], str]:
    """``(state, lineage)`` of an :func:`encode` payload (ValueError for anything else)."""
    state, header = decode_record(payload)
    return state, header["lineage"]


class StreamLedger:
    """The records under ``root`` (a folder or URL), written every ``every`` training steps.

    Args:
        root: where records are kept.
        storage: how ``root`` is reached.
        every: a record every this many optimizer steps (and wherever a run is resumed).

    Raises:
        ValueError: ``every`` below 1.
    """

    def __init__(self, root: str, storage: Storage, every: int = DEFAULT_EVERY):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"provenance_every must be a positive integer, got {every!r}")
        self.root, self.storage, self.every = root, storage, every
        self._fs: pafs.FileSystem | None = None
        self._base = ""

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "storage": self.storage, "every": self.every, "_fs": None, "_base": ""}

    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            self._fs, base = self.storage.filesystem(self.root)
            self._base = base.rstrip("/")
        return self._fs, self._base

    def _path(self, step: int, stream: int) -> str:
        return f"{self._filesystem()[1]}/{step:012d}/{stream}.npz"

    def write(self, step: int, states: Mapping[int, Any], lineage: str, edits: Any = None) -> None:
        """Record ``states`` (stream -> saved state dict) at training step ``step`` under ``lineage`` and ``edits``
        (the edits' ``to_dict``)."""
        fs, _ = self._filesystem()
        for stream, state in states.items():
            path = self._path(step, stream)
            payload = encode(state, lineage, step, stream, edits)
            if isinstance(fs, pafs.LocalFileSystem):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
                with open(temporary, "wb") as out:
                    out.write(payload)
                os.replace(temporary, path)  # peers of a replica write the same bytes: the last rename wins
            else:
                with fs.open_output_stream(path) as out:
                    out.write(payload)

    def steps(self) -> list[int]:
        """The training steps that have records, ascending."""
        fs, base = self._filesystem()
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        return sorted(int(info.base_name) for info in infos if info.base_name.isdigit())

    def read_record(self, step: int, stream: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(state, header)`` of stream ``stream``'s record at ``step``, or ``None`` where there is none that can be
        trusted: missing, unreadable (truncated, bit-flipped, empty) or the record of another step or stream (a file
        copied over this one): each is passed over, and a query replays from an earlier record instead."""
        fs, _ = self._filesystem()
        try:
            with fs.open_input_stream(self._path(step, stream)) as source:
                state, header = decode_record(source.read())
        except (FileNotFoundError, ValueError, OSError):
            return None
        if header.get("step") != step or header.get("stream") != stream:
            return None
        return state, header

    def read(self, step: int, stream: int) -> tuple[dict[str, Any], str] | None:
        """``(state, lineage)`` of stream ``stream`` at ``step``, or ``None`` where there is no trusted record."""
        record = self.read_record(step, stream)
        return None if record is None else (record[0], record[1]["lineage"])

    def latest(
        self, stream: int, at_most: int, lineage_of: Callable[[int], str], passed: list | None = None
    ) -> tuple[int, dict] | None:
        """The latest record of ``stream`` at a step ``<= at_most`` whose lineage is ``lineage_of(step)``; the
        ``(step, edits)`` of readable records of another lineage passed over on the way are appended to ``passed``."""
        for step in reversed(self.steps()):
            if step > at_most:
                continue
            record = self.read_record(step, stream)
            if record is None:
                continue
            if record[1]["lineage"] == lineage_of(step):
                return step, record[0]
            if passed is not None:
                passed.append((step, record[1].get("edits")))
        return None

    def size(self) -> int:
        """Bytes the records take."""
        fs, base = self._filesystem()
        with contextlib.suppress(OSError):
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            return sum(info.size for info in infos if info.type == pafs.FileType.File)
        return 0
