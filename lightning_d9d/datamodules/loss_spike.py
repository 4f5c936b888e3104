"""LossSpikeProvenance: when the training loss jumps, write which documents the steps before it held.

At every optimizer step's end the step's loss (the mean of its microbatches' losses) is compared with the median of
the last ``window`` steps; above ``factor`` times that median, rank 0 writes the DataModule's provenance of the last
``steps`` steps as JSONL next to the checkpoints, and says where. What to do next is the usual recipe: resume from
a checkpoint before the spike with ``skip_data=[[a, b]]`` and, if some documents are to blame,
``exclude_documents=<that file>`` (docs/provenance.md). Trade-off: the provenance is replayed in the training
process, which pauses a few seconds per spike; ``min_steps`` and ``cooldown`` keep that rare.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn


class LossSpikeProvenance(pl.Callback):
    """Write the provenance of the steps before a loss spike.

    Args:
        factor: a step's loss above ``factor × median`` of the window is a spike.
        window: steps whose losses the median is taken over.
        steps: the steps before (and including) the spike whose provenance is written.
        min_steps: steps seen before any is judged.
        cooldown: steps after a spike before another is judged.
        dirpath: where ``loss-spike-step-<s>.jsonl`` go (``None``: the checkpoint callback's folder, else
            ``<default_root_dir>``).

    Raises:
        ValueError: ``factor`` not above 1, or a count below 1.
    """

    def __init__(self, factor: float = 3.0, window: int = 100, steps: int = 20, min_steps: int = 50,
                 cooldown: int = 100, dirpath: str | None = None):  # fmt: skip
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        for name, value in (("window", window), ("steps", steps), ("min_steps", min_steps), ("cooldown", cooldown)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.factor, self.steps, self.min_steps, self.cooldown = factor, steps, min_steps, cooldown
        self.dirpath = dirpath
        self._losses: collections.deque[float] = collections.deque(maxlen=window)
        self._step_loss, self._quiet_until = 0.0, -1
        self.spikes: list[tuple[int, str]] = []  # (step, file written) of every spike seen

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._step_loss += float(loss.detach())  # already divided by the step's microbatches
        datamodule = trainer.datamodule
        index = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        _, at, count = datamodule.batch_in_step(trainer.current_epoch, index)
        if at == count - 1:
            step = trainer.global_step - 1  # the step that just ended
            self._judge(trainer, step, self._step_loss)
            self._step_loss = 0.0

    def _judge(self, trainer: pl.Trainer, step: int, loss: float) -> None:
        spike = (
            len(self._losses) >= self.min_steps
            and step > self._quiet_until
            and loss > self.factor * statistics.median(self._losses)
        )
        self._losses.append(loss)
        if not spike:
            return
        self._quiet_until = step + self.cooldown
        first = max(0, step - self.steps + 1)
        path = os.path.join(self._folder(trainer), f"loss-spike-step-{step}.jsonl")
        if trainer.is_global_zero:
            pieces = trainer.datamodule.provenance(range(first, step + 1))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.writelines(json.dumps(piece.to_dict()) + "\n" for piece in pieces)
            rank_zero_warn(
                f"loss spike at step {step}: {loss:.4g} against a median of {statistics.median(self._losses):.4g}; "
                f"the provenance of steps {first}-{step} is in {path!r} (to go on without that data, resume from a "
                f"checkpoint before step {first} with skip_data=[[{first}, {step + 1}]], or exclude documents with "
                "exclude_documents=<a file of their references>)"
            )
        self.spikes.append((step, path))

    def _folder(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) if callback is not None else None
        return folder or trainer.default_root_dir
