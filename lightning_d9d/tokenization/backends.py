"""Tokenizer backends: the encoder that turns a ``tokenizer.json`` into ids, chosen per run, checked against
Hugging Face ``tokenizers``.

Every backend reads the same ``tokenizer.json`` and gives a batch's ids as one flat int32 array with offsets
(:class:`EncodedBatch`), so no per-token Python object is made between the encoder and the packer. ``tokenizers`` is
the reference: a fast backend is used only where it is installed, can load the tokenizer, and gave the reference's
ids on a sample of the run's own documents plus a fixed set of hostile texts (:func:`resolve_backend`); during the
run a sampled share of documents is re-encoded by the reference (:class:`BackendGuard`) and any difference stops the
run naming the document. Backends are rebuilt in each process from ``(name, tokenizer JSON)``, so what crosses to a
worker is two strings. Trade-off: the guard's share is re-encoded at the reference's speed (several % of a fast
backend's encoding time at ``GUARD_EVERY``); a difference outside the sample and the guard's share goes unnoticed.

Adding a backend: subclass :class:`TokenizerBackend` and decorate it with :func:`register_backend` (``fast=True`` to
let ``"auto"`` pick it, earlier-registered fast backends preferred).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import numpy as np
from tokenizers import Tokenizer

from lightning_d9d.tokenization.tokenizer import configured

AUTO = "auto"
REFERENCE = "tokenizers"
# One document in GUARD_EVERY is re-encoded by the reference during a run (chosen by row, so every run checks the
# same documents). The reference is some hundred times slower per token than a fast backend on one core, so the
# share is what keeps the guard a small part of tokenizing (benchmarks_streaming.md, "Tokenizer backends").
GUARD_EVERY = 1024


class TokenizerBackendError(ValueError):
    """A backend asked for that is unknown, not installed, or cannot serve this tokenizer with identical ids."""


class TokenizerBackendMismatch(RuntimeError):
    """A fast backend gave other ids than ``tokenizers`` for a document during the run."""


class EncodedDocument:
    """One document's ids (an int32 array): what callers use of an encoding, ``ids`` and ``len``."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)


