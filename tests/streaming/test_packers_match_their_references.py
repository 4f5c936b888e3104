"""The best-fit and concat packers against straightforward ports of the reference algorithms, and positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_d9d.core.tokens import restart_positions
from lightning_d9d.streaming.packing.bestfit import BestFitPacker
from lightning_d9d.streaming.packing.concat import ConcatPacker

BOS = 0


def make_doc(i: int, length: int) -> np.ndarray:
    """A document of ``length`` tokens: BOS, then tokens that name the document and position (1-based)."""
    doc = np.arange(length, dtype=np.int32) + 1 + 1000 * i
    doc[0] = BOS
    return doc


def reference_bestfit(docs: list[np.ndarray], capacity: int, rows: int, buffer_size: int, batch: int):
    """The reference's best-fit (a Python scan of the buffer per pick), ported as is."""
    doc_buffer: list[np.ndarray] = []
    source = iter([docs[i : i + batch] for i in range(0, len(docs), batch)])
    out, crops = [], 0
    for _ in range(rows):
        row, pos = np.empty(capacity, np.int32), 0
        while pos < capacity:
            while len(doc_buffer) < buffer_size:
                doc_buffer.extend(next(source))
            remaining = capacity - pos
            best_idx, best_len = -1, 0
            for i, doc in enumerate(doc_buffer):
                if len(doc) <= remaining and len(doc) > best_len:
                    best_idx, best_len = i, len(doc)
            if best_idx >= 0:
                doc = doc_buffer.pop(best_idx)
                row[pos : pos + len(doc)] = doc
                pos += len(doc)
            else:
                shortest = min(range(len(doc_buffer)), key=lambda i: len(doc_buffer[i]))
                doc = doc_buffer.pop(shortest)
                row[pos:] = doc[:remaining]
                crops += 1
                pos = capacity
        out.append(row)
    return np.stack(out), crops


def run_bestfit(docs: list[np.ndarray], capacity: int, rows: int, buffer_size: int, batch: int):
    packer = BestFitPacker(capacity, buffer_size)
    chunks = iter([docs[i : i + batch] for i in range(0, len(docs), batch)])
    consumed = [0]

    def refill() -> None:
        for doc in next(chunks):
            packer.add(doc[:capacity], len(doc), (consumed[0], 0))
            consumed[0] += 1

    return packer.take(rows, refill)[0], packer


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=400, max_size=400),
    capacity=st.integers(2, 40),
    buffer_size=st.integers(1, 30),
    batch=st.integers(1, 9),
)
def test_bestfit_picks_exactly_what_the_reference_scan_picks(lengths, capacity, buffer_size, batch) -> None:
    docs = [make_doc(i, n) for i, n in enumerate(lengths)]
    rows = 20
    expected, expected_crops = reference_bestfit(docs, capacity, rows, buffer_size, batch)
    got, packer = run_bestfit(docs, capacity, rows, buffer_size, batch)
    np.testing.assert_array_equal(got, expected)
    assert packer.counters.crops == expected_crops
    assert (got[:, 0] == BOS).all()  # every row starts at a document start


def test_bestfit_reports_crops_and_dropped_tokens() -> None:
    docs = [make_doc(i, n) for i, n in enumerate([30, 5, 12, 40, 7, 3, 25, 9] * 20)]
    got, packer = run_bestfit(docs, capacity=16, rows=30, buffer_size=6, batch=4)
    assert packer.counters.crops > 0 and packer.counters.cropped > 0
    assert packer.counters.emitted == got.size
    # every emitted token is a prefix of one document: a BOS starts each piece, positions follow on
    for row in got:
        starts = np.flatnonzero(row == BOS)
        assert starts[0] == 0
        for a, b in zip(starts, [*starts[1:], len(row)]):
            piece = row[a:b]
            doc_id = (piece[1] - 1) // 1000 if len(piece) > 1 else None
            if doc_id is not None:
                np.testing.assert_array_equal(piece[1:], make_doc(int(doc_id), len(piece))[1:])


