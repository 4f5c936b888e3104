"""Best-fit-split packing: against a straightforward port of the algorithm, and its invariants on long runs.

The packer never reads token values, so most tests give every token a value that names its document and
position (``make_doc``), the first one included (it stands where BOS would be): every row can then be parsed
back into the pieces it holds and checked against the documents. One test runs real text through a real
``tokenizers`` BPE, with a real BOS.
"""

from __future__ import annotations

import pydoc_data.topics
from collections import Counter
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.streaming.packing.bestfit import BestFitSplitPacker
from lightning_d9d.streaming.packing.rows import NO_TARGET, START, StreamCounters, flagged_tensors

PAD = 1
STRIDE = 100_000  # token = 10 + document * STRIDE + position: positions stay below STRIDE


def make_doc(i: int, length: int) -> np.ndarray:
    """Document ``i`` of ``length`` tokens, each naming the document and its position (0-based)."""
    return (10 + i * STRIDE + np.arange(length)).astype(np.int32)


def decode(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (tokens - 10) // STRIDE, (tokens - 10) % STRIDE


def random_lengths(rng: np.random.Generator, n: int, capacity: int) -> list[int]:
    """Mostly short documents, many longer than a row, and the edges: 1 token, exactly a row, whole rows + 1."""
    kinds = rng.integers(0, 6, n)
    lengths = np.where(kinds < 3, rng.integers(1, capacity + 1, n), rng.integers(capacity + 1, 6 * capacity, n))
    lengths[kinds == 5] = rng.choice([1, capacity, capacity + 1, 2 * capacity, 3 * capacity + 1], (kinds == 5).sum())
    return lengths.tolist()


class Source:
    """Documents fed one per ``refill()`` call, keyed ``(index // 7, index % 7)`` like (row group, row)."""

    def __init__(self, docs: list[np.ndarray], packer: BestFitSplitPacker, cursor: int = 0) -> None:
        self.docs, self.packer, self.cursor = docs, packer, cursor

    def refill(self) -> None:
        i = self.cursor
        self.packer.add(self.docs[i], (i // 7, i % 7))
        self.cursor += 1

    def fetch(self, row: np.ndarray, need: int) -> np.ndarray:
        _seq, _length, key0, key1, offset, _final, _hash, _hashed = row.tolist()
        return self.docs[7 * key0 + key1][offset : offset + need]


def reference_split(
    docs: list[np.ndarray], capacity: int, takes: list[int], buffer_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The algorithm as stated, with a Python scan of the buffer per pick and flags set token by token."""
    source = iter(docs)
    buffer: list[tuple[np.ndarray, bool, bool]] = []  # (tokens, continuation, non-final), insertion order
    tokens, flags = [], []
    for _ in range(sum(takes)):
        row, row_flags, after_non_final = [], [], False
        while len(row) < capacity:
            while len(buffer) < buffer_size:
                doc = next(source)
                for k in range(0, len(doc), capacity):
                    buffer.append((doc[k : k + capacity], k > 0, k + capacity < len(doc)))
            space = capacity - len(row)
            best = -1
            for j, (piece, _, _) in enumerate(buffer):
                if len(piece) <= space and (best < 0 or len(piece) > len(buffer[best][0])):
                    best = j
            if best < 0:
                row += [PAD] * space
                row_flags += [START | NO_TARGET] + [NO_TARGET] * (space - 1)
                break
            piece, continuation, non_final = buffer.pop(best)
            row += piece.tolist()
            row_flags += [START | (NO_TARGET if continuation or after_non_final else 0)] + [0] * (len(piece) - 1)
            after_non_final = non_final
        tokens.append(row)
        flags.append(row_flags)
    return np.array(tokens, np.int32), np.array(flags, np.uint8)


def run(docs: list[np.ndarray], capacity: int, takes: list[int], buffer_size: int):
    packer = BestFitSplitPacker(capacity, PAD, buffer_size)
    source = Source(docs, packer)
    out = [packer.take(n, source.refill) for n in takes]
    return np.concatenate([t for t, _ in out]), np.concatenate([f for _, f in out]), packer, source


def parse_rows(tokens: np.ndarray, flags: np.ndarray, docs: list[np.ndarray], capacity: int):
    """Check every row is pieces of documents then at most one padding run; the pieces and expected flags.

    Returns ``(pieces, expected_flags)``: ``pieces`` maps ``(document, chunk)`` to how often it was emitted;
    ``expected_flags`` are the flags rule by rule, derived from which document piece sits where.
    """
    pieces: Counter = Counter()
    expected = np.zeros_like(flags)
    for r in range(len(tokens)):
        row = tokens[r]
        starts = [*np.flatnonzero(flags[r] & START).tolist(), capacity]
        assert starts[0] == 0, f"row {r} does not start a piece at column 0"
        after_non_final = False
        for a, b in pairwise(starts):
            segment = row[a:b]
            if segment[0] == PAD and (flags[r, a] & NO_TARGET):
                assert b == capacity and (segment == PAD).all(), f"row {r}: padding is not one run at the row end"
                assert a > 0, f"row {r} is all padding"
                expected[r, a:b] = NO_TARGET
                expected[r, a] |= START
                break
            doc, pos = decode(segment)
            d, p0 = int(doc[0]), int(pos[0])
            assert (doc == d).all() and (pos == np.arange(p0, p0 + len(segment))).all(), f"row {r} col {a}"
            assert p0 % capacity == 0, f"row {r}: a piece starts at position {p0} of document {d}, not a chunk start"
            assert len(segment) == min(capacity, len(docs[d]) - p0), f"row {r}: document {d}'s chunk is not whole"
            np.testing.assert_array_equal(segment, docs[d][p0 : p0 + len(segment)])
            pieces[(d, p0 // capacity)] += 1
            expected[r, a] = START | (NO_TARGET if p0 > 0 or after_non_final else 0)
            after_non_final = p0 + len(segment) < len(docs[d])
            assert not after_non_final or (a, b) == (0, capacity), f"row {r}: a non-final chunk shares its row"
    return pieces, expected


def all_pieces(docs: list[np.ndarray], capacity: int) -> Counter:
    return Counter((i, k) for i, d in enumerate(docs) for k in range(-(-len(d) // capacity)))


def buffered_pieces(packer: BestFitSplitPacker) -> Counter:
    meta = packer.snapshot()
    return Counter((7 * int(k0) + int(k1), int(offset) // packer.capacity) for k0, k1, offset in meta[:, 2:5])


def expected_positions(flags: np.ndarray) -> np.ndarray:
    positions = np.zeros(flags.shape, np.int64)
    for r in range(len(flags)):
        for c in range(1, flags.shape[1]):
            positions[r, c] = 0 if flags[r, c] & START else positions[r, c - 1] + 1
    return positions


# ------------------------------------------------------------------------------------------------ the algorithm
@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 130), min_size=300, max_size=300),
    capacity=st.integers(2, 40),
    buffer_size=st.integers(1, 25),
    takes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_bestfit_split_matches_the_reference_scan(lengths, capacity, buffer_size, takes) -> None:
    docs = [make_doc(i, n) for i, n in enumerate(lengths)]
    tokens, flags, _, _ = run(docs, capacity, takes, buffer_size)
    expected_tokens, expected_flags = reference_split(docs, capacity, takes, buffer_size)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(flags, expected_flags)


def test_every_piece_is_emitted_whole_once_and_nothing_is_lost() -> None:
    capacity, buffer_size = 64, 40
    rng = np.random.default_rng(0)
    docs = [make_doc(i, n) for i, n in enumerate(random_lengths(rng, 3000, capacity))]
    takes = rng.integers(1, 9, 400).tolist()
    tokens, flags, packer, source = run(docs, capacity, takes, buffer_size)
    added = docs[: source.cursor]

    pieces, expected_flags = parse_rows(tokens, flags, docs, capacity)
    np.testing.assert_array_equal(flags, expected_flags)
    assert max(pieces.values()) == 1  # no piece twice
    buffered = buffered_pieces(packer)
    assert not (pieces.keys() & buffered.keys())
    assert pieces + buffered == all_pieces(added, capacity)  # every piece of every added document, once
    # Whole documents sit in one row each; split ones are their chunks in chunk order.
    whole = [i for i, d in enumerate(added) if len(d) <= capacity and (i, 0) in pieces]
    split_done = [
        i
        for i, d in enumerate(added)
        if len(d) > capacity and all((i, k) in pieces for k in range(-(-len(d) // capacity)))
    ]
    assert len(whole) > 500 and len(split_done) > 300
    emitted: dict[int, list[tuple[int, int]]] = {}  # document -> (position of a piece's first token, row)
    for r, row in enumerate(tokens):
        doc, pos = decode(row)
        for c in np.flatnonzero((flags[r] & START) & (row != PAD)).tolist():
            emitted.setdefault(int(doc[c]), []).append((int(pos[c]), r))
    for i in whole:
        assert len(emitted[i]) == 1 and emitted[i][0][0] == 0
    for i in split_done:
        chunks = sorted(emitted[i])
        rebuilt = np.concatenate([tokens[r][(decode(tokens[r])[0] == i)] for _, r in chunks])
        np.testing.assert_array_equal(rebuilt, added[i])

    # Multiset of tokens: emitted + still buffered == added.
    meta = packer.snapshot()
    still = [source.fetch(row, int(row[1])) for row in meta]
    padding = tokens == PAD  # no document token is PAD
    assert ((flags[padding] & NO_TARGET) != 0).all()
    real = tokens[~padding]
    np.testing.assert_array_equal(np.sort(np.concatenate([real, *still])), np.sort(np.concatenate(added)))


def test_counters_add_up() -> None:
    capacity = 50
    rng = np.random.default_rng(1)
    lengths = random_lengths(rng, 2000, capacity)
    docs = [make_doc(i, n) for i, n in enumerate(lengths)]
    tokens, flags, packer, source = run(docs, capacity, [5] * 60, 30)
    added = lengths[: source.cursor]
    padding = int(((flags & NO_TARGET) != 0)[tokens == PAD].sum())
    c = packer.counters
    assert c == StreamCounters(
        docs=len(added),
        split_docs=sum(n > capacity for n in added),
        chunks=sum(-(-n // capacity) for n in added if n > capacity),
        emitted=tokens.size - padding,
        padding=padding,
    )
    assert c.emitted + c.padding == 300 * capacity
    assert sum(added) == c.emitted + packer.buffered_tokens
    assert c.split_docs > 0 and c.padding > 0
    assert packer.next_seq == len(packer.snapshot()) + int((flags & START).astype(bool)[tokens != PAD].sum())


def test_padding_is_no_target_and_positions_restart_at_every_piece() -> None:
    capacity = 33
    rng = np.random.default_rng(2)
    docs = [make_doc(i, n) for i, n in enumerate(random_lengths(rng, 800, capacity))]
    tokens, flags, _, _ = run(docs, capacity, [4] * 30, 12)
    inputs, targets, positions = flagged_tensors(tokens, flags)
    assert inputs.dtype == targets.dtype == positions.dtype == torch.int64
    assert inputs.shape == targets.shape == positions.shape == (120, capacity - 1)
    np.testing.assert_array_equal(inputs.numpy(), tokens[:, :-1])
    _, expected_flags = parse_rows(tokens, flags, docs, capacity)
    masked = (expected_flags[:, 1:] & NO_TARGET) != 0
    np.testing.assert_array_equal(targets.numpy(), np.where(masked, IGNORE_INDEX, tokens[:, 1:]))
    np.testing.assert_array_equal(positions.numpy(), expected_positions(flags)[:, :-1])
    padding = (tokens[:, 1:] == PAD) & ((flags[:, 1:] & START) != 0)
    assert padding.any()
    # Targets kept: every token inside a piece, and the first token of a document after a whole one.
    starts = (flags[:, 1:] & START) != 0
    first_of_doc = starts & (decode(tokens[:, 1:])[1] == 0)
    assert first_of_doc.any() and (targets.numpy()[first_of_doc] == tokens[:, 1:][first_of_doc]).all()
    assert (targets.numpy()[~starts & (tokens[:, 1:] != PAD)] != IGNORE_INDEX).all()
    continuation = starts & (decode(tokens[:, 1:])[1] > 0) & (tokens[:, 1:] != PAD)
    assert continuation.any() and (targets.numpy()[continuation] == IGNORE_INDEX).all()


def test_flagged_tensors_on_a_hand_written_row() -> None:
    s, n = START, NO_TARGET
    # A document (BOS 0, 5, 6) | a final continuation chunk (7, 8) | a document (BOS 0, 9) | padding (2, 2).
    tokens = np.array([[0, 5, 6, 7, 8, 0, 9, 2, 2]], np.int32)
    flags = np.array([[s, 0, 0, s | n, 0, s, 0, s | n, n]], np.uint8)
    inputs, targets, positions = flagged_tensors(tokens, flags)
    assert inputs.tolist() == [[0, 5, 6, 7, 8, 0, 9, 2]]
    assert targets.tolist() == [[5, 6, -100, 8, 0, 9, -100, -100]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    assert inputs.is_contiguous() and targets.is_contiguous() and positions.is_contiguous()
    with pytest.raises(ValueError, match="same"):
        flagged_tensors(tokens, flags[:, :-1])


def test_flags_of_a_split_document_in_order() -> None:
    capacity = 10
    # A buffer of 1 packs documents in order. Document 0 (25 tokens) -> chunks of 10, 10, 5.
    docs = [make_doc(0, 25), make_doc(1, 5), make_doc(2, 3), make_doc(3, 10), make_doc(4, 4)]
    tokens, flags, packer, _ = run(docs, capacity, [4], 1)
    s, n = START, NO_TARGET
    assert flags[0].tolist() == [s] + [0] * 9  # chunk 0 starts at its BOS
    assert flags[1].tolist() == [s | n] + [0] * 9  # chunk 1 continues: no target at its first token
    # The final chunk, then document 1, whose first token stays a target ("the document ends here").
    assert flags[2].tolist() == [s | n, 0, 0, 0, 0, s, 0, 0, 0, 0]
    # Document 2, then document 3 (10 tokens) does not fit: padding, and document 3 waits for the next row.
    assert flags[3].tolist() == [s, 0, 0, s | n, n, n, n, n, n, n]
    assert (tokens[3, 3:] == PAD).all() and packer.snapshot()[:, 1].tolist() == [10]
    np.testing.assert_array_equal(np.concatenate([tokens[0], tokens[1], tokens[2, :5]]), docs[0])


# ------------------------------------------------------------------------------------------------ state
def test_resume_from_any_snapshot_continues_identically() -> None:
    capacity, buffer_size = 40, 16
    rng = np.random.default_rng(3)
    docs = [make_doc(i, n) for i, n in enumerate(random_lengths(rng, 1500, capacity))]
    takes = rng.integers(1, 4, 80).tolist()
    packer = BestFitSplitPacker(capacity, PAD, buffer_size)
    source = Source(docs, packer)
    outputs, states = [], []
    for n in takes:
        outputs.append(packer.take(n, source.refill))
        states.append((packer.snapshot(), packer.next_seq, packer.counters.copy(), source.cursor))

    partly_emitted = 0
    for step in range(len(takes) - 1):
        meta, next_seq, counters, cursor = states[step]
        # A split document with some chunks emitted and a later one buffered: its chunk 0 is gone.
        first_chunk: dict[tuple[int, int], int] = {}
        for key0, key1, offset in meta[:, 2:5].tolist():
            chunk = offset // capacity
            first_chunk[(key0, key1)] = min(chunk, first_chunk.get((key0, key1), chunk))
        partly_emitted += any(chunk > 0 for chunk in first_chunk.values())
        resumed = BestFitSplitPacker(capacity, PAD, buffer_size, counters=counters.copy())
        fetched: list[int] = []
        again = Source(docs, resumed, cursor)

        def fetch(row: np.ndarray, need: int, again: Source = again, fetched: list[int] = fetched) -> np.ndarray:
            fetched.append(int(row[0]))
            return again.fetch(row, need)

        resumed.reset(meta, next_seq, fetch)
        assert fetched == [] and len(resumed) == len(meta)  # nothing is fetched until picked
        for later in range(step + 1, len(takes)):
            got = resumed.take(takes[later], again.refill)
            np.testing.assert_array_equal(got[0], outputs[later][0])
            np.testing.assert_array_equal(got[1], outputs[later][1])
            snapshot, seq, counters_after, cursor_after = states[later]
            np.testing.assert_array_equal(resumed.snapshot(), snapshot)
            assert (resumed.next_seq, resumed.counters, again.cursor) == (seq, counters_after, cursor_after)
        assert len(fetched) == len(set(fetched)) and set(fetched) <= set(meta[:, 0].tolist())
    assert partly_emitted > 5  # resumed with a split document's later chunks buffered, its first already emitted


def test_restore_rejects_a_changed_chunk_or_length() -> None:
    capacity = 8
    packer = BestFitSplitPacker(capacity, PAD, 4)
    packer.add(make_doc(0, 20), (3, 4))  # chunks of 8, 8, 4
    packer.add(make_doc(1, 5), (5, 6))
    meta = packer.snapshot()
    assert meta[:, 4].tolist() == [0, 8, 16, 0] and meta[:, 5].tolist() == [0, 0, 1, 1]
    assert (meta[:3, 6] != 0).all() and meta[3, 6] == 0
    assert meta[:, 7].tolist() == [8, 8, 4, 0]  # pieces hashed whole; a whole document is verified by its length

    changed = make_doc(0, 20)
    changed[9] += 1  # inside chunk 1 only
    restored = BestFitSplitPacker(capacity, PAD, 1)
    restored.reset(
        meta, packer.next_seq, lambda row, need: (changed if row[2] == 3 else make_doc(1, 5))[row[4] :][:need]
    )
    restored.take(1, lambda: None)  # chunk 0 still matches
    with pytest.raises(ValueError, match=r"piece at token 8 of document \(3, 4\) does not match its saved length 8 /"):
        restored.take(1, lambda: None)

    shorter = BestFitSplitPacker(capacity, PAD, 1)
    shorter.reset(meta[3:], packer.next_seq, lambda row, need: make_doc(1, 4))
    with pytest.raises(ValueError, match=r"at token 0 of document \(5, 6\) does not match its saved length 5 \(got"):
        shorter.take(1, lambda: None)


def test_restore_refuses_a_bad_state() -> None:
    packer = BestFitSplitPacker(8, PAD, 2)
    packer.add(make_doc(0, 5), (0, 0))
    with pytest.raises(RuntimeError, match="empty packer"):
        packer.reset(packer.snapshot(), 1, lambda row, need: None)
    with pytest.raises(ValueError, match=r"must be \(pieces, 8\)"):
        BestFitSplitPacker(8, PAD).reset(np.zeros((2, 5), np.int64), 0, lambda row, need: None)
    with pytest.raises(ValueError, match="a state with buffered pieces needs fetch"):
        BestFitSplitPacker(4, PAD).reset(packer.snapshot(), 1, None)


def test_a_refill_that_adds_no_document_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="added no document"):
        BestFitSplitPacker(8, PAD, 2).take(1, lambda: None)


@pytest.mark.parametrize("bad", [0, 1, -3])
def test_rejects_rows_without_room_and_empty_documents(bad: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        BestFitSplitPacker(bad, PAD)
    with pytest.raises(ValueError, match="buffer_size"):
        BestFitSplitPacker(8, PAD, buffer_size=0)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        BestFitSplitPacker(8, PAD).add(np.zeros(0, np.int32), (0, 0))
    with pytest.raises(ValueError, match=r"non-empty 1-D token array, got shape \(2, 3\)"):
        BestFitSplitPacker(8, PAD).add(np.zeros((2, 3), np.int32), (0, 0))


# ------------------------------------------------------------------------------------------------ real text
@pytest.fixture(scope="module")
def real_text() -> tuple[list[str], Tokenizer, int, int]:
    texts = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<bos>", "<pad>"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return texts, tok, tok.token_to_id("<bos>"), tok.token_to_id("<pad>")


def feed_real(texts: list[str], tok: Tokenizer, bos: int, batch: int, packer: BestFitSplitPacker) -> Callable:
    """A refill that tokenizes ``batch`` texts per tokenizer call and adds one document per refill."""
    pending: list[np.ndarray] = []
    cursor = [0]

    def refill() -> None:
        if not pending:
            for enc in tok.encode_batch_fast(texts[cursor[0] : cursor[0] + batch], add_special_tokens=False):
                doc = np.empty(len(enc.ids) + 1, np.int32)  # one numpy conversion per document
                doc[0], doc[1:] = bos, enc.ids
                pending.append(doc)
        packer.add(pending.pop(0), (cursor[0], 0))
        cursor[0] += 1

    return refill


def test_real_text_rows_do_not_depend_on_tokenizer_batches_and_hold_every_chunk(real_text) -> None:
    texts, tok, bos, pad = real_text
    capacity, rows = 129, 150
    results = []
    for batch in (1, 7, 64):
        packer = BestFitSplitPacker(capacity, pad, 24)
        tokens, flags = packer.take(rows, feed_real(texts, tok, bos, batch, packer))
        results.append((tokens, flags, packer.snapshot(), packer.counters.copy()))
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], results[0][0])
        np.testing.assert_array_equal(other[1], results[0][1])
        np.testing.assert_array_equal(other[2], results[0][2])
        assert other[3] == results[0][3]
    tokens, flags, meta, counters = results[0]
    assert 10 < counters.split_docs < counters.docs < len(texts)

    docs = [np.array([bos, *e.ids], np.int32) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    chunks = {
        (i, k): d[k * capacity : (k + 1) * capacity]
        for i, d in enumerate(docs[: counters.docs])
        for k in range(-(-len(d) // capacity))
    }
    by_bytes = {piece.tobytes(): key for key, piece in chunks.items()}
    assert len(by_bytes) == len(chunks)  # every chunk is told apart by its tokens
    seen: Counter = Counter()
    for r in range(rows):
        starts = [*np.flatnonzero(flags[r] & START).tolist(), capacity]
        for a, b in pairwise(starts):
            if tokens[r, a] == pad:
                assert b == capacity and (tokens[r, a:] == pad).all() and (flags[r, a:] & NO_TARGET).all()
                continue
            key = by_bytes.get(tokens[r, a:b].tobytes())
            assert key is not None, f"row {r} columns {a}:{b} are no document chunk"
            seen[key] += 1
            assert bool(flags[r, a] & NO_TARGET) == (key[1] > 0), f"row {r} column {a}: target flag of chunk {key}"
            assert not (flags[r, a + 1 : b] & (START | NO_TARGET)).any()
    buffered = Counter((key0, offset // capacity) for key0, offset in meta[:, [2, 4]].tolist())
    assert seen + buffered == Counter(chunks.keys())
    assert max(seen.values()) == 1
