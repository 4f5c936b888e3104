"""The corpus of a PretrainingDataModule: files scanned per source, their stream specs, fingerprint and size.

:class:`PretrainingCorpus` holds the settings that decide the rows and the loaded tokenizer; from a file spec it
scans the parquet footers (``streaming.source``), builds the :class:`~lightning_d9d.streaming.stream.StreamSpec`
the K streams share (a :class:`~lightning_d9d.streaming.mixture_stream.MixtureSpec` over one per source for a
mixture), the fingerprint of everything that decides the rows, and estimates one pass
(``streaming.estimate``). It knows nothing of ranks, workers or Lightning: the DataModule holds one per
``setup`` and keeps only what it hands to its loaders.

The files of every source of a mixture (and of every validation source) are resolved before any footer is read,
and a file that two sources claim (the same path, or an overlapping glob; URLs compared without their query and
credentials, local paths after symlinks) is refused unless ``allow_shared_files``: each source reads its files on
its own, so a shared file's documents would be trained twice per pass, once under each name.

Trade-off: the tokenizer is read and the footers scanned again on every ``setup``, so a run always streams the
files as they are now (and the fingerprint notices a file changed since a checkpoint), at the cost of listing
and opening every file once per ``setup``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from lightning_d9d.datamodules.pretraining_mixture import (
    SINGLE_SOURCE_NAME,
    SourceConfig,
)
from lightning_d9d.resume import Fingerprint
from lightning_d9d.streaming.estimate import estimate_pass, first_text
from lightning_d9d.streaming.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.mixture_stream import MixtureSpec
from lightning_d9d.streaming.reader import DEFAULT_MAX_DOCUMENT_CHARS
from lightning_d9d.streaming.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.storage import Storage, canonical, redact
from lightning_d9d.streaming.stream import StreamSpec
from lightning_d9d.tokenizer import pad_token_id, read_tokenizer


@dataclass(frozen=True, kw_only=True)
class PackedRowsFingerprint(Fingerprint):
    """The settings that decide the packed rows, one corpus or a mixture alike (the subclasses add the files)."""

    tokenizer: str
    bos_token: str
    seq_len: int
    packing: str
    seed: int
    global_batch_size: int
    num_streams: int
    bestfit_buffer_size: int
    # Checkpoints from before the cap had none; the default cap changes no row of an ordinary corpus.
    max_document_chars: int | None = field(
        default=DEFAULT_MAX_DOCUMENT_CHARS, metadata={"when_missing": (None, DEFAULT_MAX_DOCUMENT_CHARS)}
    )

    @staticmethod
    def settings_of(settings: CorpusSettings, tokenizer: str) -> dict[str, Any]:
        """This class's fields: ``tokenizer`` (the tokenizer's digest) and the rest read off ``settings``."""
        names = (f.name for f in dataclasses.fields(PackedRowsFingerprint) if f.name != "tokenizer")
        return {"tokenizer": tokenizer, **{name: getattr(settings, name) for name in names}}


@dataclass(frozen=True, kw_only=True)
class StreamFingerprint(PackedRowsFingerprint):
    """What decides the rows of every step of one corpus (how documents are batched for the tokenizer does not).

    ``file_digests`` holds one footer digest per file (row counts, sizes and text statistics of its row
    groups), so a file rewritten with other text is noticed and named; ``file_labels`` only names files in
    messages and is not compared.
    """

    files: str
    file_digests: tuple[int, ...]
    text_column: str
    file_labels: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def describe_difference(self, name: str, then: Any, now: Any) -> str:
        if name != "file_digests":
            return super().describe_difference(name, then, now)
        if not isinstance(then, list):
            return super().describe_difference(name, then, now)
        if len(then) != len(now):
            return f"file_digests: checkpoint {len(then)} files, this run {len(now)}"
        changed = [i for i, (a, b) in enumerate(zip(then, now)) if a != b]
        names = [self.file_labels[i] if i < len(self.file_labels) else f"file {i}" for i in changed]
        shown = ", ".join(repr(name) for name in names[:5]) + (" ..." if len(names) > 5 else "")
        return f"files: {len(changed)} of {len(now)} changed since the checkpoint ({shown})"


@dataclass(frozen=True, kw_only=True)
class MixtureFingerprint(PackedRowsFingerprint):
    """What decides a mixture's rows, besides the shares: the settings and, by source name, each source's
    ``(files summary, footer digests, text column)``. A source added is no mismatch here (it starts fresh, once
    the change of shares it brings is accepted); one removed or whose files changed is. A source's position is
    saved under its name, so a renamed source is one removed and one added: the error names both, and its advice
    is the way that works (``mismatch_advice``), not a restart of the epoch."""

    sources: tuple[tuple[str, str, tuple[int, ...], str], ...]

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        others = {name: value for name, value in saved.items() if name != "sources"}
        differences = [d for d in super().mismatches({**others, "sources": self.to_dict()["sources"]})]
        now = {source[0]: source for source in self.to_dict()["sources"]}
        then = saved.get("sources")
        if not isinstance(then, list):
            return [*differences, f"sources: checkpoint {then!r}, this run {list(now)} (not a mixture's checkpoint)"]
        removed, added = self._removed_and_added(then)
        if removed and added:
            differences.append(
                f"sources: {_names(removed)} {'is' if len(removed) == 1 else 'are'} in the checkpoint but not in this "
                f"run, and {_names(added)} {'is' if len(added) == 1 else 'are'} in this run but not in the "
                "checkpoint: a renamed source?"
            )
        elif removed:
            differences.append(
                f"sources: {_names(removed)} {'is' if len(removed) == 1 else 'are'} in the checkpoint but not in this "
                "run: a source cannot be removed on resume"
            )
        for source in then:
            name = source[0]
            if name in now and list(source) != list(now[name]):
                differences.append(f"sources[{name!r}]: checkpoint {source[1:]!r}, this run {now[name][1:]!r}")
        return differences

    def mismatch_advice(self, saved: dict[str, Any]) -> str | None:
        """When sources were removed (or renamed) and nothing else differs: keep the checkpoint's names, or keep
        a removed source at weight 0 from the resume step on under ``on_mixture_change='continue'`` (which starts
        an added source fresh and refuses a removed one). ``on_order_mismatch='restart_epoch'`` would throw away
        every source's position, so it is not offered."""
        then = saved.get("sources")
        if not isinstance(then, list):
            return None
        removed, added = self._removed_and_added(then)
        only_sources = len(self.mismatches(saved)) == 1
        if not removed or not only_sources:
            return None
        old = _names(removed)
        zero = ", ".join([f"{name!r}: 0" for name in removed] + [f"{name!r}: <weight>" for name in added])
        keep = (
            f"To continue {old} where {'it' if len(removed) == 1 else 'they'} stopped, use the checkpoint's "
            f"name{'s' if len(removed) > 1 else ''} {old} again (a source's position is saved under its name). "
            if added
            else ""
        )
        instead = f"To replace {old} by {_names(added)}" if added else f"To stop reading {old}"
        fresh = f" ({_names(added)} then start{'s' if len(added) == 1 else ''} fresh)" if added else ""
        return (
            f"{keep}{instead}, keep {old} in train_files, give {'it' if len(removed) == 1 else 'them'} weight 0 from "
            f"the resume step on (the checkpoint's global step S: weights=[[0, <the checkpoint's weights>], [S, "
            f"{{..., {zero}}}]]) and pass on_mixture_change='continue'{fresh}"
        )

    def _removed_and_added(self, then: list[Any]) -> tuple[list[str], list[str]]:
        """The checkpoint's source names this run lacks, and this run's names the checkpoint lacks, in order."""
        saved_names = [source[0] for source in then if isinstance(source, (list, tuple)) and source]
        names = [source[0] for source in self.sources]
        return [n for n in saved_names if n not in names], [n for n in names if n not in saved_names]


