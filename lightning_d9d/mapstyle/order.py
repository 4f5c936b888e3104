"""Order: the global sequence of global batches of one epoch, a pure function of (seed, epoch, data, sizes).

A seeded Feistel bijection maps epoch positions to sample indices on demand (no O(N) permutation). Without sorting,
global batch ``s`` is positions ``[s·G, (s+1)·G)``; with sorting, windows of ``K·G`` samples are sorted by key, cut
into K batches of neighbours and visited in a seeded order. Nothing depends on world size, microbatch size or workers.

Trade-off: batches are shuffled only within a window, so one sort serves K steps without multiplying padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lightning_d9d.core.digest import digest

# Feistel rounds: 4 rounds of a strong mixing function make a well-shuffled permutation; more buys nothing.
_FEISTEL_ROUNDS = 4
# Unsorted orders evaluate the bijection for this many positions at once: one numpy call per block.
_UNSORTED_BLOCK_SAMPLES = 4096


def _mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised (uint64 wraps by design)."""
    values = values.copy()
    values ^= values >> np.uint64(30)
    values *= np.uint64(0xBF58476D1CE4E5B9)
    values ^= values >> np.uint64(27)
    values *= np.uint64(0x94D049BB133111EB)
    values ^= values >> np.uint64(31)
    return values


class SeededPermutation:
    """A seeded bijection on ``[0, size)`` (Feistel network with cycle walking), evaluated lazily.

    Args:
        seed: any sequence of non-negative integers (e.g. ``(seed, epoch)``).
    """

    def __init__(self, size: int, seed: Sequence[int]):
        if size < 1:
            raise ValueError(f"SeededPermutation needs size >= 1, got {size}")
        self.size = size
        half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
        self._half_bits = np.uint64(half_bits)
        self._half_mask = np.uint64((1 << half_bits) - 1)
        self._round_keys = np.random.SeedSequence(list(seed)).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        left = values >> self._half_bits
        right = values & self._half_mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._half_mask)
        return (left << self._half_bits) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        values = self._feistel(np.asarray(positions, dtype=np.uint64))
        outside = values >= np.uint64(self.size)
        while outside.any():
            values[outside] = self._feistel(values[outside])
            outside = values >= np.uint64(self.size)
        return values.astype(np.int64)


KeyLookup = Callable[[np.ndarray], np.ndarray]


def resolve_sort_keys(dataset: Any, sort_key: str | Callable[[int], Any] | None) -> KeyLookup | None:
    """Turn the user's ``sort_key`` choice into a vectorised lookup ``indices -> keys``.

    Args:
        sort_key: ``None`` (``dataset.sort_key`` if any), a callable of one index, or a column name.

    Raises:
        ValueError: a column name the dataset does not have, or a dataset without columns.
    """
    if sort_key is None:
        method = getattr(dataset, "sort_key", None)
        return _per_index_lookup(method) if callable(method) else None
    if isinstance(sort_key, str):
        column_names = getattr(dataset, "column_names", None)
        if column_names is None:
            raise ValueError(
                f"sort_key={sort_key!r} names a column, but the dataset ({type(dataset).__name__}) has no columns; "
                "pass a callable(index) or give the dataset a sort_key(index) method"
            )
        if sort_key not in column_names:
            raise ValueError(f"sort_key column {sort_key!r} is not in the dataset; its columns are {column_names}")
        return _arrow_column_lookup(dataset, sort_key)
    if callable(sort_key):
        return _per_index_lookup(sort_key)
    raise ValueError(f"sort_key must be None, a column name or a callable(index); got {sort_key!r}")


def _arrow_column_lookup(dataset: Any, name: str) -> KeyLookup:
    """Vectorised reads of one column from the dataset's memory-mapped Arrow table, honouring its indices mapping."""
    column = dataset.data.column(name)
    _check_sortable_column(column, name)
    indices_mapping = getattr(dataset, "_indices", None)
    rows_of = indices_mapping.column(0) if indices_mapping is not None else None

    def lookup(indices: np.ndarray) -> np.ndarray:
        rows = pa.array(np.asarray(indices, dtype=np.int64))
        if rows_of is not None:
            rows = rows_of.take(rows)
        return column.take(rows).to_numpy(zero_copy_only=False)

    return lookup


