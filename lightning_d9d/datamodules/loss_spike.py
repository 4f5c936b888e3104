"""LossSpikeProvenance: when the training loss jumps, write which documents the steps before it held, and wherever
else those documents train.

At every optimizer step's end the step's loss (the mean of its microbatches' losses, averaged over every rank, so a
spike in any data-parallel rank's microbatches counts) is compared with the median of the last ``window`` steps;
above ``factor`` times that median, rank 0 writes one JSONL file: every piece of the last ``steps`` steps, and every
piece of those documents wherever this pass trains them (rows of later steps are known in advance: the streams are
replayed past the spike): the ``steps`` steps either side first, then, for a document not whole there (a long one,
or a ``bestfit_split`` tail waiting in the buffer, at times for dozens of steps), further out in spans that double.
The advice names the surgical remedy first: resume from a checkpoint before the first of those steps with
``exclude_documents=<that file>`` (it reads the file as it is); the blunt one, ``skip_data=[[a, b]]``, covers every
step holding a chunk of them. Trade-off: the provenance is replayed in the training process, which pauses a few
seconds per spike; ``min_steps`` and ``cooldown`` keep that rare. A waiting tail can make the ``skip_data`` range
long (it skips every step in between), which is why the surgical remedy comes first; a chunk further than
``FOLLOW_LIMIT`` steps is not searched for (``exclude_documents`` removes it anyway).
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
    """The pieces of steps ``step - steps + 1 .. step``, and every piece of their documents, in step and row order;
    with ``[first, stop)``, the steps holding any piece of those documents.

    The steps either side are searched first; a document not yet whole there (a long one packed over many steps, or
    a ``bestfit_split`` chunk left waiting in the buffer) is followed further, in spans that double, back to its
    first token and on to its last, so that a ``skip_data`` range over ``[first, stop)`` leaves no chunk of it.
    """
    window = range(max(0, step - steps + 1), step + 1)
    around = range(max(0, window.start - steps), step + steps + 1)
    every = datamodule.provenance(around, untrained=True)  # steps after the spike: rows the run will train
    inside = [piece for piece in every if piece.step in window]
    documents = {_document_of(p) for p in inside}
    pieces = [p for p in every if p.step in window or _document_of(p) in documents]
    pieces += _pieces_beyond(datamodule, documents, pieces, around, steps)
    pieces.sort(key=lambda p: (p.step, p.batch_row, p.column))
    held = [p.step for p in pieces if _document_of(p) in documents]
    return pieces, (min(held, default=window.start), max(held, default=step) + 1)


FOLLOW_LIMIT = 1024
"""Steps a document is followed past the search around a spike: the replay runs in the training process, so this
bounds the pause; a chunk further away is not searched for."""


def _document_of(piece: Any) -> tuple[Any, ...]:
    return (piece.source, piece.file, piece.row_group, piece.document_row)


def _pieces_beyond(datamodule: Any, documents: set[tuple[Any, ...]], found: list[Any], around: range,
                   steps: int) -> list[Any]:  # fmt: skip
    """The pieces of ``documents`` outside ``around``: earlier steps until each one's first token (start 0) is
    found, later ones until its pieces cover all its tokens; ``bestfit`` trains one prefix of a document, found."""
    held = [p for p in found if _document_of(p) in documents]
    if not documents or datamodule.packing == "bestfit":
        return []
    lengths = {doc: len(datamodule.document(list(doc))["tokens"]) for doc in documents}
    covered: dict[tuple[Any, ...], set[int]] = collections.defaultdict(set)
    for piece in held:
        covered[_document_of(piece)].update(range(piece.start, piece.stop))
    extra: list[Any] = []

    def whole(doc: tuple[Any, ...], forward: bool) -> bool:
        return len(covered[doc]) == lengths[doc] if forward else 0 in covered[doc]

    def take(span: range, forward: bool) -> None:
        # Outward from the spike, and only pieces of tokens not met yet, until a document is whole: its pieces in
        # another pass repeat tokens of this training of it (a skip over them would reach across the pass).
        found = datamodule.provenance(span, untrained=True)
        for piece in found if forward else reversed(found):
            doc = _document_of(piece)
            new = doc in documents and not covered[doc].issuperset(range(piece.start, piece.stop))
            if new and not whole(doc, forward):
                extra.append(piece)
                covered[doc].update(range(piece.start, piece.stop))

    start, span = around.start, steps
    while start > 0 and not all(whole(doc, False) for doc in documents):
        take(range(max(0, start - span), start), False)
        start, span = max(0, start - span), span * 2
    stop, span = around.stop, steps
    while stop < around.stop + FOLLOW_LIMIT and not all(whole(doc, True) for doc in documents):
        take(range(stop, min(stop + span, around.stop + FOLLOW_LIMIT)), True)
        stop, span = stop + span, span * 2
    return extra
