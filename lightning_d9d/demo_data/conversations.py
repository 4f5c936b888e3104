"""Demo conversations: a small chat fine-tuning set made from the demo corpus, so SFT runs without a download.

The user asks to continue a document, the assistant answers with its next words (some with a second turn or a
system message): an artificial task, but with everything a loss mask must get right. Cached like the corpus.
"""

from __future__ import annotations

from pathlib import Path

from lightning_d9d.demo_data.cache import build_once
from lightning_d9d.demo_data.corpus import build_demo_corpus

DEMO_CHAT = "demo-chat"
"""The value of ``TextDataModule(dataset=...)`` that selects this conversation set."""
_FORMAT_VERSION = 1
_PROMPT_WORDS, _ANSWER_WORDS = 10, 14
SYSTEM_PROMPT = "You continue passages of the Python documentation."


def conversation(text: str, number: int) -> list[dict[str, str]] | None:
    """The conversation made from one document, or ``None`` when it is too short."""
    words = text.split()
    first_end = _PROMPT_WORDS + _ANSWER_WORDS
    if len(words) < first_end:
        return None
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if number % 3 == 0 else []
    messages += [
        {"role": "user", "content": "Continue: " + " ".join(words[:_PROMPT_WORDS])},
        {"role": "assistant", "content": " ".join(words[_PROMPT_WORDS:first_end])},
    ]
    if len(words) >= first_end + _ANSWER_WORDS:
        messages += [
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": " ".join(words[first_end : first_end + _ANSWER_WORDS])},
        ]
    return messages


def build_demo_conversations() -> str:
    """Build the demo conversation set once, or return the cached one.

    Returns:
        A ``load_from_disk`` folder: ``train`` and ``validation`` with one ``messages`` column.
    """
    corpus = build_demo_corpus()
    root = Path(corpus.dataset_path).parent

    def write_conversations(folder: Path) -> str:
        from datasets import Dataset, DatasetDict, load_from_disk

        texts = load_from_disk(corpus.dataset_path)
        splits = {}
        for split in ("train", "validation"):
            chats = [conversation(text, number) for number, text in enumerate(texts[split]["text"])]
            splits[split] = Dataset.from_dict({"messages": [chat for chat in chats if chat is not None]})
        DatasetDict(splits).save_to_disk(str(folder / "dataset"))
        return "ok\n"

    return str(build_once(root, f"conversations-v{_FORMAT_VERSION}", write_conversations) / "dataset")
