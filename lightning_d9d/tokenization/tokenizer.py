"""The tokenizer every DataModule reads: one loader with one error text, one choice of the padding id.

Tokenizers are loaded with padding and truncation off and cached by content digest; workers receive the JSON, not
a path. The pad id is the tokenizer's padding setting, else a usual pad token, else 0 (1 when 0 is the BOS).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from tokenizers import Tokenizer

from lightning_d9d.core.digest import file_digest

PAD_TOKEN_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|endoftext|>", "</s>", "<eos>")
_HOW_TO_MAKE_ONE = (
    "give the path of a tokenizers JSON file (tokenizers.Tokenizer.save, or the tokenizer.json that "
    "transformers' save_pretrained writes)"
)
_from_json: dict[str, Tokenizer] = {}
_from_json_lock = threading.Lock()


class TokenizerFileNotFoundError(FileNotFoundError, ValueError):
    """The tokenizer path is not a file (a ``FileNotFoundError``, and a ``ValueError`` like every bad setting)."""


def check_tokenizer_file(path: str | os.PathLike) -> str:
    """``path`` as a string; ``TokenizerFileNotFoundError`` unless it is an existing file."""
    text = os.fspath(path)
    if not os.path.isfile(os.path.expanduser(text)):
        raise TokenizerFileNotFoundError(f"tokenizer={text!r} is not a file: {_HOW_TO_MAKE_ONE}")
    return text


def read_tokenizer(source: str | os.PathLike | Tokenizer) -> Tokenizer:
    """The tokenizer at ``source`` (a ``tokenizer.json`` path), or ``source`` itself if it is a ``Tokenizer``.

    Raises:
        TokenizerFileNotFoundError: the path is not a file.
        ValueError: the file is not a tokenizers JSON file.
    """
    if isinstance(source, Tokenizer):
        return source
    path = check_tokenizer_file(source)
    try:
        return Tokenizer.from_file(os.path.expanduser(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed JSON
        message = f"tokenizer={path!r} is not a valid tokenizers JSON file ({error}): {_HOW_TO_MAKE_ONE}"
        raise ValueError(message) from error


def tokenizer_digest(path: str | os.PathLike) -> str:
    """The content digest of a tokenizer file: what identifies it in fingerprints and caches."""
    return file_digest(os.path.expanduser(os.fspath(path)))


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str, digest: str, max_length: int | None = None) -> Tokenizer:
    """The tokenizer at ``path``, cached per process by ``digest``, padding off, cut at ``max_length`` if given."""
    return configured(read_tokenizer(path), max_length)


def configured(tokenizer: Any, max_length: int | None) -> Any:
    """``tokenizer`` (``tokenizers`` or a backend with the same setters) with padding off, cut at ``max_length``."""
    tokenizer.no_padding()  # a tokenizer.json saved with padding on would pad every document to one length
    if max_length is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length)
    return tokenizer


def tokenizer_from_json(tokenizer_json: str) -> Tokenizer:
    """A tokenizer from its JSON text, parsed once per process, without padding or truncation."""
    tokenizer = _from_json.get(tokenizer_json)
    if tokenizer is None:
        with _from_json_lock:
            tokenizer = _from_json.get(tokenizer_json)
            if tokenizer is None:
                tokenizer = Tokenizer.from_str(tokenizer_json)
                tokenizer.no_padding()
                tokenizer.no_truncation()
                _from_json[tokenizer_json] = tokenizer
    return tokenizer


def pad_token_id(tokenizer: Tokenizer, avoid: int | None = None) -> int:
    """The id to write at padding positions, never ``avoid`` (the BOS id where BOS marks document starts)."""
    padding = tokenizer.padding
    if padding is not None and padding.get("pad_id") != avoid:
        return int(padding["pad_id"])
    for token in PAD_TOKEN_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id != avoid:
            return int(token_id)
    return 1 if avoid == 0 else 0
