"""The corpus of a PretrainingDataModule: its sources scanned, their stream specs, and one pass estimated.

:class:`PretrainingCorpus` holds the loaded tokenizer and the settings; from the sources (a single corpus is one
source) it scans the parquet footers (``streaming.source``), builds the
:class:`~lightning_d9d.streaming.spec.MixtureSpec` the K streams share and estimates one pass per source
(``streaming.estimate``). It knows nothing of ranks, workers or Lightning.

Trade-off: the tokenizer is read and the footers scanned again on every ``setup``, so a run always streams the
files as they are now (and the fingerprint notices a file changed since a checkpoint), at the cost of listing
and opening every file once per ``setup``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from lightning_d9d.datamodules.pretraining_mixture import SourceConfig
from lightning_d9d.streaming.estimate import estimate_pass, first_text
from lightning_d9d.streaming.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.source import RowGroupIndex, Units, resolve_files
from lightning_d9d.streaming.spec import MixtureSpec, StreamSettings, StreamSpec
from lightning_d9d.streaming.storage import Storage
from lightning_d9d.tokenizer import pad_token_id, read_tokenizer


@dataclass(frozen=True)
class TrainCorpus:
    """The training side of a corpus: the streams' spec and the estimate of one pass.

    ``source_pass_rows`` holds the estimated rows of one pass over each source; ``pass_tokens`` the estimated
    tokens of one pass over all of them.
    """

    spec: MixtureSpec
    pass_tokens: float
    source_pass_rows: dict[str, float]

    def steps_per_pass(self) -> int:
        """Optimizer steps in one estimated pass over all sources.

        Raises:
            ValueError: the corpus is too small for one step, naming its estimated tokens and rows.
        """
        settings = self.spec.sources[0].settings
        rows = sum(self.source_pass_rows.values())
        steps = int(rows // settings.global_batch_size)
        if steps < 1:
            raise ValueError(
                f"train_files are too small for one optimizer step: about {self.pass_tokens:.0f} tokens "
                f"({rows:.1f} rows of seq_len+1={settings.seq_len + 1}) per pass, but one step takes "
                f"global_batch_size={settings.global_batch_size} rows; add data, lower seq_len or "
                "global_batch_size, or set steps_per_epoch to cycle the data"
            )
        return steps


class PretrainingCorpus:
    """The loaded tokenizer and the settings, which turn sources into specs.

    Args:
        settings: the streams' settings.
        tokenizer: a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``.
        bos_token: the token every document starts with.
        storage: how files and URLs are reached.

    Raises:
        ValueError: the tokenizer lacks ``bos_token``, naming its added/special tokens.
    """

    def __init__(
        self, settings: StreamSettings, tokenizer: str | os.PathLike | Tokenizer, bos_token: str, storage: Storage
    ):
        loaded = read_tokenizer(tokenizer)
        bos_id = loaded.token_to_id(bos_token)
        if bos_id is None:
            special = sorted(t.content for t in loaded.get_added_tokens_decoder().values())
            raise ValueError(
                f"the tokenizer has no token bos_token={bos_token!r}; its added/special tokens are "
                f"{special}: pass one of them as bos_token or add it to the tokenizer"
            )
        self.settings, self.storage, self.bos_id = settings, storage, bos_id
        self.tokenizer_json = loaded.to_str()
        self.pad_id = pad_token_id(loaded, avoid=bos_id)  # BOS marks document starts, so padding must not use it

    def train(self, sources: Sequence[SourceConfig], schedule: MixtureSchedule, what: str) -> TrainCorpus:
        """The shuffled training streams of ``sources`` mixed by ``schedule`` (one source: all of every step).

        Args:
            sources: the sources, in order.
            schedule: their shares.
            what: how the files are named in errors (``train_files``; a source's ``train_files['web']``).

        Raises:
            ValueError: no file matches, a file is not parquet or lacks the column, the files hold no text, too
                few rows for K streams (naming the source of a mixture).
            StorageError: a URL could not be listed or opened.
        """
        specs, pass_rows, total_tokens = [], {}, 0.0
        for source in sources:
            where = what if len(sources) == 1 and what == "train_files" else f"{what}[{source.name!r}]"
            spec = self.spec(source, where, shuffle=True)
            tokens, pass_rows[source.name] = estimate_pass(spec)
            specs.append(spec)
            total_tokens += tokens
        plan = MixturePlan(schedule, self.settings.global_batch_size)
        mixture = MixtureSpec(tuple(source.name for source in sources), tuple(specs), plan)
        return TrainCorpus(mixture, total_tokens, pass_rows)

    def validation(self, source: SourceConfig, what: str) -> MixtureSpec:
        """The streams of one validation source, read in file order (``what`` names it in errors)."""
        spec = self.spec(source, what, shuffle=False)
        plan = MixturePlan(MixtureSchedule([source.name]), self.settings.global_batch_size)
        return MixtureSpec((source.name,), (spec,), plan)

    def spec(self, source: SourceConfig, what: str, shuffle: bool) -> StreamSpec:
        """The spec of the K streams ``source``'s row groups are dealt to.

        Raises:
            ValueError: as :meth:`scan`, or too few rows for K streams (naming ``what``).
        """
        index = self.scan(source.files, what, source.text_column)
        try:
            units = Units.of(index, self.settings.num_streams)
        except ValueError as error:  # too few rows for K streams: say which source of a mixture
            if "[" not in what:
                raise
            raise ValueError(f"{what}: {error}") from error
        return StreamSpec(self.settings, index, units, self.tokenizer_json, self.bos_id, self.pad_id, shuffle)

    def scan(self, files: Any, what: str, text_column: str) -> RowGroupIndex:
        """The row groups of ``files`` (footers only).

        Raises:
            ValueError: as ``resolve_files``/``RowGroupIndex.scan``, or every text of the column is null or empty.
        """
        storage = self.storage
        index = RowGroupIndex.scan(resolve_files(files, what, storage), text_column, storage)
        if first_text(index) is None:
            raise ValueError(
                f"{what} hold no text: every value of column {text_column!r} in {len(index.files)} file(s) "
                f"({index.total_rows} rows) is null or empty"
            )
        return index
