"""Formats: recognise what a fine-tuning row holds and bring it into one shape.

The format is decided from column names alone (messages or ShareGPT ``conversations``, then prompt/completion, then
text; ``format=`` overrides it). Rows become plain dicts, ShareGPT speakers mapped to roles and ``None`` keys dropped.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

Format = Literal["text", "prompt_completion", "messages"]
FORMATS: tuple[str, ...] = ("text", "prompt_completion", "messages")


class LossOn(enum.StrEnum):
    """Which tokens of a sample are trained (its labels; the rest are ``-100``)."""

    ALL = "all"
    COMPLETION = "completion"  # prompt/completion: the completion, with its end token
    ASSISTANT = "assistant"  # messages: every assistant turn, with its end-of-turn token
    LAST_ASSISTANT = "last_assistant"  # messages: the last assistant turn


LOSS_ON_BY_FORMAT: dict[str, tuple[LossOn, ...]] = {
    "text": (LossOn.ALL,),
    "prompt_completion": (LossOn.COMPLETION, LossOn.ALL),
    "messages": (LossOn.ASSISTANT, LossOn.LAST_ASSISTANT, LossOn.ALL),
}
"""The ``loss_on`` values each format accepts; the first is its default."""


def loss_on_setting(value: Any) -> LossOn | None:
    """A ``loss_on`` setting as given (``None``: the format's default), checked."""
    if value is None:
        return None
    try:
        return LossOn(value)
    except ValueError:
        valid = [member.value for member in LossOn]
        raise ValueError(f"loss_on must be one of {valid} or None (the format's default), got {value!r}") from None


def resolve_loss_on(format: str, loss_on: LossOn | str | None) -> LossOn:
    """``loss_on`` for ``format``: its default for ``None``; ``ValueError`` if the format lacks the value."""
    allowed = LOSS_ON_BY_FORMAT[format]
    chosen = loss_on_setting(loss_on)
    if chosen is None:
        return allowed[0]
    if chosen not in allowed:
        raise ValueError(
            f"loss_on={chosen.value!r} does not apply to {format!r} data; valid: {[a.value for a in allowed]}"
        )
    return chosen


SHAREGPT_COLUMN = "conversations"
# ShareGPT speakers and the roles chat templates know them as.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where each format's fields live in a row."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


def detect_format(column_names: list[str], columns: Columns, requested: str | None = None) -> Format:
    """The split's format: ``requested`` (checked against the columns), else read from the columns."""
    present = set(column_names)
    if requested is not None:
        if requested not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)} (or None to detect it), got {requested!r}")
        needed = required_columns(requested, columns, present)
        missing = [name for name in needed if name not in present]
        if missing:
            raise ValueError(
                f"format {requested!r} needs column(s) {missing}, but the dataset's columns are {sorted(present)}"
            )
        return requested  # type: ignore[return-value]
    if columns.messages in present or SHAREGPT_COLUMN in present:
        return "messages"
    if columns.prompt in present and columns.completion in present:
        return "prompt_completion"
    if columns.text in present:
        return "text"
    raise ValueError(
        f"text_column {columns.text!r} is not a column of the dataset, and neither are the fine-tuning formats' "
        f"(messages: {columns.messages!r} or ShareGPT's {SHAREGPT_COLUMN!r}; prompt/completion: {columns.prompt!r} "
        f"and {columns.completion!r}), so its format cannot be told; its columns are {sorted(present)}; set "
        "text_column=, messages_column=, prompt_column=/completion_column= or format="
    )


def required_columns(format: str, columns: Columns, present: set[str] | None = None) -> list[str]:
    """The columns a row of ``format`` reads (the messages column falls back to ShareGPT's when absent)."""
    if format == "messages":
        if present is not None and columns.messages not in present and SHAREGPT_COLUMN in present:
            return [SHAREGPT_COLUMN]
        return [columns.messages]
    if format == "prompt_completion":
        return [columns.prompt, columns.completion]
    return [columns.text]


def row_messages(value: Any, row: int, column: str) -> list[dict[str, Any]]:
    """One conversation as plain ``{"role", "content", ...}`` dicts (ShareGPT turns mapped); raises if malformed."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"row {row}: column {column!r} must hold a list of messages, got {type(value).__name__}")
    messages = []
    for number, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"row {row}: message {number} of {column!r} is {type(message).__name__}, not a dict")
        plain = {key: item for key, item in message.items() if item is not None}
        if "role" not in plain and "from" in plain:
            speaker = plain.pop("from")
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(
                    f"row {row}: message {number} has ShareGPT speaker {speaker!r}; known: {sorted(SHAREGPT_ROLES)}"
                )
            plain["role"] = SHAREGPT_ROLES[speaker]
            if "value" in plain and "content" not in plain:
                plain["content"] = plain.pop("value")
        if "role" not in plain or "content" not in plain:
            raise ValueError(
                f"row {row}: message {number} of {column!r} needs 'role' and 'content' (or ShareGPT's 'from' and "
                f"'value'); it has {sorted(message)}"
            )
        if not isinstance(plain["content"], str):
            # A template would render a list or number as its Python repr (Llama 3's ``| trim``) or fail on it.
            raise ValueError(
                f"row {row}: message {number} of {column!r} has content of type {type(plain['content']).__name__}; "
                "content must be a string (multimodal content lists are not supported)"
            )
        messages.append(plain)
    if not messages:
        raise ValueError(f"row {row}: column {column!r} holds an empty conversation")
    return messages


def row_part(value: Any, row: int, column: str) -> str | list[dict[str, Any]]:
    """A prompt or completion: a string, or a list of messages; ``ValueError`` for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return row_messages(value, row, column)
    raise ValueError(
        f"row {row}: column {column!r} must hold a string or a list of messages, got {type(value).__name__}"
    )
