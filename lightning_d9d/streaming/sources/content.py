"""Content keys of parquet units: a unit's cached tokens are named by the bytes its texts are decoded from.

A row group's key is the SHA-256 of its text column chunk as stored (every page, compressed, from the dictionary
page on: one ranged read of ``total_compressed_size`` bytes) together with what decides how those bytes decode:
codec, physical and logical type, definition and repetition levels, value and row counts, the writer and the
column's Arrow type. The footer only says where the chunk is; it is never trusted with the text. When a unit is
read to be tokenized, its texts are decoded from the very bytes that were hashed (pyarrow reads the chunk out of
memory, guided by the footer), so the key names exactly the text that was tokenized, whatever happens to the file
meanwhile. Trade-off: a unit served from the cache still costs one read and one hash of its compressed text.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lightning_d9d.core.digest import content_key


@dataclass(frozen=True)
class ChunkSpan:
    """Where a row group's text column chunk is stored (``offset``, ``length`` bytes) and what decides its decoding
    (``facts``, as text)."""

    offset: int
    length: int
    facts: str


def text_leaf(metadata: pq.FileMetaData, text_column: str) -> int:
    """The index of the parquet leaf column holding ``text_column`` (ValueError if none)."""
    schema = metadata.schema
    for leaf in range(len(schema)):
        if schema.column(leaf).path == text_column:
            return leaf
    raise ValueError(f"no parquet column {text_column!r}")


def text_chunk(metadata: pq.FileMetaData, group: int, text_column: str) -> ChunkSpan:
    """Where row group ``group``'s text column chunk lies, as pyarrow reads it, and its decoding facts."""
    leaf = text_leaf(metadata, text_column)
    row_group = metadata.row_group(group)
    chunk, column = row_group.column(leaf), metadata.schema.column(leaf)
    offset = chunk.data_page_offset
    dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
    if dictionary and dictionary < offset:  # some writers store 0 for "no dictionary page"
        offset = dictionary
    arrow_type = str(metadata.schema.to_arrow_schema().field(text_column).type)
    facts = json.dumps([chunk.compression, chunk.physical_type, str(column.logical_type), column.converted_type,
                        column.max_definition_level, column.max_repetition_level, chunk.num_values,
                        row_group.num_rows, metadata.created_by, arrow_type])  # fmt: skip
    return ChunkSpan(int(offset), int(chunk.total_compressed_size), facts)


def chunk_key(span: ChunkSpan, data: bytes) -> str:
    """The content key of a text column chunk stored as ``data`` (its ``span.length`` bytes)."""
    return content_key("parquet", span.facts, data)


class _ChunkFile(io.RawIOBase):
    """A read-only file of ``size`` bytes that holds ``data`` at ``offset`` and nothing else."""

    def __init__(self, size: int, offset: int, data: bytes):
        super().__init__()
        self._size, self._offset, self._data, self._position = size, offset, memoryview(data), 0
        self.outside = False  # whether a read asked for bytes other than the chunk's

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def read(self, size: int = -1) -> bytes:
        low = self._position
        high = self._size if size is None or size < 0 else min(self._size, low + size)
        if low < self._offset or high > self._offset + len(self._data):
            self.outside = True
            raise OSError(f"bytes {low}..{high} are outside the text column chunk")
        self._position = high
        return bytes(self._data[low - self._offset : high - self._offset])

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def decode_chunk(
    metadata: pq.FileMetaData, group: int, text_column: str, span: ChunkSpan, data: bytes, file_size: int
) -> pa.ChunkedArray | None:
    """Row group ``group``'s text column decoded from ``data`` (its chunk's stored bytes) alone; ``None`` where pyarrow
    needs other bytes of the file (a writer whose footer undercounts the chunk): the caller reads it as usual and
    keys nothing. ValueError (pyarrow's) for bytes that do not decode.
    """
    source = _ChunkFile(file_size, span.offset, data)
    try:
        parquet = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=metadata)
        return parquet.read_row_group(group, columns=[text_column]).column(0)
    except (pa.ArrowException, OSError):
        if source.outside:
            return None
        raise
