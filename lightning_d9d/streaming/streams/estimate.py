"""Estimate: how many tokens and rows one pass over the corpus gives, counted where the token cache knows, else from
the footers and a small sample.

With a token cache, every unit it holds is counted exactly: its documents and tokens are read from its entry's
header once and kept in the source's count record (``count_record.py``), so a filled cache sizes a pass from one
small record and tokenizes nothing. Units it lacks are estimated at the tokens per row of the counted units (when
they are as many rows as a sample) or of the sample.

The sample is ``sample_docs`` documents or ``sample_chars`` characters, whichever comes first, spread over
``sample_groups`` row groups visited in a fixed seeded order. Tokens per pass are the sample's tokens per row times
the footers' row count; rows are ``tokens / (seq_len + 1)`` for packings that keep every token (with CP rounding
for ``bestfit_split``), and for ``bestfit`` scaled by a yield measured by running the real packer over the sample's
lengths (or the counted units' first documents'). A sample is made once per tokenizer, settings and footers and kept
in the count record. Deterministic for one state of the cache; a cache filled meanwhile changes the count, so a
Trainer's ranks take rank 0's. Trade-off: a few thousand documents are within a few percent for ordinary text and
keep setup short, but a corpus of very uneven lengths or row groups is misjudged; the epoch length is a step count,
so that makes epochs a little longer or shorter, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lightning_d9d.core.progress import count_progress
from lightning_d9d.streaming.packing.bestfit import BestFitPacker
from lightning_d9d.streaming.tokens.count_record import CountRecord
from lightning_d9d.streaming.tokens.memory import SAMPLE_CHARS, SAMPLE_DOCUMENT_CHARS
from lightning_d9d.streaming.tokens.tokenize import encode_documents

if TYPE_CHECKING:
    from lightning_d9d.streaming.plans.spec import StreamSpec
    from lightning_d9d.streaming.sources.source import RowGroupIndex


@dataclass(frozen=True)
class PassSample:
    """One pass's tokens, and sampled documents' token counts (BOS included) that rows are judged by.

    Attributes:
        tokens: the pass's tokens, BOS included (estimated, or counted where ``exact``).
        lengths: the sampled documents' token counts; empty where rows need none of them (no best-fit cropping and
            no CP rounding) or there is no text.
        exact: every unit was counted from the token cache.
    """

    tokens: float
    lengths: tuple[int, ...]
    exact: bool = False

    def rows(self, spec: StreamSpec, capacity: int) -> float:
        """Rows of ``capacity`` tokens one pass fills with ``spec``'s packing (best-fit scaled by its sampled yield)."""
        tokens, lengths, multiple = self.tokens, list(self.lengths), spec.settings.cp_multiple
        if tokens <= 0 or not (lengths or not _needs_lengths(spec)):
            return 0.0
        if not spec.packing.crops_to_row:
            if multiple > 1 and spec.packing.flagged:  # bestfit_split: every piece rounded up for CP
                return tokens * _cp_growth(lengths, capacity, multiple) / capacity
            return tokens / capacity
        return tokens * _bestfit_yield(lengths, capacity, spec.buffer_size, multiple) / capacity


def estimate_pass(
    spec: StreamSpec,
    sample_groups: int = 8,
    sample_docs: int = 4096,
    sample_chars: int = SAMPLE_CHARS,
    capacity: int | None = None,
) -> tuple[float, float]:
    """Estimate ``(tokens, rows)`` of one pass over ``spec.index`` (rows of ``capacity`` tokens, default the rows of
    step 0), from a sample and the parquet footers; see :func:`sample_pass`.
    """
    sample = sample_pass(spec, sample_groups, sample_docs, sample_chars)
    return sample.tokens, sample.rows(spec, capacity or spec.capacity_at(0))


