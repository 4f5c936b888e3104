"""Chat templates of real model families (as they ship in their tokenizer_config.json: Llama 3.1, Qwen2.5, Qwen3,
Mistral/Mixtral, Llama 2, Gemma, Phi-3, Zephyr, a SmolLM3-style one with generation blocks), on tokenizers built the
way those families build theirs (byte-level BPE with added special tokens, Phi-3's whitespace-stripping ones;
SentencePiece-like Metaspace), checked row by row and through ``TextDataModule`` against transformers'
``apply_chat_template`` and against a mask computed independently from the rendered text: exactly the assistant
content and its end-of-turn token are trained."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import make_texts
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lightning_d9d.text.chat_template import load_chat_template
from lightning_d9d.text.formats import Columns
from lightning_d9d.text.sft_tokenize import RowTokenizer, SFTRecipe
from lightning_d9d.tokenization.tokenizer import load_tokenizer, tokenizer_digest


def loaded_tokenizer(path: str) -> Any:
    return load_tokenizer(path, tokenizer_digest(path))


transformers = pytest.importorskip("transformers")

# ------------------------------------------------------------------------------------------------ templates
LLAMA3 = (
    "{{- bos_token }}\n"
    '{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n{%- endif %}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
"""Llama 3.1 Instruct (without tools): BOS, a system header always written, ``| trim``, ``<|eot_id|>``."""

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
"""Qwen2.5 Instruct (without tools): ChatML with a default system prompt, a newline after each ``<|im_end|>``."""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
"""Mistral-7B-Instruct-v0.1 / Mixtral-8x7B-Instruct: ``[INST]`` as text, raises on roles that do not alternate."""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
"""Llama-2-chat: a BOS before every user turn (so one per exchange, as Meta trained it), ``' ' + answer + ' </s>'``."""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
"""Gemma: no system role, ``assistant`` written as ``model``, ``<end_of_turn>`` then a newline."""

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
"""Phi-3-mini-instruct: ``<|end|>`` ends a turn; a finished conversation (no generation prompt) ends in EOS."""

ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)
"""Zephyr: headers as plain text, every turn ends in ``</s>``; trim_blocks/lstrip_blocks decide the newlines."""

SMOL_MARKED = (
    "{%- for message in messages %}\n"
    "{%- if message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- generation %}\n"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}\n"
    "{{- message.content | trim + '<|im_end|>' }}\n"
    "{%- endgeneration %}\n"
    "{{- '\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
"""A SmolLM3/Qwen3-style training template: ``{% generation %}`` around the answer (an empty think block on the last
one, as Qwen3 writes it) and ``<|im_end|>``, not the newline after it."""


QWEN3 = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        {{- '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
"""Qwen3 (without tools): the answers after the last user turn get a think block, earlier ones lose theirs — so the
render of a conversation cut after an earlier answer is not a prefix of the whole (that answer was the last)."""

QWEN3_MARKED = QWEN3.replace(
    "{{- '<|im_start|>' + message.role + '\\n' }}\n",
    "{{- '<|im_start|>' + message.role + '\\n' }}\n{%- generation %}\n",
).replace("{{- '<|im_end|>' }}\n", "{{- '<|im_end|>' }}\n{%- endgeneration %}\n")
"""Qwen3 with {% generation %} around each answer (its think block included) and <|im_end|>, as TRL trains it."""


# ------------------------------------------------------------------------------------------------ model folders
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable one."},
    ],
    [
        {"role": "user", "content": "Ünïcode ✓ and tabs\there"},
        {"role": "assistant", "content": "naïve café — fine 日本語"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "and once more"},
        {"role": "assistant", "content": " spaced out \n"},
    ],
]


def family(conversation: list[dict[str, str]], name: str) -> list[dict[str, str]]:
    """The conversation as the family accepts it (no system role for Gemma/Mistral: merged into the first user turn)."""
    if name in ("gemma", "mistral") and conversation[0]["role"] == "system":
        first = dict(conversation[1], content=conversation[0]["content"] + "\n\n" + conversation[1]["content"])
        return [first, *conversation[2:]]
    return conversation


def build_tokenizer(kind: str, specials: list[str], bos: str | None = None, rstrip: tuple[str, ...] = ()) -> Tokenizer:
    """A BPE trained on the test texts the way the family builds its tokenizer, with its special tokens added.

    ``byte_level``: GPT-2/Llama-3/Qwen byte-level BPE. ``metaspace``: SentencePiece-like (``▁`` for spaces, one
    prepended to the text), as Mistral's and Gemma's; ``metaspace_always``: a ``▁`` prepended to every piece
    between special tokens, as legacy Llama-2 tokenizers do. ``bos``: a post-processor that prepends it, as Llama's
    tokenizers do (a rendered template writes its own, so it must not be added twice). ``rstrip``: added tokens that
    swallow the whitespace after them, as Phi-3's chat tokens do.
    """
    texts = [text for text in make_texts(300, seed=5) if text]
    texts += [message["content"] for chat in CONVERSATIONS for message in chat] + ["[INST] [/INST] <<SYS>>"]
    if kind == "byte_level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        scheme = "always" if kind == "metaspace_always" else "first"
        tokenizer = Tokenizer(models.BPE(byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
        alphabet = sorted({char for text in texts for char in text})
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, rstrip=token in rstrip, normalized=False) for token in specials])
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer


# name: (template, tokenizer kind, special tokens of tokenizer_config.json, end-of-turn string, added specials)
FAMILIES: dict[str, tuple[str, str, dict[str, str], str, list[str]]] = {
    "llama3": (
        LLAMA3,
        "byte_level",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
    "qwen25": (
        QWEN25,
        "byte_level",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    ),
    "mistral": (MISTRAL, "metaspace", {"bos_token": "<s>", "eos_token": "</s>"}, "</s>", ["<unk>", "<s>", "</s>"]),
    "llama2": (
        LLAMA2,
        "metaspace_always",
        {"bos_token": "<s>", "eos_token": "</s>"},
        "</s>",
        ["<unk>", "<s>", "</s>"],
    ),
    "gemma": (
        GEMMA,
        "metaspace",
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        "<end_of_turn>",
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
    ),
    "phi3": (
        PHI3,
        "byte_level",
        {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
        "<|end|>",
        ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    ),
    "phi3_plain": (
        PHI3,
        "byte_level",
        {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
        "<|end|>",
        ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    ),
    "zephyr": (ZEPHYR, "byte_level", {"bos_token": "<s>", "eos_token": "</s>"}, "</s>", ["<unk>", "<s>", "</s>"]),
    "qwen3": (
        QWEN3,
        "byte_level",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    ),
    "qwen3_marked": (
        QWEN3_MARKED,
        "byte_level",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    ),
    "smol_marked": (
        SMOL_MARKED,
        "byte_level",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    ),
}
ASSISTANT_HEADERS = {
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen25": "<|im_start|>assistant\n",
    "mistral": "[/INST]",
    "llama2": "[/INST]",
    "gemma": "<start_of_turn>model\n",
    "phi3": "<|assistant|>\n",
    "phi3_plain": "<|assistant|>\n",
    "zephyr": "<|assistant|>\n",
}
"""What each family writes before an assistant's content (the truth's anchor for empty answers)."""
PHI3_CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
"""Phi-3's tokenizer strips the whitespace after these (``rstrip``): ``<|assistant|>\n`` is one token."""
POST_PROCESSOR_BOS = {"llama3": "<|begin_of_text|>", "llama2": "<s>", "mistral": "<s>", "gemma": "<bos>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real_templates")
    made = {}
    for name, (template, kind, special, _, added) in FAMILIES.items():
        folder = root / name
        folder.mkdir()
        rstrip = PHI3_CHAT_TOKENS if name == "phi3" else ()
        build_tokenizer(kind, added, POST_PROCESSOR_BOS.get(name), rstrip).save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **special}))
        made[name] = folder / "tokenizer.json"
    return made


