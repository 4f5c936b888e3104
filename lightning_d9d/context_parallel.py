"""Context parallelism (CP): lay out packed documents so a row splits evenly over CP ranks, and split it.

Under CP every rank of a CP group receives the same batch (it is dealt by data-parallel rank only) and keeps a
slice of each sequence. Causal attention costs more towards a sequence's end, so the slice is *load-balanced*
(the zigzag or head-tail split of Megatron-LM, TransformerEngine and torchtitan): the sequence is cut into
``2·cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2·cp − 1 − r``, one cheap and one dear.

Packed (padding-free) rows hold several documents, and attention must not cross them; the balanced split is
then applied to *each document*, so every document must be a multiple of ``2·cp`` long. The data layer pads it
(:func:`pad_documents_for_cp`, :func:`flatten_for_cp`): ``cu_seqlens`` keeps the real lengths,
``cu_seqlens_padded`` the padded spans (TransformerEngine's THD convention), positions restart at 0 at each
document and continue through its padding, whose labels are ``-100``. :func:`cp_shard` and :func:`cp_unshard`
split a row and put it back; :func:`cp_shard_batch` splits a whole batch's sequence fields and never its
metadata (``cu_seqlens*``, ``max_seqlen`` stay those of the whole row, as varlen CP attention expects).

Trade-off: per-document padding wastes up to ``2·cp − 1`` positions per document (the token-budget planner
counts them against ``microbatch_tokens``); it is what keeps documents apart and ranks balanced without an
all-to-all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100
SEQUENCE_FIELDS = ("input_ids", "labels", "position_ids", "inputs", "targets")
"""A batch's fields that hold one value per position and are split over CP ranks; all others are metadata."""


def cp_multiple(cp_size: int) -> int:
    """The length every document is padded to a multiple of: ``2·cp_size`` (1 for ``cp_size`` 1: nothing to split).

    Raises:
        ValueError: ``cp_size`` is not a positive integer.
    """
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"context_parallel_size must be a positive integer, got {cp_size!r}")
    return 1 if cp_size == 1 else 2 * int(cp_size)


class CPPadding(NamedTuple):
    """Documents padded for CP: ``padded_lengths`` (int64), ``cu_seqlens`` and ``cu_seqlens_padded`` (int32,
    cumulative real and padded lengths, each starting at 0)."""

    padded_lengths: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray


