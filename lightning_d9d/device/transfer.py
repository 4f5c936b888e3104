"""Transfer: move a (pinned) batch to the training device without blocking the host.

Algorithm: the same tree walk as the pin stage; each tensor gets ``.to(device, non_blocking=True)`` when the
target is an accelerator, so a copy from pinned memory is queued on the stream and overlaps with compute.
On a CPU target the batch is returned as it is (no copy, no new objects).

Trade-off: ``non_blocking`` from pageable memory is silently synchronous, so this pays off only together with
the pin stage. Unlike Lightning's ``move_data_to_device`` this does not deep-copy dataclasses and works for
frozen ones.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.device.pin import map_tensors


def move_batch_to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of ``batch`` to ``device``, keeping the batch's container types.

    Args:
        batch: a tensor, or dicts/lists/tuples/namedtuples/dataclasses of them (other leaves pass through).
        device: the target device; a CPU target returns ``batch`` unchanged.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
