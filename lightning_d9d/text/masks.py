"""Loss masks and truncation: which tokens of a sample are trained, and how a long sample is cut honestly.

``span_mask`` trains every token overlapping a trained character span (transformers' rule), and a span edge inside
a token is an error. A sample left with no trained target is dropped whatever the truncation rule.

Trade-off: a token straddling an edge is trained rather than lost; ambiguous edges raise instead of guessing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from lightning_d9d.core.tokens import IGNORE_INDEX

Truncation = Literal["error", "drop", "keep_start"]
TRUNCATIONS: tuple[str, ...] = ("error", "drop", "keep_start")
KEPT, TRUNCATED, DROPPED_TOO_LONG, DROPPED_UNTRAINED = 0, 1, 2, 3
"""Statuses of a tokenized sample."""


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
    """Raise ValueError when a span starts or ends inside a token (naming the row and the characters)."""
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
    """The token holding ``boundary`` strictly inside, or ``None`` (a binary search: runs for every turn)."""
    token = bisect.bisect_left(offsets, boundary, key=lambda offset: offset[0]) - 1
    while token >= 0 and offsets[token][0] == offsets[token][1]:  # an empty token (a prepended marker) holds none
        token -= 1
    return token if token >= 0 and offsets[token][1] > boundary else None


@dataclass(frozen=True)
class TokenizedText:
    """A rendered text, its tokens' character ``offsets`` and the template's ``control_ids``."""

    ids: Sequence[int]
    offsets: Sequence[tuple[int, int]]
    text: str
    control_ids: frozenset[int]


def fit_turn_spans(spans: Sequence[tuple[int, int]], tokens: TokenizedText, row: int) -> list[tuple[int, int]]:
    """Turns found between two renders fitted to what the model writes (after the header, up to the end-of-turn)."""
    spans = start_after_control_tokens(spans, tokens)
    check_token_boundaries(tokens.offsets, spans, row)
    return end_at_end_of_turn(spans, tokens)


def start_after_control_tokens(spans: Sequence[tuple[int, int]], tokens: TokenizedText) -> list[tuple[int, int]]:
    """Spans starting inside a control token that swallowed only whitespace (Phi-3's header) start after it."""
    ids, offsets, text = tokens.ids, tokens.offsets, tokens.text
    moved = []
    for start, end in spans:
        token = _token_around(offsets, start)
        if token is not None and ids[token] in tokens.control_ids and not text[start : offsets[token][1]].strip():
            start = min(offsets[token][1], end)
        moved.append((start, end))
    return moved


def end_at_end_of_turn(spans: Sequence[tuple[int, int]], tokens: TokenizedText) -> list[tuple[int, int]]:
    """Each span cut after its last control token when only whitespace follows it (never generated)."""
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
    """``(ids, labels, status)`` of a sample under the truncation rule (``"error"`` raises on a long sample)."""
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