def row_tokenizer(path: Path, loss_on: str = "assistant", max_length: int = 10_000, truncation="error", fmt="messages"):
    template = load_chat_template(None, str(path))
    recipe = SFTRecipe(fmt, loss_on, truncation, max_length, Columns(), template, None)
    return RowTokenizer(recipe, loaded_tokenizer(str(path)))


def hf_encode(name: str, path: Path, messages: list, **kwargs: Any) -> dict[str, Any]:
    template, _, special, _, _ = FAMILIES[name]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **special)
    hf.chat_template = template
    return hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )


def rendered_text(name: str, path: Path, messages: list, **kwargs: Any) -> str:
    template, _, special, _, _ = FAMILIES[name]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **special)
    return hf.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)


def content_and_end_of_turn_mask(name: str, path: Path, messages: list, offsets: list) -> np.ndarray:
    """The independent truth: tokens overlapping each assistant message's (trimmed) content and the end-of-turn
    string that follows it, found by searching the rendered text left to right."""
    text, end_of_turn = rendered_text(name, path, messages), FAMILIES[name][3]
    spans, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        if message["role"] == "assistant":
            cursor = text.index(ASSISTANT_HEADERS[name], cursor) + len(ASSISTANT_HEADERS[name])
        found = text.index(content, cursor)
        if message["role"] == "assistant":
            end = text.index(end_of_turn, found + len(content)) + len(end_of_turn)
            assert text[found + len(content) : end - len(end_of_turn)].strip() == ""  # only spaces between
            spans.append((found, end))
        cursor = found + len(content)
    mask = np.zeros(len(offsets), dtype=bool)
    for token, (start, stop) in enumerate(offsets):
        mask[token] = any(stop > a and start < b for a, b in spans)
    return mask


