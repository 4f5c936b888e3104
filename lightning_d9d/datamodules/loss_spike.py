"""LossSpikeProvenance: when the training loss jumps, write which documents the steps before it held, and wherever
else those documents train.

At every optimizer step's end the step's loss (the mean of its microbatches' losses, averaged over every rank, so a
spike in any data-parallel rank's microbatches counts) is compared with the median of the last ``window`` steps;
above ``factor`` times that median, rank 0 writes one JSONL file: every piece of the last ``steps`` steps, and every
piece of those documents in the ``steps`` steps either side (rows of later steps are known in advance: the streams
are replayed past the spike). The advice names the surgical remedy first: resume from a checkpoint before the first
of those steps with ``exclude_documents=<that file>`` (it reads the file as it is); the blunt one,
``skip_data=[[a, b]]``, covers every step holding a chunk of them. Trade-off: the provenance is replayed in the
training process, which pauses a few seconds per spike; ``min_steps`` and ``cooldown`` keep that rare, and a chunk
further than ``steps`` steps from the window is not searched for (``exclude_documents`` removes it anyway).
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
        steps: the steps before (and including) the spike whose documents are written; their pieces in this many
            steps either side are written too.
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
            # Every rank ends the step here together: the mean over ranks is the step's loss on every rank, so all
            # judge alike (the cooldown stays in step) and a spike in one rank's microbatches is seen.
            local = torch.tensor(self._step_loss, dtype=torch.float64, device=pl_module.device)
            self._judge(trainer, step, float(trainer.strategy.reduce(local, reduce_op="mean")))
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
        path = os.path.join(self._folder(trainer), f"loss-spike-step-{step}.jsonl")
        if trainer.is_global_zero:
            pieces, (first, stop) = spike_pieces(trainer.datamodule, step, self.steps)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.writelines(json.dumps(piece.to_dict()) + "\n" for piece in pieces)
            documents = len({(p.source, p.file, p.row_group, p.document_row) for p in pieces})
            window = max(0, step - self.steps + 1)
            rank_zero_warn(
                f"loss spike at step {step}: {loss:.4g} against a median of {statistics.median(self._losses):.4g}; "
                f"the {documents} documents of steps {window}-{step}, with every piece of them in steps "
                f"{first}-{stop - 1}, are in {path!r}. To go on without them, resume from a checkpoint before step "
                f"{first} with exclude_documents={path!r} (only those documents removed, from the resume on), or "
                f"with skip_data=[[{first}, {stop}]] (every step holding a chunk of them)"
            )
        self.spikes.append((step, path))

    def _folder(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) if callback is not None else None
        return folder or trainer.default_root_dir


def spike_pieces(datamodule: Any, step: int, steps: int) -> tuple[list[Any], tuple[int, int]]:
    """The pieces of steps ``step - steps + 1 .. step``, and the pieces of their documents in the ``steps`` steps
    either side; with ``[first, stop)``, the steps holding any piece of those documents."""
    window = range(max(0, step - steps + 1), step + 1)
    around = range(max(0, window.start - steps), step + steps + 1)
    every = datamodule.provenance(around, untrained=True)  # steps after the spike: rows the run will train
    inside = [piece for piece in every if piece.step in window]
    documents = {(p.source, p.file, p.row_group, p.document_row) for p in inside}
    pieces = [p for p in every if p.step in window or (p.source, p.file, p.row_group, p.document_row) in documents]
    held = [p.step for p in pieces if (p.source, p.file, p.row_group, p.document_row) in documents]
    return pieces, (min(held, default=window.start), max(held, default=step) + 1)
