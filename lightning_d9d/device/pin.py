"""Pin: copy every tensor of a batch into page-locked host memory (torch's DataLoader pinning skips dataclasses).

Trade-off: one extra host copy per batch, for asynchronous host-to-device copies that overlap compute; CPU-only
torch cannot pin, so callers pin only for an accelerator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a batch tree, keeping container types (frozen dataclasses included)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            field.name: map_tensors(getattr(batch, field.name), fn) for field in dataclasses.fields(batch) if field.init
        }
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, dict):
        return type(batch)((key, map_tensors(value, fn)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, fn) for value in batch)
    return batch


def pin_batch(batch: Any) -> Any:
    """Return ``batch`` with every CPU tensor in page-locked memory.

    Raises:
        RuntimeError: from torch, when no accelerator is available.
    """
    return map_tensors(batch, lambda tensor: tensor if tensor.is_pinned() else tensor.pin_memory())


def resolve_pin_memory(pin_memory: bool | None, device: torch.device | None) -> bool:
    """``pin_memory`` if set, else pin exactly when ``device`` (the trainer's; ``None``: none, then the machine)
    is CUDA: pinning needs an accelerator, and pays only for copies to one.

    Raises:
        ValueError: ``pin_memory=True`` where ``torch.cuda.is_available()`` is False.
    """
    if pin_memory is not None:
        if pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs a CUDA device, but torch.cuda.is_available() is False; "
                "use pin_memory=None (pin exactly when training on CUDA) or False"
            )
        return bool(pin_memory)
    if device is not None:
        return device.type == "cuda"
    return torch.cuda.is_available()