def _check_sortable_column(column: pa.ChunkedArray, name: str) -> None:
    """Raise TypeError for a key column with nulls, NaNs or a non-numeric type."""
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise TypeError(f"sort_key column {name!r} has type {column.type}; sort keys must be integers or floats")
    bad = pc.is_null(column, nan_is_null=True) if column.null_count or pa.types.is_floating(column.type) else None
    if bad is not None and pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise TypeError(
            f"sort_key column {name!r} has a null/NaN key at row {row}; sort keys must be numbers for every sample"
        )


def _per_index_lookup(function: Callable[[int], Any]) -> KeyLookup:
    def lookup(indices: np.ndarray) -> np.ndarray:
        keys = [function(int(index)) for index in indices]
        array = np.asarray(keys) if keys and not isinstance(keys[0], (tuple, list)) else None
        if array is not None and array.ndim == 1 and array.dtype.kind in "biuf":
            return array
        # Anything else (strings, tuples, mixed types) is compared as Python objects, so that keys of mixed
        # types raise instead of being silently coerced (numpy would turn [1, "x"] into strings).
        out = np.empty(len(keys), dtype=object)
        out[:] = keys
        return out

    return lookup


def argsort_keys(keys: np.ndarray, tie_break: np.ndarray, indices: np.ndarray | None = None) -> np.ndarray:
    """Positions that sort ``keys`` ascending, ties ordered by ``tie_break``; ``TypeError`` for incomparable keys."""
    if keys.dtype != object and keys.dtype.kind in "biuf":
        if keys.dtype.kind == "f" and np.isnan(keys).any():
            position = int(np.flatnonzero(np.isnan(keys))[0])
            where = f" (sample {int(indices[position])})" if indices is not None else ""
            raise TypeError(f"sort key nan{where} is not comparable; sort keys must be numbers or comparable values")
        return np.lexsort((tie_break, keys))
    try:
        return np.asarray(sorted(range(len(keys)), key=lambda i: (keys[i], tie_break[i])), dtype=np.int64)
    except TypeError as error:
        examples = sorted({type(key).__name__ for key in keys})
        position = _odd_key_position(keys)
        where = f"sample {int(indices[position])}" if indices is not None else f"key number {position}"
        raise TypeError(
            f"sort keys are not comparable with each other: {where} has sort key {keys[position]!r} "
            f"(key types seen: {examples}; {error}); sort keys must be numbers or mutually comparable values"
        ) from None


def _odd_key_position(keys: np.ndarray) -> int:
    """The first key that is None, NaN, or of a type other than the most common one."""
    types = [type(key) for key in keys]
    common = max(set(types), key=types.count)
    for position, key in enumerate(keys):
        if key is None or (isinstance(key, float) and key != key) or type(key) is not common:
            return position
    return 0


def keys_digest(lookup: KeyLookup | None, num_samples: int, samples: int = 64) -> str:
    """A short digest of the sort keys at up to ``samples`` evenly spaced indices (cheap dataset fingerprint)."""
    if lookup is None:
        return "unsorted"
    indices = np.unique(np.linspace(0, num_samples - 1, num=min(samples, num_samples)).astype(np.int64))
    return digest(repr(lookup(indices).tolist()))


def check_sort_buffer_size(sort_buffer_size: int, global_batch_size: int) -> None:
    """Raise ValueError when the sort window cannot hold one global batch."""
    if sort_buffer_size < global_batch_size:
        raise ValueError(
            f"sort_buffer_size={sort_buffer_size} is smaller than global_batch_size={global_batch_size}; "
            "use None (no sorting) or a multiple of global_batch_size (16x or more pads least)"
        )


