"""Keyword arguments that make a Hugging Face causal LM keep packed documents apart.

A packed row holds several sequences (documents, chunks of documents, padding runs). A Hugging Face model given only
``position_ids`` infers the sequences from them only when it builds no KV cache and the attention backend looks at
positions at all; otherwise every token attends to every earlier token of the row, across documents. So the batch
states its sequences explicitly, in the form each ``attn_implementation`` reads:

* ``eager`` / ``sdpa``: a 4-D ``[B, 1, T, T]`` block-causal mask (additive float for ``eager``, which adds it to
  the scores; boolean for ``sdpa``), which Hugging Face passes through unchanged;
* ``flex_attention``: a ``BlockMask`` from the same rule (``torch.nn.attention.flex_attention``);
* ``flash_attention_2`` / ``flash_attention_3``: the varlen arguments ``cu_seq_lens_q/k`` and ``max_length_q/k``
  over the flattened microbatch, which the model's flash path uses as given.

Each position's sequence is found once from ``cu_seqlens_padded`` (a ``searchsorted`` of the flat positions). Trade-off:
the dense masks cost ``B·T²`` elements (a boolean ``sdpa`` mask a quarter of the float one), the price of running
packed rows through kernels that know no sequences; ``flex_attention`` and flash keep documents apart without it.
"""

from __future__ import annotations

from typing import Any

import torch

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def sequence_ids(cu_seqlens_padded: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each position's sequence number, ``shape`` (``[B, T]``), from the offsets of the flattened microbatch.

    Raises:
        ValueError: the offsets do not end at ``B·T`` (a context-parallel slice, or offsets of other rows).
    """
    total = 1
    for size in shape:
        total *= size
    bounds = cu_seqlens_padded.to(torch.int64)
    if len(bounds) == 0 or int(bounds[0]) != 0 or int(bounds[-1]) != total:
        raise ValueError(
            f"hf_inputs needs whole rows: the sequence offsets end at {int(bounds[-1]) if len(bounds) else None}, "
            f"the batch holds {total} positions {tuple(shape)} (a context-parallel slice? Hugging Face models attend "
            "over whole sequences: call hf_inputs on the batch before cp_shard_batch)"
        )
    flat = torch.arange(total, device=bounds.device)
    return torch.searchsorted(bounds[1:], flat, right=True).reshape(shape)


def hf_attention_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    attn_implementation: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``input_ids``, ``position_ids`` and what keeps the sequences apart under ``attn_implementation``.

    Args:
        input_ids: ``[B, T]`` token ids.
        position_ids: ``[B, T]``, 0 at each sequence start.
        cu_seqlens_padded: sequence offsets in the flattened ``B·T`` positions, from 0.
        attn_implementation: the model's ``config._attn_implementation``, one of ``ATTENTION_IMPLEMENTATIONS``.
        dtype: the model's floating dtype (the ``eager`` mask is added to its scores).

    Raises:
        ValueError: an unknown ``attn_implementation``, or offsets that do not cover the batch (a CP slice).
    """
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, got {attn_implementation!r}"
        )
    inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    shape = tuple(input_ids.shape)
    segments = sequence_ids(cu_seqlens_padded.to(input_ids.device), shape)
    if attn_implementation.startswith("flash_attention"):
        bounds = cu_seqlens_padded.to(device=input_ids.device, dtype=torch.int32)
        longest = int(bounds.diff().max()) if len(bounds) > 1 else 0  # CP padding included: the kernel sees it
        inputs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
        return inputs
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def block_causal(batch: Any, head: Any, query: Any, key: Any) -> Any:
            return (segments[batch, query] == segments[batch, key]) & (query >= key)

        batch, length = shape
        inputs["attention_mask"] = create_block_mask(
            block_causal, batch, None, length, length, device=str(input_ids.device)
        )
        return inputs
    length = shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal  # [B, T, T]: query row, key column
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        inputs["attention_mask"] = allowed
    else:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
        inputs["attention_mask"] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return inputs
