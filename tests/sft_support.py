"""Shared pieces of the fine-tuning tests: a real byte-level BPE tokenizer with chat special tokens, two chat
templates (ChatML with ``{% generation %}`` blocks, a BOS-prefixed Llama-2-like one without), conversations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support import make_texts
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% elif message['role'] in ['system', 'user'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with generation blocks around each assistant message and its end-of-turn token."""

LLAMA_LIKE = """{{ bos_token }}{% for message in messages %}
{% if message['role'] == 'system' %}
{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}
{% elif message['role'] == 'user' %}
{{ '[INST] ' + message['content'] + ' [/INST]' }}
{% elif message['role'] == 'assistant' %}
{{ message['content'] + eos_token }}
{% endif %}
{% endfor %}"""
"""BOS first (from bos_token), no generation blocks, trim_blocks/lstrip_blocks matter, unknown roles skipped."""

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
        {"role": "assistant", "content": "naïve café — fine"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": ""},
    ],
]


def train_chat_tokenizer(path: Path | None = None, vocab_size: int = 400) -> Tokenizer:
    """Byte-level BPE trained on the test texts, with chat special tokens; no post-processor (like Qwen/ChatML)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = make_texts(300, seed=3) + [message["content"] for chat in CONVERSATIONS for message in chat]
    tokenizer.train_from_iterator([text for text in texts if text], trainer=trainer)
    if path is not None:
        tokenizer.save(str(path))
    return tokenizer


def write_model_folder(folder: Path, template: str, **special: Any) -> Path:
    """A Hugging Face-like tokenizer folder: tokenizer.json, tokenizer_config.json (special tokens, template)."""
    folder.mkdir(parents=True, exist_ok=True)
    train_chat_tokenizer(folder / "tokenizer.json")
    config = {"chat_template": template, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def hf_tokenizer(tokenizer_path: Path, template: str, **special: str) -> Any:
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), **special)
    tokenizer.chat_template = template
    return tokenizer
