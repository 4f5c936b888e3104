"""Loss masks and truncation: which tokens of a sample are trained, and how a long sample is cut honestly.

Algorithm: a trained region is a character span of the text that was encoded (a ``{% generation %}`` block, an
assistant turn found by rendering turn by turn, a completion). ``span_mask`` marks every token whose character
offsets overlap a span — the rule transformers applies to ``return_assistant_tokens_mask`` — in one pass, as
tokens and spans are both in order. ``check_token_boundaries`` refuses a span whose ends fall inside a token
(the tokens of a prefix would not be a prefix of the whole's tokens, so any mask would be wrong by a token),
found by a binary search over the token offsets. A turn found between two renders is first fitted to what the
model writes (``fit_turn_spans``): ``start_after_control_tokens`` moves its start past a header token that
swallowed the turn's leading whitespace, and ``end_at_end_of_turn`` ends it at its end-of-turn token, without the
separator after it.
Labels are Hugging Face's: the input ids where trained, ``-100`` elsewhere, unshifted; ``trained_targets``
counts what a causal LM predicts after its shift (position 0 is never a target).

``truncate`` applies the truncation rule to a sample longer than ``max_length``: ``"error"`` raises naming the
row, ``"drop"`` drops it, ``"keep_start"`` keeps its first ``max_length`` tokens; a sample left with no trained
target is dropped whatever the rule (it would add 0 to the loss and its tokens to the normaliser, or NaN on a
step of its own). The returned status says what happened, so the callers can count it.

Trade-off: marking by character overlap trains a token that straddles a span's edge rather than silently losing
it; the boundary check turns the cases where that would differ from tokenizing the prefix into an error
instead of a guess.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from lightning_d9d.tokens import IGNORE_INDEX

Truncation = Literal["error", "drop", "keep_start"]
TRUNCATIONS: tuple[str, ...] = ("error", "drop", "keep_start")
KEPT, TRUNCATED, DROPPED_TOO_LONG, DROPPED_UNTRAINED = 0, 1, 2, 3
"""Statuses of a tokenized sample: kept whole, kept cut to max_length, dropped for its length, dropped with
nothing left to train."""


def span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``bool [tokens]``: True at every token whose ``[start, end)`` characters overlap one of ``spans``."""
    mask = np.zeros(len(offsets), dtype=bool)
    ordered = sorted(span for span in spans if span[1] > span[0])
    index = 0
    for token, (start, end) in enumerate(offsets):
        while index < len(ordered) and start >= ordered[index][1]:
            index += 1
        if index == len(ordered):
            break
        if end > ordered[index][0] and end > start:
            mask[token] = True
    return mask


def check_token_boundaries(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], row: int) -> None:
    """Raises ValueError when a span starts or ends inside a token (naming the row and the characters)."""
    for boundary in (edge for span in spans for edge in span):
        token = _token_around(offsets, boundary)
        if token is not None:
            token_start, token_end = offsets[token]
            raise ValueError(
                f"row {row}: a trained span's edge (character {boundary}) falls inside a token "
                f"(characters {token_start}-{token_end}): the template's turn prefix does not tokenize as a "
                "prefix of the whole conversation, so no exact mask exists; mark the assistant output "
                "with {% generation %} blocks in the template, or use loss_on='all'"
            )


def _token_around(offsets: Sequence[tuple[int, int]], boundary: int) -> int | None:
    """The token whose characters hold ``boundary`` strictly inside (``start < boundary < end``), or ``None``.

    Tokens come in text order, so only those starting before the boundary can hold it, and of those the last one
    reaches furthest: a binary search instead of a scan, as this runs for every turn of every row.
    """
    token = bisect.bisect_left(offsets, boundary, key=lambda offset: offset[0]) - 1
    while token >= 0 and offsets[token][0] == offsets[token][1]:  # an empty token (a prepended marker) holds none
        token -= 1
    return token if token >= 0 and offsets[token][1] > boundary else None


