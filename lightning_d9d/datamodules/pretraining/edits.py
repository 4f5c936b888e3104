"""The data edits a PretrainingDataModule is asked for: ``skip_data`` ranges and ``exclude_documents`` references
checked at construction, reference files read, and a spec that passes over excluded documents.

Functions only: the edits in force are the run plan's state (``plan.py``). A file of references is read at
``setup``, not at construction, so a config can name the file a loss-spike callback will write. Trade-off: an
unreadable file is found at ``setup``, after the DataModule was built.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from lightning_d9d.streaming.plans.edits import DocumentRef, resolve_reference, step_range
from lightning_d9d.streaming.plans.spec import MixtureSpec


def edits_asked(skip_data: Any, exclude_documents: Any) -> tuple[tuple[tuple[int, int], ...], Any]:
    """``skip_data`` checked as ranges of optimizer steps, and ``exclude_documents`` (references checked now, a file
    read at ``setup``).

    Raises:
        ValueError: a range that is not ``[start, stop)`` with ``0 <= start < stop``, a reference that is not
            ``[source, file, row_group, row]``, or something else in their place.
    """
    if skip_data is None:
        ranges: tuple[tuple[int, int], ...] = ()
    elif isinstance(skip_data, Sequence) and not isinstance(skip_data, str):
        ranges = tuple(step_range(value, number) for number, value in enumerate(skip_data))
    else:
        raise ValueError(f"skip_data={skip_data!r} is not valid: give ranges [[start, stop], ...] of optimizer steps")
    if exclude_documents is None or isinstance(exclude_documents, (str, os.PathLike)):
        return ranges, exclude_documents
    if not isinstance(exclude_documents, Sequence):
        raise ValueError(
            f"exclude_documents={exclude_documents!r} is not valid: give a list of document references "
            "[source, file, row_group, row] or the path of a JSONL file of them"
        )
    return ranges, tuple(DocumentRef.of(value, number) for number, value in enumerate(exclude_documents))


def read_references(path: str | os.PathLike) -> tuple[DocumentRef, ...]:
    """The document references of a file: JSONL (one ``[source, file, row_group, row]`` or object per line; blank
    lines and ``#`` comments ignored; a provenance or loss-spike JSONL works as it is) or the ``.parquet`` the
    provenance command writes (columns ``source, file, row_group, document_row``).

    Raises:
        ValueError: a file that cannot be read (missing, not UTF-8 text, not parquet) or a line that is no
            reference, naming ``exclude_documents``, the file and the line.
    """
    name = os.fspath(path)
    if name.endswith(".parquet"):
        return _parquet_references(name)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"exclude_documents={name!r}: cannot read it ({error}); give a JSONL file of document references or "
            "the .parquet the provenance command writes"
        ) from error
    refs = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            refs.append(DocumentRef.of(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as error:
            raise ValueError(f"line {number} of exclude_documents={name!r}: {error}") from error
    return tuple(refs)


def _parquet_references(name: str) -> tuple[DocumentRef, ...]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["source", "file", "row_group", "document_row"]
    try:
        table = pq.read_table(name, columns=columns)
    except (OSError, pa.ArrowException, KeyError) as error:
        raise ValueError(
            f"exclude_documents={name!r}: cannot read it as the provenance command's .parquet (columns {columns}): "
            f"{error}"
        ) from error
    rows = zip(*(table.column(column).to_pylist() for column in columns))
    return tuple(DocumentRef.of(list(row), number) for number, row in enumerate(rows))


def excluding(spec: MixtureSpec, refs: Iterable[DocumentRef]) -> MixtureSpec:
    """``spec`` with every source passing over the documents ``refs`` name (``ValueError`` for a bad reference)."""
    indexes = [source.index for source in spec.sources]
    keys: list[set[tuple[int, int]]] = [set() for _ in spec.sources]
    for ref in refs:
        source, group, row = resolve_reference(spec.names, indexes, ref)
        keys[source].add((group, row))
    sources = tuple(dataclasses.replace(s, excluded=frozenset(k)) for s, k in zip(spec.sources, keys))
    return dataclasses.replace(spec, sources=sources)