def test_bestfit_snapshot_restore_continues_identically() -> None:
    docs = [make_doc(i, n) for i, n in enumerate(np.random.default_rng(0).integers(1, 60, 600))]
    capacity, buffer_size, batch = 24, 20, 5
    full, _ = run_bestfit(docs, capacity, 60, buffer_size, batch)

    packer = BestFitPacker(capacity, buffer_size)
    chunks = [docs[i : i + batch] for i in range(0, len(docs), batch)]
    cursor = [0]

    def refill() -> None:
        for doc in chunks[cursor[0]]:
            packer.add(doc[:capacity], len(doc), (cursor[0], 0))
        cursor[0] += 1

    first = packer.take(25, refill)[0]
    meta, next_seq, at = packer.snapshot(), packer.next_seq, cursor[0]
    # Rebuild from positions only: each buffered document's prefix comes back from the "source".
    by_seq = {}
    seq = 0
    for c in range(at):
        for doc in chunks[c]:
            by_seq[seq] = doc
            seq += 1
    restored = BestFitPacker(capacity, buffer_size)
    fetched = []
    restored.reset(meta, next_seq, lambda row, need: fetched.append(int(row[0])) or by_seq[int(row[0])][:need])
    assert fetched == []  # nothing is fetched until picked
    packer, cursor[0] = restored, at
    second = packer.take(35, refill)[0]
    np.testing.assert_array_equal(np.concatenate([first, second]), full)
    assert 0 < len(fetched) == len(set(fetched)) <= len(meta)


def test_bestfit_restore_rejects_a_changed_prefix() -> None:
    packer = BestFitPacker(8, 2)
    packer.add(make_doc(1, 20)[:8], 20, (0, 0))
    meta = packer.snapshot()
    changed = make_doc(1, 20)[:8].copy()
    changed[3] += 1
    restored = BestFitPacker(8, 1)
    restored.reset(meta, 1, lambda row, need: changed)
    with pytest.raises(ValueError, match=r"at token 0 of document \(0, 0\) does not match its saved length 20 / "):
        restored.take(1, lambda: None)


def test_concat_is_the_token_stream_cut_into_rows() -> None:
    rng = np.random.default_rng(1)
    docs = [make_doc(i, int(n)) for i, n in enumerate(rng.integers(1, 50, 200))]
    packer, rows = ConcatPacker(17), []
    for chunk, start in enumerate(range(0, len(docs), 7)):
        part = docs[start : start + 7]
        packer.add(np.concatenate(part), np.cumsum([0] + [len(d) for d in part[:-1]]), ref=chunk)
        while (taken := packer.take(3)) is not None:
            rows.append(taken.copy())
    stream = np.concatenate(docs)
    emitted = np.concatenate(rows).ravel()
    np.testing.assert_array_equal(emitted, stream[: len(emitted)])
    assert len(stream) - len(emitted) < 3 * 17


def test_concat_position_names_the_document_and_offset_of_the_next_token() -> None:
    docs = [make_doc(i, 9) for i in range(40)]
    starts = np.arange(4) * 9
    packer = ConcatPacker(5)
    packer.add(np.concatenate(docs[0:4]), starts, ref="a")
    packer.add(np.concatenate(docs[4:8]), starts, ref="b")
    packer.take(2)
    assert packer.position() == ("a", 1, 1)  # 10 tokens emitted: document 1 of chunk a, its token 1
    packer.take(3)
    assert packer.position() == ("a", 2, 7)
    packer.take(4)
    assert packer.position() == ("b", 1, 0)
    # Resume: re-add from that document with the offset skipped, and the rows continue identically.
    resumed = ConcatPacker(5)
    resumed.add(np.concatenate(docs[5:12]), np.arange(7) * 9, ref="c")
    np.testing.assert_array_equal(resumed.take(3), packer.take(3))
    exact = ConcatPacker(5)
    exact.add(np.concatenate([make_doc(0, 5), make_doc(1, 5)]), np.array([0, 5]), ref="d")
    exact.take(2)
    assert exact.position() == ("d", 2, 0)  # all emitted: just after the last document


def test_position_ids_restart_at_row_start_and_every_bos() -> None:
    inputs = np.array([[0, 5, 6, 0, 7], [8, 9, 0, 1, 2], [0, 0, 3, 4, 0]])
    expected = np.array([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 0, 1, 2, 0]])
    np.testing.assert_array_equal(restart_positions(inputs == BOS), expected)


@pytest.mark.parametrize("bad", [0, 1, -3])
def test_packers_reject_rows_without_room(bad: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        ConcatPacker(bad)
    with pytest.raises(ValueError, match="capacity"):
        BestFitPacker(bad)