@dataclass(frozen=True)
class TokenizedText:
    """A rendered text and its tokens, as the turn fitting reads them.

    Attributes:
        ids: the token ids.
        offsets: each token's ``[start, end)`` characters in ``text``.
        text: the rendered text.
        control_ids: ids of the template's control tokens (headers, end-of-turn markers).
    """

    ids: Sequence[int]
    offsets: Sequence[tuple[int, int]]
    text: str
    control_ids: frozenset[int]


def fit_turn_spans(spans: Sequence[tuple[int, int]], tokens: TokenizedText, row: int) -> list[tuple[int, int]]:
    """Turns found between two renders fitted to what the model writes: each starts after a header token that
    swallowed its leading whitespace (``start_after_control_tokens``) and ends at its end-of-turn token
    (``end_at_end_of_turn``).

    Raises:
        ValueError: a span (after its start moved) starts or ends inside a token, see ``check_token_boundaries``.
    """
    spans = start_after_control_tokens(spans, tokens)
    check_token_boundaries(tokens.offsets, spans, row)
    return end_at_end_of_turn(spans, tokens)


def start_after_control_tokens(spans: Sequence[tuple[int, int]], tokens: TokenizedText) -> list[tuple[int, int]]:
    """Each span whose start falls inside a control token that swallowed only whitespace of the span (a header
    token that strips to its right, as Phi-3's ``<|assistant|>``) starts after that token: the header is prompt,
    and the whitespace it holds is not a token the model could write."""
    ids, offsets, text = tokens.ids, tokens.offsets, tokens.text
    moved = []
    for start, end in spans:
        token = _token_around(offsets, start)
        if token is not None and ids[token] in tokens.control_ids and not text[start : offsets[token][1]].strip():
            start = min(offsets[token][1], end)
        moved.append((start, end))
    return moved


def end_at_end_of_turn(spans: Sequence[tuple[int, int]], tokens: TokenizedText) -> list[tuple[int, int]]:
    """Each span cut after its last control token when only whitespace follows it inside the span.

    A turn found between two renders ends where the next turn's header starts, so it also holds the separator a
    template writes after the end-of-turn token (ChatML's and Gemma's newline): the model must learn to stop at
    the end-of-turn token, not to write the separator that is never generated. A span that ends in text (a
    template without control tokens) keeps its end. Spans must start and end on token boundaries.
    """
    ids, offsets, text = tokens.ids, tokens.offsets, tokens.text
    starts = [start for start, _ in offsets]
    cut = []
    for start, end in spans:
        first, stop = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        new_end = end
        for token in range(stop - 1, first - 1, -1):
            if ids[token] in tokens.control_ids:
                new_end = offsets[token][1]
                break
            if text[offsets[token][0] : offsets[token][1]].strip():
                break
        cut.append((start, new_end))
    return cut


def labels_from_mask(ids: Sequence[int], mask: np.ndarray) -> np.ndarray:
    """Hugging Face labels: ``ids`` where trained, ``-100`` elsewhere (unshifted: the model shifts)."""
    return np.where(mask, np.asarray(ids, dtype=np.int64), IGNORE_INDEX)


def trained_targets(labels: np.ndarray) -> int:
    """Targets a causal LM trains after its shift: trained labels at positions 1 and later."""
    return int((np.asarray(labels)[1:] != IGNORE_INDEX).sum())


def truncate(
    ids: np.ndarray, labels: np.ndarray, max_length: int, rule: Truncation, row: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids, labels, status)`` of a sample under the truncation rule (see the module docstring).

    Raises:
        ValueError: ``rule="error"`` and the sample is longer than ``max_length`` (naming the row and length).
    """
    status = KEPT
    if len(ids) > max_length:
        if rule == "error":
            raise ValueError(
                f"row {row} has {len(ids)} tokens, more than max_length={max_length}; raise max_length, or set "
                "truncation='drop' (skip such rows, counted) or 'keep_start' (cut them, counted)"
            )
        if rule == "drop":
            return ids[:0], labels[:0], DROPPED_TOO_LONG
        ids, labels, status = ids[:max_length], labels[:max_length], TRUNCATED
    if trained_targets(labels) == 0:
        return ids[:0], labels[:0], DROPPED_UNTRAINED
    return ids, labels, status
