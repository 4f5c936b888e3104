"""A chunk replayed from the token cache is laid out exactly as the same chunk tokenized, whichever way it is copied."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_d9d.streaming.sources.reader import TextChunk
from lightning_d9d.streaming.streams import stream
from lightning_d9d.streaming.streams.stream import LaidOut, bos_first

BOS = 5


class _Encoding:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)


def _chunk(counts: list[int], seed: int) -> tuple[TextChunk, list[_Encoding], np.ndarray]:
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 60000, n).tolist() for n in counts]
    ids = np.asarray([i for doc in documents for i in doc], np.uint16)
    n = len(counts)
    zeros = np.zeros(n, np.int64)
    tokens = (ids, np.asarray(counts, np.int64))
    cached = TextChunk(0, 0, 0, np.arange(n, dtype=np.int64), [], zeros, zeros, tokens=tokens)
    tokenized = TextChunk(0, 0, 0, np.arange(n, dtype=np.int64), ["text"] * n, zeros, zeros)
    return cached, [_Encoding(doc) for doc in documents], tokenized


# few long documents (copied one slice each) and many short ones (one vectorised insert), empty documents among both
LONG = [9000, 0, 4500, 12000]
SHORT = [7, 1, 0, 30, 3] * 80


@pytest.mark.parametrize("counts", [LONG, SHORT, [1], [2048]], ids=["few-long", "many-short", "one-token", "one-row"])
@pytest.mark.parametrize("capacity", [None, 1025])
def test_a_cached_chunk_is_laid_out_as_the_same_chunk_tokenized(counts: list[int], capacity: int | None) -> None:
    cached, encodings, tokenized = _chunk(counts, seed=len(counts))
    replayed, fresh = LaidOut(cached, [], BOS, capacity), LaidOut(tokenized, encodings, BOS, capacity)
    np.testing.assert_array_equal(replayed.lengths, fresh.lengths)
    np.testing.assert_array_equal(replayed.starts, fresh.starts)
    if capacity is None:
        assert replayed.payload.dtype == fresh.payload.dtype == np.int32
        np.testing.assert_array_equal(replayed.payload, fresh.payload)
    else:
        assert len(replayed.payload) == len(fresh.payload) == len(counts)
        for ours, theirs in zip(replayed.payload, fresh.payload, strict=True):
            np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(("counts", "sliced"), [(LONG, True), (SHORT, False)])
def test_both_copies_give_numpy_insert_s_layout(counts: list[int], sliced: bool) -> None:
    cached, _, _ = _chunk(counts, seed=1)
    ids, lengths = cached.tokens
    # the two regimes really take the two paths
    assert (len(lengths) * stream._SLICED_DOCUMENT_TOKENS <= len(ids)) is sliced
    starts = np.concatenate([[0], np.cumsum(lengths[:-1] + 1)])
    expected = np.insert(ids.astype(np.int32), np.concatenate([[0], np.cumsum(lengths[:-1])]), BOS)
    laid = bos_first(ids, lengths, starts, BOS)
    assert laid.dtype == np.int32
    np.testing.assert_array_equal(laid, expected)
