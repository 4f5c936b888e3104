"""Peer check: prove that the processes of each data-parallel replica train identical microbatches.

Each step's microbatch digests are all-gathered with every process's ``dp_rank``; disagreeing peers raise the same
error everywhere. Trade-off: a host copy and an all-gather per step, so it is for a run's first few steps.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_d9d.core.digest import Hasher


class PeerMismatchError(RuntimeError):
    """Processes of one data-parallel replica trained different microbatches in the same optimizer step."""


def batch_digest(batch: Any) -> str:
    """A stable hex digest of a batch (tensors by shape, dtype and bytes; other leaves by ``repr``)."""
    hashed = Hasher()
    _update(hashed, batch)
    return hashed.hexdigest()


def _update(hashed: Hasher, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous()
        hashed.add(f"tensor{tuple(tensor.shape)}{tensor.dtype}".encode())
        # A view as bytes hashes every dtype (bfloat16 and bool included, which numpy cannot hold).
        hashed.add(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        hashed.add(f"array{array.shape}{array.dtype.str}".encode())
        hashed.add(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        hashed.add(f"dataclass {type(value).__qualname__}".encode())
        for field in dataclasses.fields(value):
            hashed.add(f"field {field.name}".encode())
            _update(hashed, getattr(value, field.name))
    elif isinstance(value, dict):
        hashed.add(b"dict")
        for key in sorted(value, key=repr):
            hashed.add(f"key {key!r}".encode())
            _update(hashed, value[key])
    elif isinstance(value, (list, tuple)):
        hashed.add(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _update(hashed, item)
    else:
        hashed.add(f"leaf {value!r}".encode())


class NothingToCompareWarning(UserWarning):
    """``verify_peers`` is on, but no data-parallel replica has two processes: the check proves nothing."""


def checked_summary(what: str, dp_size: int, world_size: int) -> str:
    """The one line that says what a passed check compared, e.g. ``peer check: optimizer steps 0-4 identical ...``."""
    peers = world_size // dp_size
    replicas = "the one data-parallel replica" if dp_size == 1 else f"each of {dp_size} data-parallel replicas"
    return f"peer check: {what} identical across the {peers} processes of {replicas}"


def steps_checked(first: int, last: int) -> str:
    """``optimizer step 3`` or ``optimizer steps 0-4``."""
    return f"optimizer step {first}" if first == last else f"optimizer steps {first}-{last}"


def nothing_to_compare(verify_peers: int, dp_size: int, world_size: int) -> str | None:
    """The warning for a check without peers to compare (every replica one process), else ``None``."""
    if world_size // dp_size > 1:
        return None
    where = (
        "a single process"
        if world_size == 1
        else f"each of the {dp_size} data-parallel replicas has one process (data_parallel counts every process as "
        "a replica: right under DDP or FSDP; under tensor, context or pipeline parallelism it names the wrong dims "
        "and peers train different rows)"
    )
    return (
        f"verify_peers={verify_peers} compares the processes of each data-parallel replica, but {where}: there are "
        "no peers to compare, so the check proves nothing"
    )


def verify_peer_step(step: int | str, digests: Sequence[str], dp_rank: int, group: Any = None) -> None:
    """All-gather every process's digests of one step and compare them within each replica (a collective).

    Args:
        digests: this process's digest of each microbatch of the step, in order.

    Raises:
        PeerMismatchError: peers whose digests differ (the same error on every process).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (int(dp_rank), list(digests)), group=group)
    check_peer_digests(step, gathered)


def check_peer_digests(step: int | str, gathered: Sequence[tuple[int, Sequence[str]]]) -> None:
    """Compare gathered ``(dp_rank, digests)`` per process within each replica (``PeerMismatchError``)."""
    replicas: dict[int, dict[tuple[str, ...], list[int]]] = {}
    for process, (dp_rank, digests) in enumerate(gathered):
        replicas.setdefault(dp_rank, {}).setdefault(tuple(digests), []).append(process)
    broken = {dp: groups for dp, groups in sorted(replicas.items()) if len(groups) > 1}
    if broken:
        details = "; ".join(
            f"data-parallel rank {dp}: processes " + " vs ".join(str(ranks) for ranks in groups.values())
            for dp, groups in broken.items()
        )
        raise PeerMismatchError(
            f"optimizer step {step}: processes of one data-parallel replica trained different microbatches "
            f"({details}). Peers (tensor/context/pipeline parallel) must share data: the data is dealt by process "
            "instead of by data-parallel rank; set the DataModule's data_parallel to the layout"
        )
    sequences = {next(iter(groups)) for groups in replicas.values()}
    if len(replicas) > 1 and len(sequences) == 1:
        warnings.warn(
            f"optimizer step {step}: all {len(replicas)} data-parallel replicas trained identical microbatches; "
            "the data is replicated rather than dealt among replicas (or the samples are duplicates)",
            stacklevel=2,
        )
