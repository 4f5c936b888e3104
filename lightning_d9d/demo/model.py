"""TinyGPT: a small decoder-only transformer LightningModule for the demo run and for tests.

Pre-norm blocks with learned positions and a tied output layer over ``TextBatch``, ``FlatBatch`` and packed rows;
attention masks the future, padding and other documents, so padded and flattened samples give the same logits.
The loss ``loss_sum / step_label_tokens × dp_size × accumulate_grad_batches`` is the step's exact per-token mean.

Trade-off: flattened rows are regrouped as ``[documents, longest]`` (exact block-diagonal attention, a scatter and
gather per layer).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from jsonargparse.typing import NonNegativeInt, PositiveInt
from torch import nn

from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.datamodules.observability import GlobalStepLoss
from lightning_d9d.datamodules.pretraining import PretrainingBatch
from lightning_d9d.text.collate import FlatBatch, TextBatch


class _Block(nn.Module):
    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attention_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, hidden: torch.Tensor, allowed: torch.Tensor, documents: _Documents | None = None) -> torch.Tensor:
        width = hidden.shape[-1]
        q, k, v = self.qkv(self.attention_norm(hidden)).split(width, dim=-1)
        if documents is not None:  # one flattened row: attention per document
            q, k, v = (documents.regroup(t[0]) for t in (q, k, v))
            allowed = documents.allowed
        rows, span = q.shape[:2]
        q, k, v = (t.reshape(rows, span, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )
        attended = attended.transpose(1, 2).reshape(rows, span, width)
        if documents is not None:
            attended = documents.flatten(attended)[None]
        hidden = hidden + self.attention_out(attended)
        return hidden + self.mlp(self.mlp_norm(hidden))


class _Documents:
    """One flattened row's documents, regrouped as ``[D, longest, ...]`` for attention and flattened back."""

    def __init__(self, document_ids: torch.Tensor, offsets: torch.Tensor):
        self.document_ids, self.offsets = document_ids, offsets
        count = int(document_ids.max()) + 1 if document_ids.numel() else 0
        longest = int(offsets.max()) + 1 if offsets.numel() else 1
        lengths = torch.bincount(document_ids, minlength=count)
        self.shape = (count, longest)
        span = torch.arange(longest, device=offsets.device)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=offsets.device).tril()
        allowed = causal & (span[None, None, :] < lengths[:, None, None])
        # Every query may see itself, so a padding query never has an all-masked row (which would give NaN).
        self.allowed = (allowed | torch.eye(longest, dtype=torch.bool, device=offsets.device))[:, None]

    def regroup(self, row: torch.Tensor) -> torch.Tensor:
        out = row.new_zeros(*self.shape, *row.shape[1:])
        return out.index_put((self.document_ids, self.offsets), row)

    def flatten(self, grouped: torch.Tensor) -> torch.Tensor:
        return grouped[self.document_ids, self.offsets]