class EncodedBatch(Sequence[EncodedDocument]):
    """The ids of a batch of documents: ``ids`` (int32, all documents concatenated) and ``offsets`` (int64,
    document ``i`` is ``ids[offsets[i]:offsets[i + 1]]``)."""

    __slots__ = ("ids", "offsets")

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        self.ids, self.offsets = ids, offsets

    @classmethod
    def of_arrays(cls, arrays: Sequence[np.ndarray]) -> EncodedBatch:
        """The batch of documents whose ids are ``arrays``."""
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        ids = np.concatenate(arrays).astype(np.int32, copy=False) if len(arrays) else np.zeros(0, np.int32)
        return cls(ids, offsets)

    @property
    def counts(self) -> np.ndarray:
        """Tokens per document."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> EncodedDocument:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return EncodedDocument(self.ids[self.offsets[i] : self.offsets[i + 1]])

    def __iter__(self) -> Iterator[EncodedDocument]:
        bounds = self.offsets.tolist()
        return (EncodedDocument(self.ids[a:b]) for a, b in itertools.pairwise(bounds))


class TokenizerBackend:
    """An encoder of one ``tokenizer.json``: the ids of texts, without the post-processor's special tokens.

    Subclasses set ``name`` and ``module`` (the import that must be installed) and implement ``_load`` and
    ``encode``; ``_load`` raises where the backend cannot serve the tokenizer (a model, normalizer or pre-tokenizer
    it lacks).
    """

    name: ClassVar[str]
    module: ClassVar[str]

    def __init__(self, tokenizer_json: str, max_length: int | None = None):
        self.tokenizer_json, self.max_length = tokenizer_json, max_length
        self._load(tokenizer_json, max_length)

    def _load(self, tokenizer_json: str, max_length: int | None) -> None:
        """Load the tokenizer, padding off, truncated at ``max_length`` tokens (``None``: not truncated)."""
        raise NotImplementedError

    def encode(self, texts: list[str], add_special_tokens: bool = False) -> EncodedBatch:
        """The ids of ``texts``, as one flat batch (``add_special_tokens``: with the post-processor's)."""
        raise NotImplementedError

    @classmethod
    def installed(cls) -> bool:
        return importlib.util.find_spec(cls.module) is not None

    def __reduce__(self) -> tuple:
        # Rebuilt from its JSON where it is unpickled (native tokenizers do not pickle, or pickle slowly).
        return (backend_for, (self.name, self.tokenizer_json, self.max_length))


_BACKENDS: dict[str, type[TokenizerBackend]] = {}
_FAST: list[str] = []


def register_backend(cls: type[TokenizerBackend] | None = None, *, fast: bool = True):  # type: ignore[no-untyped-def]
    """Register a backend class under its ``name`` (``fast``: ``"auto"`` may choose it); usable as a decorator."""

    def add(backend: type[TokenizerBackend]) -> type[TokenizerBackend]:
        _BACKENDS[backend.name] = backend
        if fast and backend.name not in _FAST:
            _FAST.append(backend.name)
        return backend

    return add if cls is None else add(cls)


def unregister_backend(name: str) -> None:
    """Forget a registered backend (a test's); the reference cannot be removed."""
    if name == REFERENCE:
        raise ValueError("the reference backend 'tokenizers' cannot be unregistered")
    _BACKENDS.pop(name, None)
    if name in _FAST:
        _FAST.remove(name)
    for key in [key for key in _instances if key[0] == name]:
        del _instances[key]


def backend_names() -> list[str]:
    """What ``tokenizer_backend`` accepts: ``"auto"``, ``"tokenizers"`` and every registered backend."""
    return [AUTO, REFERENCE, *(name for name in _BACKENDS if name != REFERENCE)]


@register_backend(fast=False)
class HuggingFaceBackend(TokenizerBackend):
    """Hugging Face ``tokenizers``: the reference, serving every ``tokenizer.json``."""

    name = REFERENCE
    module = "tokenizers"

    def _load(self, tokenizer_json: str, max_length: int | None) -> None:
        self.tokenizer = configured(Tokenizer.from_str(tokenizer_json), max_length)

    def encode(self, texts: list[str], add_special_tokens: bool = False) -> EncodedBatch:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return EncodedBatch.of_arrays([np.asarray(e.ids, np.int32) for e in encodings])


@register_backend
class FastokensBackend(TokenizerBackend):
    """``fastokens`` (Rust BPE): byte-level BPE tokenizers; refuses models, normalizers and pre-tokenizers it lacks
    (WordPiece, Unigram, WordLevel, NFKC, Metaspace, ...) when loading."""

    name = "fastokens"
    module = "fastokens"

    def _load(self, tokenizer_json: str, max_length: int | None) -> None:
        import fastokens

        self.tokenizer = configured(fastokens.Tokenizer.from_json_str(tokenizer_json), max_length)

    def encode(self, texts: list[str], add_special_tokens: bool = False) -> EncodedBatch:
        try:
            ids, offsets = self.tokenizer.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
        except ValueError:
            # fastokens refuses what tokenizers passes over (a byte without a token in a vocabulary trained without
            # the full byte alphabet): that batch is the reference's, whose ids are by definition the right ones.
            return backend_for(REFERENCE, self.tokenizer_json, self.max_length).encode(texts, add_special_tokens)
        # uint32 ids of a vocabulary under 2**31 read as int32, uint64 offsets as int64: views, no copy.
        return EncodedBatch(np.frombuffer(ids, np.int32), np.frombuffer(offsets, np.int64))


_instances: dict[tuple[str, str, int | None], TokenizerBackend] = {}
_instances_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child builds its own encoders: a native library's thread pool does not survive a fork, and a
    worker's thread setting (``FASTOKENS_BPE_THREADS``) is read when one is built."""
    global _instances_lock
    _instances.clear()
    _instances_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def backend_for(name: str, tokenizer_json: str, max_length: int | None = None) -> TokenizerBackend:
    """Backend ``name`` of the tokenizer ``tokenizer_json`` (truncating at ``max_length`` tokens), made once per
    process (``name`` already resolved).

    Raises:
        TokenizerBackendError: ``name`` is not registered or not installed, or cannot load this tokenizer.
    """
    key = (name, tokenizer_json, max_length)
    backend = _instances.get(key)
    if backend is None:
        with _instances_lock:
            backend = _instances.get(key)
            if backend is None:
                backend = _instances[key] = _load(_backend_class(name), tokenizer_json, max_length)
    return backend


def _backend_class(name: str) -> type[TokenizerBackend]:
    if name == AUTO or name not in _BACKENDS:
        raise TokenizerBackendError(
            f"tokenizer_backend={name!r} is not a tokenizer backend: pass one of {backend_names()}"
        )
    cls = _BACKENDS[name]
    if not cls.installed():
        raise TokenizerBackendError(
            f"tokenizer_backend={name!r} is not installed (no module {cls.module!r}): pip install {cls.module}, or "
            f"pass tokenizer_backend='auto' (the fastest installed) or 'tokenizers'"
        )
    return cls


def _load(cls: type[TokenizerBackend], tokenizer_json: str, max_length: int | None) -> TokenizerBackend:
    try:
        return cls(tokenizer_json, max_length)
    except Exception as error:  # each library raises its own type for what it cannot load
        raise TokenizerBackendError(
            f"tokenizer_backend={cls.name!r} cannot serve this tokenizer ({error}); pass tokenizer_backend='auto' "
            f"(it falls back to 'tokenizers') or 'tokenizers'"
        ) from error


def hostile_texts(tokenizer_json: str) -> list[str]:
    """Texts on which encoders tend to differ, and every added token written in text, alone and between words."""
    reference = backend_for(REFERENCE, tokenizer_json).tokenizer
    added = [token.content for token in reference.get_added_tokens_decoder().values()]
    return [
        "",
        "plain words, digits 12345 and punctuation!?",
        "emoji 👩‍👩‍👧‍👦 🇫🇷 😀😀 flags and joiners",
        "combining marks: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
        "line\r\nendings\r\n\r\nand\ttabs\n",
        "nul\x00inside\x00\x00text",
        " " * 5000 + "after spaces",
        "x" * 100_000,
        "中文字符和日本語のテキスト、한국어",
        "zero\u200bwidth\u200bspaces\ufeffand\u200dbom",
        *added,
        *(f"before{token}after {token} {token}{token}" for token in added),
    ]


def _same_ids(got: EncodedBatch, want: EncodedBatch) -> int | None:
    """The first document where two batches' ids differ, ``None`` if none does."""
    if np.array_equal(got.offsets, want.offsets) and np.array_equal(got.ids, want.ids):
        return None
    for i, (a, b) in enumerate(zip(got, want)):
        if not np.array_equal(a.ids, b.ids):
            return i
    return min(len(got), len(want))


def resolve_backend(
    setting: str,
    tokenizer_json: str,
    sample: Sequence[str] | Callable[[], Sequence[str]],
    max_length: int | None = None,
    add_special_tokens: bool = False,
) -> tuple[str, str]:
    """The backend a run uses for ``setting`` and why: ``(name, reason)``.

    ``"auto"``: the first registered fast backend that is installed, loads the tokenizer and gives the reference's
    ids on ``sample`` (the run's own documents; a callable is called only once a backend loads) and
    :func:`hostile_texts`; else ``"tokenizers"``. A named fast backend must pass the same checks. ``max_length``
    and ``add_special_tokens``: how the run encodes (truncation, the post-processor's tokens), checked as used.

    Raises:
        TokenizerBackendError: a named backend that is unknown, not installed, cannot load the tokenizer, or gave
            other ids than ``tokenizers`` on the sample.
    """
    if setting == REFERENCE:
        return REFERENCE, "asked for"
    texts: list[Sequence[str]] = []

    def sampled() -> Sequence[str]:
        if not texts:
            texts.append(sample() if callable(sample) else sample)
        return texts[0]

    if setting != AUTO:
        _backend_class(setting)  # unknown or not installed: raises
        failed = _check(setting, tokenizer_json, sampled, max_length, add_special_tokens)
        if failed is not None:
            raise TokenizerBackendError(f"tokenizer_backend={setting!r} cannot serve this tokenizer: {failed}")
        return setting, "asked for; ids identical to tokenizers on the sample"
    reasons = []
    for name in _FAST:
        if not _BACKENDS[name].installed():
            reasons.append(f"{name} is not installed")
            continue
        failed = _check(name, tokenizer_json, sampled, max_length, add_special_tokens)
        if failed is None:
            return name, f"auto: ids identical to tokenizers on {len(sampled())} sampled documents and hostile texts"
        reasons.append(failed)
    return REFERENCE, "auto: " + ("; ".join(reasons) if reasons else "no fast backend is registered")


def _check(
    name: str, tokenizer_json: str, sample: Callable[[], Sequence[str]], max_length: int | None, specials: bool
) -> str | None:
    """Why backend ``name`` cannot serve this tokenizer, ``None`` where it gives the reference's ids."""
    try:
        backend = backend_for(name, tokenizer_json, max_length)
    except TokenizerBackendError as error:
        return f"{name} cannot load this tokenizer ({error.__cause__ or error})"
    texts = [*hostile_texts(tokenizer_json), *sample()]
    reference = backend_for(REFERENCE, tokenizer_json, max_length)
    try:
        differs = _same_ids(backend.encode(texts, specials), reference.encode(texts, specials))
    except Exception as error:  # a backend failing on a text cannot serve the run
        return f"{name} failed to encode a sampled text ({error})"
    if differs is not None:
        return f"{name} gave other ids than tokenizers for the text {texts[differs][:80]!r}"
    return None


class BackendGuard:
    """Re-encodes one document in ``every`` (chosen by row number) with the reference and raises on any difference.

    Args:
        name: the backend whose ids are checked (the reference itself: nothing is checked).
        tokenizer_json: the tokenizer.
        every: one document in this many is checked (``None``: ``GUARD_EVERY``; 0: none).
    """

    def __init__(self, name: str, tokenizer_json: str, every: int | None = None):
        self.name, self.tokenizer_json = name, tokenizer_json
        self.every = GUARD_EVERY if every is None else every

    @property
    def active(self) -> bool:
        return self.name != REFERENCE and self.every > 0

    def picks(self, group: int, rows: np.ndarray) -> np.ndarray:
        """Positions among the documents at ``rows`` of row group ``group`` that are checked: a hash of both, so
        that small row groups are not checked at their first row each."""
        hashed = (np.asarray(rows, np.int64) * 0x9E3779B1 + group * 0x85EBCA77) & 0xFFFFFFFF
        return np.flatnonzero(hashed % self.every == 0)

    def check(self, texts: Sequence[str], got: Sequence[np.ndarray], where: Sequence[str], encode_reference) -> None:  # type: ignore[no-untyped-def]
        """Raise :class:`TokenizerBackendMismatch` naming the first of ``where`` whose ids differ from the
        reference's (``encode_reference(texts)`` gives those)."""
        want = encode_reference(list(texts))
        for text, ids, expected, place in zip(texts, got, want, where):
            if not np.array_equal(np.asarray(ids), np.asarray(expected.ids)):
                first = _first_difference(np.asarray(ids), np.asarray(expected.ids))
                raise TokenizerBackendMismatch(
                    f"tokenizer_backend={self.name!r} gave other ids than tokenizers for {place} "
                    f"({len(text)} characters, first difference at token {first}): stopped rather than train on "
                    f"other tokens; pass tokenizer_backend='tokenizers' and report the document to the backend"
                )


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
