"""The loss-spike file and its ``skip_data`` advice cover every chunk of the spike's documents, however far from the
spike ``bestfit_split`` or ``concat`` trains them (a document's tail can wait in the best-fit buffer for dozens of
steps; a long document runs over many steps).

The reference never asks provenance: every word of the corpus is ``doc<i>p<j>``, word ``j`` of document ``i``, so a
trained row's tokens say which documents and which of their tokens it holds; a document's training is the steps that
train a word of it not trained before, up to its last word (its next pass repeats words: not this training). Each
piece's document is read back from its parquet file, row group and row by hand.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support import small_corpus, small_run
from tokenizers import Tokenizer

from lightning_d9d.datamodules.loss_spike import spike_pieces

SPIKE, STEPS = 12, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(3)
    lengths = [rng.choice([rng.randint(2, 20), rng.randint(30, 120)]) for _ in range(150)]
    docs = [" ".join(f"doc{i}p{j}" for j in range(n)) for i, n in enumerate(lengths)]
    return small_corpus(tmp_path_factory.mktemp("spike_advice"), docs, row_group_size=16)


def trained_documents(corpus: Path, packing: str) -> dict[int, tuple[list[int], int]]:
    """For each document the spike's window holds: the steps of its first training that hold a word of it not
    trained before (as an input or the row's last target), and the step its next pass starts it again (its first
    word back as an input), from the rows the loader yields."""
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    word = {i: tuple(map(int, w[3:].split("p"))) for w, i in tokenizer.get_vocab().items() if w.startswith("doc")}
    dm = small_run(corpus, packing, steps=400, seq_len=16, global_batch_size=8)
    batches, seen, steps, again, window = iter(dm.train_dataloader()), collections.defaultdict(set), {}, {}, set()
    for step in range(400):
        held = collections.defaultdict(set)
        for _ in range(dm.microbatches_at(step)):
            batch = next(batches)
            for inputs, targets in zip(batch.input_ids.tolist(), batch.targets.tolist(), strict=True):
                for doc, at in (word[t] for t in inputs + targets[-1:] if t in word):
                    held[doc].add(at)
        for doc, positions in held.items():
            if doc in steps and 0 in positions and 0 in seen[doc]:
                again.setdefault(doc, step)
            elif doc not in again and not positions <= seen[doc]:
                steps.setdefault(doc, []).append(step)
                seen[doc] |= positions
        if SPIKE - STEPS < step <= SPIKE:
            window |= set(held)
        if step > SPIKE and all(doc in again for doc in window):
            break
    dm.close_loaders()
    assert len(window) >= 3 and all(doc in again for doc in window)
    return {doc: (steps[doc], again[doc]) for doc in window}


@pytest.mark.parametrize("packing", ["bestfit_split", "concat"])
def test_spike_file_and_skip_range_hold_every_chunk_of_the_documents(corpus: Path, packing: str) -> None:
    """Every step training a document of the window is named, none of its next pass is (a 1-token tail piece in a
    row's last column is no input and no target: the reference cannot see it, so the named steps may hold more)."""
    want = trained_documents(corpus, packing)
    near = range(SPIKE - 2 * STEPS + 1, SPIKE + STEPS + 1)  # what the search around the spike reads
    assert any(step not in near for steps, _ in want.values() for step in steps), "some chunk lies beyond the window"

    dm = small_run(corpus, packing, steps=400, seq_len=16, global_batch_size=8)
    pieces, (first, stop) = spike_pieces(dm, SPIKE, STEPS)
    assert [(p.step, p.batch_row, p.column) for p in pieces] == sorted((p.step, p.batch_row, p.column) for p in pieces)
    named = collections.defaultdict(set)
    for piece in pieces:
        text = pq.ParquetFile(piece.file).read_row_group(piece.row_group).column("text")[piece.document_row].as_py()
        named[int(text.split()[0][3:].split("p")[0])].add(piece.step)
    assert set(named) == set(want)
    for doc, (steps, again) in want.items():
        assert set(steps) <= named[doc] and max(named[doc]) < again, (doc, steps, again, sorted(named[doc]))
    held = sorted({step for steps in named.values() for step in steps})
    assert (first, stop) == (held[0], held[-1] + 1)
    assert first <= min(s for steps, _ in want.values() for s in steps)
    assert stop > max(s for steps, _ in want.values() for s in steps)
