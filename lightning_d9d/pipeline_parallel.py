"""Pipeline parallelism (PP): which fields of a batch each pipeline stage needs.

Every stage of a pipeline gets the same batch from a lightning_d9d DataModule (it is dealt by data-parallel rank,
and the stages of one replica share it), because the schedule runs all stages on the same microbatches. A stage
only needs part of it: the first stage embeds the tokens (``input_ids``/``inputs``, ``position_ids``), the last
computes the loss (``labels``/``targets``, ``loss_mask``), and every stage needs the metadata that shapes
attention (``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``) and the step's ``step_label_tokens`` — the
split Megatron-LM and torchtitan make. :func:`pipeline_stage_fields` drops the rest, so a middle stage holds no
token tensors at all.

Trade-off: every stage still loads the whole batch (the same redundant, deterministic reads torchtitan does);
dropping fields saves device memory and transfers, not loading work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

FIRST_STAGE_FIELDS = ("input_ids", "inputs", "position_ids", "attention_mask")
"""Fields only the first stage needs (it embeds the tokens)."""
LAST_STAGE_FIELDS = ("labels", "targets", "loss_mask")
"""Fields only the last stage needs (it computes the loss)."""


def pipeline_stage_fields(
    batch: Any,
    first: bool,
    last: bool,
    first_fields: Sequence[str] = FIRST_STAGE_FIELDS,
    last_fields: Sequence[str] = LAST_STAGE_FIELDS,
) -> Any:
    """A copy of ``batch`` with only what this pipeline stage needs: the first stage's and last stage's fields
    where it is that stage, and every other field (metadata: ``cu_seqlens*``, ``max_seqlen``, counts) always.

    A dict loses the dropped keys; a dataclass keeps its type with the dropped fields set to ``None``.

    Args:
        batch: a dataclass (``FlatBatch``, ``TextBatch``, ``PretrainingBatch``) or a dict.
        first: this stage is the pipeline's first. last: this stage is its last (a one-stage pipeline is both).
        first_fields, last_fields: the names of each end's fields (e.g. add ``"position_ids"`` to both where
            every stage applies rotary embeddings itself).

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
