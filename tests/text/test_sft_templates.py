"""Chat templates rendered without transformers give transformers' own input_ids and assistant masks; formats are
recognised from the columns; bad templates and rows are one clear error naming the row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sft_support import CHATML, CONVERSATIONS, LLAMA_LIKE, hf_tokenizer, write_model_folder
from support import make_texts, train_tokenizer
from tokenizers import Tokenizer, processors

from lightning_d9d.text.chat_template import ChatTemplate, load_chat_template
from lightning_d9d.text.formats import Columns, detect_format, row_messages
from lightning_d9d.text.sft_tokenize import RowTokenizer, SFTRecipe
from lightning_d9d.tokenization.tokenizer import load_tokenizer, tokenizer_digest


def loaded_tokenizer(path: str) -> Any:
    return load_tokenizer(path, tokenizer_digest(path))


transformers = pytest.importorskip("transformers")

# The answer and its end-of-turn token are marked, not the newline the template writes after them (trim_blocks eats
# the first newline after the block's end tag, so the rendered text is unchanged).
LLAMA_LIKE_MARKED = LLAMA_LIKE.replace(
    "{{ message['content'] + eos_token }}\n",
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}\n\n",
)
CHATML_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
LLAMA_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_models")
    return {
        "chatml": write_model_folder(root / "chatml", CHATML, **CHATML_SPECIAL),
        "llama": write_model_folder(root / "llama", LLAMA_LIKE, **LLAMA_SPECIAL),
        "llama_marked": write_model_folder(root / "llama_marked", LLAMA_LIKE_MARKED, **LLAMA_SPECIAL),
    }


def row_tokenizer(tokenizer_path: Path, loss_on: str = "assistant", chat_template: str | None = None) -> RowTokenizer:
    template = load_chat_template(chat_template, str(tokenizer_path))
    recipe = SFTRecipe("messages", loss_on, "error", 10_000, Columns(), template, None)
    return RowTokenizer(recipe, loaded_tokenizer(str(tokenizer_path)))


def hf_encode(tokenizer_path: Path, template: str, special: dict[str, str], messages: list) -> dict[str, Any]:
    hf = hf_tokenizer(tokenizer_path, template, **special)
    return hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)


@pytest.mark.parametrize(
    ("name", "template", "special"),
    [("chatml", CHATML, CHATML_SPECIAL), ("llama_marked", LLAMA_LIKE_MARKED, LLAMA_SPECIAL)],
)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_and_assistant_mask_equal_transformers(
    folders: dict, name: str, template: str, special: dict, conversation
):
    messages = CONVERSATIONS[conversation]
    expected = hf_encode(folders[name], template, special, messages)
    ids, labels, _ = row_tokenizer(folders[name])({"messages": messages}, 0)
    assert ids.tolist() == list(expected["input_ids"])
    assert (labels != -100).astype(int).tolist() == list(expected["assistant_masks"])
    assert sum(expected["assistant_masks"]) > 0
    # Labels are the ids where trained, -100 elsewhere (unshifted).
    assert np.array_equal(labels[labels != -100], ids[labels != -100])


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_a_template_without_generation_blocks_is_masked_turn_by_turn(folders: dict, conversation: int) -> None:
    messages = CONVERSATIONS[conversation]
    ids, labels, _ = row_tokenizer(folders["llama"])({"messages": messages}, 0)
    plain = hf_encode(folders["llama"], LLAMA_LIKE, LLAMA_SPECIAL, messages)
    assert ids.tolist() == list(plain["input_ids"])
    assert sum(plain["assistant_masks"]) == 0  # transformers cannot mask this template
    # The same template with generation blocks around each assistant turn (its EOS included) gives our mask.
    marked = hf_encode(folders["llama"], LLAMA_LIKE_MARKED, LLAMA_SPECIAL, messages)
    assert list(marked["input_ids"]) == ids.tolist()
    assert (labels != -100).astype(int).tolist() == list(marked["assistant_masks"])
    eos = loaded_tokenizer(str(folders["llama"])).token_to_id("</s>")
    assert all(labels[ids == eos] == eos)  # every end-of-turn token is trained


def test_last_assistant_trains_only_the_last_turn(folders: dict) -> None:
    messages = CONVERSATIONS[1]
    _, every, _ = row_tokenizer(folders["chatml"])({"messages": messages}, 0)
    ids, last, _ = row_tokenizer(folders["chatml"], "last_assistant")({"messages": messages}, 0)
    trained = np.flatnonzero(last != -100)
    assert 0 < len(trained) < (every != -100).sum()
    assert set(trained) <= set(np.flatnonzero(every != -100))
    assert trained.max() == np.flatnonzero(every != -100).max()  # the last turn's tokens
    tokenizer = loaded_tokenizer(str(folders["chatml"]))
    assert tokenizer.decode(ids[trained].tolist(), skip_special_tokens=False) == "An immutable one.<|im_end|>"
    _, all_labels, _ = row_tokenizer(folders["chatml"], "all")({"messages": messages}, 0)
    assert np.array_equal(all_labels, ids)


CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""ChatML as most models ship it: no generation blocks, so the turns are found turn by turn."""


