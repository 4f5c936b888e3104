"""The corpus of a PretrainingDataModule: its sources scanned, their stream specs, and one pass counted when asked.

All sources' files are resolved before any footer is read, and a file two sources claim is refused unless
``allow_shared_files``. Trade-off: footers are rescanned on every ``setup``, so a run reads the files as they are
now, at the cost of opening each file once per ``setup``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer

from lightning_d9d.core.digest import digest
from lightning_d9d.core.urls import redact
from lightning_d9d.datamodules.pretraining.mixture import SourceConfig
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.plans.spec import MixtureSpec, StreamSettings, StreamSpec
from lightning_d9d.streaming.sources.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.sources.storage import Storage, canonical
from lightning_d9d.streaming.streams.estimate import PassSample, backend_sample, count_pass, first_text, stored_sample
from lightning_d9d.streaming.tokens.count_record import CountRecord
from lightning_d9d.streaming.tokens.stream_cache import StreamCache, usable_root
from lightning_d9d.streaming.tokens.token_cache import TokenCache
from lightning_d9d.streaming.tokens.tokenize import LONG_DOCUMENT_CHARS
from lightning_d9d.tokenization.backends import AUTO, TokenizerBackendError, backend_names, resolve_backend
from lightning_d9d.tokenization.tokenizer import pad_token_id, read_tokenizer

# Bump when how a document becomes ids changes in a way the cache key does not name, so old entries are not read.
TOKEN_RECIPE_VERSION = 1


class TrainCorpus:
    """The training side of a corpus: the streams' spec and, counted when first asked, one pass per source.

    Args:
        spec: the training streams.
        counts: one pass's count per source, where already known (another rank's); else counted when first asked.
    """

    def __init__(self, spec: MixtureSpec, counts: Mapping[str, PassSample] | None = None):
        self.spec = spec
        self._counts: dict[str, PassSample] | None = None
        self._rows: dict[int, dict[str, float]] = {}
        if counts is not None:
            self.use_counts(counts)

    def use_counts(self, counts: Mapping[str, PassSample]) -> None:
        """Take these counts (another process's) rather than counting."""
        self._counts, self._rows = dict(counts), {}

    def sampled(self) -> TrainCorpus:
        """This corpus sized by the sampled estimate alone (kept in the token cache once made), whatever the cache
        counts: how epochs were sized before counts were taken from the cache."""
        return TrainCorpus(
            self.spec, {name: stored_sample(spec) for name, spec in zip(self.spec.names, self.spec.sources)}
        )

    @property
    def counts(self) -> dict[str, PassSample]:
        """One pass's tokens (and sampled lengths) per source: counted from the token cache where it holds the units,
        else estimated (made once, then kept); nothing is read or tokenized before the first ask."""
        if self._counts is None:
            self._counts = {name: count_pass(spec) for name, spec in zip(self.spec.names, self.spec.sources)}
        return self._counts

    @property
    def exact(self) -> bool:
        """Whether every source's pass was counted from the token cache, none estimated."""
        return all(sample.exact for sample in self.counts.values())

    @property
    def pass_tokens(self) -> float:
        return sum(sample.tokens for sample in self.counts.values())

    def source_pass_rows(self, step: int = 0) -> dict[str, float]:
        """Rows of one pass over each source, at the row length of ``step`` (estimated, or counted)."""
        capacity, counts = self.spec.capacity_at(step), self.counts
        if capacity not in self._rows:  # best-fit's yield runs its packer: once per row length
            self._rows[capacity] = {
                name: counts[name].rows(spec, capacity) for name, spec in zip(self.spec.names, self.spec.sources)
            }
        return dict(self._rows[capacity])

    def steps_per_pass(self) -> int:
        """Whole optimizer steps in one pass over all sources, the shape schedule followed (``ValueError``
        if fewer than one): a step of ``G`` rows of length ``L`` takes ``G`` of the pass's rows at that length.
        """
        shapes, used, steps = self.spec.shapes, 0.0, 0
        for first, end, shape in shapes.phases():
            rows = sum(self.source_pass_rows(first).values())
            share = shape.global_batch_size / rows if rows > 0 else math.inf  # of a pass, per step
            fit = math.floor((1.0 - used) / share + 1e-9) if share > 0 else 0
            if fit < end - first:
                steps += fit
                break
            steps, used = steps + int(end - first), used + (end - first) * share
        if steps < 1:
            first = shapes.at(0)
            rows = sum(self.source_pass_rows(0).values())
            raise ValueError(
                f"train_files are too small for one optimizer step: {'' if self.exact else 'about '}"
                f"{self.pass_tokens:.0f} tokens "
                f"({rows:.1f} rows of seq_len+1={first.capacity}) per pass, but one step takes "
                f"global_batch_size={first.global_batch_size} rows; add data, lower seq_len or "
                "global_batch_size, or set steps_per_epoch to cycle the data"
            )
        return steps


class PretrainingCorpus:
    """The loaded tokenizer and the settings, which turn sources into specs.

    The tokenizer backend is resolved once, at the first source's spec, on a sample of that source's documents
    (``tokenizer_backend="auto"``: the fastest that gives ``tokenizers``' ids, else ``tokenizers``).

    Raises:
        ValueError: the tokenizer lacks ``bos_token``; ``token_cache`` is a file or lies inside one.
        TokenizerBackendError: a named tokenizer backend unknown, not installed or unable to serve the tokenizer.
    """

    def __init__(
        self,
        settings: StreamSettings,
        tokenizer: str | os.PathLike | Tokenizer,
        bos_token: str,
        storage: Storage,
        token_cache: str | None = None,
        on_malformed: str = "error",
        tokenizer_backend: str = AUTO,
    ):
        if tokenizer_backend not in backend_names():
            raise TokenizerBackendError(
                f"tokenizer_backend={tokenizer_backend!r} is not a tokenizer backend: pass one of {backend_names()}"
            )
        self.backend_setting = tokenizer_backend
        self.backend: tuple[str, str] | None = None  # (name, why), resolved at the first spec
        loaded = read_tokenizer(tokenizer)
        bos_id = loaded.token_to_id(bos_token)
        if bos_id is None:
            special = sorted(t.content for t in loaded.get_added_tokens_decoder().values())
            raise ValueError(
                f"the tokenizer has no token bos_token={bos_token!r}; its added/special tokens are "
                f"{special}: pass one of them as bos_token or add it to the tokenizer"
            )
        self.settings, self.storage, self.bos_id = settings, storage, bos_id
        # A cache whose storage cannot be reached is left out for this run (one warning), for every format alike.
        self.token_cache = usable_root(token_cache, storage) if token_cache is not None else None
        self.on_malformed = on_malformed
        self.tokenizer_json = loaded.to_str()
        self.vocab_size = loaded.get_vocab_size(with_added_tokens=True)
        self.pad_id = pad_token_id(loaded, avoid=bos_id)  # BOS marks document starts, so padding must not use it

    def train(
        self, sources: Sequence[SourceConfig], schedule: MixtureSchedule, mixture: bool, allow_shared_files: bool
    ) -> TrainCorpus:
        """The shuffled training streams of ``sources`` mixed by ``schedule``.

        Args:
            mixture: name the sources in errors (``train_files['web']``).

        Raises:
            ValueError: missing, shared or bad files, no text, or too few rows for K streams.
            StorageError: a URL could not be listed or opened.
        """
        whats = [f"train_files[{source.name!r}]" if mixture else "train_files" for source in sources]
        resolved = self._resolved(sources, whats, "train_files", allow_shared_files)
        specs = [self.spec(source, files, what, shuffle=True) for source, what, files in zip(sources, whats, resolved)]
        plan = MixturePlan(schedule, self.settings.shapes.global_batch_sizes)
        return TrainCorpus(MixtureSpec(tuple(source.name for source in sources), tuple(specs), plan))

    def validation(
        self, sources: Sequence[SourceConfig], by_source: bool, allow_shared_files: bool, seq_len: int | None = None
    ) -> list[MixtureSpec]:
        """The streams of every validation source, each read in file order, in rows of one shape: ``seq_len``
        (default: the last phase's) and the last phase's global batch size.
        """
        shapes = self.settings.shapes
        last = shapes.at(max(shapes.boundaries))
        settings = dataclasses.replace(self.settings, seq_len=seq_len or last.seq_len,
                                       global_batch_size=last.global_batch_size)  # fmt: skip
        whats = [f"val_files[{source.name!r}]" if by_source else "val_files" for source in sources]
        resolved = self._resolved(sources, whats, "val_files", allow_shared_files)
        plans = [MixturePlan(MixtureSchedule([source.name]), last.global_batch_size) for source in sources]
        return [
            MixtureSpec((source.name,), (self.spec(source, files, what, shuffle=False, settings=settings),), plan)
            for source, what, files, plan in zip(sources, whats, resolved, plans)
        ]

    def _resolved(
        self, sources: Sequence[SourceConfig], whats: Sequence[str], what: str, allow_shared_files: bool
    ) -> list[list[str]]:
        """Every source's files, resolved (no footer read) and checked for shared files."""
        resolved = [resolve_files(source.files, name, self.storage) for source, name in zip(sources, whats)]
        if not allow_shared_files:
            check_shared_files([(source.name, files) for source, files in zip(sources, resolved)], what)
        return resolved

    def spec(
        self, source: SourceConfig, files: list[str], what: str, shuffle: bool, settings: StreamSettings | None = None
    ) -> StreamSpec:
        """The spec of the K streams ``source``'s row groups are dealt to (with ``settings``, default the corpus's)."""
        index = self.scan(files, source.text_column)
        cache = (
            StreamCache(self._token_cache(source.text_column), index, what) if self.token_cache is not None else None
        )
        if not _holds_text(index, cache):
            raise ValueError(
                f"{what} hold no text: every value of column {source.text_column!r} in {len(index.files)} file(s) "
                f"({index.total_rows} rows) is null or empty"
            )
        try:
            units = Units.of(index, self.settings.num_streams)
        except ValueError as error:  # too few rows for K streams: say which source of a mixture
            if "[" not in what:
                raise
            raise ValueError(f"{what}: {error}") from error
        if self.backend is None:
            max_chars = self.settings.max_document_chars
            self.backend = resolve_backend(
                self.backend_setting, self.tokenizer_json, lambda: backend_sample(index, max_chars)
            )
        return StreamSpec(settings or self.settings, index, units, self.tokenizer_json, self.bos_id, self.pad_id,
                          shuffle, cache=cache, tokenizer_backend=self.backend[0])  # fmt: skip

    def _token_cache(self, text_column: str) -> TokenCache:
        """A source's token cache, keyed by everything that decides its documents' tokens."""
        key = {
            "tokenizer": digest(self.tokenizer_json),
            "text_column": text_column,
            "max_document_chars": self.settings.max_document_chars,
            "long_document_chars": LONG_DOCUMENT_CHARS,
            "recipe": TOKEN_RECIPE_VERSION,
        }
        return TokenCache(self.token_cache, self.storage, key, vocab_size=self.vocab_size)

    def scan(self, files: list[str], text_column: str) -> RowGroupIndex:
        """The row groups of resolved ``files`` (footers and JSONL layouts only)."""
        layouts = f"{self.token_cache.rstrip('/')}/jsonl-layouts" if self.token_cache is not None else None
        return RowGroupIndex.scan(files, text_column, self.storage, layouts, self.on_malformed)


def _holds_text(index: RowGroupIndex, cache: StreamCache | None) -> bool:
    """Whether the files hold a non-empty text: proven by a footer's statistics or by a unit the token cache counted
    documents in (nothing read), else found by reading row groups until one holds a text."""
    if index.text_proven.any():
        return True
    if cache is not None and any(documents for documents, _ in CountRecord(cache).data["units"].values()):
        return True
    return first_text(index) is not None


def file_identity(path: str) -> str:
    """What makes two resolved paths the same file: local paths after symlinks, URLs without query and credentials."""
    if "://" not in path:
        return os.path.realpath(path)
    url = canonical(path)
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return os.path.realpath(rest)
    return f"{'s3' if scheme == 's3a' else scheme}://{rest}"


def check_shared_files(resolved: Sequence[tuple[str, Sequence[str]]], what: str) -> None:
    """Raise ValueError when a file belongs to two of the ``(source name, files)`` pairs."""
    if len(resolved) < 2:
        return  # one source: nothing to share (its list holds each path once)
    owners: dict[str, tuple[str, str]] = {}
    shared: dict[tuple[str, str], list[str]] = {}
    for name, files in resolved:
        for path in files:
            owner, first_path = owners.setdefault(file_identity(path), (name, path))
            if owner != name:
                shared.setdefault((owner, name), []).append(first_path)
    if not shared:
        return
    (first, second), paths = next(iter(shared.items()))
    more = f" and {len(paths) - 1} more file{'s' if len(paths) > 2 else ''}" if len(paths) > 1 else ""
    raise ValueError(
        f"{what}[{first!r}] and {what}[{second!r}] both hold {redact(paths[0])!r}{more}: each source reads its files "
        "on its own, so that file's documents would be read twice per pass, once under each name; give each file "
        "to one source (weights set the sources' shares), or pass allow_shared_files=True if the duplicates are meant"
    )