def _names(names: Sequence[str]) -> str:
    return repr(names[0]) if len(names) == 1 else repr(list(names))


def files_summary(index: RowGroupIndex) -> str:
    """``"N files, R rows, sha256 …"`` of a source's files (labels and footer digests)."""
    files = hashlib.sha256()
    for label, digest in zip(index.file_labels(), index.file_digests):
        files.update(f"{label}\0{digest}\0".encode())
    return f"{len(index.files)} files, {index.total_rows} rows, sha256 {files.hexdigest()[:16]}"


def file_identity(path: str) -> str:
    """What makes two resolved paths the same file: a local path (or ``file://`` URL) after symlinks, a URL without
    its query and credentials (``s3a://`` is ``s3://``)."""
    if "://" not in path:
        return os.path.realpath(path)
    url = canonical(path)
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        return os.path.realpath(rest)
    return f"{'s3' if scheme == 's3a' else scheme}://{rest}"


def check_shared_files(resolved: Sequence[tuple[str, Sequence[str]]], what: str) -> None:
    """Raises ValueError when a file belongs to two of the named sources' resolved files, naming both sources, the
    first such file and how many they share.

    Args:
        resolved: ``(source name, its resolved files)`` per source, in order.
        what: the argument's name (``train_files``, ``val_files``).
    """
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


