"""Argument checks shared by every stage: one message shape, so a bad value always names itself the same way.

jsonargparse's ``PositiveInt``/``NonNegativeInt`` reject bad values while a CLI config is parsed; these checks
give Python callers the same errors and return plain ``int`` (so checkpoints load with ``weights_only=True``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def positive_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    """``value`` as a plain int.

    Raises:
        ValueError: ``value`` is not an integer >= 1 (or ``None`` where ``allow_none``), naming ``name``.
    """
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as a plain int.

    Raises:
        ValueError: ``value`` is not an integer >= 0, naming ``name``.
    """
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)
