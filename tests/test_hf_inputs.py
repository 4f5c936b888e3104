"""``batch.hf_inputs(attn_implementation)`` keeps packed documents apart in a real Hugging Face model.

A tiny ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download) runs packed ``PretrainingBatch`` rows (concat
and ``bestfit_split``, whose rows end in padding runs) and padding-free ``FlatBatch`` rows with the arguments
``hf_inputs`` gives; the reference runs every sequence alone, the sequences found from the tokens (a BOS, a row
start, or the padding after a document's last target), not from the batch's offsets. Its loss from the returned
labels equals a cross-entropy computed by hand over those alone-run logits. ``flex_attention``'s ``BlockMask``
allows exactly what the dense mask allows (compiling flex attention in the model takes minutes on a CPU); flash
attention's arguments are checked for shape and values (no GPU here).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import BOS, make_docs, one_torch_thread, small_corpus, small_run, tiny_llama
from tokenizers import Tokenizer

from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.text.collate import FlatteningCollator

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    with one_torch_thread():
        yield


def model_of(attention: str, vocab_size: int) -> Any:
    # use_cache left on: the default a newcomer meets, which hides packing from position_ids.
    return tiny_llama(attention, vocab_size, use_cache=True).eval()


def pieces(input_ids: torch.Tensor, targets: torch.Tensor, bos: int) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of every sequence, found from the tokens: a row start, a BOS, or the first position
    after a document whose last target is missing (the padding run after it)."""
    out = []
    for row in range(len(input_ids)):
        starts, padding = [0], False
        for t in range(1, input_ids.shape[1]):
            if int(input_ids[row, t]) == bos:
                starts.append(t)
                padding = False
            elif not padding and int(targets[row, t - 1]) == IGNORE_INDEX:
                starts.append(t)
                padding = True
        bounds = [*starts, input_ids.shape[1]]
        out += [(row, a, b) for a, b in itertools.pairwise(bounds)]
    return out