def encode_rendered(path: Path, text: str) -> Any:
    return loaded_tokenizer(str(path)).encode(text, add_special_tokens=False)


UNMARKED = ["llama3", "qwen25", "mistral", "llama2", "gemma", "phi3", "phi3_plain", "zephyr"]


# ------------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("name", UNMARKED)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_and_exactly_content_and_end_of_turn_are_trained(folders, name, conversation) -> None:
    path, messages = folders[name], family(CONVERSATIONS[conversation], name)
    expected = hf_encode(name, path, messages)
    ids, labels, _ = row_tokenizer(path)({"messages": messages}, conversation)
    assert ids.tolist() == list(expected["input_ids"])
    encoding = encode_rendered(path, rendered_text(name, path, messages))
    truth = content_and_end_of_turn_mask(name, path, messages, encoding.offsets)
    mask = labels != -100
    if name.startswith("phi3"):
        # A finished Phi-3 conversation ends in "\n<|endoftext|>" after the last <|end|>: written after the last
        # turn, it is trained with it (the model learns to close the conversation).
        closing = 2 if name == "phi3_plain" else 1  # the rstrip <|end|> holds the newline
        assert encoding.tokens[-closing:] == ["Ċ", "<|endoftext|>"][-closing:] and mask[-closing:].all()
        mask = mask.copy()
        mask[-closing:] = False
    assert mask.tolist() == truth.tolist()
    assert np.array_equal(labels[mask], ids[mask])
    bos = FAMILIES[name][2].get("bos_token")
    bos_id = loaded_tokenizer(str(path)).token_to_id(bos) if bos else None
    if name in POST_PROCESSOR_BOS:  # the template writes the BOS; the tokenizer's own is not added on top
        user_turns = sum(message["role"] == "user" for message in messages)
        assert (ids == bos_id).sum() == (user_turns if name == "llama2" else 1) and ids[0] == bos_id
    elif bos_id is not None:
        assert (ids == bos_id).sum() == 0


