"""What a PretrainingDataModule reports about its sources and streams: names, counters, the mixture's lines.

:class:`PretrainingReports` is mixed into :class:`~lightning_d9d.datamodules.pretraining.PretrainingDataModule`;
it only reads what ``setup`` and the loaders leave on the DataModule (``sources``, ``train_spec``,
``source_pass_rows`` and ``position``, whose stream states the loaders advance as they hand out steps), and
changes nothing. The figures themselves are computed by
:mod:`lightning_d9d.datamodules.pretraining_mixture`.

Trade-off: the counters are those of the streams this rank owns, read without communication, so they are the
run's figures only with one rank; summing them over ranks is the caller's choice (and cost).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_d9d.datamodules.pretraining_mixture import Sources, mixture_report, source_stats
from lightning_d9d.streaming.loader import StreamPosition
from lightning_d9d.streaming.packing import StreamCounters
from lightning_d9d.streaming.spec import MixtureSpec


class PretrainingReports:
    """Source names, per-source and per-stream counters and ``inspect``'s mixture lines of a pretraining run."""

    sources: Sources
    train_spec: MixtureSpec | None
    source_pass_rows: dict[str, float]
    position: StreamPosition
    token_cache: str | None
    _cache_said = False

    @property
    def source_names(self) -> list[str]:
        """The training sources, in order (``PretrainingBatch.sources`` indexes it); ``["train"]`` for one corpus."""
        return [source.name for source in self.sources.train]

    @property
    def val_source_names(self) -> list[str]:
        """The validation sources, in the order of their loaders (Lightning's ``dataloader_idx``)."""
        return [source.name for source in self.sources.validation or []]

    def source_stats(self) -> dict[str, dict[str, float]]:
        """Per training source, as of the latest step handed out, over the streams this rank owns: ``rows``,
        ``tokens`` (document tokens in rows), ``documents`` (taken by the packer), ``padding``, ``too_long``
        (documents over ``max_document_chars`` skipped) and ``passes`` (passes read, fractional: the mean over
        the rank's streams; the run's figure with one rank)."""
        return source_stats(self._require(self.train_spec), self.position.states)

    def mixture_report(self, run_steps: int, realised: Sequence[int], steps: int) -> list[str]:
        """``inspect``'s lines on the mixture (none for one corpus): phases, expected passes of each source over
        ``run_steps`` steps, and the realised shares (``realised`` rows per source) of the first ``steps``."""
        spec = self._require(self.train_spec)
        if not self.sources.mixture:
            return []
        return mixture_report(spec, self.source_pass_rows, run_steps, realised, steps)

    def _say_cache_changes(self, spec: MixtureSpec) -> None:
        """Once per DataModule: what its token cache holds of other tokenizers, settings or file contents."""
        if self.token_cache is None or self._cache_said:
            return
        self._cache_said = True
        for message in dict.fromkeys(m for source in spec.sources for m in source.cache.changes()):
            rank_zero_warn(message)

    def token_cache_report(self) -> list[str]:
        """``inspect``'s lines on the token cache: per source, the units it holds of all, and their size (none
        without a cache)."""
        spec = self._require(self.train_spec)
        lines = []
        for name, source in zip(spec.names, spec.sources):
            if source.cache is None:
                continue
            covered = source.cache.coverage(source.units)
            share = 100.0 * covered.cached / max(1, covered.total)
            lines.append(
                f"token cache {source.cache.cache.where()!r}, source {name!r}: {covered.cached} of {covered.total} "
                f"units cached ({share:.0f} %), {covered.bytes / 2**20:,.1f} MiB"
            )
        return lines

    def stream_stats(self) -> dict[str, int]:
        """This rank's stream counters so far, summed over the streams it owns (see ``StreamCounters``).

        Keys: ``docs`` (documents taken by the packer), ``empty`` (null or empty texts skipped),
        ``text_free_units`` (units skipped for holding no text), ``too_long`` (documents over
        ``max_document_chars`` skipped), ``tokens`` (tokens of the documents taken,
        BOS included), ``emitted`` (document tokens in rows), ``padding`` (padding tokens in rows:
        ``bestfit_split``'s gaps and the CP padding), ``cp_padding`` (of those, what rounds best-fit pieces up to
        a multiple of ``2 × context_parallel_size``), ``crops``/``cropped`` (documents cropped and their dropped
        tokens, ``bestfit``), ``split_docs``/``chunks`` (documents split and their pieces, ``bestfit_split``),
        ``rows``. Counters are as of the latest step handed out, and continue across a resume.
        """
        totals = StreamCounters()
        for state in self.position.states.values():
            totals.add(state.counters)
        return totals.to_dict()

    def step_metrics(self, rows_by_source: Counter[int]) -> dict[str, float]:
        """What the callback logs per optimizer step beside the timing (see
        :mod:`~lightning_d9d.datamodules.observability`).

        ``data/fill``: document tokens over the row positions yielded so far (``bestfit_split``'s padding is the
        rest); ``data/cropped``: tokens that ``bestfit``'s crops dropped over the document tokens taken; both
        from :meth:`stream_stats`, this rank's streams since the run began (a resume continues them), as of the
        latest step the loader handed out. A mixture adds ``data/share/<source>``: each source's share of this
        step's rows on this rank (``rows_by_source``, by index into :attr:`source_names`).
        """
        stats = self.stream_stats()
        positions = stats["emitted"] + stats["padding"]
        metrics = {
            "data/fill": stats["emitted"] / positions if positions else 1.0,
            "data/cropped": stats["cropped"] / stats["tokens"] if stats["tokens"] else 0.0,
        }
        names = self.source_names
        rows = sum(rows_by_source.values())
        if len(names) > 1 and rows:
            metrics.update({f"data/share/{name}": rows_by_source[i] / rows for i, name in enumerate(names)})
        return metrics

    @staticmethod
    def _require(value: Any) -> Any:
        """``value``, which ``setup`` sets; before it, an error saying so."""
        if value is None:
            raise RuntimeError("call dm.setup('fit') first (Trainer.fit does it)")
        return value
