"""Writes this fixture: a tiny corpus, a tokenizer, and checkpoint data states in the stream-state format of
PretrainingDataModule state version 2 (before stages had get_state/reset), with the digests of the batches that
followed each state. Run from the repository root with the code of that version; the test that reads it checks
that the current code resumes those states onto exactly the same batches."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from support import digest, make_docs, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule

OPTIONS = dict(seq_len=24, global_batch_size=8, microbatch_size=4, num_workers=0, num_streams=4,
               steps_per_epoch=40, bestfit_buffer_size=12, tokenizer_batch_size=8)  # fmt: skip
SAVED_AT, FOLLOWING = 7, 12  # optimizer steps before the state is taken; microbatches recorded after it


def main() -> None:
    docs = make_docs(160, seed=11)
    write_parquet(HERE / "data", docs, files=2, row_group_size=16)
    train_tokenizer(docs, HERE / "tokenizer.json")
    out = {}
    for packing in ("concat", "bestfit", "bestfit_split"):
        dm = PretrainingDataModule(
            train_files=str(HERE / "data"), tokenizer=str(HERE / "tokenizer.json"), packing=packing, **OPTIONS
        )
        dm.setup("fit")
        batches = iter(dm.train_dataloader())
        for _ in range(SAVED_AT * dm.microbatches_per_step):
            next(batches)
        state = dm.state_dict()
        following = [digest(next(batches)) for _ in range(FOLLOWING)]
        batches.close()
        out[packing] = {"state": state, "following": following}
    torch.save(out, HERE / "states.pt")


if __name__ == "__main__":
    main()