@pytest.mark.parametrize("name", UNMARKED)
def test_last_assistant_trains_the_last_turn_only(folders: dict, name: str) -> None:
    path, messages = folders[name], family(CONVERSATIONS[1], name)
    ids, every, _ = row_tokenizer(path)({"messages": messages}, 0)
    last_ids, last, _ = row_tokenizer(path, "last_assistant")({"messages": messages}, 0)
    assert np.array_equal(ids, last_ids)
    trained, all_trained = np.flatnonzero(last != -100), np.flatnonzero(every != -100)
    assert 0 < len(trained) < len(all_trained) and set(trained) <= set(all_trained)
    # The last turn's tokens form the tail of the assistant mask: every trained token after the previous turn.
    gaps = np.flatnonzero(np.diff(all_trained) > 1)
    assert trained.tolist() == all_trained[gaps[-1] + 1 :].tolist()
    text = loaded_tokenizer(str(path)).decode(ids[trained].tolist(), skip_special_tokens=True)
    assert text.strip() == "An immutable one."


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_a_template_with_generation_blocks_gives_transformers_mask(folders: dict, conversation: int) -> None:
    path, messages = folders["smol_marked"], CONVERSATIONS[conversation]
    expected = hf_encode("smol_marked", path, messages)
    ids, labels, _ = row_tokenizer(path)({"messages": messages}, 0)
    assert ids.tolist() == list(expected["input_ids"])
    assert (labels != -100).astype(int).tolist() == list(expected["assistant_masks"])
    _, last, _ = row_tokenizer(path, "last_assistant")({"messages": messages}, 0)
    hf_mask = np.asarray(expected["assistant_masks"], dtype=bool)
    runs = np.flatnonzero(hf_mask)
    tail = runs[np.flatnonzero(np.diff(runs) > 1)[-1] + 1 :] if (np.diff(runs) > 1).any() else runs
    assert np.flatnonzero(last != -100).tolist() == tail.tolist()


def test_prompt_completion_messages_train_the_answer_and_its_end_of_turn(folders: dict) -> None:
    path = folders["qwen25"]
    prompt, completion = CONVERSATIONS[1][:4], CONVERSATIONS[1][4:]
    ids, labels, _ = row_tokenizer(path, "completion", fmt="prompt_completion")(
        {"prompt": prompt, "completion": completion}, 0
    )
    expected = hf_encode("qwen25", path, prompt + completion)
    assert ids.tolist() == list(expected["input_ids"])
    tokenizer = loaded_tokenizer(str(path))
    assert tokenizer.decode(ids[labels != -100].tolist(), skip_special_tokens=False) == "An immutable one.<|im_end|>"


# ------------------------------------------------------------------------------------------------ truncation
def long_conversation(turn_words: int = 60) -> list[dict[str, str]]:
    words = " ".join(make_texts(40, seed=9)).split()
    return [
        {"role": "user", "content": "summarise"},
        {"role": "assistant", "content": " ".join(words[:turn_words])},
        {"role": "user", "content": " ".join(words[turn_words : 2 * turn_words])},
        {"role": "assistant", "content": " ".join(words[2 * turn_words : 3 * turn_words])},
    ]


@pytest.mark.parametrize("name", ["llama3", "gemma"])
def test_truncation_modes_on_a_long_conversation(folders: dict, name: str) -> None:
    path, messages = folders[name], long_conversation()
    full_ids, full_labels, status = row_tokenizer(path)({"messages": messages}, 0)
    assert status == 0 and len(full_ids) > 120
    limit = len(full_ids) - 30  # cuts into the last assistant turn
    with pytest.raises(ValueError, match=rf"row 4 has {len(full_ids)} tokens, more than max_length={limit}"):
        row_tokenizer(path, max_length=limit)({"messages": messages}, 4)
    ids, labels, status = row_tokenizer(path, max_length=limit, truncation="drop")({"messages": messages}, 4)
    assert (len(ids), len(labels), status) == (0, 0, 2)
    ids, labels, status = row_tokenizer(path, max_length=limit, truncation="keep_start")({"messages": messages}, 4)
    assert status == 1 and ids.tolist() == full_ids[:limit].tolist() and labels.tolist() == full_labels[:limit].tolist()
    # Under last_assistant, a cut before the last answer leaves nothing to train: dropped, never emitted empty.
    start = int(np.flatnonzero(row_tokenizer(path, "last_assistant")({"messages": messages}, 0)[1] != -100)[0])
    ids, labels, status = row_tokenizer(path, "last_assistant", max_length=start, truncation="keep_start")(
        {"messages": messages}, 4
    )
    assert (len(ids), status) == (0, 3)


