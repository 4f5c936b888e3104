"""``lightning-d9d provenance``: which pieces of which documents every row of some steps of a run holds.

The DataModule of the config is set up, given the data state of ``--ckpt_path`` (its data edits and stream states;
``last``, or a folder: the newest checkpoint the run wrote there), and asked ``dm.provenance(steps)``, which replays
streams from the run's records (``provenance_dir``, by default ``<trainer.default_root_dir>/data_provenance``). Only
the checkpoint's data state is read: the model's hyperparameters, whatever classes they pickle, are loaded as opaque
stand-ins (never imported or run), so a checkpoint of any ``Trainer.fit`` script works. ``--text`` adds each
document's first characters and token count. Trade-off: one process replays every stream, so a query costs up to
``provenance_every`` steps of packing whatever the run's layout was.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch


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


def provenance_report(
    datamodule: Any,
    trainer: Any,
    steps: str,
    ckpt_path: str | None,
    output: str | None,
    text: bool = False,
    untrained: bool = False,
) -> str:
    """The pieces of ``steps`` (printed, or written to ``output``: ``.jsonl`` or ``.parquet``); a summary line.

    Args:
        datamodule: the config's DataModule (a ``PretrainingDataModule``).
        trainer: the config's Trainer (its ``default_root_dir`` and checkpoint folder), or ``None``.
        steps: ``"s"`` or ``"a:b"``.
        ckpt_path: a checkpoint file, ``last`` or a folder of checkpoints (their newest), or ``None``.
        output: a ``.jsonl`` or ``.parquet`` file, or ``None`` to print.
        text: add each piece's document's first characters and token count.
        untrained: answer steps past what the run is known to have trained (said so in the output).

    Raises:
        ValueError: bad ``--steps``, an ``--output`` of another suffix, a DataModule without provenance, no
            checkpoint where ``--ckpt_path`` points, or a checkpoint without its data state.
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
        ckpt_path = resolve_checkpoint(ckpt_path, trainer)
        datamodule.load_state_dict(data_state(ckpt_path, type(datamodule).__qualname__))
    known = datamodule.trained_until()
    pieces = datamodule.provenance(wanted, untrained=untrained)
    rows = [piece.to_dict() for piece in pieces]
    if text:
        _add_text(datamodule, rows)
    note = (
        f"steps {max(known, wanted.start)}-{wanted.stop - 1} are not trained yet (as far as the checkpoint and the "
        "ledger say): their rows are the ones the run would train"
        if wanted.stop > known
        else None
    )
    if output is None:
        return "\n".join(([f"# {note}"] if note else []) + _lines(rows))
    _write(rows, output)
    done = f"wrote {len(pieces)} pieces of steps {wanted.start}-{wanted.stop - 1} to {output}"
    return f"{done}; {note}" if note else done


def resolve_checkpoint(ckpt_path: str, trainer: Any) -> str:
    """A checkpoint file for ``--ckpt_path``: the file given; for a folder, its newest ``.ckpt``; for ``last``, the
    newest ``last*.ckpt`` of the run's checkpoint folder, else its newest ``.ckpt`` (the folder: the
    ModelCheckpoint's ``dirpath``, else ``<default_root_dir>/checkpoints`` or the newest
    ``<default_root_dir>/lightning_logs/version_*/checkpoints``).

    Raises:
        ValueError: no checkpoint there, naming where it looked.
    """
    if ckpt_path == "last":
        folders = _checkpoint_folders(trainer)
    elif os.path.isdir(ckpt_path):
        folders = [ckpt_path]
    else:
        return ckpt_path
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "*.ckpt")), key=os.path.getmtime)
        if found:
            named_last = [path for path in found if os.path.basename(path).startswith("last")]
            return (named_last or found)[-1]
    raise ValueError(
        f"--ckpt_path {ckpt_path!r}: no .ckpt file in {folders}; give a checkpoint file, the folder the run wrote "
        "its checkpoints to, or 'last' with the run's trainer settings (default_root_dir, ModelCheckpoint dirpath)"
    )


def _checkpoint_folders(trainer: Any) -> list[str]:
    folders = []
    callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    if getattr(callback, "dirpath", None):
        folders.append(str(callback.dirpath))
    root = getattr(trainer, "default_root_dir", None) if trainer is not None else None
    if root is not None:
        folders.append(os.path.join(root, "checkpoints"))
        versions = glob.glob(os.path.join(root, "lightning_logs", "version_*", "checkpoints"))
        folders += sorted(versions, key=os.path.getmtime, reverse=True)
    return folders


class _Opaque:
    """What a checkpoint pickles that is not plain data (a model's hyperparameters): built and filled with nothing,
    so loading it neither imports nor runs the class it names."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def data_state(ckpt_path: str, name: str) -> dict[str, Any]:
    """The DataModule state ``ckpt[name]`` of a checkpoint, loaded with ``weights_only`` and every other global it
    pickles (a model's hyperparameters: argparse namespaces, int subclasses, a user's classes) read as an opaque
    stand-in.

    Raises:
        ValueError: a file that is no checkpoint, or one that holds no ``name`` state.
    """
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(ckpt_path)
        stand_ins = [(type(path, (_Opaque,), {}), path) for path in unsafe]
        with torch.serialization.safe_globals(stand_ins):
            checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, ValueError, EOFError) as error:  # torch reports a bad zip as RuntimeError
        raise ValueError(f"--ckpt_path {ckpt_path!r} is not a readable checkpoint: {error}") from error
    if not isinstance(checkpoint, dict) or name not in checkpoint:
        held = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"--ckpt_path {ckpt_path!r} holds no {name} data state (it holds {held})")
    return checkpoint[name]


def _add_text(datamodule: Any, rows: list[dict[str, Any]], width: int = 80) -> None:
    """Each row gets ``text`` (its document's first ``width`` characters) and ``document_tokens``."""
    documents: dict[tuple, tuple[str, int]] = {}
    for row in rows:
        key = (row["source"], row["file"], row["row_group"], row["document_row"])
        if key not in documents:
            document = datamodule.document(list(key))
            documents[key] = (document["text"][:width], len(document["tokens"]))
        row["text"], row["document_tokens"] = documents[key]


def _lines(rows: list[dict[str, Any]]) -> list[str]:
    lines, last = [], None
    for row in rows:
        if (row["step"], row["batch_row"]) != last:
            last = (row["step"], row["batch_row"])
            lines.append(f"step {row['step']} row {row['batch_row']}:")
        where = f"{row['source']} {row['file']} row group {row['row_group']} row {row['document_row']}"
        lines.append(f"  column {row['column']:>6} length {row['length']:>6}  {where} "
                     f"tokens [{row['start']}, {row['stop']})")  # fmt: skip
        if "text" in row:
            lines.append(f"      {row['document_tokens']} tokens: {json.dumps(row['text'], ensure_ascii=False)}")
    return lines


def _write(rows: list[dict[str, Any]], output: str) -> None:
    if output.endswith(".jsonl"):
        with open(output, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), output)
