"""SyntheticTokenDataset: a deterministic, learnable token dataset that needs no files and no download.

Sample ``i`` is generated on demand from ``(seed, i)``: a heavy-tailed log-normal length, then a strided token
sequence a model visibly learns. Only the lengths are stored, so any size costs 8 bytes per sample.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

_STRIDES = np.array([1, 2, 3, 5, 7])


class SyntheticTokenDataset(Dataset):
    """Map-style dataset of ``{"input_ids": int64 tensor}`` samples with heavy-tailed lengths.

    Args:
        num_samples: dataset length.
        vocab_size: token ids are in ``[0, vocab_size)``.
        min_length, max_length: the length range (``min_length`` >= 2, for a next-token target).
        median_length: median of the length distribution before clipping.
        seed: makes samples and lengths reproducible.

    Raises:
        ValueError: non-positive sizes or a bad length range.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        vocab_size: int = 512,
        min_length: int = 2,
        max_length: int = 128,
        median_length: int = 32,
        seed: int = 0,
    ):
        for name, value in (("num_samples", num_samples), ("vocab_size", vocab_size), ("median_length", median_length)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 2 <= min_length <= max_length:
            raise ValueError(
                f"need 2 <= min_length <= max_length, got min_length={min_length}, max_length={max_length}"
            )
        self.num_samples, self.vocab_size, self.seed = num_samples, vocab_size, seed
        lengths = np.random.default_rng([seed, 0x1E17]).lognormal(np.log(median_length), 0.8, size=num_samples)
        self.lengths = np.clip(np.rint(lengths), min_length, max_length).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(self.vocab_size), rng.choice(_STRIDES)
        tokens = (start + stride * np.arange(self.lengths[index])) % self.vocab_size
        return {"input_ids": torch.from_numpy(tokens.astype(np.int64))}

    def sort_key(self, index: int) -> int:
        """The sample's length (D9DDataModule's default sort key)."""
        return int(self.lengths[index])
