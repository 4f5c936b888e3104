"""Spec: everything the K streams of a corpus need, checked once, picklable for DataLoader workers.

Each spec checks its settings when made, so a stream never starts from a contradictory one. Trade-off: a spec
carries the tokenizer's serialized JSON (a few MB) to every worker, rather than a path that could change under a
running job.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_d9d.core.checks import non_negative_int, positive_int
from lightning_d9d.core.digest import digest
from lightning_d9d.core.resume import MISSING, Fingerprint
from lightning_d9d.parallel.context_parallel import cp_multiple
from lightning_d9d.streaming.plans.mixture import MixturePlan
from lightning_d9d.streaming.plans.packings import PACKINGS, BufferGrowth, packing_of
from lightning_d9d.streaming.plans.shape import ShapeSchedule
from lightning_d9d.tokenization.backends import TokenizerBackend, backend_for

if TYPE_CHECKING:
    from lightning_d9d.streaming.packing.rows import Packing
    from lightning_d9d.streaming.sources.source import RowGroupIndex, Units


@dataclass(frozen=True)
class StreamSettings:
    """The settings that decide a corpus's rows (and the tokenizer batch size, which does not), checked once.

    Attributes:
        seq_len: tokens per row of ``input_ids`` (rows hold ``seq_len + 1`` tokens): a number or phases
            ``[[from_step, L], ...]`` (:class:`ShapeSchedule`).
        global_batch_size: rows of every step over all ranks (G): a number or phases by step or by tokens.
        packing: the packing strategy, or its name (:data:`PACKINGS`).
        seed: seeds each pass's unit order.
        num_streams: K, the streams the units are dealt to; K must divide G.
        bestfit_buffer_size: best-fit's buffer (documents; pieces for ``bestfit_split``).
        max_document_chars: longer documents are skipped and counted (``None``: no limit).
        tokenizer_batch_size: documents per tokenizer call, at most (never changes a row).
        growth: how a fresh best-fit buffer grows to ``buffer_size`` (a resumed stream keeps its own).
        context_parallel_size: the CP size rows are laid out for (1: none); ``seq_len`` must be a multiple of ``2·c``.
        shapes: the global batch size and ``seq_len`` of every step (made from the two settings).

    Raises:
        ValueError: a setting out of range, a malformed schedule, or an unknown packing.
    """

    seq_len: Any
    global_batch_size: Any
    packing: Packing
    seed: int = 0
    num_streams: int = 16
    bestfit_buffer_size: int = 1000
    max_document_chars: int | None = None
    tokenizer_batch_size: int = 128
    growth: BufferGrowth = field(default_factory=BufferGrowth)
    context_parallel_size: int = 1
    shapes: ShapeSchedule = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "packing", packing_of(self.packing) if isinstance(self.packing, str) else self.packing)
        if self.packing not in PACKINGS.values():
            raise ValueError(f"packing={self.packing!r} is not valid: use one of {list(PACKINGS)}")
        for name in ("num_streams", "bestfit_buffer_size", "tokenizer_batch_size", "context_parallel_size"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        shapes = ShapeSchedule(self.global_batch_size, self.seq_len)
        object.__setattr__(self, "shapes", shapes)
        # The spellings, as plain data: a number stays a number, phases become lists (compared, pickled, saved).
        for name, values in (("seq_len", shapes.seq_lens), ("global_batch_size", shapes.global_batch_sizes)):
            object.__setattr__(self, name, values.values[0] if len(values.starts) == 1 else values.to_list())
        c = self.context_parallel_size
        if c > 1:  # without CP a row is never split, so any seq_len is valid
            shapes.check_divisible(
                "seq_len", 2 * c, f"2 × context_parallel_size = {2 * c} (context_parallel_size={c})",
                f"every row is split into {2 * c} chunks over the CP ranks",
            )  # fmt: skip
        object.__setattr__(self, "seed", non_negative_int("seed", self.seed))
        object.__setattr__(
            self, "max_document_chars", positive_int("max_document_chars", self.max_document_chars, allow_none=True)
        )
        common = math.gcd(*shapes.global_batch_sizes.values)
        valid = [k for k in range(1, min(common, 64) + 1) if common % k == 0]
        shapes.check_divisible(
            "global_batch_size", self.num_streams, f"num_streams={self.num_streams}",
            "every step takes global_batch_size / num_streams rows of each stream",
            f"use num_streams in {valid} or a global_batch_size that is a multiple of {self.num_streams} (in every "
            "phase)",
        )  # fmt: skip

    @property
    def cp_multiple(self) -> int:
        """What every piece of a best-fit row is padded to a multiple of: ``2·c`` (1 without CP)."""
        return cp_multiple(self.context_parallel_size)


@dataclass(frozen=True)
class StreamSpec:
    """The streams of one source: its data, the tokenizer, the settings, and how a process reads ahead.

    Attributes:
        settings: the settings shared by every source of the corpus.
        index, units: the row groups to read and the units dealt to streams.
        tokenizer_json: the tokenizer, serialized (``Tokenizer.to_str()``).
        bos_id: the BOS token id prepended to every document.
        pad_id: the token id at padding positions.
        shuffle: reshuffle units every pass (``False``: rotated file order, for validation).
        prefetch, chunk_chars, cache: read-ahead chunks, tokenizer-call character cap and token cache; no row changes.
        record_pieces: blocks list the pieces of their rows (provenance; no row changes).
        excluded: documents (global row group, row) never read (``exclude_documents``).
        tokenizer_backend: the encoder of ``tokenizer_json``, resolved (lightning_d9d.tokenization.backends); every
            backend gives the same ids, so it changes no row and is no part of the fingerprint or the cache key.
    """

    settings: StreamSettings
    index: RowGroupIndex
    units: Units
    tokenizer_json: str
    bos_id: int
    pad_id: int = 0
    shuffle: bool = True
    prefetch: int = 4
    chunk_chars: int = 0
    cache: Any = None
    record_pieces: bool = False
    excluded: frozenset[tuple[int, int]] = frozenset()
    tokenizer_backend: str = "tokenizers"

    def encoder(self) -> TokenizerBackend:
        """This process's encoder of the spec's tokenizer (made once per process)."""
        return backend_for(self.tokenizer_backend, self.tokenizer_json)

    def capacity_at(self, step: int) -> int:
        """Tokens of a row of ``step`` (``seq_len + 1``)."""
        return self.settings.shapes.seq_len_at(step) + 1

    def capacity_span(self, step: int) -> tuple[int, float]:
        """``(capacity of step, the first later step whose capacity may differ)`` (that step may be ``math.inf``)."""
        _, end, seq_len = next(self.settings.shapes.seq_lens.segments(step, math.inf))
        return seq_len + 1, end

    @property
    def max_capacity(self) -> int:
        """Tokens of the longest rows of the schedule."""
        return self.settings.shapes.max_seq_len + 1

    @property
    def capacity(self) -> int:
        """Tokens of every row (ValueError where ``seq_len`` has phases: ask :meth:`capacity_at` a step)."""
        seq_lens = self.settings.shapes.seq_lens
        if not seq_lens.fixed:
            raise ValueError("seq_len has phases: a row's length depends on the step (capacity_at(step))")
        return seq_lens.values[0] + 1

    @property
    def packing(self) -> Packing:
        return self.settings.packing

    @property
    def num_streams(self) -> int:
        return self.settings.num_streams

    @property
    def buffer_size(self) -> int:
        return self.settings.bestfit_buffer_size

    @property
    def growth(self) -> BufferGrowth:
        return self.settings.growth

    @property
    def max_document_chars(self) -> int | None:
        return self.settings.max_document_chars

    @property
    def tokenizer_batch_size(self) -> int:
        return self.settings.tokenizer_batch_size

    def with_reading(self, prefetch: int, chunk_chars: int) -> StreamSpec:
        """This spec with another read-ahead and tokenizer-call size (neither changes a row)."""
        return dataclasses.replace(self, prefetch=prefetch, chunk_chars=chunk_chars)


@dataclass(frozen=True)
class MixtureSpec:
    """The K streams of a corpus: one or more named sources, and the rows each gives every step.

    Attributes:
        names: the source names, in order (a row's source index refers to it).
        sources: each source's stream spec (shared K, seq_len, packing, tokenizer; own files and text column).
        plan: the rows per source of every step.
        skipped: data steps ``[start, stop)`` consumed untrained (``DataEdits.skipped_data``), ascending.

    Raises:
        ValueError: no source, names and specs that differ in number, or sources that disagree on shared settings.
    """

    names: tuple[str, ...]
    sources: tuple[StreamSpec, ...]
    plan: MixturePlan
    skipped: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.sources or len(self.names) != len(self.sources):
            raise ValueError(f"a corpus needs one spec per source name, got {len(self.names)} names and "
                             f"{len(self.sources)} specs")  # fmt: skip
        first = self.sources[0]
        for name, spec in zip(self.names, self.sources):
            for setting in ("settings", "bos_id", "tokenizer_json"):
                if getattr(spec, setting) != getattr(first, setting):
                    raise ValueError(f"source {name!r} has another {setting} than source {self.names[0]!r}")
        if self.plan.rows_per_step != first.settings.shapes.global_batch_sizes:
            raise ValueError(
                f"the plan takes {self.plan.rows_per_step.to_list()} rows a step, the settings "
                f"global_batch_size={first.settings.global_batch_size}"
            )

    @property
    def num_streams(self) -> int:
        return self.sources[0].num_streams

    @property
    def shapes(self) -> ShapeSchedule:
        return self.sources[0].settings.shapes

    @property
    def packing(self) -> Packing:
        return self.sources[0].packing

    @property
    def bos_id(self) -> int:
        return self.sources[0].bos_id

    def capacity_at(self, step: int) -> int:
        return self.sources[0].capacity_at(step)

    def capacity_span(self, step: int) -> tuple[int, float]:
        return self.sources[0].capacity_span(step)

    @property
    def files(self) -> list[str]:
        return [path for source in self.sources for path in source.index.files]

    def with_reading(self, prefetch_cap: int, chunk_chars: int) -> MixtureSpec:
        """Every source reading ahead at most ``prefetch_cap`` chunks, tokenizer calls capped at ``chunk_chars``."""
        sources = tuple(
            spec.with_reading(max(1, min(spec.prefetch, prefetch_cap)), spec.chunk_chars or chunk_chars)
            for spec in self.sources
        )
        return dataclasses.replace(self, sources=sources)

    def with_plan(self, plan: MixturePlan) -> MixtureSpec:
        return dataclasses.replace(self, plan=_plan_skipping(plan, self.skipped))

    def with_skipped(self, skipped: tuple[tuple[int, int], ...]) -> MixtureSpec:
        return dataclasses.replace(self, skipped=tuple(skipped), plan=_plan_skipping(self.plan, tuple(skipped)))

    def fingerprint(self) -> CorpusFingerprint:
        """What decides the rows of every step: the settings, and by source its files and text column."""
        first, settings = self.sources[0], self.sources[0].settings
        return CorpusFingerprint(
            tokenizer=digest(first.tokenizer_json),
            bos_id=first.bos_id,
            packing=settings.packing.name,
            seed=settings.seed,
            num_streams=settings.num_streams,
            bestfit_buffer_size=settings.bestfit_buffer_size,
            max_document_chars=settings.max_document_chars,
            context_parallel_size=settings.context_parallel_size,
            sources=tuple(
                (name, files_summary(spec.index), tuple(spec.index.file_digests), spec.index.text_column)
                for name, spec in zip(self.names, self.sources)
            ),
            file_labels=tuple(tuple(spec.index.file_labels()) for spec in self.sources),
        )


def files_summary(index: RowGroupIndex) -> str:
    """``"N files, R rows, sha256 …"`` of a source's files (labels and content digests)."""
    labels = "".join(f"{label}\0{file_digest}\0" for label, file_digest in zip(index.file_labels(), index.file_digests))
    return f"{len(index.files)} files, {index.total_rows} rows, sha256 {digest(labels)}"


@dataclass(frozen=True, kw_only=True)
class CorpusFingerprint(Fingerprint):
    """What decides a corpus's rows: the settings and, per source, ``(name, files summary, file digests, text
    column)``. A source added is no mismatch here; one removed, or whose files changed, is. The shares and the shapes
    (global batch size, ``seq_len``) are saved with the plan and checked on their own, since a resume may change
    them deliberately (``on_mixture_change``).
    """

    tokenizer: str
    bos_id: int
    packing: str
    seed: int
    num_streams: int
    bestfit_buffer_size: int
    max_document_chars: int | None
    sources: tuple[tuple[str, str, tuple[int, ...], str], ...]
    context_parallel_size: int = 1
    file_labels: tuple[tuple[str, ...], ...] = field(default=(), compare=False, repr=False)

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        now = self.to_dict()
        differences = [
            self.describe_difference(name, _plain(saved.get(name, MISSING)), value)
            for name, value in now.items()
            if name != "sources" and _plain(saved.get(name, MISSING)) != value
        ]
        then = saved.get("sources", MISSING)
        if not isinstance(then, (list, tuple)) or not all(isinstance(s, (list, tuple)) and len(s) == 4 for s in then):
            return [*differences, f"sources: checkpoint {_short(then)}, this run {[s[0] for s in self.sources]}"]
        mine = {source[0]: (i, source) for i, source in enumerate(now["sources"])}
        removed, added = self._removed_and_added(then)
        if removed:
            differences.append(_removed_message(removed, added))
        for source in then:
            if source[0] in mine:
                i, current = mine[source[0]]
                differences.extend(self._source_differences(i, list(_plain(source)), current))
        return differences

    def mismatch_advice(self, saved: dict[str, Any]) -> str | None:
        """Advice when sources were only removed or renamed: keep the checkpoint's names, or keep a removed source at
        weight 0 under ``on_mixture_change='continue'``.
        """
        then = saved.get("sources")
        if not isinstance(then, (list, tuple)):
            return None
        removed, added = self._removed_and_added(then)
        if not removed or len(self.mismatches(saved)) != 1:
            return None
        old, one = _names(removed), len(removed) == 1
        zero = ", ".join([f"{name!r}: 0" for name in removed] + [f"{name!r}: <weight>" for name in added])
        keep = (
            f"To continue {old} where {'it' if one else 'they'} stopped, use the checkpoint's name{'' if one else 's'} "
            f"{old} again (a source's position is saved under its name). "
            if added
            else ""
        )
        instead = f"To replace {old} by {_names(added)}" if added else f"To stop reading {old}"
        fresh = f" ({_names(added)} then start{'s' if len(added) == 1 else ''} fresh)" if added else ""
        return (
            f"{keep}{instead}, keep {old} in train_files, give {'it' if one else 'them'} weight 0 from the resume "
            f"step on (the checkpoint's global step S: weights=[[0, <the checkpoint's weights>], [S, {{..., {zero}}}]])"
            f" and pass on_mixture_change='continue'{fresh}"
        )

    def _removed_and_added(self, then: Any) -> tuple[list[str], list[str]]:
        saved_names = [source[0] for source in then if isinstance(source, (list, tuple)) and source]
        names = [source[0] for source in self.sources]
        return [n for n in saved_names if n not in names], [n for n in names if n not in saved_names]

    def _source_differences(self, i: int, then: list, now: list) -> list[str]:
        """How source ``i`` differs from its saved ``(name, summary, digests, column)``."""
        where = "files" if len(self.sources) == 1 else f"sources[{now[0]!r}]"
        differences = []
        if then[3] != now[3]:
            differences.append(f"{where}.text_column: checkpoint {then[3]!r}, this run {now[3]!r}")
        if then[1:3] == now[1:3]:
            return differences
        if not isinstance(then[2], list) or len(then[2]) != len(now[2]):
            return [*differences, f"{where}: checkpoint {then[1]!r}, this run {now[1]!r}"]
        changed = [j for j, (a, b) in enumerate(zip(then[2], now[2])) if a != b]
        labels = self.file_labels[i] if i < len(self.file_labels) else ()
        names = [labels[j] if j < len(labels) else f"file {j}" for j in changed]
        shown = ", ".join(repr(name) for name in names[:5]) + (" ..." if len(names) > 5 else "")
        if not changed:  # the same contents under other names
            return [*differences, f"{where}: checkpoint {then[1]!r}, this run {now[1]!r}"]
        return [*differences, f"{where}: {len(changed)} of {len(now[2])} changed since the checkpoint ({shown})"]


def _removed_message(removed: list[str], added: list[str]) -> str:
    are = "is" if len(removed) == 1 else "are"
    if added:
        return (
            f"sources: {_names(removed)} {are} in the checkpoint but not in this run, and {_names(added)} "
            f"{'is' if len(added) == 1 else 'are'} in this run but not in the checkpoint: a renamed source?"
        )
    return (
        f"sources: {_names(removed)} {are} in the checkpoint but not in this run: a source cannot be removed on resume"
    )


def _names(names: list[str]) -> str:
    return repr(names[0]) if len(names) == 1 else repr(list(names))


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _plan_skipping(plan: Any, skipped: tuple[tuple[int, int], ...]) -> Any:
    """``plan`` told the data steps skipped, where it follows a mixture controller (it maps data steps to the
    training steps its decisions are made at)."""
    with_skipped = getattr(plan, "with_skipped", None)
    return plan if with_skipped is None else with_skipped(skipped)
