"""PretrainingDataModule and the parts it is composed of.

``datamodule.py`` holds the DataModule, which owns and delegates to ``corpus.py`` (sources, tokenizer, token cache,
what setup read, epoch sizing), ``plan.py`` (shapes, shares, edits, epoch length: the part a checkpoint nests),
``provenance.py`` (the ledger and its replays) and ``reports.py``; ``state.py`` is the saved layout by version,
``mixture.py`` the named sources and shares, ``specs.py`` the stream specs read from files, ``edits.py`` the edits
asked, ``batch.py`` the microbatch type. Inside the package modules import each other by their own names, never
through this one.
"""

from __future__ import annotations

from lightning_d9d.datamodules.pretraining.batch import PretrainingBatch
from lightning_d9d.datamodules.pretraining.corpus import storage_of
from lightning_d9d.datamodules.pretraining.datamodule import PretrainingDataModule
from lightning_d9d.datamodules.pretraining.state import STATE_VERSION

__all__ = ["STATE_VERSION", "PretrainingBatch", "PretrainingDataModule", "storage_of"]

# The public path users name in configs, which `lightning-d9d inspect` prints and pickles refer to: the package's,
# as before it was split into parts, not the module that happens to define the class.
PretrainingDataModule.__module__ = PretrainingBatch.__module__ = __name__