@dataclass(frozen=True)
class CorpusSettings:
    """The settings of a corpus: all but ``tokenizer_batch_size`` and ``storage`` decide the rows."""

    text_column: str
    bos_token: str
    seq_len: int
    packing: str
    seed: int
    global_batch_size: int
    num_streams: int
    bestfit_buffer_size: int
    max_document_chars: int | None
    tokenizer_batch_size: int
    storage: Storage

    @classmethod
    def of(cls, owner: Any) -> CorpusSettings:
        """The settings of ``owner`` (a DataModule), read from its attributes of the same names."""
        return cls(**{setting.name: getattr(owner, setting.name) for setting in dataclasses.fields(cls)})


@dataclass(frozen=True)
class TrainCorpus:
    """The training side of a corpus: the streams' spec, its fingerprint and the estimate of one pass.

    ``source_pass_rows`` holds the estimated rows of one pass over each source (``{"train": rows}`` for one
    corpus); ``pass_tokens`` the estimated tokens of one pass over all of them.
    """

    spec: StreamSpec | MixtureSpec
    fingerprint: Fingerprint
    pass_tokens: float
    source_pass_rows: dict[str, float]

    def steps_per_pass(self, global_batch_size: int, seq_len: int) -> int:
        """Optimizer steps in one estimated pass over all sources.

        Raises:
            ValueError: the corpus is too small for one step, naming its estimated tokens and rows.
        """
        rows = sum(self.source_pass_rows.values())
        steps = int(rows // global_batch_size)
        if steps < 1:
            raise ValueError(
                f"train_files are too small for one optimizer step: about {self.pass_tokens:.0f} tokens "
                f"({rows:.1f} rows of seq_len+1={seq_len + 1}) per pass, but one step takes "
                f"global_batch_size={global_batch_size} rows; add data, lower seq_len or "
                "global_batch_size, or set steps_per_epoch to cycle the data"
            )
        return steps


class PretrainingCorpus:
    """The loaded tokenizer and the settings, which turn file specs into stream specs.

    Args:
        settings: the corpus settings.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``.

    Raises:
        ValueError: the tokenizer lacks ``settings.bos_token``, naming its added/special tokens.
    """

    def __init__(self, settings: CorpusSettings, tokenizer: str | os.PathLike | Tokenizer):
        loaded = read_tokenizer(tokenizer)
        bos_id = loaded.token_to_id(settings.bos_token)
        if bos_id is None:
            special = sorted(t.content for t in loaded.get_added_tokens_decoder().values())
            raise ValueError(
                f"the tokenizer has no token bos_token={settings.bos_token!r}; its added/special tokens are "
                f"{special}: pass one of them as bos_token or add it to the tokenizer"
            )
        self.settings, self.bos_id = settings, bos_id
        self.tokenizer_json = loaded.to_str()
        self.pad_id = pad_token_id(loaded, avoid=bos_id)  # BOS marks document starts, so padding must not use it

    @property
    def tokenizer_digest(self) -> str:
        return f"sha256 {hashlib.sha256(self.tokenizer_json.encode()).hexdigest()[:16]}"

    def train(
        self,
        files: Any,
        sources: Sequence[SourceConfig] | None,
        schedule: MixtureSchedule | None,
        allow_shared_files: bool = False,
    ) -> TrainCorpus:
        """The shuffled training streams of ``files`` (one corpus), or of ``sources`` mixed by ``schedule``.

        Raises:
            ValueError: no file matches, a file is not parquet or lacks the column, the files hold no text, too
                few rows for K streams (naming the source of a mixture), a file two sources hold (unless
                ``allow_shared_files``).
            StorageError: a URL could not be listed or opened.
        """
        if sources is not None:
            return self._mixture(sources, schedule, allow_shared_files)
        index = self.scan(files, "train_files")
        spec = self.spec(index, shuffle=True)
        tokens, rows = estimate_pass(spec)
        return TrainCorpus(spec, self.fingerprint(index), tokens, {SINGLE_SOURCE_NAME: rows})

    def validation(self, files: Any, what: str, text_column: str | None = None) -> StreamSpec:
        """The streams of validation ``files``, read in file order (``what`` names them in errors)."""
        return self.spec(self.scan(files, what, text_column), shuffle=False)

    def validation_sources(self, sources: Sequence[SourceConfig], allow_shared_files: bool = False) -> list[StreamSpec]:
        """The streams of every validation source, in order; their files are all resolved before any is read.

        Raises:
            ValueError: as ``validation``, or a file two sources hold (unless ``allow_shared_files``).
        """
        resolved = self._resolved(sources, "val_files", allow_shared_files)
        return [
            self.spec(self._index(files, f"val_files[{source.name!r}]", source.text_column), shuffle=False)
            for source, files in zip(sources, resolved)
        ]

    def _resolved(self, sources: Sequence[SourceConfig], what: str, allow_shared_files: bool) -> list[list[str]]:
        """Every source's files, resolved (listing only, no footer read), checked for files two sources hold."""
        storage = self.settings.storage
        resolved = [resolve_files(source.files, f"{what}[{source.name!r}]", storage) for source in sources]
        if not allow_shared_files:
            check_shared_files([(source.name, files) for source, files in zip(sources, resolved)], what)
        return resolved

    def _mixture(
        self, sources: Sequence[SourceConfig], schedule: MixtureSchedule, allow_shared_files: bool
    ) -> TrainCorpus:
        """Resolve every source's files, scan them and plan the mixture; the pass estimate sums the sources'."""
        settings = self.settings
        specs, indexes, pass_rows, total_tokens = [], [], {}, 0.0
        resolved = self._resolved(sources, "train_files", allow_shared_files)
        for source, files in zip(sources, resolved):
            index = self._index(files, f"train_files[{source.name!r}]", source.text_column)
            try:
                spec = self.spec(index, shuffle=True)
            except ValueError as error:  # too few rows for K streams: say which source
                raise ValueError(f"train_files[{source.name!r}]: {error}") from error
            tokens, pass_rows[source.name] = estimate_pass(spec)
            specs.append(spec)
            indexes.append(index)
            total_tokens += tokens
        plan = MixturePlan(schedule, settings.global_batch_size)
        described = tuple(
            (source.name, files_summary(index), tuple(index.file_digests), source.text_column)
            for source, index in zip(sources, indexes)
        )
        fingerprint = MixtureFingerprint(
            sources=described, **PackedRowsFingerprint.settings_of(settings, self.tokenizer_digest)
        )
        spec = MixtureSpec(tuple(source.name for source in sources), tuple(specs), plan)
        return TrainCorpus(spec, fingerprint, total_tokens, pass_rows)

    def scan(self, files: Any, what: str, text_column: str | None = None) -> RowGroupIndex:
        """The row groups of the file spec ``files`` (footers only).

        Raises:
            ValueError: as ``resolve_files``/``RowGroupIndex.scan``, or every text of the column is null or empty.
        """
        return self._index(resolve_files(files, what, self.settings.storage), what, text_column)

    def _index(self, paths: list[str], what: str, text_column: str | None = None) -> RowGroupIndex:
        """The row groups of resolved files (footers only); raises ValueError when they hold no text."""
        text_column = text_column or self.settings.text_column
        index = RowGroupIndex.scan(paths, text_column, self.settings.storage)
        if first_text(index) is None:
            raise ValueError(
                f"{what} hold no text: every value of column {text_column!r} in {len(index.files)} file(s) "
                f"({index.total_rows} rows) is null or empty"
            )
        return index

    def spec(self, index: RowGroupIndex, shuffle: bool) -> StreamSpec:
        """The spec of the K streams ``index`` is dealt to."""
        settings = self.settings
        return StreamSpec(
            index=index,
            units=Units.of(index, settings.num_streams),
            tokenizer_json=self.tokenizer_json,
            bos_id=self.bos_id,
            seq_len=settings.seq_len,
            rows_per_block=settings.global_batch_size // settings.num_streams,
            packing=settings.packing,
            seed=settings.seed,
            shuffle=shuffle,
            num_streams=settings.num_streams,
            tokenizer_batch_size=settings.tokenizer_batch_size,
            buffer_size=settings.bestfit_buffer_size,
            pad_id=self.pad_id,
            max_document_chars=settings.max_document_chars,
        )

    def fingerprint(self, index: RowGroupIndex) -> StreamFingerprint:
        """The fingerprint of one corpus: its files (labels and footer digests), tokenizer and settings."""
        return StreamFingerprint(
            files=files_summary(index),
            file_digests=tuple(index.file_digests),
            text_column=self.settings.text_column,
            file_labels=tuple(index.file_labels()),
            **PackedRowsFingerprint.settings_of(self.settings, self.tokenizer_digest),
        )
