"""Demo corpus: a small English+code text dataset and a BPE tokenizer built from text that ships with Python.

Documents are ``pydoc_data``'s help topics and the standard library's docstrings (parsed with ``ast``, never
imported), so the demo downloads nothing; every 20th goes to ``validation``. A byte-level BPE tokenizer is trained
on the train split. Both are cached per machine under a key of the Python version, written under a file lock and
published by atomic rename so concurrent ranks never see a half-written corpus.

Trade-off: the text depends on the Python version; the cache key records that instead of hiding it.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from lightning_d9d.core.digest import digest
from lightning_d9d.demo_data.cache import build_once

# Bump when the corpus or tokenizer recipe changes: it is part of the cache key, so old caches are not reused.
_FORMAT_VERSION = 1
_VALIDATION_EVERY = 20
_MAX_TOPIC_DOCUMENT_CHARS = 1_500
_MIN_DOCSTRING_CHARS = 80
_VOCAB_SIZE = 4_096
PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
# Standard-library folders whose docstrings are tests, demos or vendored code rather than documentation.
_SKIPPED_STDLIB_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
)

DEMO = "demo"
"""The value of ``TextDataModule(dataset=..., tokenizer=...)`` that selects this corpus."""


@dataclasses.dataclass(frozen=True)
class DemoCorpus:
    """Paths of a built demo corpus.

    Attributes:
        dataset_path: a ``load_from_disk`` DatasetDict with ``train`` and ``validation``, one ``text`` column.
        tokenizer_path: a ``tokenizers`` JSON file.
    """

    dataset_path: str
    tokenizer_path: str


def demo_cache_dir() -> Path:
    """The demo corpus cache root: ``$LIGHTNING_D9D_CACHE`` if set, else ``~/.cache/lightning_d9d/demo``."""
    configured = os.environ.get("LIGHTNING_D9D_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "lightning_d9d" / "demo"


def demo_cache_key() -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return f"v{_FORMAT_VERSION}-py{python}"


def _topic_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        paragraphs = (paragraph.strip("\n") for paragraph in topics[name].split("\n\n"))
        yield from regroup_blocks(paragraphs, _MAX_TOPIC_DOCUMENT_CHARS)


def regroup_blocks(blocks: Iterable[str], max_chars: int) -> Iterator[str]:
    """Non-blank blocks joined, in order, into documents of up to ``max_chars`` (a longer block stays whole)."""
    document: list[str] = []
    size = 0
    for block in blocks:
        if not block.strip():
            continue
        if document and size + len(block) > max_chars:
            yield "\n\n".join(document)
            document, size = [], 0
        document.append(block)
        size += len(block) + 2
    if document:
        yield "\n\n".join(document)


def stdlib_sources(skipped_dirs: frozenset[str] = _SKIPPED_STDLIB_DIRS) -> Iterator[str]:
    """The text of every readable UTF-8 ``.py`` file of the standard library, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skipped_dirs)
        for file_name in sorted(files):
            if file_name.endswith(".py"):
                try:
                    yield Path(root, file_name).read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue


def _docstring_documents() -> Iterator[str]:
    for source in stdlib_sources():
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue  # a few stdlib files are templates; they add nothing
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring) >= _MIN_DOCSTRING_CHARS:
                    yield docstring


def demo_texts() -> tuple[list[str], list[str]]:
    """Return the (train, validation) documents of the demo corpus, deterministically for a Python version."""
    train: list[str] = []
    validation: list[str] = []
    for position, text in enumerate([*_topic_documents(), *_docstring_documents()]):
        (validation if position % _VALIDATION_EVERY == 0 else train).append(text)
    return train, validation


def _train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    # The end-of-document token is added by the tokenizer itself (add_special_tokens=True), so any consumer
    # of tokenizer.json - TextDataModule included - gets it, and truncation keeps it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, eos_id)]
    )
    tokenizer.save(str(path))


def build_demo_corpus(cache_dir: str | os.PathLike[str] | None = None) -> DemoCorpus:
    """Build the demo corpus and tokenizer once, or return the cached ones.

    Args:
        cache_dir: where to cache; default :func:`demo_cache_dir`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else demo_cache_dir()
    target = build_once(root, demo_cache_key(), _write_corpus)
    return DemoCorpus(dataset_path=str(target / "dataset"), tokenizer_path=str(target / "tokenizer.json"))


def _write_corpus(folder: Path) -> str:
    """Write the corpus into ``folder``; return the digest of its texts (the marker)."""
    from datasets import Dataset, DatasetDict

    train, validation = demo_texts()
    splits = DatasetDict(train=Dataset.from_dict({"text": train}), validation=Dataset.from_dict({"text": validation}))
    splits.save_to_disk(str(folder / "dataset"))
    _train_tokenizer(train, folder / "tokenizer.json")
    return f"{digest(*train, *validation)}\n"
