"""Transfer: move a (pinned) batch to the training device with ``non_blocking=True`` (synchronous from pageable
memory, so it pays off only with pinning); a CPU target returns the batch as is. Unlike Lightning's
``move_data_to_device`` it does not deep-copy dataclasses.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_d9d.device.pin import map_tensors


def move_batch_to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of ``batch`` to ``device``, keeping container types; unchanged on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
