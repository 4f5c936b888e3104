"""``lightning-d9d provenance``: which pieces of which documents every row of some steps of a run holds.

The DataModule of the config is set up, resumed from ``--ckpt_path`` (its data edits and stream states), and asked
``dm.provenance(steps)``, which replays streams from the run's records (``provenance_dir``, by default
``<trainer.default_root_dir>/data_provenance``). Trade-off: one process replays every stream, so a query costs up to
``provenance_every`` steps of packing whatever the run's layout was.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from lightning_d9d.streaming.provenance.pieces import Piece


def parse_steps(text: str) -> range:
    """``"7"`` or ``"a:b"`` (b excluded) as a range of steps (``ValueError`` naming the value otherwise)."""
    try:
        if ":" in text:
            first, stop = (int(part) for part in text.split(":", 1))
        else:
            first = int(text)
            stop = first + 1
    except ValueError:
        first = stop = -1
    if not 0 <= first < stop:
        raise ValueError(f"--steps {text!r} is not valid: give a step (e.g. 120) or steps a:b with 0 <= a < b")
    return range(first, stop)


def provenance_report(datamodule: Any, trainer: Any, steps: str, ckpt_path: str | None, output: str | None) -> str:
    """The pieces of ``steps`` (printed, or written to ``output``: ``.jsonl`` or ``.parquet``); a summary line.

    Raises:
        ValueError: bad ``--steps``, an ``--output`` of another suffix, a DataModule without provenance, or a
            checkpoint without its data state.
    """
    wanted = parse_steps(steps)
    if output is not None and not output.endswith((".jsonl", ".parquet")):
        raise ValueError(f"--output {output!r} must end in .jsonl or .parquet")
    if not hasattr(datamodule, "provenance") or not hasattr(datamodule, "provenance_dir"):
        raise ValueError(f"{type(datamodule).__name__} has no streams to replay: provenance is PretrainingDataModule's")
    if datamodule.provenance_dir is None and trainer is not None:
        datamodule.provenance_dir = os.path.join(trainer.default_root_dir, "data_provenance")
    datamodule.prepare_data()
    datamodule.setup("fit")
    if ckpt_path is not None:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        name = type(datamodule).__qualname__
        if name not in checkpoint:
            raise ValueError(f"--ckpt_path {ckpt_path!r} holds no {name} data state (it holds {sorted(checkpoint)})")
        datamodule.load_state_dict(checkpoint[name])
    pieces = datamodule.provenance(wanted)
    if output is None:
        return "\n".join(_lines(pieces))
    _write(pieces, output)
    return f"wrote {len(pieces)} pieces of steps {wanted.start}-{wanted.stop - 1} to {output}"


def _lines(pieces: list[Piece]) -> list[str]:
    lines, last = [], None
    for piece in pieces:
        if (piece.step, piece.batch_row) != last:
            last = (piece.step, piece.batch_row)
            lines.append(f"step {piece.step} row {piece.batch_row}:")
        lines.append(f"  column {piece.column:>6} length {piece.length:>6}  {piece.source} {piece.file} row group "
                     f"{piece.row_group} row {piece.document_row} tokens [{piece.start}, {piece.stop})")  # fmt: skip
    return lines


def _write(pieces: list[Piece], output: str) -> None:
    rows = [piece.to_dict() for piece in pieces]
    if output.endswith(".jsonl"):
        with open(output, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), output)