def alone_logits(model: Any, input_ids: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each sequence run on its own (positions from 0), its logits put back where it sits in the batch."""
    logits = torch.full((*input_ids.shape, model.config.vocab_size), float("nan"))
    with torch.no_grad():
        for row, start, stop in spans:
            logits[row, start:stop] = model(input_ids=input_ids[row : row + 1, start:stop]).logits[0]
    assert not logits.isnan().any(), "the pieces do not cover the batch"
    return logits


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus(tmp_path_factory.mktemp("hf_inputs"), make_docs(160, seed=3, max_words=10, long_every=40), 20)


def bos_id(corpus: Path) -> int:
    return Tokenizer.from_file(str(corpus / "tokenizer.json")).token_to_id(BOS)


def pretraining_batches(corpus: Path, packing: str, count: int = 8) -> list[Any]:
    dm = small_run(corpus, packing, 4, seq_len=32, global_batch_size=8, microbatch_size=4)
    batches = iter(dm.train_dataloader())
    taken = [next(batches) for _ in range(count)]
    dm.close_loaders()
    return taken


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_a_packed_row_gives_each_document_the_logits_it_has_alone(corpus: Path, packing: str, attention: str) -> None:
    batches = pretraining_batches(corpus, packing)
    model = model_of(attention, vocab_size=int(max(int(b.input_ids.max()) for b in batches)) + 1)
    spans = [pieces(batch.input_ids, batch.targets, bos_id(corpus)) for batch in batches]
    assert sum(len(s) for s in spans) > sum(len(b) for b in batches), "rows of one document each prove nothing"
    if packing == "bestfit_split":
        assert any((batch.targets == IGNORE_INDEX).any() for batch in batches), "no padding run was tested"
    leaks = []
    for batch, spans_of_batch in zip(batches, spans, strict=True):
        expected = alone_logits(model, batch.input_ids, spans_of_batch)
        inputs = batch.hf_inputs(attention)
        with torch.no_grad():
            output = model(**inputs)
            torch.testing.assert_close(output.logits, expected, rtol=1e-4, atol=1e-4)
            # The loss by hand: every target of the microbatch (the row's last one included), none shifted again.
            by_hand = F.cross_entropy(expected.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX)
            torch.testing.assert_close(output.loss, by_hand, rtol=1e-4, atol=1e-4)
            unmasked = model(input_ids=batch.input_ids).logits
            leaks.append(not torch.allclose(unmasked, expected, rtol=1e-4, atol=1e-4))
    assert any(leaks), "the documents would not change each other's logits even if they saw each other"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_flat_row_gives_each_document_its_own_logits_and_loss(attention: str) -> None:
    rng = np.random.default_rng(7)
    samples = [{"input_ids": rng.integers(2, 50, size=int(n))} for n in (5, 17, 1, 9, 30)]
    batch = FlatteningCollator()(samples)
    model = model_of(attention, vocab_size=50)
    bounds = np.cumsum([0] + [len(s["input_ids"]) for s in samples])
    spans = [(0, int(a), int(b)) for a, b in itertools.pairwise(bounds)]
    expected = alone_logits(model, batch.input_ids, spans)
    with torch.no_grad():
        output = model(**batch.hf_inputs(attention))
    torch.testing.assert_close(output.logits, expected, rtol=1e-4, atol=1e-4)
    # By hand: each document's n - 1 next tokens predicted from its own logits, one mean over all of them.
    losses = [
        F.cross_entropy(expected[0, a : b - 1], torch.as_tensor(s["input_ids"][1:]), reduction="sum")
        for (_, a, b), s in zip(spans, samples, strict=True)
    ]
    count = sum(len(s["input_ids"]) - 1 for s in samples)
    torch.testing.assert_close(output.loss, sum(losses) / count, rtol=1e-4, atol=1e-4)


def test_the_flex_block_mask_allows_exactly_the_block_causal_pairs(corpus: Path) -> None:
    batch = pretraining_batches(corpus, "bestfit_split", count=1)[0]
    block_mask = batch.hf_inputs("flex_attention")["attention_mask"]
    rows, length = batch.input_ids.shape
    want = torch.zeros(rows, length, length, dtype=torch.bool)
    for row, start, stop in pieces(batch.input_ids, batch.targets, bos_id(corpus)):
        want[row, start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for row in range(rows):
        got = block_mask.mask_mod(torch.tensor(row), torch.tensor(0), q, k)
        assert torch.equal(got, want[row]), f"row {row}"
    assert tuple(block_mask.shape) == (rows, 1, length, length)


def test_flash_attention_gets_the_varlen_arguments_of_every_sequence(corpus: Path) -> None:
    batch = pretraining_batches(corpus, "bestfit_split", count=1)[0]
    inputs = batch.hf_inputs("flash_attention_2")
    lengths = [stop - start for _, start, stop in pieces(batch.input_ids, batch.targets, bos_id(corpus))]
    want = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    assert torch.equal(inputs["cu_seq_lens_q"], want) and torch.equal(inputs["cu_seq_lens_k"], want)
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(lengths)
    assert "attention_mask" not in inputs and inputs["position_ids"] is batch.position_ids


def test_hf_inputs_refuses_an_unknown_implementation_and_a_context_parallel_slice(corpus: Path) -> None:
    batch = pretraining_batches(corpus, "concat", count=1)[0]
    with pytest.raises(ValueError, match=r"one of eager, sdpa, flex_attention.*got 'flash'"):
        batch.hf_inputs("flash")
    from lightning_d9d.parallel.context_parallel import cp_shard_batch

    flat = FlatteningCollator(context_parallel_size=2)([{"input_ids": np.arange(2, 12)}, {"input_ids": np.arange(3)}])
    flat.hf_inputs("sdpa")  # the whole row is fine
    with pytest.raises(ValueError, match="context-parallel slice"):
        cp_shard_batch(flat, cp_rank=0, cp_size=2).hf_inputs("sdpa")
