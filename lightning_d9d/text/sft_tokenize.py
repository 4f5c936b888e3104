"""Fine-tuning tokenization: prompt/completion and conversation rows → token ids and loss-masked labels, cached.

Messages are rendered with the chat template; trained assistant turns come from its ``{% generation %}`` blocks, else
from renders of the conversation's prefixes (``messages[:i]`` with the generation prompt, and ``messages[:i + 1]``),
cut on token boundaries. Templates outside the checked shapes are an error naming the row, never a guess.
String prompt/completion rows are encoded like text with the completion and a final EOS trained.

Trade-off: prefix renders cost one template render per trained turn, but nothing is tokenized twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from lightning_d9d.text.chat_template import ChatTemplate, TemplateRenderError, special_tokens_beside
from lightning_d9d.text.formats import Columns, Format, LossOn, required_columns, row_messages, row_part
from lightning_d9d.text.masks import (
    DROPPED_TOO_LONG,
    DROPPED_UNTRAINED,
    TRUNCATED,
    TokenizedText,
    fit_turn_spans,
    labels_from_mask,
    span_mask,
    trained_targets,
    truncate,
)
from lightning_d9d.text.tokenize import cached_batched_map
from lightning_d9d.tokenization.tokenizer import load_tokenizer

_SFT_RECIPE_VERSION = 2
"""Part of the cache fingerprint: bump whenever the same rows and settings tokenize differently."""
_OUTPUT_COLUMNS = ("input_ids", "labels", "token_counts", "label_counts", "status")
EOS_CANDIDATES = ("</s>", "<eos>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class SFTRecipe:
    """Everything that decides a fine-tuning sample's ids and labels (picklable, for ``num_proc``)."""

    format: Format
    loss_on: LossOn
    truncation: str
    max_length: int
    columns: Columns
    template: ChatTemplate | None
    eos_token: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_on", LossOn(self.loss_on))


