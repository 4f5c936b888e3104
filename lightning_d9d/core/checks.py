"""Argument checks shared by every stage: one message shape, plain ``int`` results (for ``weights_only`` loads)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plain_int(value: Any) -> Any:
    """``int(value)`` for int subclasses (jsonargparse's ``PositiveInt`` would not load with ``weights_only``)."""
    return int(value) if _is_int(value) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def positive_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    """``value`` as a plain int; ``ValueError`` unless an integer >= 1 (or ``None`` where ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as a plain int; ``ValueError`` unless an integer >= 0."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def microbatches_per_step(global_batch_size: int, dp_size: int, microbatch_size: int) -> int:
    """M = G / (D·m): microbatches one data-parallel replica runs per optimizer step; ``ValueError`` if not whole."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("dp_size", dp_size),
        ("microbatch_size", microbatch_size),
    ):
        positive_int(name, value)
    per_step = dp_size * microbatch_size
    if global_batch_size % per_step:
        valid = [per_step * k for k in range(1, 4)]
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by data-parallel size × microbatch_size = "
            f"{dp_size} × {microbatch_size} = {per_step}; use a multiple of {per_step} (e.g. {valid}) "
            f"or another microbatch_size"
        )
    return global_batch_size // per_step


def token_step_microbatches(global_batch_tokens: int, microbatch_tokens: int) -> int:
    """P = ``global_batch_tokens / microbatch_tokens``: microbatches of one token-budget step over all ranks."""
    positive_int("global_batch_tokens", global_batch_tokens)
    positive_int("microbatch_tokens", microbatch_tokens)
    if global_batch_tokens % microbatch_tokens:
        valid = [microbatch_tokens * k for k in (1, 2, 4, 8)]
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of microbatch_tokens={microbatch_tokens}: "
            f"a step is a whole number of microbatches; use a multiple of {microbatch_tokens} (e.g. {valid})"
        )
    return global_batch_tokens // microbatch_tokens


def token_microbatches_per_step(global_batch_tokens: int, microbatch_tokens: int, dp_size: int) -> int:
    """M = P / D with token budgets; ``ValueError`` if P is not divisible by ``dp_size``."""
    per_step = token_step_microbatches(global_batch_tokens, microbatch_tokens)
    positive_int("dp_size", dp_size)
    if per_step % dp_size:
        valid = [dp_size * k * microbatch_tokens for k in range(1, 4)]
        raise ValueError(
            f"global_batch_tokens / microbatch_tokens = {global_batch_tokens} / {microbatch_tokens} = {per_step} "
            f"microbatches per step do not divide among dp_size={dp_size} data-parallel replicas; use a "
            f"global_batch_tokens that is a multiple of data-parallel size × microbatch_tokens = "
            f"{dp_size * microbatch_tokens} (e.g. {valid})"
        )
    return per_step // dp_size


def one_of(name: str, value: Any, valid: tuple[str, ...]) -> Any:
    """``value`` when it is one of ``valid``, else a ``ValueError`` naming them."""
    if value not in valid:
        raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")
    return value
