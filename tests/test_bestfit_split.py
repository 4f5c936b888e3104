"""Best-fit-split packing: against a straightforward port of the algorithm, and its invariants on long runs.

The packer never reads token values, so most tests give every token a value that names its document and
position (``token_of``), the first one included (it stands where BOS would be): every row can then be parsed
back into the pieces it holds and checked against the documents. One test runs real text through a real
``tokenizers`` BPE, with a real BOS.
"""

from __future__ import annotations

import pydoc_data.topics
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from lightning_d9d.streaming.packing import (
    IGNORE_INDEX,
    NO_TARGET,
    START,
    BestFitSplitPacker,
    SplitPackerCounters,
    split_microbatch_tensors,
)

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

    def fetch(self, row: np.ndarray) -> np.ndarray:
        _seq, length, key0, key1, chunk, _final, _hash = row.tolist()
        start = chunk * self.packer.capacity
        return self.docs[7 * key0 + key1][start : start + length]


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
        for a, b in zip(starts, starts[1:]):
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
    return pieces, expected


def all_pieces(docs: list[np.ndarray], capacity: int) -> Counter:
    return Counter((i, k) for i, d in enumerate(docs) for k in range(-(-len(d) // capacity)))


def buffered_pieces(packer: BestFitSplitPacker) -> Counter:
    meta = packer.snapshot()
    return Counter((7 * int(k0) + int(k1), int(c)) for k0, k1, c in meta[:, 2:5])


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
    split_done = [i for i, d in enumerate(added) if len(d) > capacity and all((i, k) in pieces for k in range(-(-len(d) // capacity)))]
    assert len(whole) > 500 and len(split_done) > 300
    emitted = {}
    for r, row in enumerate(tokens):
        doc, pos = decode(row)
        for c in np.flatnonzero(flags[r] & START).tolist():
            if not flags[r, c] & NO_TARGET or row[c] != PAD:
                emitted.setdefault(int(doc[c]), []).append((int(pos[c]), r))
    for i in whole:
        assert len(emitted[i]) == 1 and emitted[i][0][0] == 0
    for i in split_done:
        chunks = sorted(emitted[i])
        rebuilt = np.concatenate([tokens[r][(decode(tokens[r])[0] == i)] for _, r in chunks])
        np.testing.assert_array_equal(rebuilt, added[i])

    # Multiset of tokens: emitted + still buffered == added.
    meta = packer.snapshot()
    still = [source.fetch(row) for row in meta]
    real = tokens[(flags & NO_TARGET == 0) | (tokens != PAD)]
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
    assert c == SplitPackerCounters(
        docs=len(added),
        split_docs=sum(n > capacity for n in added),
        chunks=sum(-(-n // capacity) for n in added if n > capacity),
        tokens_emitted=tokens.size - padding,
        padding=padding,
    )
    assert c.tokens_emitted + c.padding == 300 * capacity
    assert sum(added) == c.tokens_emitted + packer.buffered_tokens
    assert c.split_docs > 0 and c.padding > 0
    assert packer.next_seq == len(packer.snapshot()) + int((flags & START).astype(bool)[tokens != PAD].sum())


def test_padding_is_no_target_and_positions_restart_at_every_piece() -> None:
    capacity = 33
    rng = np.random.default_rng(2)
    docs = [make_doc(i, n) for i, n in enumerate(random_lengths(rng, 800, capacity))]
    tokens, flags, _, _ = run(docs, capacity, [4] * 30, 12)
    inputs, targets, positions = split_microbatch_tensors(tokens, flags)
    assert inputs.dtype == targets.dtype == positions.dtype == np.int64 or inputs.dtype.is_floating_point is False
    np.testing.assert_array_equal(inputs.numpy(), tokens[:, :-1])
    _, expected_flags = parse_rows(tokens, flags, docs, capacity)
    masked = (expected_flags[:, 1:] & NO_TARGET) != 0
    expected_targets = np.where(masked, IGNORE_INDEX, tokens[:, 1:])
    np.testing.assert_array_equal(targets.numpy(), expected_targets)
    np.testing.assert_array_equal(positions.numpy(), expected_positions(flags)[:, :-1])
    padded = (tokens[:, 1:] == PAD) & ((flags[:, 1:] & NO_TARGET) != 0)
    assert padded.any() and (targets.numpy()[padded] == IGNORE_INDEX).all()
    # Kept targets: inside a piece, and a document's first token after a whole document or a final chunk.
    kept_bos = (flags[:, 1:] & START).astype(bool) & ~masked
    assert kept_bos.any()


def test_split_microbatch_tensors_on_a_hand_written_row() -> None:
    s, n = START, NO_TARGET
    # doc A (BOS 0, 5, 6) | continuation chunk (7, 8) of a document that goes on | BOS 0, 9 | padding 2, 2
    tokens = np.array([[0, 5, 6, 7, 8, 0, 9, 2, 2]], np.int32)
    flags = np.array([[s, 0, 0, s | n, 0, s | n, 0, s | n, n]], np.uint8)
    inputs, targets, positions = split_microbatch_tensors(tokens, flags)
    assert inputs.tolist() == [[0, 5, 6, 7, 8, 0, 9, 2]]
    assert targets.tolist() == [[5, 6, -100, 8, -100, 9, -100, -100]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    assert inputs.is_contiguous() and targets.is_contiguous() and positions.is_contiguous()
    with pytest.raises(ValueError, match="same"):
        split_microbatch_tensors(tokens, flags[:, :-1])


def test_a_split_document_keeps_bos_target_only_after_its_end() -> None:
    capacity = 10
    # Buffer of 1: documents are packed in order. Doc 0 (25 tokens) -> chunks of 10, 10, 5; doc 1 (5 tokens).
    docs = [make_doc(0, 25), make_doc(1, 5), make_doc(2, 3), make_doc(3, 10), make_doc(4, 4)]
    tokens, flags, _, _ = run(docs, capacity, [4], 1)
    s, n = START, NO_TARGET
    assert flags[0, 0] == s and flags[1, 0] == s | n  # chunk 0 starts with BOS; chunk 1 continues
    # Row 2: the final chunk (5 tokens), then doc 1 (5 tokens): doc 1's BOS is a target ("document ends").
    assert flags[2].tolist() == [s | n, 0, 0, 0, 0, s, 0, 0, 0, 0]
    # Row 3: doc 2 (3 tokens), then doc 3 (10) does not fit -> doc 3 waits (buffer of 1): padding.
    assert flags[3].tolist() == [s, 0, 0, s | n, n, n, n, n, n, n]
    assert (tokens[3, 3:] == PAD).all()


def test_whatever_follows_a_non_final_chunk_is_no_target() -> None:
    capacity = 8
    # Buffer 3 holds doc 0's three chunks (8, 8, 2); the 2-token final chunk and short docs fill the gaps.
    docs = [make_doc(0, 18), make_doc(1, 5), make_doc(2, 17), make_doc(3, 3), make_doc(4, 2)] + [
        make_doc(5 + i, 8) for i in range(20)
    ]
    tokens, flags, _, _ = run(docs, capacity, [6], 3)
    _, expected = parse_rows(tokens, flags, docs, capacity)
    np.testing.assert_array_equal(flags, expected)
    # Some piece follows a non-final chunk in its row (doc 2's chunk of 1 is final, its chunk 0 of 8 is not).
    doc, pos = decode(tokens)
    assert any(
        flags[r, c] & START and flags[r, c] & NO_TARGET and pos[r, c] % capacity == 0 and pos[r, c] == 0
        for r in range(len(tokens))
        for c in range(1, capacity)
    ) or (flags[:, 1:] & NO_TARGET).any()


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
        states.append((packer.snapshot(), packer.next_seq, packer.counters, source.cursor))

    partly_emitted = 0
    for step in range(len(takes) - 1):
        meta, next_seq, counters, cursor = states[step]
        buffered = Counter(zip(meta[:, 2].tolist(), meta[:, 3].tolist()))
        split_buffered = {key for key, k, f in zip(zip(meta[:, 2].tolist(), meta[:, 3].tolist()), meta[:, 4], meta[:, 5]) if k > 0 or not f}
        partly_emitted += any(meta[(meta[:, 2] == k0) & (meta[:, 3] == k1), 4].min() > 0 for k0, k1 in split_buffered)
        assert sum(buffered.values()) == len(meta)
        resumed = BestFitSplitPacker(capacity, PAD, buffer_size)
        fetched: list[int] = []
        again = Source(docs, resumed, cursor)

        def fetch(row: np.ndarray, again: Source = again, fetched: list[int] = fetched) -> np.ndarray:
            fetched.append(int(row[0]))
            return again.fetch(row)

        resumed.restore(meta, next_seq, fetch)
        resumed.counters = counters
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
    assert meta[:, 4].tolist() == [0, 1, 2, 0] and meta[:, 5].tolist() == [0, 0, 1, 1]
    assert (meta[:3, 6] != 0).all() and meta[3, 6] == 0

    changed = make_doc(0, 20)
    changed[9] += 1  # inside chunk 1 only
    restored = BestFitSplitPacker(capacity, PAD, 1)
    restored.restore(meta, packer.next_seq, lambda row: (changed if row[2] == 3 else make_doc(1, 5))[8 * row[4] :][: row[1]])
    restored.take(1, lambda: None)  # chunk 0 still matches
    with pytest.raises(ValueError, match=r"piece 1 of document \(3, 4\) does not match its saved length 8 / checksum"):
        restored.take(1, lambda: None)

    shorter = BestFitSplitPacker(capacity, PAD, 1)
    shorter.restore(meta[3:], packer.next_seq, lambda row: make_doc(1, 4))
    with pytest.raises(ValueError, match=r"piece 0 of document \(5, 6\) does not match its saved length 5 \(got 4"):
        shorter.take(1, lambda: None)


def test_restore_refuses_a_bad_state() -> None:
    packer = BestFitSplitPacker(8, PAD, 2)
    packer.add(make_doc(0, 5), (0, 0))
    with pytest.raises(RuntimeError, match="empty packer"):
        packer.restore(packer.snapshot(), 1, lambda row: None)
    with pytest.raises(ValueError, match=r"must be \(pieces, 7\)"):
        BestFitSplitPacker(8, PAD).restore(np.zeros((2, 5), np.int64), 0, lambda row: None)
    with pytest.raises(ValueError, match="rows here hold 4"):
        BestFitSplitPacker(4, PAD).restore(packer.snapshot(), 1, lambda row: None)


def test_refill_must_add_exactly_one_document() -> None:
    packer = BestFitSplitPacker(8, PAD, 2)
    with pytest.raises(RuntimeError, match="added 0"):
        packer.take(1, lambda: None)

    def two() -> None:
        packer.add(make_doc(0, 3), (0, 0))
        packer.add(make_doc(1, 3), (0, 1))

    with pytest.raises(RuntimeError, match="added 2"):
        BestFitSplitPacker(8, PAD, 2).take(1, two) if False else packer.take(1, two)


@pytest.mark.parametrize("bad", [0, 1, -3])
def test_rejects_rows_without_room_and_empty_documents(bad: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        BestFitSplitPacker(bad, PAD)
    with pytest.raises(ValueError, match="buffer_size"):
        BestFitSplitPacker(8, PAD, buffer_size=0)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        BestFitSplitPacker(8, PAD).add(np.zeros(0, np.int32), (0, 0))


# ------------------------------------------------------------------------------------------------ real text
@pytest.fixture(scope="module")
def real_docs() -> tuple[list[np.ndarray], int]:
    texts = sorted(pydoc_data.topics.topics.values())[:160]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<bos>"], show_progress=False))
    bos = tok.token_to_id("<bos>")
    return texts, tok, bos


def feed_real(texts: list[str], tok: Tokenizer, bos: int, batch: int, packer: BestFitSplitPacker) -> Callable:
    """A refill that tokenizes ``batch`` texts per call to the tokenizer and adds one document per refill."""
    pending: list[np.ndarray] = []
    cursor = [0]

    def refill() -> None:
        if not pending:
            start = cursor[0] % len(texts)
            for enc in tok.encode_batch_fast(texts[start : start + batch], add_special_tokens=False):
                doc = np.empty(len(enc.ids) + 1, np.int32)
                doc[0], doc[1:] = bos, enc.ids
                pending.append(doc)
        packer.add(pending.pop(0), (cursor[0] % len(texts), 0))
        cursor[0] += 1

    return refill


def test_real_text_rows_do_not_depend_on_tokenizer_batches_and_hold_every_chunk(real_docs) -> None:
    texts, tok, bos = real_docs
    capacity, rows = 129, 120
    results = []
    for batch in (1, 7, 64):
        packer = BestFitSplitPacker(capacity, bos, 24)
        refill = feed_real(texts, tok, bos, batch, packer)
        tokens, flags = packer.take(rows, refill)
        results.append((tokens, flags, packer.snapshot(), packer.counters))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)
            else:
                assert a == b
    tokens, flags, meta, counters = results[0]
    assert counters.split_docs > 10 and counters.padding < 0.05 * tokens.size

    # Every emitted piece is a chunk of a document, each chunk once (emitted or still buffered).
    docs = [np.concatenate([[bos], e.ids]).astype(np.int32) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    chunks: dict[bytes, list[tuple[int, int]]] = {}
    for i, d in enumerate(docs[: counters.docs]):
        for k in range(-(-len(d) // capacity)):
            chunks.setdefault(d[k * capacity : (k + 1) * capacity].tobytes(), []).append((i, k))
    seen: Counter = Counter()
    for r in range(rows):
        starts = [*np.flatnonzero(flags[r] & START).tolist(), capacity]
        for a, b in zip(starts, starts[1:]):
            if flags[r, a] & NO_TARGET and tokens[r, a] == bos and (flags[r, a:b] & NO_TARGET).all() and b == capacity:
                if (tokens[r, a:b] == bos).all() and chunks.get(tokens[r, a:b].tobytes()) is None:
                    continue  # padding (pad_id = bos here)
            owners = chunks.get(tokens[r, a:b].tobytes())
            assert owners, f"row {r} columns {a}:{b} are no document chunk"
            seen[owners[0]] += 1
            assert (flags[r, a] & NO_TARGET != 0) == (owners[0][1] > 0 or (a > 0 and prev_non_final)), (r, a)
            i, k = owners[0]
            prev_non_final = (k + 1) * capacity < len(docs[i])
    buffered = Counter((int(k0), int(c)) for k0, c in meta[:, [2, 4]])
    assert seen + buffered == Counter((i, k) for i, d in enumerate(docs[: counters.docs]) for k in range(-(-len(d) // capacity)))
