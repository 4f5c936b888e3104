"""Pipeline parallelism (PP): which fields of a batch each pipeline stage needs.

Every stage gets the same batch; the first needs the tokens, the last the labels, all the attention metadata and
``step_label_tokens`` (the split Megatron-LM and torchtitan make). Dropping the rest saves device memory and
transfers, not loading work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

FIRST_STAGE_FIELDS = ("input_ids", "inputs", "position_ids", "attention_mask")
"""Fields only the first stage needs (it embeds the tokens)."""
LAST_STAGE_FIELDS = ("labels", "shift_labels", "targets", "loss_mask")
"""Fields only the last stage needs (it computes the loss)."""


def pipeline_stage_fields(
    batch: Any,
    first: bool,
    last: bool,
    first_fields: Sequence[str] = FIRST_STAGE_FIELDS,
    last_fields: Sequence[str] = LAST_STAGE_FIELDS,
) -> Any:
    """A copy of ``batch`` with only what this stage needs (a dataclass keeps its type, dropped fields ``None``).

    Args:
        batch: a dataclass or a dict.
        first, last: this stage is the pipeline's first / last (a one-stage pipeline is both).
        first_fields, last_fields: the names of each end's fields.

    Raises:
        TypeError: a batch that is neither a dataclass nor a dict.
    """
    dropped = set() if first else set(first_fields)
    if not last:
        dropped |= set(last_fields)
    if first:
        dropped -= set(first_fields)
    if last:
        dropped -= set(last_fields)
    if isinstance(batch, dict):
        return {key: value for key, value in batch.items() if key not in dropped}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        names = {field.name for field in dataclasses.fields(batch) if field.init}
        return dataclasses.replace(batch, **dict.fromkeys(dropped & names))
    raise TypeError(f"pipeline_stage_fields takes a dataclass or a dict, got {type(batch).__name__}")