def sample_pass(
    spec: StreamSpec, sample_groups: int = 8, sample_docs: int = 4096, sample_chars: int = SAMPLE_CHARS
) -> PassSample:
    """One pass's tokens over ``spec.index``, from a tokenized sample and the footers' row counts.

    Args:
        spec: the stream settings and the row groups.
        sample_groups: row groups the sample spreads over, at least (where there are as many).
        sample_docs: rows in the sample (null and empty ones included), where the corpus has as many.
        sample_chars: characters of text in the sample, about (a row group gives rows up to its share).
    """
    index, tokenizer = spec.index, spec.encoder()
    candidates = np.flatnonzero(~index.text_free) if index.text_free.size else np.arange(len(index))
    if len(candidates) == 0:
        return PassSample(0.0, ())
    # A fixed order (every rank samples the same groups) that is not file order, which may be sorted by length.
    order = candidates[np.random.default_rng(0).permutation(len(candidates))]
    groups = min(len(candidates), sample_groups)
    per_group, group_chars = max(1, -(-sample_docs // groups)), max(1, sample_chars // groups)
    raw, chars, kept = 0, 0, []
    # Each group visited is a storage read: a bar (in sampled rows, as the sample may end early on characters)
    # where several groups are read.
    bar = count_progress(min(sample_docs, index.total_rows), "estimating one pass", "row", len(order))
    for group in order.tolist():
        if raw >= sample_docs or chars >= sample_chars:
            break
        texts = index.read_capped(group, spec.max_document_chars)[0][:per_group]  # a skipped text: an empty row
        # Rows up to the one that fills the group's share of characters (that one included).
        sizes = np.cumsum([len(text or "") for text in texts])
        taken = int(np.searchsorted(sizes, group_chars)) + 1
        texts = texts[:taken]
        raw += len(texts)
        bar.update(len(texts))
        chars += int(sizes[len(texts) - 1]) if texts else 0
        kept.extend(text for text in texts if text)
    bar.close()
    # A document longer than SAMPLE_DOCUMENT_CHARS counts as its first characters' tokens scaled by its length.
    limit = SAMPLE_DOCUMENT_CHARS
    encodings = encode_documents(tokenizer, [text[:limit] for text in kept])
    lengths = [round(len(e) * max(1.0, len(text) / limit)) + 1 for e, text in zip(encodings, kept)]
    if not lengths:
        return PassSample(0.0, ())
    with_text = index.total_rows - int(index.num_rows[index.text_free].sum()) if index.text_free.size else None
    tokens = sum(lengths) / max(1, raw) * (with_text if with_text is not None else index.total_rows)
    return PassSample(tokens, tuple(lengths))


def backend_sample(
    index: RowGroupIndex, max_document_chars: int | None, groups: int = 4, docs: int = 256, chars: int = 400_000
) -> list[str]:
    """Documents of a few row groups (a fixed choice, the same on every rank), each cut to ``chars / docs``
    characters: what a fast tokenizer backend must encode as ``tokenizers`` does before a run uses it."""
    candidates = np.flatnonzero(~index.text_free) if index.text_free.size else np.arange(len(index))
    order = candidates[np.random.default_rng(1).permutation(len(candidates))][:groups]
    per_doc, kept = max(1, chars // docs), []
    for group in order.tolist():
        texts = index.read_capped(group, max_document_chars)[0]
        kept.extend(text[:per_doc] for text in texts[: docs // groups] if text)
    return kept


def count_pass(
    spec: StreamSpec, sample_groups: int = 8, sample_docs: int = 4096, sample_chars: int = SAMPLE_CHARS
) -> PassSample:
    """One pass's tokens over ``spec``: counted for every unit its token cache holds (exact when it holds them all),
    the rest estimated; without a cache, :func:`sample_pass`. The count record is updated with what was learnt."""
    if spec.cache is None:
        return sample_pass(spec, sample_groups, sample_docs, sample_chars)
    record = CountRecord(spec.cache)
    try:
        return _counted(spec, record, (sample_groups, sample_docs, sample_chars))
    finally:
        record.save()


def stored_sample(
    spec: StreamSpec,
    sample_groups: int = 8,
    sample_docs: int = 4096,
    sample_chars: int = SAMPLE_CHARS,
    record: CountRecord | None = None,
) -> PassSample:
    """:func:`sample_pass`, read from the source's count record where a setup stored it (the same tokenizer, settings,
    footers and sample), else made and stored there; without a token cache, made."""
    if spec.cache is None:
        return sample_pass(spec, sample_groups, sample_docs, sample_chars)
    own = record is None
    record = CountRecord(spec.cache) if record is None else record
    params = [sample_groups, sample_docs, sample_chars, SAMPLE_DOCUMENT_CHARS]
    kept = record.sample(params)
    if kept is not None:
        return PassSample(kept[0], tuple(kept[1]))
    sample = sample_pass(spec, sample_groups, sample_docs, sample_chars)
    record.keep_sample(params, sample.tokens, list(sample.lengths))
    if own:
        record.save()
    return sample


def _counted(spec: StreamSpec, record: CountRecord, sampling: tuple[int, int, int]) -> PassSample:
    """The pass's tokens: exact for the units ``record`` counts, at a rate per row for the others (the counted units'
    where they are as many rows as a sample, else the sample's)."""
    index, units, (sample_groups, sample_docs, _) = spec.index, spec.units, sampling
    names = [record.unit_name(*unit) for unit in zip(units.group.tolist(), units.start.tolist(), units.stop.tolist())]
    rows = units.stop - units.start
    text = ~index.text_free[units.group] if index.text_free.size else np.ones(len(units), bool)
    docs, tokens, known = record.counts(names, units.group.tolist(), text)
    counted, missing = text & known, text & ~known
    counted_tokens = int((docs + tokens)[counted].sum())  # a BOS per document
    counted_rows, missing_rows = int(rows[counted].sum()), int(rows[missing].sum())
    enough = counted_rows >= min(sample_docs, counted_rows + missing_rows) and (
        int(counted.sum()) >= min(sample_groups, int(text.sum()))
    )
    if not enough:
        sample = stored_sample(spec, *sampling, record=record)
        if not counted.any():
            return sample
        rate = sample.tokens / max(1, counted_rows + missing_rows)
        return PassSample(counted_tokens + rate * missing_rows, sample.lengths)
    lengths: list[int] = []
    if _needs_lengths(spec):
        # The counted units with documents, in a fixed order that is not file order; as many documents from each as
        # the sample takes from a row group.
        order = [names[i] for i in np.random.default_rng(0).permutation(len(names)).tolist() if counted[i] and docs[i]]
        lengths = record.lengths(order, max(1, -(-sample_docs // sample_groups)), sample_docs)
        if not lengths:  # their entries gone since they were counted: the sample's lengths
            lengths = list(stored_sample(spec, *sampling, record=record).lengths)
    tokens_per_pass = counted_tokens + counted_tokens / max(1, counted_rows) * missing_rows
    return PassSample(float(tokens_per_pass), tuple(lengths), exact=not missing.any())


def _needs_lengths(spec: StreamSpec) -> bool:
    """Whether rows depend on documents' lengths, not only on the tokens: best-fit's crops, CP-rounded pieces."""
    return spec.packing.crops_to_row or (spec.settings.cp_multiple > 1 and spec.packing.flagged)


def first_text(index: RowGroupIndex) -> tuple[int, int] | None:
    """``(row group, row)`` of the first non-empty text, or ``None`` when the corpus holds none."""
    for group in range(len(index)):
        if index.text_free.size and index.text_free[group]:
            continue
        for row, text in enumerate(index.read_texts(group)):
            if text:
                return group, row
    return None


def _cp_growth(lengths: list[int], capacity: int, multiple: int) -> float:
    """Row positions per token of ``bestfit_split`` pieces rounded up to ``multiple``."""
    array = np.asarray(lengths, np.int64)
    rest = array % capacity
    padded = array - rest + -(-rest // multiple) * multiple
    return float(padded.sum() / max(1, array.sum()))


def _bestfit_yield(lengths: list[int], capacity: int, buffer_size: int, cp_multiple: int = 1) -> float:
    """Row positions filled (document tokens, and CP padding) per token taken, by best-fit over ``lengths``."""
    rng = np.random.default_rng(0)
    feed = int(min(50_000, max(3 * len(lengths), 4 * buffer_size)))
    order = rng.choice(np.asarray(lengths), size=feed)
    packer = BestFitPacker(capacity, buffer_size, cp_multiple=cp_multiple)
    fed = iter(order.tolist())
    zeros = np.zeros(capacity, np.int32)

    class _Exhausted(Exception):
        pass

    def refill() -> None:
        for length in fed:
            packer.add(zeros[: min(length, capacity)], length, (0, 0))
            return
        raise _Exhausted

    try:
        while True:
            packer.take(1, refill)
    except _Exhausted:
        pass
    consumed = int(order.sum()) - int(packer.snapshot()[:, 1].sum())
    filled = packer.counters.emitted + packer.counters.cp_padding
    return filled / consumed if consumed > 0 else 1.0