class GlobalBatchOrder:
    """The epoch's global batches: ``order.global_batch(epoch, step)`` is an int64 array of G sample indices.

    Args:
        sort_buffer_size: ``None`` for no sorting, else the sort window (rounded down to a multiple of G).
        key_lookup: vectorised ``indices -> keys`` (required when sorting).

    Raises:
        ValueError: non-positive sizes, N < G, a buffer smaller than G, or sorting without keys.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        sort_buffer_size: int | None,
        key_lookup: KeyLookup | None,
        seed: int,
        shuffle: bool = True,
    ):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")
        if num_samples < global_batch_size:
            raise ValueError(
                f"the training dataset has {num_samples} samples, fewer than one global batch "
                f"(global_batch_size={global_batch_size}); use a smaller global_batch_size or more data"
            )
        if sort_buffer_size is not None:
            check_sort_buffer_size(sort_buffer_size, global_batch_size)
            if key_lookup is None:
                raise ValueError(
                    f"sort_buffer_size={sort_buffer_size} asks for length sorting, but no sort key was found: pass "
                    "sort_key (a column name or a callable(index)) or give the dataset a sort_key(index) method"
                )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.key_lookup = key_lookup
        self.steps_per_epoch = num_samples // global_batch_size
        self.batches_per_window = None if sort_buffer_size is None else sort_buffer_size // global_batch_size
        # Without sorting, positions are still evaluated a block at a time (~4096 samples) for speed.
        self._batches_per_window = self.batches_per_window or max(1, _UNSORTED_BLOCK_SAMPLES // global_batch_size)
        self._permutation: tuple[int, SeededPermutation] | None = None
        self._cached_window: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None
        self._window_keys = np.empty(0)  # the cached window's sort keys, in its sorted order

    def _positions_to_indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions.astype(np.int64)
        if self._permutation is None or self._permutation[0] != epoch:
            # Deriving round keys (SeedSequence) is the costly part: once per epoch, not per batch.
            self._permutation = (epoch, SeededPermutation(self.num_samples, (self.seed, epoch)))
        return self._permutation[1](positions)

    def global_batch(self, epoch: int, step: int) -> np.ndarray:
        """The G sample indices of global batch ``step`` of ``epoch`` (in sorted order when sorting)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside the epoch's {self.steps_per_epoch} steps")
        window, within = divmod(step, self._batches_per_window)
        window_indices, batch_order = self._window(epoch, window)
        slot = int(batch_order[within])
        return window_indices[slot * self.global_batch_size : (slot + 1) * self.global_batch_size]

    def _window(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """The window's sample indices (sorted by key when sorting) and the order its batches are visited in."""
        if self._cached_window is not None and self._cached_window[0] == (epoch, window):
            return self._cached_window[1]
        window_samples = self._batches_per_window * self.global_batch_size
        start = window * window_samples
        # The last window is short: it ends where the epoch's whole global batches end.
        stop = min(start + window_samples, self.steps_per_epoch * self.global_batch_size)
        indices = self._positions_to_indices(epoch, np.arange(start, stop))
        num_batches = len(indices) // self.global_batch_size
        if self.batches_per_window is None or self.key_lookup is None:
            # Unsorted: a block of consecutive positions, visited in position order.
            batch_order = np.arange(num_batches)
        else:
            rng = np.random.default_rng((self.seed, epoch, window))
            tie_break = rng.random(len(indices)) if self.shuffle else np.arange(len(indices))
            keys = self.key_lookup(indices)
            by_key = argsort_keys(keys, tie_break, indices)
            indices, self._window_keys = indices[by_key], keys[by_key]
            batch_order = rng.permutation(num_batches) if self.shuffle else np.arange(num_batches)
        self._cached_window = ((epoch, window), (indices, batch_order))
        return indices, batch_order

    def global_batch_keys(self, epoch: int, step: int) -> np.ndarray | None:
        """The sort keys of ``global_batch(epoch, step)``'s samples (``None`` without sorting), cached."""
        if self.batches_per_window is None or self.key_lookup is None:
            return None
        window, within = divmod(step, self._batches_per_window)
        _, batch_order = self._window(epoch, window)
        slot = int(batch_order[within])
        return self._window_keys[slot * self.global_batch_size : (slot + 1) * self.global_batch_size]
