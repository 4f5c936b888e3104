"""DemoPretrainingDataModule: PretrainingDataModule that understands the demo corpus' parquet shards.

``train_files``/``val_files`` values ``demo``, ``demo:prose``, ``demo:code`` and ``demo:validation`` (alone, in
a list, or as a mapping's values) and ``tokenizer="demo"`` are replaced in ``prepare_data``/``setup`` by the
shards and tokenizer of :mod:`lightning_d9d.demo.parquet`, built on first use; everything else is
``PretrainingDataModule``'s, so ``configs/demo_pretraining.yaml`` trains the demo model on a fresh clone.

Trade-off: the resolved paths lie in this machine's demo cache, so a checkpoint resumes where that cache is
(the files' footers, not their paths, decide whether the data is the same).
"""

from __future__ import annotations

from typing import Any

from lightning_d9d.datamodules.pretraining import PretrainingDataModule
from lightning_d9d.demo.parquet import DemoParquet, build_demo_parquet, resolve_demo_files, uses_demo
from lightning_d9d.tokenizer import read_tokenizer

DEMO_TOKENIZER = "demo"


class DemoPretrainingDataModule(PretrainingDataModule):
    """``PretrainingDataModule`` whose file specs and tokenizer may name the demo corpus (see the module).

    Args:
        **kwargs: every argument of :class:`~lightning_d9d.PretrainingDataModule`; ``train_files`` defaults
            to ``"demo"`` (prose and code), ``tokenizer`` to ``"demo"`` and ``bos_token`` to the demo
            tokenizer's ``<eos>`` (every document starts with it).
    """

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("train_files", "demo")
        kwargs.setdefault("tokenizer", DEMO_TOKENIZER)
        kwargs.setdefault("bos_token", "<eos>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary, special tokens included (checked by the demo model at fit start)."""
        self._resolve_demo()
        return read_tokenizer(self.tokenizer).get_vocab_size(with_added_tokens=True)

    def prepare_data(self) -> None:
        """Build the demo shards once (rank 0 of each node; ``setup`` waits on the same lock elsewhere)."""
        self._resolve_demo()

    def setup(self, stage: str | None = None) -> None:
        """Replace the demo specs by the shards' paths, then ``PretrainingDataModule.setup``."""
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
