"""Reports, a part of PretrainingDataModule: what it says about its sources and streams (names, counters, the
mixture's, shapes', edits' and token cache's lines for ``inspect``, the per-step metrics).

It reads the corpus and the run plan it is given and the position each call passes, and owns only whether the token
cache's changes were said (once per DataModule); it saves nothing in a checkpoint. The counters are those of the
streams this rank owns, read without communication: the run's figures only with one rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lightning_d9d.datamodules.pretraining.corpus import Corpus
from lightning_d9d.datamodules.pretraining.mixture import mixture_report, source_stats
from lightning_d9d.datamodules.pretraining.plan import RunPlan
from lightning_d9d.streaming.loading.loader import StreamPosition
from lightning_d9d.streaming.packing.rows import StreamCounters
from lightning_d9d.streaming.plans.spec import MixtureSpec


class Reports:
    """What a PretrainingDataModule reports.

    Args:
        corpus: the sources and what setup read of them.
        plan: the run's plan (the spec trained, the shapes, the edits).
    """

    def __init__(self, corpus: Corpus, plan: RunPlan):
        self.corpus, self.plan = corpus, plan
        self._cache_said = False

    @property
    def source_names(self) -> list[str]:
        """The training sources, in order (``PretrainingBatch.sources`` indexes it); ``["train"]`` for one corpus."""
        return [source.name for source in self.corpus.sources.train]

    @property
    def val_source_names(self) -> list[str]:
        """The validation sources, in the order of their loaders (Lightning's ``dataloader_idx``)."""
        return [source.name for source in self.corpus.sources.validation or []]

    def val_metric_name(self, name: str, dataloader_idx: int = 0) -> str:
        """The key to log a validation metric of loader ``dataloader_idx`` under: ``f"{name}/{source}"`` where
        ``val_files`` maps names to files (one loader per source), else ``name``.

        Log it with ``self.log(dm.val_metric_name("val/loss", dataloader_idx), ..., add_dataloader_idx=False)``:
        Lightning would otherwise append ``/dataloader_idx_N`` to every key of a multi-loader validation.

        Raises:
            ValueError: ``dataloader_idx`` is not the index of one of the validation loaders.
        """
        names = self.val_source_names
        by_source = self.corpus.sources.validation_by_source
        count = len(names) if by_source else min(len(names), 1)
        if isinstance(dataloader_idx, bool) or not isinstance(dataloader_idx, int) or not 0 <= dataloader_idx < count:
            raise ValueError(
                f"dataloader_idx must be the index of a validation loader, 0 to {count - 1} "
                f"(val_source_names={names}), got {dataloader_idx!r}"
            )
        return f"{name}/{names[dataloader_idx]}" if by_source else name

    def source_stats(self, position: StreamPosition) -> dict[str, dict[str, float]]:
        """Per training source, over this rank's streams as of the latest step handed out: ``rows``, ``tokens``,
        ``documents``, ``padding``, ``too_long``, ``excluded`` and ``passes`` (fractional).
        """
        return source_stats(self.plan.require(), position.states)

    def mixture_report(self, run_steps: int, realised: Sequence[int], steps: int) -> list[str]:
        """``inspect``'s mixture lines (none for one corpus): phases, expected passes, realised shares."""
        spec = self.plan.require()
        if not self.corpus.sources.mixture:
            return []
        return mixture_report(spec, self.corpus.source_pass_rows_at, run_steps, realised, steps)

    def edits_report(self) -> list[str]:
        """``inspect``'s lines for the data edits recorded or asked (skips, exclusions)."""
        lines = self.plan.edits.describe()
        return ["data edits:", *(f"  {line}" for line in lines)] if lines else []

    def shape_report(self, run_steps: int, dp_size: int) -> list[str]:
        """``inspect``'s lines for shapes in phases (none for one shape): each phase's steps, global batch, microbatches
        per replica, the row positions (``G × seq_len``) it trains up to ``run_steps`` and its expected fill and
        padding; then the run's total positions and expected document tokens.

        The fill of a phase is what one pass gives at its row length: each source's pass tokens over its pass rows
        times the row's tokens, weighted by the rows the plan takes of each source in the phase.
        """
        shapes = self.plan.shapes
        if shapes.fixed:
            return []
        lines, tokens = [f"shapes ({run_steps} steps):"], 0.0
        for first, end, shape in shapes.phases():
            if first >= run_steps:
                lines.append(f"  steps {first}-: not reached")
                break
            stop = int(min(end, run_steps))
            per_step = shape.global_batch_size * shape.seq_len
            micro = shape.global_batch_size // (dp_size * self.plan.microbatch_size)
            fill = self._expected_fill(first, stop, shape.capacity)
            tokens += fill * (stop - first) * per_step
            lines.append(
                f"  steps {first}-{stop - 1}: global_batch_size {shape.global_batch_size}, seq_len {shape.seq_len}, "
                f"{micro} microbatch(es) per step per replica, {per_step:,} positions per step, "
                f"{(stop - first) * per_step:,} in {stop - first} steps (from {shapes.tokens_before(first):,}), "
                f"expected fill {100 * fill:.2f} %, padding {100 * (1 - fill):.2f} %"
            )
        total = shapes.tokens_before(run_steps)
        lines.append(
            f"run total ({run_steps} steps): {total:,} positions (sum of global_batch_size × seq_len), about "
            f"{tokens:,.0f} document tokens at the expected fill"
        )
        return lines

    def _expected_fill(self, first: int, stop: int, capacity: int) -> float:
        """Document tokens over row tokens in steps ``[first, stop)`` (one row length), expected from a pass."""
        spec = self.plan.require()
        rows, tokens = self.corpus.source_pass_rows_at(first), self.corpus.source_pass_tokens()
        taken = [float(b - a) for a, b in zip(spec.plan.target_rows(first), spec.plan.target_rows(stop))]
        held = sum(t * tokens[name] / rows[name] for name, t in zip(spec.names, taken) if rows.get(name, 0) > 0)
        return min(1.0, held / (sum(taken) * capacity)) if sum(taken) > 0 else 1.0

    def say_cache_changes(self, spec: MixtureSpec) -> None:
        """Once per DataModule: what its token cache holds of other tokenizers, settings or file contents."""
        if self.corpus.token_cache is None or self._cache_said:
            return
        self._cache_said = True
        if rank_zero_only.rank != 0:  # only rank 0 speaks: the others need not list the cache at all
            return
        caches = [source.cache for source in spec.sources if source.cache is not None]  # None: unreachable, left out
        for message in dict.fromkeys(m for cache in caches for m in cache.changes()):
            rank_zero_warn(message)

    def token_cache_report(self) -> list[str]:
        """``inspect``'s token-cache lines: per source, the units held and their size."""
        spec = self.plan.require()
        lines = []
        for name, source in zip(spec.names, spec.sources):
            if source.cache is None:
                continue
            covered = source.cache.coverage(source.units)
            share = 100.0 * covered.cached / max(1, covered.total)
            lines.append(
                f"token cache {source.cache.cache.where()!r}, source {name!r}: {covered.cached} of {covered.total} "
                f"units cached ({share:.0f} %), {covered.bytes / 2**20:,.1f} MiB"
                + (
                    f"; {covered.partial} more in part (their first documents, kept by runs that stopped inside "
                    f"them), {covered.partial_bytes / 2**20:,.1f} MiB"
                    if covered.partial
                    else ""
                )
            )
        return lines

    def stream_stats(self, position: StreamPosition) -> dict[str, int]:
        """This rank's stream counters so far, summed over its streams (keys: ``StreamCounters``'s); they
        continue across a resume. ``padding`` includes the CP padding, of which ``cp_padding`` is the part.
        """
        totals = StreamCounters()
        for state in position.states.values():
            totals.add(state.counters)
        return totals.to_dict()

    def step_metrics(self, rows_by_source: Counter[int], position: StreamPosition) -> dict[str, float]:
        """What the callback logs per step: ``data/fill`` (document tokens over row positions), ``data/cropped`` (tokens
        crops dropped over tokens taken) and, for a mixture, ``data/share/<source>`` of this step's rows on this rank.
        """
        stats = self.stream_stats(position)
        positions = stats["emitted"] + stats["padding"]
        metrics = {
            "data/fill": stats["emitted"] / positions if positions else 1.0,
            "data/cropped": stats["cropped"] / stats["tokens"] if stats["tokens"] else 0.0,
        }
        edits = self.plan.edits
        if edits.skips:  # how far the data runs ahead of the step: every step skipped so far
            step = position.epoch * self.plan.steps_per_epoch + position.step
            metrics["data/skipped_steps"] = float(edits.data_step(step) - step)
        names = self.source_names
        rows = sum(rows_by_source.values())
        if len(names) > 1 and rows:
            metrics.update({f"data/share/{name}": rows_by_source[i] / rows for i, name in enumerate(names)})
        return metrics
