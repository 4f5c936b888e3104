"""Packing: tokens of documents into rows of ``seq_len + 1`` (concat, best-fit crop, best-fit split).

Importing this package registers every strategy by name (``streaming.plans.packings``); a new strategy is one
module here that registers itself, plus its import below.
"""

# Each module registers its strategies by name when imported.
import lightning_d9d.streaming.packing.bestfit_stage
import lightning_d9d.streaming.packing.concat  # noqa: F401
