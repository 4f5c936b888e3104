"""The demo corpus as parquet shards, two sources (``prose`` and ``code``), for the streaming path's demo configs.

Each source is written as several parquet files of several row groups so K streams have units to share, built once
per machine; ``demo`` and ``demo:<source>`` file specs resolve to them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_d9d.demo_data.cache import build_once
from lightning_d9d.demo_data.corpus import (
    build_demo_corpus,
    demo_cache_dir,
    demo_cache_key,
    demo_texts,
    regroup_blocks,
    stdlib_sources,
)

_FORMAT_VERSION = 1
_SHARDS = 4
_ROW_GROUP_ROWS = 64
_MAX_CODE_DOCUMENT_CHARS = 1_500
_CODE_CHARS = 1_500_000
DEMO_PREFIX = "demo"
SOURCES = ("prose", "code", "validation")


@dataclasses.dataclass(frozen=True)
class DemoParquet:
    """Paths of the written shards: ``files`` per source, and the demo ``tokenizer_path`` (``<eos>`` serves as BOS)."""

    files: dict[str, list[str]]
    tokenizer_path: str


def code_documents(limit_chars: int = _CODE_CHARS) -> list[str]:
    """Standard-library source in sorted file order, up to ``limit_chars``, regrouped into documents."""
    documents: list[str] = []
    total = 0
    for source in stdlib_sources():
        for document in regroup_blocks(source.split("\n\n"), _MAX_CODE_DOCUMENT_CHARS):
            documents.append(document)
            total += len(document)
            if total >= limit_chars:
                return documents
    return documents


def write_shards(texts: list[str], folder: Path, name: str) -> list[str]:
    """Write ``texts`` as ``_SHARDS`` parquet files (contiguous slices) of ``_ROW_GROUP_ROWS`` rows per group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(texts) // _SHARDS)
    paths = []
    for shard in range(_SHARDS):
        path = folder / f"{name}-{shard:05d}.parquet"
        table = pa.table({"text": pa.array(texts[shard * per_shard : (shard + 1) * per_shard], pa.string())})
        pq.write_table(table, path, row_group_size=_ROW_GROUP_ROWS)
        paths.append(str(path))
    return paths


def build_demo_parquet(cache_dir: str | os.PathLike[str] | None = None) -> DemoParquet:
    """Write the demo parquet shards once into ``cache_dir``, or return the cached ones (safe from every rank)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else demo_cache_dir()
    corpus = build_demo_corpus(root)
    target = build_once(root, f"{demo_cache_key()}-parquet{_FORMAT_VERSION}", _write_sources)
    files = {name: sorted(str(p) for p in (target / name).glob("*.parquet")) for name in SOURCES}
    return DemoParquet(files, corpus.tokenizer_path)


def _write_sources(folder: Path) -> str:
    train, validation = demo_texts()
    for name, texts in (("prose", train), ("code", code_documents()), ("validation", validation)):
        write_shards(texts, folder / name, name)
    return "ok\n"


def resolve_demo_files(spec: Any, built: DemoParquet) -> Any:
    """``spec`` with every ``demo``/``demo:<source>`` string replaced by that source's shards."""
    if isinstance(spec, str) and (spec == DEMO_PREFIX or spec.startswith(f"{DEMO_PREFIX}:")):
        name = spec.partition(":")[2]
        if not name:
            return built.files["prose"] + built.files["code"]
        if name not in built.files:
            raise ValueError(f"{spec!r} is not a demo source: use 'demo' or one of {[f'demo:{n}' for n in SOURCES]}")
        return list(built.files[name])
    if isinstance(spec, Mapping):
        return {key: resolve_demo_files(value, built) for key, value in spec.items()}
    if isinstance(spec, (list, tuple)):
        resolved: list[Any] = []
        for item in spec:
            value = resolve_demo_files(item, built)
            resolved.extend(value if isinstance(value, list) and isinstance(item, str) else [value])
        return resolved
    return spec


def uses_demo(spec: Any) -> bool:
    """Whether ``spec`` names a demo source anywhere (so the shards must be built)."""
    if isinstance(spec, str):
        return spec == DEMO_PREFIX or spec.startswith(f"{DEMO_PREFIX}:")
    if isinstance(spec, Mapping):
        return any(uses_demo(value) for value in spec.values())
    if isinstance(spec, (list, tuple)):
        return any(uses_demo(item) for item in spec)
    return False
