"""Peer check: prove that the processes of each data-parallel replica train identical microbatches.

Under tensor, context or pipeline parallelism every process of one replica (same ``dp_rank``) must see the same
batches; a data loader that deals by process gives them different ones, and nothing fails. The check digests
every microbatch of an optimizer step (:func:`batch_digest`: the bytes, shape and dtype of each tensor, walked
through dataclasses, dicts, lists, tuples and numpy arrays in a fixed order; any other leaf by its ``repr``),
all-gathers each process's digests with its ``dp_rank`` (:func:`verify_peer_step`), and raises one error
naming the step and the processes that disagree within a replica. Every process raises the same error, so
none is left waiting in a collective.

Trade-off: digesting copies each tensor to the host and one all-gather runs per step, so the check is meant for
the first few steps of a run (a DataModule's ``verify_peers``), not for all of them; it proves agreement, not
that the data is right (different replicas are only warned about when all of them are identical).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class PeerMismatchError(RuntimeError):
    """Processes of one data-parallel replica trained different microbatches in the same optimizer step."""


def batch_digest(batch: Any) -> str:
    """A stable hex digest (32 digits) of a batch: equal batches give equal digests on any process.

    Tensors (any dtype, any device) and numpy arrays count by shape, dtype and bytes; dataclasses by their
    fields, dicts by their sorted keys, lists and tuples in order; any other leaf by ``repr``.
    """
    digest = hashlib.sha256()
    _update(digest, batch)
    return digest.hexdigest()[:32]


def _update(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous()
        digest.update(f"tensor{tuple(tensor.shape)}{tensor.dtype}".encode())
        # A view as bytes hashes every dtype (bfloat16 and bool included, which numpy cannot hold).
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        digest.update(f"array{array.shape}{array.dtype.str}".encode())
        digest.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        digest.update(f"dataclass {type(value).__qualname__}".encode())
        for field in dataclasses.fields(value):
            digest.update(f"field {field.name}".encode())
            _update(digest, getattr(value, field.name))
    elif isinstance(value, dict):
        digest.update(b"dict")
        for key in sorted(value, key=repr):
            digest.update(f"key {key!r}".encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _update(digest, item)
    else:
        digest.update(f"leaf {value!r}".encode())


def verify_peer_step(step: int | str, digests: Sequence[str], dp_rank: int, group: Any = None) -> None:
    """All-gather every process's digests of one optimizer step and compare them within each replica.

    Every process of ``group`` must call it at the same step (it is a collective). On one process, or without
    ``torch.distributed``, there is nothing to compare.

    Args:
        step: the optimizer step, for the message (a string such as ``"3 (validation)"`` for a validation run).
        digests: this process's :func:`batch_digest` of each microbatch of the step, in training order.
        dp_rank: this process's data-parallel rank; processes with the same one are peers.
        group: the process group (default: the world).

    Raises:
        PeerMismatchError: peers whose digests differ, naming the step, the replica and the processes of each
            distinct sequence (the same error on every process).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (int(dp_rank), list(digests)), group=group)
    check_peer_digests(step, gathered)


def check_peer_digests(step: int | str, gathered: Sequence[tuple[int, Sequence[str]]]) -> None:
    """Compare gathered ``(dp_rank, digests)`` of every process (index = process rank) within each replica.

    Raises:
        PeerMismatchError: see :func:`verify_peer_step`.
    """
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