@dataclasses.dataclass
class _Tokens:
    """The fields the model needs from a TextBatch, a FlatBatch or a packed-rows batch."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None  # [1, T] for a flattened row: attention stays inside a document
    shifted: bool = False  # labels already hold the next token (packed rows)
    step_label_tokens: int | None = None

    @classmethod
    def of(cls, batch: Any) -> _Tokens:
        step_label_tokens = getattr(batch, "step_label_tokens", None)
        if isinstance(batch, PretrainingBatch):
            # Packed rows have no padding; attention stays causal over the whole row (documents see earlier
            # documents of the row), the usual simplification of packed pretraining.
            return cls(
                batch.input_ids, torch.ones_like(batch.input_ids), batch.targets, batch.position_ids, shifted=True,
                step_label_tokens=batch.step_target_tokens,
            )  # fmt: skip
        if isinstance(batch, FlatBatch):
            lengths = torch.diff(batch.cu_seqlens.long())
            documents = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)[None]
            return cls(
                batch.input_ids,
                torch.ones_like(batch.input_ids),
                batch.labels,
                batch.position_ids,
                documents,
                step_label_tokens=step_label_tokens,
            )
        if isinstance(batch, TextBatch):
            return cls(batch.input_ids, batch.attention_mask, batch.labels, step_label_tokens=step_label_tokens)
        raise TypeError(f"TinyGPT takes a TextBatch, a FlatBatch or a PretrainingBatch, got {type(batch).__name__}")


class TinyGPT(pl.LightningModule):
    """A small GPT-style causal language model.

    Args:
        vocab_size: tokenizer vocabulary size (checked against a TextDataModule's at fit start).
        max_positions: longest padded sequence the position embedding covers.
        width: hidden size.
        num_layers: transformer blocks.
        num_heads: attention heads (must divide ``width``).
        dropout: dropout in attention and MLP.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay (not on biases, norms and embeddings).
        warmup_steps: optimizer steps of linear warm-up.
        min_learning_rate_ratio: the cosine decay ends at this fraction of the peak.
        lr_batch_scaling: with a global batch size in phases, scale the learning rate by ``(G(step) / G(0)) ** p``:
            ``"sqrt"`` (p = 1/2, for Adam), ``"linear"`` (p = 1, for SGD) or ``"none"`` (docs/schedules.md).

    Raises:
        ValueError: ``num_heads`` does not divide ``width``; at fit start, a larger tokenizer or longer sequences.
    """

    def __init__(
        self,
        vocab_size: PositiveInt = 4096,
        max_positions: PositiveInt = 256,
        width: PositiveInt = 128,
        num_layers: PositiveInt = 2,
        num_heads: PositiveInt = 4,
        dropout: float = 0.0,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: NonNegativeInt = 20,
        min_learning_rate_ratio: float = 0.1,
        lr_batch_scaling: Literal["none", "sqrt", "linear"] = "none",
    ):
        super().__init__()
        if lr_batch_scaling not in _LR_BATCH_SCALING:
            raise ValueError(f"lr_batch_scaling must be one of {list(_LR_BATCH_SCALING)}, got {lr_batch_scaling!r}")
        if width % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide width={width}")
        # Without arguments Lightning records what the CLI gave (with its class_path, so `validate --ckpt_path`
        # can re-parse the checkpoint's hyperparameters). The CLI's values are jsonargparse's PositiveInt (an int
        # subclass), which torch.load(weights_only=True) refuses to unpickle: store them as plain numbers.
        self.save_hyperparameters()
        for name, value in list(self.hparams.items()):
            if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
                self.hparams[name] = int(value)
            elif isinstance(value, float) and type(value) is not float:
                self.hparams[name] = float(value)
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(max_positions, width)
        self.blocks = nn.ModuleList(_Block(width, num_heads, dropout) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(width)
        self.apply(self._init_weights)
        self._fit_started_at: float | None = None
        self._tokens_since_start = 0
        self.global_loss = GlobalStepLoss()  # train/global_loss: the step's exact mean over every microbatch and rank

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]``; ``document_ids`` keep attention inside each document of a flattened row."""
        length = input_ids.shape[1]
        real = attention_mask.bool()
        if position_ids is None:
            positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        else:
            positions = position_ids.clamp(max=self.hparams.max_positions - 1)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        documents = allowed = None
        if document_ids is not None and position_ids is not None and input_ids.shape[0] == 1:
            documents = _Documents(document_ids[0], position_ids[0])
        else:
            causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
            allowed = causal & real[:, None, :]
            if document_ids is not None:
                allowed &= document_ids[:, :, None] == document_ids[:, None, :]
            # Every query may see itself, so a padding query never has an all-masked row (which would give NaN).
            allowed |= torch.eye(length, dtype=torch.bool, device=input_ids.device)
            allowed = allowed[:, None]  # broadcast over heads
        for block in self.blocks:
            hidden = block(hidden, allowed, documents)
        return self.final_norm(hidden) @ self.token_embedding.weight.T

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, _Tokens]:
        """(summed token loss, predicted tokens, fields) of one microbatch; the labels are shifted here."""
        tokens = _Tokens.of(batch)
        logits = self(tokens.input_ids, tokens.attention_mask, tokens.position_ids, tokens.document_ids)
        targets = tokens.labels
        if not tokens.shifted:
            logits, targets = logits[:, :-1], targets[:, 1:]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss_sum, (targets != IGNORE_INDEX).sum(), tokens

    def step_loss(self, loss_sum: torch.Tensor, count: torch.Tensor, step_label_tokens: int | None) -> torch.Tensor:
        """``loss_sum / step_label_tokens`` times ``dp_size`` and ``accumulate_grad_batches`` (per-token mean)."""
        if step_label_tokens is None:
            return loss_sum / count.clamp(min=1)
        trainer = self._trainer
        replicas = getattr(trainer.datamodule, "dp_size", trainer.world_size) if trainer is not None else 1
        accumulated = trainer.accumulate_grad_batches if trainer is not None and self.automatic_optimization else 1
        return loss_sum * (replicas * accumulated / max(int(step_label_tokens), 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss_sum, count, tokens = self._loss(batch)
        now = time.perf_counter()
        real_tokens = int(tokens.attention_mask.sum())
        if self._fit_started_at is None:
            self._fit_started_at = now
        else:  # the first microbatch only starts the clock: its tokens have no elapsed time to divide by
            self._tokens_since_start += real_tokens
        elapsed = max(now - self._fit_started_at, 1e-9)
        self.log("train/loss", loss_sum.detach() / count.clamp(min=1), prog_bar=True)
        self.log("train/padding_pct", 100.0 * (1 - real_tokens / tokens.attention_mask.numel()), prog_bar=True)
        self.log("train/tokens_per_s", self._tokens_since_start / elapsed, prog_bar=True)
        self.global_loss.add(loss_sum, count)
        return self.step_loss(loss_sum, count, tokens.step_label_tokens)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Every process calls this once per optimizer step, after all its microbatches: the collective lines up.
        # (Nothing pending: a subclass's own training_step added nothing.)
        if self.global_loss.pending:
            self.log("train/global_loss", self.global_loss.compute(self), rank_zero_only=True)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        loss_sum, count, _ = self._loss(batch)
        loss = loss_sum / count.clamp(min=1)
        # One validation loader per source (a mapping of val_files): the loss of each under its source's name.
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        naming = _declared(datamodule, "val_metric_name")
        key = naming("val/loss", dataloader_idx) if naming is not None else "val/loss"
        # Token-weighted mean over the whole validation set, so microbatch sizes do not bias it.
        self.log(key, loss, prog_bar=True, batch_size=max(int(count), 1), add_dataloader_idx=False)
        return loss

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        vocab_size = _declared(datamodule, "vocab_size")
        if vocab_size is not None and vocab_size > self.hparams.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but TinyGPT(vocab_size={self.hparams.vocab_size}); "
                f"set model.init_args.vocab_size >= {vocab_size}"
            )
        longest = _declared(datamodule, "longest_padded_length") or _declared(datamodule, "max_seq_len")
        if longest is not None and longest > self.hparams.max_positions:
            raise ValueError(
                f"batches can be {longest} tokens long but TinyGPT(max_positions={self.hparams.max_positions}); "
                f"raise model.init_args.max_positions or lower data.init_args.max_length"
            )

    def configure_optimizers(self) -> Any:
        decayed = [p for name, p in self.named_parameters() if p.dim() >= 2 and "embedding" not in name]
        not_decayed = [p for name, p in self.named_parameters() if p.dim() < 2 or "embedding" in name]
        optimizer = torch.optim.AdamW(
            [
                {"params": decayed, "weight_decay": self.hparams.weight_decay},
                {"params": not_decayed, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        total_steps = self._total_steps()
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_learning_rate_ratio
        batch_scale = self._batch_scale()

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1) * batch_scale(step)
            if not math.isfinite(total_steps) or total_steps <= warmup:
                return batch_scale(step)
            progress = min((step - warmup) / (total_steps - warmup), 1.0)
            return (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))) * batch_scale(step)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> float:
        """The optimizer steps of the fit: ``max_steps``, else the DataModule's epochs where its steps change size
        (Lightning's estimate divides one epoch's microbatches by one accumulation count), else Lightning's."""
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.max_steps
        datamodule = trainer.datamodule
        if _declared(datamodule, "step_sizes_vary") and trainer.max_epochs is not None and trainer.max_epochs > 0:
            return sum(datamodule.steps_in_epoch(epoch) for epoch in range(trainer.max_epochs))
        return trainer.estimated_stepping_batches

    def _batch_scale(self) -> Callable[[int], float]:
        """``step -> (G(step) / G(0)) ** p`` (1 without a DataModule that schedules its global batch size)."""
        power = _LR_BATCH_SCALING[self.hparams.lr_batch_scaling]
        datamodule = self.trainer.datamodule
        if not power or _declared(datamodule, "global_batch_size_at") is None:
            return lambda step: 1.0
        first = datamodule.global_batch_size_at(0)
        return lambda step: (datamodule.global_batch_size_at(step) / first) ** power


_LR_BATCH_SCALING = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def _declared(owner: Any, name: str) -> Any:
    """``owner.name`` where ``owner`` declares it, else ``None``; read directly, so a broken property still raises."""
    if owner is None or inspect.getattr_static(owner, name, None) is None:
        return None
    return getattr(owner, name)