class RowTokenizer:
    """One row → ``(input_ids, labels, status)`` under a recipe."""

    def __init__(self, recipe: SFTRecipe, tokenizer: Any):
        self.recipe, self.tokenizer = recipe, tokenizer
        # Added tokens (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, ...): where a turn found by rendering ends.
        added = tokenizer.get_added_tokens_decoder()
        self.control_ids = frozenset(added)
        self.control_tokens = tuple(token.content for token in added.values() if token.content)

    def __call__(self, row: dict[str, Any], index: int) -> tuple[np.ndarray, np.ndarray, int]:
        recipe = self.recipe
        columns = required_columns(recipe.format, recipe.columns, set(row))
        for column in columns:
            if column not in row or row[column] is None:
                raise ValueError(f"row {index} has no value in column {column!r} (format {recipe.format!r})")
        if recipe.format == "messages":
            ids, labels = self._conversation(row_messages(row[columns[0]], index, columns[0]), index)
        else:
            prompt = row_part(row[columns[0]], index, columns[0])
            completion = row_part(row[columns[1]], index, columns[1])
            if isinstance(prompt, str) and isinstance(completion, str):
                ids, labels = self._plain_completion(prompt, completion)
            elif isinstance(prompt, list) and isinstance(completion, list):
                ids, labels = self._chat_completion(prompt, completion, index)
            else:
                raise ValueError(
                    f"row {index}: prompt and completion must both be strings or both be lists of messages"
                )
        return truncate(ids, labels, recipe.max_length, recipe.truncation, index)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ conversations
    def _conversation(self, messages: list[dict[str, Any]], index: int) -> tuple[np.ndarray, np.ndarray]:
        template = self._template(index)
        rendered = _render(template, messages, index)
        _check_contents_rendered(messages, rendered.text, index)
        encoding = self.tokenizer.encode(rendered.text, add_special_tokens=False)
        ids = encoding.ids
        if self.recipe.loss_on is LossOn.ALL:
            return np.asarray(ids, dtype=np.int64), np.asarray(ids, dtype=np.int64)
        if not any(message["role"] == "assistant" for message in messages):
            raise ValueError(f"row {index} has no assistant turn to train (loss_on={self.recipe.loss_on!r})")
        last_only = self.recipe.loss_on is LossOn.LAST_ASSISTANT
        if template.has_generation_blocks:
            spans = list(rendered.generation_spans)
        else:
            spans = _turn_spans(template, messages, rendered.text, index, self.control_tokens, last_only)
            spans = fit_turn_spans(spans, TokenizedText(ids, encoding.offsets, rendered.text, self.control_ids), index)
        if last_only:
            spans = spans[-1:]
        mask = span_mask(encoding.offsets, spans)
        if not mask.any():
            raise ValueError(
                f"row {index}: no token of an assistant turn was found in the rendered conversation (the template's "
                "{% generation %} blocks render nothing for it)"
            )
        return np.asarray(ids, dtype=np.int64), labels_from_mask(ids, mask)

    def _chat_completion(
        self, prompt: list[dict[str, Any]], completion: list[dict[str, Any]], index: int
    ) -> tuple[np.ndarray, np.ndarray]:
        template = self._template(index)
        start = _render(template, prompt, index, add_generation_prompt=True).text
        whole = _render(template, prompt + completion, index).text
        _check_contents_rendered(prompt + completion, whole, index)
        if not whole.startswith(start):
            raise ValueError(
                f"row {index}: the prompt rendered with the generation prompt is not a prefix of prompt + completion "
                "rendered; the template changes earlier text when the completion is added"
            )
        encoding = self.tokenizer.encode(whole, add_special_tokens=False)
        spans = [(len(start), len(whole))]
        mask = np.ones(len(encoding.ids), dtype=bool)
        if self.recipe.loss_on is LossOn.COMPLETION:
            tokens = TokenizedText(encoding.ids, encoding.offsets, whole, self.control_ids)
            spans = fit_turn_spans(spans, tokens, index)
            mask = span_mask(encoding.offsets, spans)
        return np.asarray(encoding.ids, dtype=np.int64), labels_from_mask(encoding.ids, mask)

    # ------------------------------------------------------------------ plain prompt/completion
    def _plain_completion(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self.tokenizer.encode(prompt + completion)
        special = np.asarray(encoding.special_tokens_mask, dtype=bool)
        ids = list(encoding.ids)
        if self.recipe.loss_on is LossOn.ALL:
            mask = np.ones(len(ids), dtype=bool)
        else:
            mask = span_mask(encoding.offsets, [(len(prompt), len(prompt) + len(completion))]) & ~special
            # Special tokens the post-processor appends after the completion (an EOS) end it: trained.
            text_tokens = np.flatnonzero(~special)
            after = (text_tokens[-1] + 1) if len(text_tokens) else 0
            mask[after:] = True
        eos_id = self.tokenizer.token_to_id(self.recipe.eos_token) if self.recipe.eos_token else None
        if eos_id is not None and (not ids or ids[-1] != eos_id):
            ids.append(eos_id)
            mask = np.append(mask, True)
        return np.asarray(ids, dtype=np.int64), labels_from_mask(ids, mask)

    def _template(self, index: int) -> ChatTemplate:
        if self.recipe.template is None:
            raise ValueError(
                f"row {index} holds messages, which need a chat template: pass chat_template= (a Jinja string, a "
                ".jinja file or a tokenizer_config.json), or put chat_template.jinja next to the tokenizer.json"
            )
        return self.recipe.template


def _render(template: ChatTemplate, messages: list[dict[str, Any]], index: int, add_generation_prompt=False) -> Any:
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt)
    except TemplateRenderError as error:
        raise ValueError(f"row {index}: {error}") from error


def _check_contents_rendered(messages: list[dict[str, Any]], text: str, index: int) -> None:
    """Raise ValueError when a message's text is missing from the render."""
    for number, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in text:
            raise ValueError(
                f"row {index}: message {number} (role {message.get('role')!r}) does not appear in the rendered "
                "conversation: the chat template skips that role or rewrites its content, so its turns cannot be "
                "located; use a role the template renders, or a template that renders every message"
            )