# ------------------------------------------------------------------------------------------------ bad rows
def test_bad_rows_of_real_templates_are_one_clear_error_naming_the_row(folders: dict) -> None:
    swapped = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match="row 3: the chat template raised: Conversation roles must alternate"):
        row_tokenizer(folders["mistral"])({"messages": swapped}, 3)
    system = [{"role": "system", "content": "s"}, *CONVERSATIONS[0]]
    with pytest.raises(ValueError, match="row 5: the chat template raised: System role not supported"):
        row_tokenizer(folders["gemma"])({"messages": system}, 5)
    critic = [{"role": "critic", "content": "meh"}, *CONVERSATIONS[0]]
    with pytest.raises(ValueError, match=r"row 6: message 0 \(role 'critic'\) does not appear"):
        row_tokenizer(folders["qwen25"])({"messages": critic}, 6)
    with pytest.raises(ValueError, match="row 7 has no assistant turn"):
        row_tokenizer(folders["llama3"])({"messages": CONVERSATIONS[0][:1]}, 7)
    with pytest.raises(ValueError, match="row 8 has no value in column 'messages'"):
        row_tokenizer(folders["llama3"])({"text": "x"}, 8)
    with pytest.raises(ValueError, match="row 9 has no value in column 'completion'"):
        row_tokenizer(folders["llama3"], "completion", fmt="prompt_completion")({"prompt": "x"}, 9)


# ------------------------------------------------------------------------------------------------ public API
def many_conversations(count: int) -> list[list[dict[str, str]]]:
    words = " ".join(make_texts(count * 2, seed=11)).split()
    rng = np.random.default_rng(4)
    conversations = []
    for number in range(count):
        messages = [{"role": "system", "content": "Answer in one line."}] if number % 3 == 0 else []
        for _ in range(1 + number % 3):
            start, ask, answer = (
                int(rng.integers(0, len(words) - 80)),
                int(rng.integers(1, 10)),
                int(rng.integers(0, 40)),
            )
            messages.append({"role": "user", "content": " ".join(words[start : start + ask])})
            messages.append({"role": "assistant", "content": " ".join(words[start + ask : start + ask + answer])})
        conversations.append(messages)
    return conversations