def pad_documents_for_cp(lengths: Sequence[int] | np.ndarray, cp_size: int) -> CPPadding:
    """Round every document's length up to a multiple of ``2·cp_size`` (unchanged for ``cp_size`` 1).

    Args:
        lengths: the documents' real lengths (whole numbers >= 0), in row order.
        cp_size: the context-parallel size.

    Raises:
        ValueError: a negative or non-integer length, or a ``cp_size`` that is not a positive integer.
    """
    multiple = cp_multiple(cp_size)
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and (array.dtype.kind not in "iu" or int(array.min()) < 0)):
        raise ValueError(f"lengths must be a 1-D sequence of whole numbers >= 0, got {lengths!r}")
    real = array.astype(np.int64)
    padded = -(-real // multiple) * multiple
    zero = np.zeros(1, dtype=np.int64)
    return CPPadding(
        padded,
        np.concatenate([zero, np.cumsum(real)]).astype(np.int32),
        np.concatenate([zero, np.cumsum(padded)]).astype(np.int32),
    )


@dataclasses.dataclass
class CPRow:
    """One padding-free row laid out for CP (1-D numpy arrays; see :func:`flatten_for_cp`).

    Attributes:
        input_ids: ``int64 [T]`` the documents, each followed by its padding (``pad_token_id``).
        labels: ``int64 [T]`` Hugging Face labels (unshifted): the ids, ``-100`` at each document's first token
            and at padding.
        position_ids: ``int64 [T]`` 0 at each document's start, continuing through its padding.
        cu_seqlens: ``int32 [D + 1]`` cumulative real lengths. cu_seqlens_padded: ``int32 [D + 1]`` cumulative
            padded lengths (document ``i`` spans ``cu_seqlens_padded[i]`` to ``cu_seqlens_padded[i + 1]``).
        max_seqlen: the longest padded document (an upper bound of every document's length).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    max_seqlen: int


def flatten_for_cp(
    documents: Sequence[Any],
    cp_size: int,
    labels: Sequence[Any] | None = None,
    pad_token_id: int = 0,
) -> CPRow:
    """Concatenate documents into one row, each padded to a multiple of ``2·cp_size`` (see :class:`CPRow`).

    Args:
        documents: each document's token ids (1-D ints), in row order.
        cp_size: the context-parallel size (1: no padding, the plain flattened row).
        labels: optional per-document labels (``-100`` where not trained), each as long as its document; the
            first token of every document and the padding get ``-100`` on top.
        pad_token_id: the id written at padding positions (masked out of the loss, so any valid id works).

    Raises:
        ValueError: a ``cp_size`` that is not a positive integer; labels whose number or lengths differ from the
            documents'.
    """
    ids = [np.asarray(document, dtype=np.int64).reshape(-1) for document in documents]
    lengths = np.fromiter((len(document) for document in ids), dtype=np.int64, count=len(ids))
    padded, cu_seqlens, cu_padded = pad_documents_for_cp(lengths, cp_size)
    if labels is not None:
        label_rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in labels]
        if len(label_rows) != len(ids) or any(len(a) != len(b) for a, b in zip(label_rows, ids)):
            raise ValueError(
                f"labels must match the documents one to one and in length: {len(ids)} documents of lengths "
                f"{lengths.tolist()}, labels of lengths {[len(row) for row in label_rows]}"
            )
    total = int(cu_padded[-1])
    starts = cu_padded[:-1].astype(np.int64)
    # Real positions: document i's tokens sit at starts[i] .. starts[i] + lengths[i].
    real = _concat_ranges(starts, lengths)
    input_ids = np.full(total, pad_token_id, dtype=np.int64)
    input_ids[real] = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    label_row = np.full(total, IGNORE_INDEX, dtype=np.int64)
    label_row[real] = np.concatenate(label_rows) if labels is not None and ids else input_ids[real]
    label_row[starts[lengths > 0]] = IGNORE_INDEX
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, padded)
    return CPRow(input_ids, label_row, position_ids, cu_seqlens, cu_padded, int(padded.max(initial=0)))


# ---------------------------------------------------------------------------------------------- slicing
def cp_indices(length: int, cp_rank: int, cp_size: int, cu_seqlens_padded: Any = None) -> np.ndarray:
    """The positions of a row of ``length`` that CP rank ``cp_rank`` keeps, in order (see :func:`cp_shard`).

    Raises:
        ValueError: see :func:`cp_shard`.
    """
    _check_rank(cp_rank, cp_size)
    if cp_size == 1:
        return np.arange(length, dtype=np.int64)
    if cu_seqlens_padded is None:
        if length % (2 * cp_size):
            raise ValueError(
                f"a sequence of {length} positions does not split into 2 × context_parallel_size = {2 * cp_size} "
                "equal chunks: pad it to a multiple of that (per-sequence split), or pass cu_seqlens_padded"
            )
        bounds = np.array([0, length], dtype=np.int64)
    else:
        bounds = _checked_bounds(cu_seqlens_padded, length, cp_size)
    starts, spans = bounds[:-1], np.diff(bounds)
    chunk = spans // (2 * cp_size)
    # Each document contributes its chunk cp_rank and its mirror 2·cp − 1 − cp_rank, in document order.
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    piece_starts = np.stack([first, second], axis=1).reshape(-1)
    piece_lengths = np.repeat(chunk, 2)
    return _concat_ranges(piece_starts, piece_lengths)


def cp_shard(tensor: Any, cp_rank: int, cp_size: int, seq_dim: int = -1, cu_seqlens_padded: Any = None) -> Any:
    """This CP rank's load-balanced slice of ``tensor`` along ``seq_dim`` (a ``torch.Tensor`` or numpy array).

    Without ``cu_seqlens_padded`` the whole sequence is split into ``2·cp_size`` chunks and rank ``r`` keeps
    chunks ``r`` and ``2·cp_size − 1 − r`` (head-tail / zigzag); with it, each document's padded span is split so
    and the rank's pieces of every document are concatenated in document order. ``cp_size`` 1 returns
    ``tensor`` unchanged. Every rank's slice has ``length / cp_size`` positions.

    Args:
        tensor: the whole row (or a batch of rows) to slice.
        cp_rank: this rank in ``[0, cp_size)``. cp_size: the context-parallel size.
        seq_dim: the sequence dimension.
        cu_seqlens_padded: cumulative padded document lengths (0 first, the row's length last), each document a
            multiple of ``2·cp_size``; ``None`` for the per-sequence split. For a 2-D ``(rows, length)`` tensor
            split along its last dim they may instead span the flattened rows (``rows × length`` last, every row
            start a bound: flash-attention's varlen offsets of a microbatch, as ``PretrainingBatch`` holds);
            each row then keeps this rank's pieces of its own documents.

    Raises:
        ValueError: a rank out of range; a length not divisible by ``2·cp_size`` (per sequence); bounds that do not
            start at 0, decrease or do not end at the length, or a document not a multiple of ``2·cp_size``
            (naming it).
    """
    if cp_size == 1:
        _check_rank(cp_rank, cp_size)
        return tensor
    if _rows_of_flat_bounds(tensor.shape, seq_dim, cu_seqlens_padded):
        flat = tensor.reshape(-1)
        index = cp_indices(flat.shape[0], cp_rank, cp_size, cu_seqlens_padded)
        return _take(flat, index, 0).reshape(tensor.shape[0], -1)
    index = cp_indices(tensor.shape[seq_dim], cp_rank, cp_size, cu_seqlens_padded)
    return _take(tensor, index, seq_dim)


def cp_unshard(slices: Sequence[Any], cp_size: int, seq_dim: int = -1, cu_seqlens_padded: Any = None) -> Any:
    """The whole row from the ``cp_size`` slices :func:`cp_shard` gave ranks ``0 … cp_size − 1`` (in rank order).

    Args:
        slices: every rank's slice, rank 0 first (tensors or numpy arrays, all of one kind).
        cp_size: the context-parallel size. seq_dim: the sequence dimension.
        cu_seqlens_padded: the same bounds the slices were cut with (``None``: per-sequence).

    Raises:
        ValueError: not ``cp_size`` slices, slices of unequal length, or bounds that do not fit them (see
            :func:`cp_shard`).
    """
    if len(slices) != cp_size:
        raise ValueError(f"cp_unshard needs one slice per CP rank: {cp_size} expected, got {len(slices)}")
    if cp_size == 1:
        return slices[0]
    sizes = {int(part.shape[seq_dim]) for part in slices}
    if len(sizes) != 1:
        raise ValueError(f"CP slices must be equally long, got lengths {[part.shape[seq_dim] for part in slices]}")
    length = sizes.pop() * cp_size
    shape = (*slices[0].shape[:-1], length) if slices[0].ndim == 2 else (length,)
    if _rows_of_flat_bounds(shape, seq_dim, cu_seqlens_padded):
        whole = cp_unshard([part.reshape(-1) for part in slices], cp_size, 0, cu_seqlens_padded)
        return whole.reshape(shape[0], -1)
    order = np.concatenate([cp_indices(length, rank, cp_size, cu_seqlens_padded) for rank in range(cp_size)])
    joined = (
        torch.cat(list(slices), dim=seq_dim) if isinstance(slices[0], torch.Tensor) else np.concatenate(slices, seq_dim)
    )
    return _take(joined, np.argsort(order, kind="stable"), seq_dim)


def cp_shard_batch(
    batch: Any,
    cp_rank: int,
    cp_size: int,
    seq_dim: int = -1,
    fields: Sequence[str] = SEQUENCE_FIELDS,
    per_document: bool = True,
) -> Any:
    """A copy of ``batch`` (a dataclass or dict) with its sequence ``fields`` sliced for this CP rank.

    Metadata (``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``, ``step_label_tokens``, anything not in
    ``fields``) is never sliced: it describes the whole row, which varlen CP attention needs.

    Args:
        batch: a dataclass (e.g. ``FlatBatch``, ``TextBatch``) or dict.
        cp_rank, cp_size, seq_dim: see :func:`cp_shard`.
        fields: the names of the per-position fields (those present are sliced).
        per_document: split each document (bounds from the batch's ``cu_seqlens_padded``, else ``cu_seqlens``);
            ``False``, or a batch without either, splits each whole sequence.

    Raises:
        TypeError: a batch that is neither a dataclass nor a dict.
        ValueError: see :func:`cp_shard`.
    """
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = {field.name: getattr(batch, field.name) for field in dataclasses.fields(batch)}
    elif isinstance(batch, dict):
        values = dict(batch)
    else:
        raise TypeError(f"cp_shard_batch takes a dataclass or a dict, got {type(batch).__name__}")
    bounds = None
    if per_document:
        bounds = next((values[k] for k in ("cu_seqlens_padded", "cu_seqlens") if values.get(k) is not None), None)
    sliced = {
        name: cp_shard(value, cp_rank, cp_size, seq_dim, bounds)
        for name, value in values.items()
        if name in fields and value is not None
    }
    if isinstance(batch, dict):
        return {**batch, **sliced}
    return dataclasses.replace(batch, **sliced)


# ---------------------------------------------------------------------------------------------- helpers
def _check_rank(cp_rank: int, cp_size: int) -> None:
    cp_multiple(cp_size)
    if not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")


def _rows_of_flat_bounds(shape: Sequence[int], seq_dim: int, cu_seqlens_padded: Any) -> bool:
    """Whether ``cu_seqlens_padded`` spans the flattened rows of a 2-D ``shape`` split along its last dim.

    Raises:
        ValueError: bounds over the flattened rows that miss a row's start (a sequence would cross rows).
    """
    if cu_seqlens_padded is None or len(shape) != 2 or seq_dim not in (-1, 1) or shape[0] < 2:
        return False
    bounds = _as_array(cu_seqlens_padded)
    rows, width = int(shape[0]), int(shape[1])
    if len(bounds) < 1 or int(bounds[-1]) != rows * width:
        return False
    missing = np.setdiff1d(np.arange(0, rows * width, width), bounds)
    if len(missing):
        raise ValueError(
            f"cu_seqlens_padded spans {rows} rows of {width} positions but has no bound at row start "
            f"{int(missing[0])}: every row must start a sequence"
        )
    return True


def _as_array(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _checked_bounds(cu_seqlens_padded: Any, length: int, cp_size: int) -> np.ndarray:
    bounds = _as_array(cu_seqlens_padded)
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != length or (np.diff(bounds) < 0).any():
        raise ValueError(
            f"cu_seqlens_padded must rise from 0 to the sequence's {length} positions, got {bounds.tolist()}"
        )
    spans = np.diff(bounds)
    uneven = np.flatnonzero(spans % (2 * cp_size))
    if len(uneven):
        first = int(uneven[0])
        raise ValueError(
            f"document {first} spans {int(spans[first])} positions, not a multiple of 2 × context_parallel_size = "
            f"{2 * cp_size} ({len(uneven)} such documents): pad every document for CP (pad_documents_for_cp, "
            "FlatteningCollator(context_parallel_size=...))"
        )
    return bounds


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    start = np.asarray(starts, dtype=np.int64)
    length = np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(length) - length
    return np.repeat(start - offsets, length) + np.arange(int(length.sum()), dtype=np.int64)


def _take(values: Any, index: np.ndarray, dim: int) -> Any:
    if isinstance(values, torch.Tensor):
        return values.index_select(dim, torch.from_numpy(index).to(values.device))
    return np.take(values, index, axis=dim)
