"""lightning_d9d: correct and fast training data loading for PyTorch Lightning.

order → shard → load → pack → pin → transfer, with the data position saved in every checkpoint.
"""

from lightning_d9d.datamodule import D9DDataModule, SteppedDataModule
from lightning_d9d.order import GlobalBatchOrder, SeededPermutation
from lightning_d9d.pin import pin_batch
from lightning_d9d.pretraining import PretrainingBatch, PretrainingDataModule
from lightning_d9d.text import CausalLMCollator, TextBatch, TextDataModule
from lightning_d9d.transfer import move_batch_to_device

__all__ = [
    "CausalLMCollator",
    "D9DDataModule",
    "GlobalBatchOrder",
    "PretrainingBatch",
    "PretrainingDataModule",
    "SeededPermutation",
    "SteppedDataModule",
    "TextBatch",
    "TextDataModule",
    "move_batch_to_device",
    "pin_batch",
]
