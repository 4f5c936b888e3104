"""A script may end, or drop its iterators, with loaders partly consumed: nothing may print at exit or at
garbage collection ("Exception ignored", a traceback), in-process or with workers, for either DataModule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import TESTS, make_docs, train_tokenizer, write_parquet


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exit")
    docs = make_docs(300, seed=5)
    write_parquet(root / "train", docs, files=2, row_group_size=25)
    train_tokenizer(docs, root / "tokenizer.json")
    return root


SCRIPT = """
import gc, sys
from support import LengthDataset, pad_collate
from lightning_d9d import D9DDataModule, PretrainingDataModule

ending = {ending!r}

def make(kind, workers, packing):
    if kind == "streaming":
        dm = PretrainingDataModule(train_files={train!r}, tokenizer={tokenizer!r}, seq_len=32, global_batch_size=8,
                                   microbatch_size=4, num_workers=workers, steps_per_epoch=20, num_streams=4,
                                   packing=packing)
    else:
        dm = D9DDataModule(LengthDataset(400), pad_collate, global_batch_size=16, microbatch_size=4,
                           num_workers=workers)
    dm.setup("fit")
    return dm

# Two loaders of each DataModule, in-process and with workers, a few batches of each, as a new user would try
# them; the iterators stay open.
iterators = []
for kind in ("streaming", "mapstyle"):
    for workers in (0, 2):
        for packing in ("concat", "bestfit"):
            batches = iter(make(kind, workers, packing).train_dataloader())
            for _ in range(3):
                next(batches)
            iterators.append(batches)
if ending == "collect":
    del iterators, batches
    gc.collect()
print("ended", flush=True)
"""


@pytest.mark.slow  # fresh interpreters, each importing torch and Lightning
@pytest.mark.parametrize("ending", ["exit", "collect"])
def test_open_iterators_end_silently(parquet: Path, ending: str) -> None:
    code = SCRIPT.format(
        ending=ending,
        train=str(parquet / "train"),
        tokenizer=str(parquet / "tokenizer.json"),
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, cwd=TESTS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ended"
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
