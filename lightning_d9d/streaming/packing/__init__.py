"""Packing: tokens of documents into rows of ``seq_len + 1`` (concat, best-fit crop, best-fit split).

Importing this package registers every strategy by name (``streaming.plans.packings``); a new strategy is one
module here that registers itself, plus its import below.
"""

from lightning_d9d.streaming.packing import bestfit_stage, concat  # noqa: F401  (each registers its strategies)