def _turn_spans(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    whole: str,
    index: int,
    control_tokens: tuple[str, ...] = (),
    last_only: bool = False,
) -> list:
    """Character spans of the trained assistant turns, from renders of the conversation's prefixes."""
    turns = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    spans = []
    for turn in turns[-1:] if last_only else turns:
        before = _render(template, messages[:turn], index, add_generation_prompt=True).text if turn else ""
        if turn == 0:
            before = _opening_prompt(template, messages[0], index)
        after = _render(template, messages[: turn + 1], index).text
        if not whole.startswith(after) and whole.startswith(before):
            after = _turn_without_closing(after, len(before), messages[turn], control_tokens)
            if not whole.startswith(after):
                after = _turn_in_whole(whole, len(before), messages[turn], control_tokens) or after
        if not (whole.startswith(before) and whole.startswith(after) and len(after) > len(before)):
            raise ValueError(
                f"row {index}: the chat template is not prefix-preserving at message {turn} (rendering the "
                "conversation up to that turn does not give a prefix of the whole), so its assistant turns cannot be "
                "found; add {% generation %} blocks to the template, or use loss_on='all'"
            )
        spans.append((len(before), len(after)))
    return spans


def _opening_prompt(template: ChatTemplate, message: dict[str, Any], index: int) -> str:
    """What the template writes before an assistant turn that opens the conversation (rendered with a marker)."""
    marker = "d9d-turn-start-7f3a"
    try:
        alone = template.render([{**message, "content": marker}]).text
        probe = [{"role": "user", "content": "?"}]
        plain, prompted = template.render(probe).text, template.render(probe, add_generation_prompt=True).text
    except TemplateRenderError as error:
        raise ValueError(
            f"row {index}: the conversation opens with an assistant turn, rendered alone: {error}"
        ) from error
    # What the generation prompt adds (after the text both renders share: Phi-3 closes the plain one with EOS).
    shared = next((n for n, (a, b) in enumerate(zip(plain, prompted)) if a != b), min(len(plain), len(prompted)))
    generation_prompt = prompted[shared:]
    opening = alone[: alone.find(marker)] if marker in alone else None
    if opening is None or not opening.endswith(generation_prompt):
        raise ValueError(
            f"row {index}: the conversation opens with an assistant turn, and the chat template does not show where "
            f"it starts (rendered alone it does not follow the generation prompt {generation_prompt!r}); start the "
            "conversation with a system or user turn, add {% generation %} blocks to the template, or use "
            "loss_on='all'"
        )
    return opening


def _turn_in_whole(whole: str, start: int, message: dict[str, Any], control_tokens: tuple[str, ...]) -> str | None:
    """``whole`` up to the end of the turn at ``start`` if it is exactly the content and an end-of-turn token."""
    content = message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    rest = whole[start:].lstrip()
    if not rest.startswith(content):
        return None
    tail = rest[len(content) :].lstrip()
    matches = [token for token in control_tokens if tail.startswith(token)]
    if not matches:
        return None
    end = len(whole) - len(tail) + len(max(matches, key=len))
    return whole[: end + len(whole[end:]) - len(whole[end:].lstrip())]


def _turn_without_closing(after: str, start: int, message: dict[str, Any], control_tokens: tuple[str, ...]) -> str:
    """``after`` cut after the end-of-turn token following the content (drops a conversation's closing)."""
    content = message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    found = after.find(content, start) if content else start
    if found < 0:
        return after
    ends = [after.find(token, found + len(content)) for token in control_tokens]
    ends = [(position, len(token)) for position, token in zip(ends, control_tokens) if position >= 0]
    if not ends:
        return after
    position, length = min(ends)
    end = position + length
    # The whitespace after the token stays with it: a token that strips to its right (Phi-3's <|end|>) holds it.
    return after[: end + len(after[end:]) - len(after[end:].lstrip())]


def default_eos_token(
    tokenizer: Any, template: ChatTemplate | None, beside: dict[str, str] | None = None
) -> str | None:
    """The EOS token from the template config, the tokenizer's config or vocabulary, else ``None``."""
    if template is not None and template.special("eos_token"):
        return template.special("eos_token")
    if beside and beside.get("eos_token"):
        return beside["eos_token"]
    encoding = tokenizer.encode("a")
    if encoding.special_tokens_mask and encoding.special_tokens_mask[-1]:
        return tokenizer.id_to_token(encoding.ids[-1])
    for token in EOS_CANDIDATES:
        if tokenizer.token_to_id(token) is not None:
            return token
    return None


