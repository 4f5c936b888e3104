"""``GlobalStepLoss`` (the demo model's ``train/global_loss``) logs under real 2-process DDP exactly the loss of
the whole global batch: the reference takes every microbatch of each step from a 1-process DataModule (the same
global batches on any world size) and computes one cross-entropy over all their targets with the same weights
(learning rate 0). Best-fit rows with padding make microbatches of unequal target counts, so a mean of microbatch
means (or one rank's own value) differs from it, which the test checks too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from global_loss_script import make_datamodule, make_model
from support import TESTS, make_docs, small_corpus

from lightning_d9d.core.tokens import IGNORE_INDEX

STEPS = 3


@pytest.mark.slow
def test_the_logged_global_loss_is_the_whole_global_batchs_loss(tmp_path: Path) -> None:
    corpus = small_corpus(tmp_path / "corpus", make_docs(200, seed=5, max_words=12, long_every=30), 20)
    options = dict(
        train_files=str(corpus / "train"), tokenizer=str(corpus / "tokenizer.json"), seq_len=24, global_batch_size=8,
        microbatch_size=2, num_streams=4, num_workers=0, steps_per_epoch=10, packing="bestfit_split",
    )  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, str(TESTS / "global_loss_script.py"), json.dumps({"devices": 2, "steps": STEPS,
                                                                           "options": options, "out": str(out)})],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    logged = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    dm = make_datamodule(options)
    dm.setup("fit")
    model = make_model().eval()
    batches = iter(dm.train_dataloader())
    expected, mean_of_means = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            sums, counts, means = 0.0, 0, []
            for _ in range(dm.microbatches_per_step):  # 4 microbatches of 2 rows: the step's 8 rows
                batch = next(batches)
                logits = model(batch.input_ids, torch.ones_like(batch.input_ids), batch.position_ids)
                loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum",
                                       ignore_index=IGNORE_INDEX)  # fmt: skip
                count = int((batch.targets != IGNORE_INDEX).sum())
                sums, counts = sums + float(loss), counts + count
                means.append(float(loss) / count)
            expected.append(sums / counts)
            mean_of_means.append(sum(means) / len(means))
    dm.close_loaders()
    assert dm.microbatches_per_step == 4
    assert len(logged[0]) == len(logged[1]) == STEPS
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(logged[rank]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # The test tells the exact mean from a mean of microbatch means.
    assert max(abs(a - b) for a, b in zip(expected, mean_of_means, strict=True)) > 1e-4