@pytest.mark.parametrize("template", [CHATML_PLAIN, CHATML], ids=["turn_by_turn", "generation_blocks"])
def test_chatml_trains_each_answer_and_its_im_end_not_the_newline_after_it(template: str) -> None:
    """docs/finetuning.md: the newline ChatML writes after <|im_end|> is never generated, so it is not trained.

    The tokenizer: support's byte-level BPE (trained here on the test text; its post-processor appends <eos>) with
    <|im_start|> and <|im_end|> added as special tokens, as a model's tokenizer knows them.
    """
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "waa wab wac"},
        {"role": "assistant", "content": "wad wae"},
        {"role": "user", "content": "waf"},
        {"role": "assistant", "content": "wag wah wba"},
    ]
    tokenizer = train_tokenizer(make_texts(200) + [m["content"] for m in messages], kind="bpe")
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    im_end, newline = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("Ċ")  # byte-level "\n"
    assert im_end is not None and newline is not None and tokenizer.encode("\n").ids[0] == newline
    chat_template = ChatTemplate(template, (("eos_token", "<|im_end|>"),))
    for loss_on, answers in (("assistant", messages[2::2]), ("last_assistant", messages[4:])):
        recipe = SFTRecipe("messages", loss_on, "error", 10_000, Columns(), chat_template, None)
        ids, labels, _ = RowTokenizer(recipe, tokenizer)({"messages": messages}, 0)
        # The truth, independent of the masking code: each answer's own tokens, then <|im_end|>.
        expected = [i for m in answers for i in [*tokenizer.encode(m["content"], add_special_tokens=False).ids, im_end]]
        assert ids[labels != -100].tolist() == expected
        assert np.array_equal(labels[labels != -100], ids[labels != -100])
        ends = np.flatnonzero(ids == im_end)
        assert len(ends) == len(messages) and ids[-1] == newline  # every turn, the last too, ends "<|im_end|>\n"
        assert ids[ends + 1].tolist() == [newline] * len(messages) and (labels[ends + 1] == -100).all()
    # A completion given as messages: the same answer and <|im_end|>, not the newline after it.
    recipe = SFTRecipe("prompt_completion", "completion", "error", 10_000, Columns(), chat_template, None)
    ids, labels, _ = RowTokenizer(recipe, tokenizer)({"prompt": messages[:-1], "completion": messages[-1:]}, 0)
    assert ids[labels != -100].tolist() == [*tokenizer.encode("wag wah wba", add_special_tokens=False).ids, im_end]
    assert ids[-1] == newline and labels[-1] == -100


def test_at_most_one_bos_even_when_the_tokenizer_adds_one(tmp_path: Path, folders: dict) -> None:
    # A tokenizer whose post-processor prepends <s>, like Llama's: rendering writes bos_token, so encoding the
    # rendered text with special tokens would make two.
    folder = tmp_path / "bos"
    folder.mkdir()
    tokenizer = Tokenizer.from_file(str(folders["llama"]))
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA_LIKE, **LLAMA_SPECIAL}))
    assert tokenizer.encode("hi").ids[0] == bos  # the tokenizer itself adds one
    for messages in CONVERSATIONS:
        ids, _, _ = row_tokenizer(folder / "tokenizer.json")({"messages": messages}, 0)
        assert ids[0] == bos and (ids == bos).sum() == 1
        expected = hf_encode(folder / "tokenizer.json", LLAMA_LIKE, LLAMA_SPECIAL, messages)
        assert ids.tolist() == list(expected["input_ids"])