def completion_eos_token(
    tokenizer: Any,
    template: ChatTemplate | None,
    tokenizer_path: str,
    explicit: str | None = None,
    string_completions: bool = True,
) -> str | None:
    """The EOS token string completions end with: ``explicit``, else ``default_eos_token``.

    Raises:
        ValueError: the token is not in the vocabulary, or string completions without any EOS token.
    """
    if explicit is not None:
        token, source = explicit, "eos_token="
    else:
        token = default_eos_token(tokenizer, template, special_tokens_beside(tokenizer_path))
        source = "the tokenizer config's eos_token "  # the only source of a token the vocabulary may lack
    added = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content)
    if token is not None and tokenizer.token_to_id(token) is None and (explicit is not None or string_completions):
        raise ValueError(
            f"{source}{token!r} is not a token of the tokenizer {tokenizer_path!r} (its added/special tokens: "
            f"{added}): pass eos_token= one of its tokens"
        )
    if token is None and string_completions:
        raise ValueError(
            f"the tokenizer {tokenizer_path!r} has no end-of-sequence token, and prompt/completion strings need one "
            "after every completion (trained without it, the model never learns to stop): no eos_token in a "
            "tokenizer_config.json or special_tokens_map.json beside it, none its post-processor appends, none of "
            f"{list(EOS_CANDIDATES)}; pass eos_token= (a token of the tokenizer; its added/special tokens: {added}) "
            'to TextDataModule, or put {"eos_token": "..."} in a tokenizer_config.json next to the tokenizer.json'
        )
    return token


@dataclasses.dataclass
class _TokenizeRows:
    recipe: SFTRecipe
    tokenizer_path: str
    tokenizer_digest: str

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        rows = RowTokenizer(self.recipe, load_tokenizer(self.tokenizer_path, self.tokenizer_digest))
        names = list(batch)
        out: dict[str, list[Any]] = {name: [] for name in _OUTPUT_COLUMNS}
        for position, index in enumerate(indices):
            ids, labels, status = rows({name: batch[name][position] for name in names}, index)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["token_counts"].append(len(ids))
            out["label_counts"].append(trained_targets(labels) if len(ids) else 0)
            out["status"].append(status)
        return out


@dataclasses.dataclass(frozen=True)
class SFTSplit:
    """A tokenized fine-tuning split: kept rows, trained targets per row, and dropped and truncated counts."""

    dataset: Any
    label_counts: np.ndarray
    dropped: int
    truncated: int


def sft_tokenized_split(
    raw: Any, recipe: SFTRecipe, tokenizer_path: str, tokenizer_digest: str, **map_kwargs: Any
) -> SFTSplit:
    """Tokenize a loaded split with ``recipe``, or open the cached result of an earlier run with the same inputs.

    Raises:
        ValueError: a bad row (naming it), or no row left to train.
    """
    from datasets.fingerprint import Hasher

    template_digest = recipe.template.digest if recipe.template is not None else None
    fingerprint = Hasher.hash(
        [
            raw._fingerprint,
            tokenizer_digest,
            template_digest,
            dataclasses.astuple(dataclasses.replace(recipe, template=None)),
            _SFT_RECIPE_VERSION,
        ]
    )
    name = map_kwargs.pop("name", "dataset")
    tokenized = cached_batched_map(
        raw,
        _TokenizeRows(recipe, tokenizer_path, tokenizer_digest),
        fingerprint,
        f"Tokenizing {Path(name).name or name} ({recipe.format}, loss on {recipe.loss_on})",
        with_indices=True,
        **map_kwargs,
    )
    status = np.asarray(tokenized.with_format("numpy")["status"])
    kept = np.flatnonzero(status < DROPPED_TOO_LONG)
    if len(kept) == 0:
        raise ValueError(
            f"no row of {name!r} is left to train: {int((status == DROPPED_TOO_LONG).sum())} longer than "
            f"max_length={recipe.max_length} (truncation={recipe.truncation!r}), "
            f"{int((status == DROPPED_UNTRAINED).sum())} with no trained token"
        )
    label_counts = np.asarray(tokenized.with_format("numpy")["label_counts"], dtype=np.int64)[kept]
    dataset = tokenized if len(kept) == len(status) else tokenized.select(kept)
    return SFTSplit(
        dataset.with_format("numpy", columns=["input_ids", "labels"]),
        label_counts,
        dropped=int((status >= DROPPED_TOO_LONG).sum()),
        truncated=int((status == TRUNCATED).sum()),
    )
