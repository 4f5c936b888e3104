"""Context parallelism (CP): lay out packed documents so a row splits evenly over CP ranks, and split it.

Each sequence is cut into ``2·cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2·cp − 1 − r`` (zigzag), balancing
causal attention cost. In packed rows each document is split and padded to a multiple of ``2·cp`` (THD layout:
``cu_seqlens`` real, ``cu_seqlens_padded`` padded); metadata is never split. A rank's two pieces are not
contiguous, so slicing a batch also hands out what a model cannot infer from them: global positions, and labels
shifted before the split.

Trade-off: up to ``2·cp − 1`` padding positions per document, for balanced ranks without an all-to-all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_d9d.core.tokens import IGNORE_INDEX

SEQUENCE_FIELDS = (
    "input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "loss_mask", "inputs", "targets",
)  # fmt: skip
"""A batch's per-position fields, split over CP ranks; all others are metadata."""


def cp_multiple(cp_size: int) -> int:
    """The multiple every document is padded to: ``2·cp_size`` (1 for ``cp_size`` 1)."""
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"context_parallel_size must be a positive integer, got {cp_size!r}")
    return 1 if cp_size == 1 else 2 * int(cp_size)


class CPPadding(NamedTuple):
    """Documents padded for CP: ``padded_lengths`` and cumulative real/padded ``cu_seqlens*`` (from 0)."""

    padded_lengths: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray


def pad_documents_for_cp(lengths: Sequence[int] | np.ndarray, cp_size: int) -> CPPadding:
    """Round every document's length up to a multiple of ``2·cp_size``."""
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
    """One padding-free row laid out for CP; ``labels`` are unshifted, ``-100`` at first tokens and padding."""

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
    """Concatenate documents into one row, each padded to a multiple of ``2·cp_size``.

    Args:
        documents: each document's token ids, in row order.
        labels: optional per-document labels; first tokens and padding get ``-100``.

    Raises:
        ValueError: a bad ``cp_size`` or labels that do not match the documents.
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
    """The positions of a row of ``length`` that CP rank ``cp_rank`` keeps, in order."""
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
    """This CP rank's load-balanced slice of ``tensor`` (torch or numpy) along ``seq_dim``.

    Args:
        cu_seqlens_padded: padded document bounds to split each document by; ``None``: the whole sequence.

    Raises:
        ValueError: a rank out of range, a length not divisible by ``2·cp_size``, or malformed bounds.
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
    """The whole row from every rank's :func:`cp_shard` slice, rank 0 first.

    Raises:
        ValueError: not ``cp_size`` equal slices, or bounds that do not fit them.
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
    """A copy of ``batch`` (a dataclass or dict) with its per-position ``fields`` sliced for this CP rank.

    Positions and shifted labels are made before slicing where the batch lacks them (and ``fields`` names them),
    since a rank's zigzag pieces are not contiguous: ``position_ids`` (each position's index in its row, restarting
    per document with bounds) and, from Hugging Face ``labels`` (unshifted: the model shifts), ``shift_labels``
    (the label of the next position, ``-100`` at each sequence's end): the loss must take these, as a shift
    inside the rank's slice would pair tokens of different pieces.

    Args:
        per_document: split each document by ``cu_seqlens_padded`` (else ``cu_seqlens``).

    Raises:
        TypeError: a batch that is neither a dataclass nor a dict.
        ValueError: a field that cannot be sliced (named), a per-position field not in ``fields``, a dataclass
            without a field for the positions or shifted labels; see also :func:`cp_shard`.
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
    kind = type(batch)
    if cp_size > 1:
        derived = _derived_fields(values, fields, seq_dim, bounds)
        kind = _slice_type(batch, derived)
        values.update(derived)
        _check_sliceable(type(batch).__name__, values, fields, seq_dim)
    sliced = {
        name: cp_shard(value, cp_rank, cp_size, seq_dim, bounds)
        for name, value in values.items()
        if name in fields and value is not None
    }
    if isinstance(batch, dict):
        return {**batch, **sliced}
    if kind is type(batch):
        return dataclasses.replace(batch, **sliced)
    names = [field.name for field in dataclasses.fields(kind) if field.init]
    return kind(**{name: sliced.get(name, values.get(name)) for name in names})


def _derived_fields(values: dict[str, Any], fields: Sequence[str], seq_dim: int, bounds: Any) -> dict[str, Any]:
    """``position_ids`` and ``shift_labels`` where ``fields`` asks for them and the batch lacks them."""
    tokens = _reference(values)
    derived = {}
    if "position_ids" in fields and values.get("position_ids") is None and tokens is not None:
        derived["position_ids"] = _positions(values[tokens], seq_dim, bounds)
    if "shift_labels" in fields and values.get("shift_labels") is None and values.get("labels") is not None:
        derived["shift_labels"] = _shifted(values["labels"], seq_dim, bounds)
    return derived


def _slice_type(batch: Any, derived: dict[str, Any]) -> type:
    """The dataclass a slice is made as: the batch's own, or the ``context_parallel_slice`` it names (a subclass
    with the fields the slice adds); ``ValueError`` if neither holds them."""
    if isinstance(batch, dict):
        return dict
    kind = type(batch)
    for candidate in (kind, getattr(kind, "context_parallel_slice", kind)):
        names = {field.name for field in dataclasses.fields(candidate) if field.init}
        if set(derived) <= names:
            return candidate
    missing = sorted(set(derived) - {field.name for field in dataclasses.fields(kind)})
    raise ValueError(
        f"cp_shard_batch must hand out {missing} with the slices of a {kind.__name__} (a rank's zigzag pieces are "
        f"not contiguous, so a model cannot infer them), but it has no such field: add {missing} (default None) to "
        "it, pass a dict, or leave them out of fields="
    )


def _check_sliceable(kind: str, values: dict[str, Any], fields: Sequence[str], seq_dim: int) -> None:
    """One ``ValueError`` for a named field that cannot be sliced or a per-position field that would stay whole."""
    tokens = _reference(values)
    if tokens is None:
        return
    shape = tuple(values[tokens].shape)
    for name, value in values.items():
        if value is None or not hasattr(value, "shape") or name == tokens:
            continue
        if name in fields and (len(value.shape) != len(shape) or value.shape[seq_dim] != shape[seq_dim]):
            raise ValueError(
                f"{kind}.{name} has shape {tuple(value.shape)}, which cannot be sliced like {tokens} "
                f"{shape} along dim {seq_dim}: give it {tokens}'s shape (a mask over pairs of positions is built "
                "after slicing, from the sliced position_ids), or leave it out of fields="
            )
        if name not in fields and tuple(value.shape) == shape:
            raise ValueError(
                f"{kind}.{name} has the shape of {tokens} {shape}, so it looks per-position, but it is not in "
                f"fields={list(fields)}: it would stay whole next to sliced tokens; name it in fields= to slice "
                "it, or drop it from the batch"
            )


def _reference(values: dict[str, Any]) -> str | None:
    """The field whose shape every per-position field shares."""
    return next((name for name in ("input_ids", "inputs") if values.get(name) is not None), None)


def _positions(tokens: Any, seq_dim: int, bounds: Any) -> Any:
    """Each position's index in its row (with ``bounds``: in its document), shaped like ``tokens``."""
    moved = _move_last(tokens, seq_dim)
    shape, length = tuple(moved.shape), int(moved.shape[-1])
    if bounds is None:
        positions = np.broadcast_to(np.arange(length, dtype=np.int64), shape)
    else:
        edges = _as_array(bounds)
        total = int(edges[-1]) if len(edges) else 0
        if total not in (length, math.prod(shape)):
            raise ValueError(
                f"the document bounds end at {total}, neither a row's {length} positions nor the batch's "
                f"{math.prod(shape)}: they do not describe these rows"
            )
        index = np.arange(total, dtype=np.int64) - np.repeat(edges[:-1], np.diff(edges))
        positions = np.broadcast_to(index, shape) if total == length else index.reshape(shape)
    positions = np.ascontiguousarray(positions)
    if isinstance(tokens, torch.Tensor):
        return _move_back(torch.from_numpy(positions).to(tokens.device), seq_dim)
    return _move_back(positions, seq_dim)


def _shifted(labels: Any, seq_dim: int, bounds: Any) -> Any:
    """Each position's next label (``-100`` at every row's and, with ``bounds``, every document's last position)."""
    moved = _move_last(labels, seq_dim)
    if isinstance(labels, torch.Tensor):
        shifted = torch.full(moved.shape, IGNORE_INDEX, dtype=moved.dtype, device=moved.device)
    else:
        shifted = np.full(moved.shape, IGNORE_INDEX, dtype=moved.dtype)
    shifted[..., :-1] = moved[..., 1:]
    if bounds is not None:
        edges = _as_array(bounds)
        ends = edges[1:][edges[1:] > 0] - 1
        index = torch.from_numpy(ends).to(moved.device) if isinstance(labels, torch.Tensor) else ends
        if int(edges[-1]) == shifted.shape[-1]:  # the same bounds in every row
            shifted[..., index] = IGNORE_INDEX
        elif int(edges[-1]) == math.prod(shifted.shape):  # bounds over the rows flattened
            shifted.reshape(-1)[index] = IGNORE_INDEX
    return _move_back(shifted, seq_dim)


def _move_last(values: Any, dim: int) -> Any:
    return values.movedim(dim, -1) if isinstance(values, torch.Tensor) else np.moveaxis(values, dim, -1)


def _move_back(values: Any, dim: int) -> Any:
    return values.movedim(-1, dim) if isinstance(values, torch.Tensor) else np.moveaxis(values, -1, dim)


# ---------------------------------------------------------------------------------------------- helpers
def _check_rank(cp_rank: int, cp_size: int) -> None:
    cp_multiple(cp_size)
    if not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")


def _rows_of_flat_bounds(shape: Sequence[int], seq_dim: int, cu_seqlens_padded: Any) -> bool:
    """Whether ``cu_seqlens_padded`` spans the flattened rows of a 2-D ``shape`` (each row start a bound)."""
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
