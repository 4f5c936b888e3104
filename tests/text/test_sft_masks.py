"""Loss masks of prompt/completion rows, and truncation that never lies: counted drops and cuts, no sample left
with nothing to train, a clear error under truncation="error"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sft_support import CHATML, CONVERSATIONS, train_chat_tokenizer
from support import train_tokenizer
from tokenizers import Tokenizer

from lightning_d9d.text.chat_template import ChatTemplate
from lightning_d9d.text.formats import Columns, resolve_loss_on
from lightning_d9d.text.masks import (
    DROPPED_TOO_LONG,
    DROPPED_UNTRAINED,
    KEPT,
    TRUNCATED,
    span_mask,
    trained_targets,
    truncate,
)
from lightning_d9d.text.sft_tokenize import RowTokenizer, SFTRecipe, default_eos_token

CHATML_TEMPLATE = ChatTemplate(CHATML, (("eos_token", "<|im_end|>"),))


@pytest.fixture(scope="module")
def chat_tokenizer() -> Tokenizer:
    return train_chat_tokenizer()


def rows(tokenizer: Tokenizer, format: str, loss_on: str, truncation: str = "error", max_length: int = 10_000):
    eos = default_eos_token(tokenizer, CHATML_TEMPLATE if format == "messages" else None)
    recipe = SFTRecipe(format, loss_on, truncation, max_length, Columns(), CHATML_TEMPLATE, eos)  # type: ignore[arg-type]
    return RowTokenizer(recipe, tokenizer)


def test_span_mask_marks_every_token_overlapping_a_span() -> None:
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (0, 0)]
    assert span_mask(offsets, [(3, 6)]).tolist() == [False, True, True, False, False]
    assert span_mask(offsets, [(0, 1), (6, 7)]).tolist() == [True, False, False, True, False]
    assert span_mask(offsets, [(4, 4)]).tolist() == [False] * 5  # an empty span trains nothing


def test_plain_prompt_completion_trains_the_completion_and_an_eos(chat_tokenizer: Tokenizer) -> None:
    # A tokenizer without a post-processor: the EOS (</s>, a usual one of its vocabulary) is appended and trained.
    row = {"prompt": "What is a list? ", "completion": "A mutable sequence."}
    ids, labels, status = rows(chat_tokenizer, "prompt_completion", "completion")(row, 0)
    eos = chat_tokenizer.token_to_id("</s>")
    assert status == KEPT and ids[-1] == eos and (ids == eos).sum() == 1
    trained = ids[labels != -100]
    assert chat_tokenizer.decode(trained.tolist(), skip_special_tokens=False) == "A mutable sequence.</s>"
    prompt_ids = chat_tokenizer.encode(row["prompt"]).ids
    assert ids[: len(prompt_ids)].tolist() == prompt_ids and (labels[: len(prompt_ids)] == -100).all()
    _, every, _ = rows(chat_tokenizer, "prompt_completion", "all")(row, 0)
    assert np.array_equal(every, ids)


def test_an_eos_the_post_processor_appends_is_trained_not_doubled(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(["some words to learn " * 5, "more text here"], tmp_path / "t.json", kind="bpe")
    eos = tokenizer.token_to_id("<eos>")
    assert tokenizer.encode("a").ids[-1] == eos  # its post-processor ends every text with <eos>
    ids, labels, _ = rows(tokenizer, "prompt_completion", "completion")({"prompt": "some ", "completion": "words"}, 0)
    assert (ids == eos).sum() == 1 and ids[-1] == eos and labels[-1] == eos
    assert tokenizer.decode(ids[labels != -100].tolist(), skip_special_tokens=False).endswith("<eos>")


def test_conversational_prompt_completion_trains_what_the_completion_adds(chat_tokenizer: Tokenizer) -> None:
    conversation = CONVERSATIONS[1]
    row = {"prompt": conversation[:-1], "completion": conversation[-1:]}
    ids, labels, _ = rows(chat_tokenizer, "prompt_completion", "completion")(row, 0)
    trained = chat_tokenizer.decode(ids[labels != -100].tolist(), skip_special_tokens=False)
    # The answer and its end-of-turn token, not the newline written after it (as the template's generation block).
    assert trained == "An immutable one.<|im_end|>"
    whole, _, _ = rows(chat_tokenizer, "messages", "all")({"messages": conversation}, 0)
    assert np.array_equal(ids, whole)
    with pytest.raises(ValueError, match="row 6: prompt and completion must both be strings or both be lists"):
        rows(chat_tokenizer, "prompt_completion", "completion")({"prompt": "q", "completion": conversation[-1:]}, 6)


@pytest.mark.parametrize("truncation", ["drop", "keep_start", "error"])
def test_truncation_rules(truncation: str) -> None:
    ids = np.arange(10, 20)
    labels = np.where(np.arange(10) >= 6, ids, -100)  # the last four tokens are trained
    if truncation == "error":
        with pytest.raises(ValueError, match="row 12 has 10 tokens, more than max_length=8"):
            truncate(ids, labels, 8, truncation, 12)
        return
    kept_ids, kept_labels, status = truncate(ids, labels, 8, truncation, 12)  # type: ignore[arg-type]
    if truncation == "drop":
        assert status == DROPPED_TOO_LONG and len(kept_ids) == 0
    else:
        assert status == TRUNCATED and kept_ids.tolist() == list(range(10, 18))
        assert trained_targets(kept_labels) == 2
    # Cut before anything trained: dropped (never a sample with zero targets), under every rule that cuts.
    _, _, status = truncate(ids, labels, 6, truncation, 12)  # type: ignore[arg-type]
    assert status == (DROPPED_TOO_LONG if truncation == "drop" else DROPPED_UNTRAINED)
    # Short enough: kept whole.
    assert truncate(ids, labels, 10, truncation, 12)[2] == KEPT  # type: ignore[arg-type]


def test_truncated_conversations_through_the_row_tokenizer(chat_tokenizer: Tokenizer) -> None:
    conversation = {"messages": CONVERSATIONS[1]}
    full, labels, _ = rows(chat_tokenizer, "messages", "assistant")(conversation, 0)
    first_trained = int(np.flatnonzero(labels != -100)[0])
    ids, cut, status = rows(chat_tokenizer, "messages", "assistant", "keep_start", first_trained + 3)(conversation, 0)
    assert status == TRUNCATED and np.array_equal(ids, full[: first_trained + 3])
    assert trained_targets(cut) == 3
    _, _, status = rows(chat_tokenizer, "messages", "assistant", "keep_start", first_trained)(conversation, 0)
    assert status == DROPPED_UNTRAINED
    with pytest.raises(ValueError, match=f"row 3 has {len(full)} tokens"):
        rows(chat_tokenizer, "messages", "assistant", "error", len(full) - 1)(conversation, 3)


def test_loss_on_must_suit_the_format() -> None:
    assert resolve_loss_on("messages", None) == "assistant"
    assert resolve_loss_on("prompt_completion", None) == "completion"
    assert resolve_loss_on("text", None) == "all"
    with pytest.raises(ValueError, match=r"loss_on='assistant' does not apply to 'prompt_completion' data"):
        resolve_loss_on("prompt_completion", "assistant")
    with pytest.raises(ValueError, match=r"loss_on='completion' does not apply to 'messages'"):
        resolve_loss_on("messages", "completion")


def test_a_row_without_the_columns_names_it(chat_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="row 4 has no value in column 'completion'"):
        rows(chat_tokenizer, "prompt_completion", "completion")({"prompt": "q", "completion": None}, 4)
    with pytest.raises(ValueError, match="row 2: column 'prompt' must hold a string or a list of messages, got int"):
        rows(chat_tokenizer, "prompt_completion", "completion")({"prompt": 3, "completion": "a"}, 2)
