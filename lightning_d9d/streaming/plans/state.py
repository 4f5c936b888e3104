"""State: how the streaming stages write their state to a checkpoint and read it back, validated.

Each stage's state is a frozen dataclass with ``to_dict()``/``from_dict()`` nesting its source's (packings carry a
``kind`` tag), written as plain ints, strings and int64 arrays for ``torch.load(weights_only=True)``. A saved
state is never trusted: ``from_dict`` checks presence and types, each stage checks ranges against the data, and
anything else is one :class:`InvalidDataState` naming the field's path, its value and what would be valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_d9d.core.resume import MISSING, InvalidDataState


def mapping(state: Any, path: str) -> Mapping[str, Any]:
    """``state`` itself when it is a mapping, else an :class:`InvalidDataState` for ``path``."""
    if not isinstance(state, Mapping):
        raise InvalidDataState(path, state, "expected a dict")
    return state


def field(state: Mapping[str, Any], key: str, path: str) -> Any:
    """``state[key]``, or an :class:`InvalidDataState` naming ``path.key`` when it is missing."""
    if key not in state:
        raise InvalidDataState(join(path, key), MISSING, f"the state must hold {key!r} (it holds {sorted(state)})")
    return state[key]


def integer(state: Mapping[str, Any], key: str, path: str, low: int = 0, high: int | None = None) -> int:
    """``state[key]`` as an int in ``[low, high)`` (``high=None``: no upper bound); bools and floats are refused."""
    value = field(state, key, path)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidDataState(join(path, key), value, f"expected an integer, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in {low}..{high - 1}"
        raise InvalidDataState(join(path, key), value, f"expected an integer {bound}")
    return value


def int_table(state: Mapping[str, Any], key: str, path: str, columns: int) -> np.ndarray:
    """``state[key]`` as an int64 ``(rows, columns)`` array (a tensor comes in as numpy already)."""
    value = field(state, key, path)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        raise InvalidDataState(join(path, key), value, f"expected an integer array of {columns} columns")
    if value.ndim != 2 or (value.shape[1] != columns and len(value)):
        raise InvalidDataState(
            join(path, key), value, f"expected a (rows, {columns}) integer array, got shape {tuple(value.shape)}"
        )
    return np.asarray(value, np.int64).reshape(len(value), columns)


def check_column(table: np.ndarray, column: int, name: str, path: str, low: int, high: np.ndarray | int) -> None:
    """Every row's ``column`` in ``[low, high)`` (``high`` per row or one bound), else the first bad row named."""
    values = table[:, column]
    bad = np.flatnonzero((values < low) | (values >= high))
    if len(bad):
        row = int(bad[0])
        bound = high[row] if isinstance(high, np.ndarray) else high
        raise InvalidDataState(f"{path}[{row}].{name}", int(values[row]), f"expected {low}..{int(bound) - 1}")


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