def samples_of(batch: Any) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of every sample of a padded or padding-free batch."""
    if hasattr(batch, "cu_seqlens"):
        bounds = batch.cu_seqlens.tolist()
        ids, labels = batch.input_ids[0].tolist(), batch.labels[0].tolist()
        return [(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(bounds)]
    out = []
    for row in range(len(batch.input_ids)):
        real = batch.attention_mask[row].bool()
        assert (batch.labels[row][~real] == -100).all()
        out.append((batch.input_ids[row][real].tolist(), batch.labels[row][real].tolist()))
    return out


@pytest.mark.parametrize(
    ("source", "truncation", "padding_free"),
    [("save_to_disk", "drop", False), ("jsonl", "keep_start", True), ("jsonl", "drop", True)],
)
def test_the_datamodule_batches_carry_the_row_masks_and_exact_step_label_tokens(
    folders: dict, tmp_path: Path, source: str, truncation: str, padding_free: bool
) -> None:
    from lightning_d9d import TextDataModule

    conversations, max_length = many_conversations(60), 200
    if source == "save_to_disk":
        import datasets

        datasets.Dataset.from_list([{"messages": chat} for chat in conversations]).save_to_disk(tmp_path / "chats")
        dataset = str(tmp_path / "chats")
    else:
        dataset = str(tmp_path / "chats.jsonl")
        Path(dataset).write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in conversations))
    path = folders["llama3"]
    rows = row_tokenizer(path, max_length=max_length, truncation=truncation)
    expected = [rows({"messages": chat}, number) for number, chat in enumerate(conversations)]
    kept = [(ids.tolist(), labels.tolist()) for ids, labels, status in expected if status < 2]
    dm = TextDataModule(
        dataset=dataset,
        tokenizer=str(path),
        loss_on="assistant",
        truncation=truncation,
        max_length=max_length,
        global_batch_tokens=2048,
        microbatch_tokens=512,
        padding_free=padding_free,
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.dropped_samples == sum(status >= 2 for _, _, status in expected)
    assert dm.truncated_samples == sum(status == 1 for _, _, status in expected)
    assert (dm.truncated_samples > 0, dm.dropped_samples > 0) == (truncation == "keep_start", truncation == "drop")
    batches = list(dm.train_dataloader())
    per_step = len(batches) // dm.steps_in_epoch(0)
    assert per_step * dm.steps_in_epoch(0) == len(batches) and dm.steps_in_epoch(0) > 1
    seen = []
    for step in range(dm.steps_in_epoch(0)):
        microbatches = batches[step * per_step : (step + 1) * per_step]
        counted = sum(int((batch.labels[:, 1:] != -100).sum()) for batch in microbatches)
        assert {batch.step_label_tokens for batch in microbatches} == {counted}
        seen += [sample for batch in microbatches for sample in samples_of(batch)]
    # Each sample is a kept row with its own ids and labels, at most once (the microbatches left over after the
    # last full step are dropped, as for text).
    remaining = [(tuple(ids), tuple(labels)) for ids, labels in kept]
    for ids, labels in seen:
        remaining.remove((tuple(ids), tuple(labels)))
    assert len(seen) > len(kept) // 2
    # Two simulated ranks: each step's count is that of both ranks' microbatches.
    loaders = [list(dm.train_dataloader_for_rank(rank, 2)) for rank in range(2)]
    per_rank = len(loaders[0]) // dm.steps_in_epoch(0)
    for step in range(dm.steps_in_epoch(0)):
        both = [batch for loader in loaders for batch in loader[step * per_rank : (step + 1) * per_rank]]
        counted = sum(int((batch.labels[:, 1:] != -100).sum()) for batch in both)
        assert {batch.step_label_tokens for batch in both} == {counted}
    bos = loaded_tokenizer(str(path)).token_to_id("<|begin_of_text|>")
    for ids, labels in seen:
        assert ids[0] == bos and ids.count(bos) == 1
        assert any(label != -100 for label in labels[1:])  # no sample without a trained target


def test_content_that_is_not_a_string_and_template_type_errors_name_the_row(folders: dict) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}]
    # Llama 3's "| trim" would write the list's Python repr into the training text; Qwen's "+" would raise TypeError.
    for name in ("llama3", "qwen25"):
        with pytest.raises(ValueError, match="row 3: message 0 of 'messages' has content of type list"):
            row_tokenizer(folders[name])({"messages": parts}, 3)
    with pytest.raises(ValueError, match="row 4: message 0 of 'completion' has content of type int"):
        row_tokenizer(folders["qwen25"], "completion", fmt="prompt_completion")(
            {"prompt": CONVERSATIONS[0][:1], "completion": [{"role": "assistant", "content": 5}]}, 4
        )
    # A template whose expression fails on a field (a Python error, not raise_exception) still names the row.
    template = "{% for m in messages %}{{ m['content'] + m['weight'] }}{% endfor %}"
    messages = [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a", "weight": 1}]
    path = folders["qwen25"]
    recipe = SFTRecipe("messages", "assistant", "error", 100, Columns(), load_chat_template(template, str(path)), None)
    rows = RowTokenizer(recipe, loaded_tokenizer(str(path)))
    with pytest.raises(ValueError, match="row 5: the chat template failed: TypeError"):
        rows({"messages": messages}, 5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_token_boundary_search_agrees_with_a_scan_of_every_token(folders: dict, name: str) -> None:
    from lightning_d9d.text.masks import _token_around

    path = folders[name]
    for conversation in CONVERSATIONS:
        text = rendered_text(name, path, family(conversation, name))
        offsets = encode_rendered(path, text).offsets
        for boundary in range(len(text) + 1):
            inside = [token for token, (start, end) in enumerate(offsets) if start < boundary < end]
            found = _token_around(offsets, boundary)
            assert (found is not None) == bool(inside)
            if found is not None:
                assert offsets[found] == offsets[inside[-1]]


def test_special_tokens_only_in_special_tokens_map_json_are_used(folders: dict, tmp_path: Path) -> None:
    # Zephyr-era folders: tokenizer_config.json holds the template, special_tokens_map.json the tokens.
    (tmp_path / "tokenizer.json").write_bytes(folders["zephyr"].read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ZEPHYR, "eos_token": None}))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "unk_token": "<unk>"})
    )
    template = load_chat_template(None, str(tmp_path / "tokenizer.json"))
    assert (template.special("bos_token"), template.special("eos_token")) == ("<s>", "</s>")
    ids, labels, _ = row_tokenizer(tmp_path / "tokenizer.json")({"messages": CONVERSATIONS[1]}, 0)
    assert ids.tolist() == list(hf_encode("zephyr", folders["zephyr"], CONVERSATIONS[1])["input_ids"])
    tokenizer = loaded_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.decode(ids[labels != -100].tolist(), skip_special_tokens=False).count("</s>") == 2


@pytest.mark.parametrize(("name", "eos"), [("llama3", "<|eot_id|>"), ("mistral", "</s>"), ("qwen25", "<|im_end|>")])
def test_prompt_completion_strings_train_the_completion_and_one_eos_after_one_bos(folders, name, eos) -> None:
    path = folders[name]
    tokenizer = loaded_tokenizer(str(path))
    recipe = SFTRecipe("prompt_completion", "completion", "error", 1_000, Columns(), None, eos)
    rows = RowTokenizer(recipe, tokenizer)
    for prompt, completion in [("Question: what is a list?\nAnswer:", " A mutable sequence."), ("Q: ünï ✓", " ")]:
        ids, labels, status = rows({"prompt": prompt, "completion": completion}, 0)
        reference = tokenizer.encode(prompt + completion)  # with the post-processor's BOS, as text is encoded
        assert ids.tolist() == [*reference.ids, tokenizer.token_to_id(eos)] and status == 0
        bos = POST_PROCESSOR_BOS.get(name)
        assert bos is None or ((ids == tokenizer.token_to_id(bos)).sum(), ids[0]) == (1, tokenizer.token_to_id(bos))
        trained = ids[labels != -100].tolist()
        assert tokenizer.decode(trained, skip_special_tokens=False).strip() == (completion + eos).strip()
        assert labels[-1] == tokenizer.token_to_id(eos) and (labels[: len(tokenizer.encode(prompt).ids)] == -100).all()


ASSISTANT_FIRST = [
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
]


@pytest.mark.parametrize("name", ["llama3", "qwen25", "phi3", "phi3_plain", "zephyr"])
def test_a_conversation_opening_with_the_assistant_trains_no_preamble_or_header(folders: dict, name: str) -> None:
    # The prompt before an opening assistant turn is not "" : Llama 3 writes BOS and a system header, Qwen its
    # default system prompt, all of them the assistant header.
    path = folders[name]
    ids, labels, _ = row_tokenizer(path)({"messages": ASSISTANT_FIRST}, 0)
    assert ids.tolist() == list(hf_encode(name, path, ASSISTANT_FIRST)["input_ids"])
    encoding = encode_rendered(path, rendered_text(name, path, ASSISTANT_FIRST))
    truth = content_and_end_of_turn_mask(name, path, ASSISTANT_FIRST, encoding.offsets)
    mask = labels != -100
    if name.startswith("phi3"):  # the closing "\n<|endoftext|>" goes with the last turn
        mask[-(2 if name == "phi3_plain" else 1) :] = False
    assert mask.tolist() == truth.tolist()


def test_an_opening_assistant_turn_the_template_writes_differently_is_refused(folders: dict) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{{ ('Bot: ' if loop.first else 'Assistant: ') + m.content + '\\n' }}"
        "{% else %}{{ 'User: ' + m.content + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
    )
    path = folders["qwen25"]
    recipe = SFTRecipe("messages", "assistant", "error", 1000, Columns(), load_chat_template(template, str(path)), None)
    rows = RowTokenizer(recipe, loaded_tokenizer(str(path)))
    with pytest.raises(ValueError, match="row 2: the conversation opens with an assistant turn, and the chat template"):
        rows({"messages": ASSISTANT_FIRST}, 2)
    _, labels, _ = rows({"messages": ASSISTANT_FIRST[1:]}, 2)  # opening with the user, it is fine
    assert (labels != -100).any()


def test_the_datamodule_reads_prompt_completion_message_lists(folders: dict, tmp_path: Path) -> None:
    from lightning_d9d import TextDataModule

    chats = [chat for chat in many_conversations(24) if len(chat) > 2]
    rows = [{"prompt": chat[:-1], "completion": chat[-1:]} for chat in chats]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = folders["qwen25"]
    dm = TextDataModule(
        dataset=str(tmp_path / "pairs.jsonl"),
        tokenizer=str(path),
        max_length=1_000,
        global_batch_size=4,
        microbatch_size=2,
        num_workers=0,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.sft.recipes["split"].format == "prompt_completion" and dm.sft.recipes["split"].loss_on == "completion"
    tokenizer = loaded_tokenizer(str(path))
    for number, chat in enumerate(chats):
        sample = dm.train_dataset[number]
        assert sample["input_ids"].tolist() == list(hf_encode("qwen25", path, chat)["input_ids"])
        trained = tokenizer.decode(sample["input_ids"][sample["labels"] != -100].tolist(), skip_special_tokens=False)
        assert trained == chat[-1]["content"] + "<|im_end|>"


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_qwen3_without_generation_blocks_masks_as_with_them(folders: dict, conversation: int) -> None:
    # Qwen3 renders an earlier answer differently once it is not the last (no think block): its turns are found in
    # the whole conversation — after the prompt, the answer and its end-of-turn token — as the marked template says.
    messages = CONVERSATIONS[conversation]
    ids, labels, _ = row_tokenizer(folders["qwen3"])({"messages": messages}, 0)
    marked = hf_encode("qwen3_marked", folders["qwen3_marked"], messages)
    assert ids.tolist() == list(hf_encode("qwen3", folders["qwen3"], messages)["input_ids"]) == marked["input_ids"]
    assert (labels != -100).astype(int).tolist() == list(marked["assistant_masks"])
    reasoning = [*messages[:-1], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}]
    reasoning += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}]
    # An earlier answer whose reasoning the template drops is not in the whole as written: one error, no guess.
    with pytest.raises(ValueError, match=r"row 1: message \d \(role 'assistant'\) does not appear in the rendered"):
        row_tokenizer(folders["qwen3"])({"messages": reasoning}, 1)


@pytest.mark.parametrize("name", ["phi3", "phi3_plain", "qwen3", "gemma", "llama3"])
def test_prompt_completion_messages_of_real_templates_train_the_last_turn(folders: dict, name: str) -> None:
    path = folders[name]
    conversation = family(CONVERSATIONS[2], name)  # ends with an answer that opens with a space
    row = {"prompt": conversation[:-1], "completion": conversation[-1:]}
    ids, labels, _ = row_tokenizer(path, "completion", fmt="prompt_completion")(row, 0)
    whole, last, _ = row_tokenizer(path, "last_assistant")({"messages": conversation}, 0)
    assert ids.tolist() == whole.tolist() == list(hf_encode(name, path, conversation)["input_ids"])
    assert labels.tolist() == last.tolist()  # the completion is the last turn, trained alike
