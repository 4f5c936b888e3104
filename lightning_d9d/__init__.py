"""lightning_d9d: correct and fast training data loading for PyTorch Lightning.

order → shard → load → pack → pin → transfer, with the data position saved in every checkpoint.

Layout (one file per stage; only ``datamodules``, ``cli`` and the demo model import Lightning):

* ``mapstyle``: the map-style path — ``order`` (seeded, length-sorted global batches), ``plan`` (token-budget
  epochs: samples packed into microbatches of at most ``microbatch_tokens``, padded or padding-free),
  ``shard`` (microbatches dealt to ranks), ``steps`` (sample counts or token budgets, one interface),
  ``loader`` (torchdata's ``StatefulDataLoader`` fed with precomputed index batches);
* ``streaming``: the pretraining path — ``source`` (parquet files and row groups), ``reader`` (texts, by
  position), ``tokenize`` (prefetching tokenizer, no state), ``packing`` (rows from documents), ``stream``
  (the three composed, with state), ``loader`` (streams of one rank, in workers);
* ``text``: tokenizing text datasets once (``tokenize``) and padding or flattening microbatches (``collate``);
* ``device``: ``pin`` and ``transfer``; ``resume``: the position and fingerprint every DataModule saves;
* ``datamodules``: the Lightning-facing layer (``base``, the DataModules, and ``callback``, which keeps the
  Trainer's settings and restored counters in agreement with the data); ``demo``: the embedded corpus, tiny
  model and synthetic data.

The public names below are imported on first use, so that importing a stage does not import Lightning.
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