def test_templates_are_found_where_model_folders_keep_them(tmp_path: Path, folders: dict) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(folders["chatml"]).read_bytes())
    assert load_chat_template(None, str(folder / "tokenizer.json")) is None
    config = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]}
    config["eos_token"] = {"content": "<|im_end|>", "lstrip": False}  # an AddedToken as saved by transformers
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    found = load_chat_template(None, str(folder / "tokenizer.json"))
    assert found.source == CHATML and found.special("eos_token") == "<|im_end|>"
    (folder / "chat_template.jinja").write_text(LLAMA_LIKE)  # preferred over the config's, as transformers does
    assert load_chat_template(None, str(folder / "tokenizer.json")).source == LLAMA_LIKE
    (tmp_path / "other.jinja").write_text(CHATML)
    assert load_chat_template(str(tmp_path / "other.jinja"), str(folder / "tokenizer.json")).source == CHATML
    assert load_chat_template("{{ messages }}", str(folder / "tokenizer.json")).source == "{{ messages }}"
    with pytest.raises(FileNotFoundError, match="missing.jinja"):
        load_chat_template(str(tmp_path / "missing.jinja"), str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match="cannot parse the chat template"):
        load_chat_template("{% for m in messages %}", str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "y"}]}))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="without a 'default'"):
        load_chat_template(None, str(folder / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------------- bad input
def test_a_template_that_raises_names_the_row(folders: dict) -> None:
    messages = [{"role": "critic", "content": "meh"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match=r"row 7: the chat template raised: unknown role critic"):
        row_tokenizer(folders["chatml"])({"messages": messages}, 7)


def test_a_role_the_template_skips_names_the_row(folders: dict) -> None:
    messages = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "the answer"}]
    with pytest.raises(ValueError, match=r"row 3: message 0 \(role 'tool'\) does not appear"):
        row_tokenizer(folders["llama"])({"messages": messages}, 3)


def test_a_conversation_without_an_assistant_turn_names_the_row(folders: dict) -> None:
    with pytest.raises(ValueError, match="row 5 has no assistant turn"):
        row_tokenizer(folders["chatml"])({"messages": [{"role": "user", "content": "hello"}]}, 5)
    ids, labels, _ = row_tokenizer(folders["chatml"], "all")({"messages": [{"role": "user", "content": "hello"}]}, 5)
    assert np.array_equal(ids, labels)  # loss_on="all" trains it


def test_a_template_that_is_not_prefix_preserving_is_refused(folders: dict) -> None:
    # Like templates that rewrite earlier turns (Qwen3 drops earlier reasoning): the last turn renders differently.
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' }}"
        "{% if loop.last %}{{ m['content'] + ' [end]' }}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    messages = CONVERSATIONS[1]
    with pytest.raises(ValueError, match="row 2: the chat template is not prefix-preserving at message 2"):
        row_tokenizer(folders["chatml"], chat_template=template)({"messages": messages}, 2)


def test_a_turn_edge_inside_a_token_is_refused(folders: dict) -> None:
    # The turn before the answer ends with a space, which byte-level BPE merges into the answer's first word: the
    # tokens of the prefix are not a prefix of the conversation's tokens.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + '\\n' }}"
        "{% else %}{{ 'Q: ' + m['content'] + '\\nA: ' }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "what is a list"}, {"role": "assistant", "content": "mutable sequence"}]
    with pytest.raises(ValueError, match="row 4: a trained span's edge"):
        row_tokenizer(folders["chatml"], chat_template=template)({"messages": messages}, 4)


def test_formats_are_detected_from_the_columns() -> None:
    columns = Columns()
    assert detect_format(["messages", "id"], columns) == "messages"
    assert detect_format(["conversations"], columns) == "messages"
    assert detect_format(["prompt", "completion", "text"], columns) == "prompt_completion"
    assert detect_format(["text", "meta"], columns) == "text"
    assert detect_format(["q", "a"], Columns(prompt="q", completion="a")) == "prompt_completion"
    with pytest.raises(ValueError, match=r"'text' is not a column .* cannot be told; its columns are \['body'\]"):
        detect_format(["body"], columns)
    with pytest.raises(ValueError, match=r"format 'messages' needs column\(s\) \['messages'\]"):
        detect_format(["text"], columns, "messages")
    with pytest.raises(ValueError, match="format must be one of"):
        detect_format(["text"], columns, "alpaca")


def test_sharegpt_turns_are_mapped_and_bad_messages_name_the_row() -> None:
    sharegpt = [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert row_messages(sharegpt, 0, "conversations") == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    # datasets fills a struct's missing fields with None; they are dropped, not shown to the template.
    assert row_messages([{"role": "user", "content": "q", "name": None}], 0, "messages") == [
        {"role": "user", "content": "q"}
    ]
    with pytest.raises(ValueError, match="row 9: message 0 has ShareGPT speaker 'bot'"):
        row_messages([{"from": "bot", "value": "x"}], 9, "conversations")
    with pytest.raises(ValueError, match="row 2: message 1 of 'messages' needs 'role' and 'content'"):
        row_messages([{"role": "user", "content": "q"}, {"text": "x"}], 2, "messages")
    with pytest.raises(ValueError, match="row 1: column 'messages' must hold a list of messages, got str"):
        row_messages("hello", 1, "messages")
