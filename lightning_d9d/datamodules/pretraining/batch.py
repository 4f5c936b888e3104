"""PretrainingBatch: one microbatch of packed rows as training receives it, and the function that builds it.

The tensors are built by ``streaming/loading/step_tensors.py`` in the loader's workers; this module only names them
for models (and pins them where the trainer's device is CUDA). Trade-off: a dataclass, not a dict, so Lightning's
device transfer keeps its type and a model reads named fields; pinning then goes field by field (``device/pin.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_d9d.core.hf_inputs import hf_attention_inputs
from lightning_d9d.device.pin import pin_batch
from lightning_d9d.streaming.loading.step_tensors import microbatch_tensors
from lightning_d9d.streaming.packing.rows import RowBlock
from lightning_d9d.streaming.plans.spec import MixtureSpec


@dataclass
class PretrainingBatch:
    """One microbatch of packed rows.

    Attributes:
        input_ids: ``(microbatch_size, seq_len)`` int64 token ids.
        targets: shifted ``input_ids``; ``-100`` where there is no next token.
        position_ids: 0 at every row, document, chunk and padding-run start.
        sources: each row's index in ``dm.source_names`` (validation: in ``dm.val_source_names``).
        cu_seqlens: int32 sequence offsets in the flattened microbatch (flash-attention varlen).
        cu_seqlens_padded: the offsets with CP padding (equal to ``cu_seqlens`` without CP).
        max_seqlen: the longest of those sequences.
        step_target_tokens: the targets (``targets != -100``) of the whole optimizer step over every data-parallel
            replica, what a per-token mean over the step divides by; ``None`` until known (several replicas outside
            a Trainer: sum ``rank_step_target_tokens`` over them).
        rank_step_target_tokens: the targets of this replica's microbatches of the step.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    sources: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    step_target_tokens: int | None = None
    rank_step_target_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def hf_inputs(self, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM's ``model(**...)`` that keep the packed sequences apart.

        ``input_ids``, ``position_ids``, ``use_cache=False``, the mask or varlen arguments ``attn_implementation``
        reads (``lightning_d9d/core/hf_inputs.py``), ``labels`` and ``shift_labels``: the targets are already shifted
        (a row's last target is the token after it), so the model's loss takes them as ``shift_labels`` and shifts
        nothing. Its loss is the mean over the microbatch's targets; add ``num_items_in_batch=step_target_tokens``
        for the step's per-token mean (``docs/streaming.md``).

        Args:
            attn_implementation: the model's ``config._attn_implementation`` (``eager``, ``sdpa``,
                ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``).
            dtype: the model's floating dtype (the ``eager`` mask is added to its attention scores).

        Raises:
            ValueError: an unknown ``attn_implementation``; a context-parallel slice (the model needs whole rows).
        """
        inputs = hf_attention_inputs(
            self.input_ids, self.position_ids, self.cu_seqlens_padded, attn_implementation, dtype
        )
        return inputs | {"labels": self.targets, "shift_labels": self.targets}


def make_batch(
    rows: RowBlock,
    step_targets: int | None,
    spec: MixtureSpec,
    pin: bool,
    source: int | None = None,
    all_targets: int | None = None,
) -> PretrainingBatch:
    """The ``PretrainingBatch`` of a microbatch's rows; ``source``, where given, labels every row.

    Args:
        step_targets: the targets of the replica's rows of the whole step (``None``: validation).
        all_targets: the step's targets over every replica, where known without asking the others.
    """
    built = microbatch_tensors(rows, spec.bos_id, spec.sources[0].settings.context_parallel_size)
    sources = built.sources if source is None else torch.full((len(rows),), source, dtype=torch.int64)
    batch = PretrainingBatch(built.input_ids, built.targets, built.position_ids, sources, built.cu_seqlens,
                             built.cu_seqlens_padded, built.max_seqlen, all_targets, step_targets)  # fmt: skip
    return pin_batch(batch) if pin else batch


def train_batch(rows: RowBlock, step_targets: int, spec: MixtureSpec, pin: bool, dp_size: int) -> PretrainingBatch:
    """A training microbatch, with its step's targets over every replica where known without asking the others:
    where every position has a target (no flags, no CP padding) the count is the same on every replica."""
    all_targets = None
    if not (spec.packing.flagged or spec.sources[0].settings.cp_multiple > 1):
        all_targets = step_targets * dp_size
    elif dp_size == 1:
        all_targets = step_targets
    return make_batch(rows, step_targets, spec, pin, all_targets=all_targets)


class StepTargets:
    """``step_target_tokens`` where padding makes it differ by replica: the replicas' counts summed by one collective
    per optimizer step (not per microbatch), kept for the step's other microbatches."""

    def __init__(self) -> None:
        self._step, self._counted = -1, 0  # the global step counted, and its targets over every replica

    def complete(self, trainer: Any, batch: Any, peers_per_replica: int) -> None:
        """Fill ``batch.step_target_tokens`` (a collective at a step's first microbatch: call it on every process).
        TP/CP/PP peers hold their replica's count, so the sum over processes is divided by ``peers_per_replica``."""
        if not isinstance(batch, PretrainingBatch) or batch.step_target_tokens is not None:
            return
        if self._step != trainer.global_step:
            local = torch.tensor(
                [batch.rank_step_target_tokens], dtype=torch.int64, device=trainer.strategy.root_device
            )
            total = trainer.strategy.reduce(local, reduce_op="sum")
            self._step, self._counted = trainer.global_step, int(total.item()) // peers_per_replica
        batch.step_target_tokens = self._counted
