"""lightning_d9d: correct and fast training data loading for PyTorch Lightning.

order → shard → load → pack → pin → transfer, with the data position saved in every checkpoint. Only
``datamodules``, ``cli`` and the demo model import Lightning; the public names below are imported on first use,
so importing a stage does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "D9DDataModule": "lightning_d9d.datamodules.d9d",
    "SteppedDataModule": "lightning_d9d.datamodules.base",
    "TextDataModule": "lightning_d9d.datamodules.text",
    "PretrainingDataModule": "lightning_d9d.datamodules.pretraining",
    "PretrainingBatch": "lightning_d9d.datamodules.pretraining",
    "GlobalStepLoss": "lightning_d9d.datamodules.observability",
    "CausalLMCollator": "lightning_d9d.text.collate",
    "FlatteningCollator": "lightning_d9d.text.collate",
    "FlatBatch": "lightning_d9d.text.collate",
    "TextBatch": "lightning_d9d.text.collate",
    "TokenBudget": "lightning_d9d.mapstyle.plan",
    "GlobalBatchOrder": "lightning_d9d.mapstyle.order",
    "SeededPermutation": "lightning_d9d.mapstyle.order",
    "pin_batch": "lightning_d9d.device.pin",
    "move_batch_to_device": "lightning_d9d.device.transfer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_d9d' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
