"""DemoPretrainingDataModule: PretrainingDataModule that understands the demo corpus' parquet shards.

``demo``/``demo:<source>`` file specs and ``tokenizer="demo"`` are replaced by the demo shards and tokenizer,
built on first use, so the demo config trains on a fresh clone. A checkpoint's data identity is the files'
footers, not their cache paths.
"""

from __future__ import annotations

from typing import Any

from lightning_d9d.datamodules.pretraining import PretrainingDataModule
from lightning_d9d.demo_data.parquet import DemoParquet, build_demo_parquet, resolve_demo_files, uses_demo
from lightning_d9d.tokenization.tokenizer import read_tokenizer

DEMO_TOKENIZER = "demo"


class DemoPretrainingDataModule(PretrainingDataModule):
    """``PretrainingDataModule`` whose file specs and tokenizer may name the demo corpus.

    Args:
        **kwargs: every argument of ``PretrainingDataModule``; ``train_files`` and ``tokenizer`` default to
            ``"demo"``, ``bos_token`` to the demo tokenizer's ``<eos>``.
    """

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("train_files", "demo")
        kwargs.setdefault("tokenizer", DEMO_TOKENIZER)
        kwargs.setdefault("bos_token", "<eos>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size, special tokens included."""
        self._resolve_demo()
        return read_tokenizer(self.tokenizer).get_vocab_size(with_added_tokens=True)

    def prepare_data(self) -> None:
        """Build the demo shards once (elsewhere ``setup`` waits on the same lock)."""
        self._resolve_demo()

    def setup(self, stage: str | None = None) -> None:
        self._resolve_demo()
        super().setup(stage)

    def _resolve_demo(self) -> None:
        specs = (self.train_files, self.val_files)
        wants_tokenizer = isinstance(self.tokenizer, str) and self.tokenizer == DEMO_TOKENIZER
        if not (wants_tokenizer or any(uses_demo(spec) for spec in specs)):
            return
        built: DemoParquet = build_demo_parquet()
        self.train_files = resolve_demo_files(self.train_files, built)
        self.val_files = resolve_demo_files(self.val_files, built)
        if wants_tokenizer:
            self.tokenizer = built.tokenizer_path
