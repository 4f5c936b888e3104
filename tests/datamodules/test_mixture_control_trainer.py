"""Mixture controllers under a real Trainer: each built-in fits; a decision acts exactly ``MIXTURE_LAG`` steps after
its update step, every step taking exactly the rows its shares ask for (checked against counts of the rows trained,
not the planner); a resume from mid-run checkpoints (inside a window and at an update step) trains the same FULL row
sequence and journal as the uninterrupted run; 2 workers give the rows of in-process streams; 2 DDP processes decide
the same from all-reduced statistics; bad weights stop the run with one error naming the update step."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from mixture_control_support import G, datamodule, fit, steps_of, write_data

from lightning_d9d.mixtures import DoReMi, LossProportional, WeightsFile
from lightning_d9d.streaming.plans.mixture_journal import MIXTURE_LAG

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("mixture_control"))


def counts(steps: dict[int, list[tuple[int, str]]]) -> dict[int, tuple[int, int]]:
    """Rows of each source in each step, counted from the rows trained."""
    out = {}
    for step, rows in steps.items():
        c = Counter(source for source, _ in rows)
        out[step] = (c[0], c[1])
    return out


def assert_rows_follow_the_journal(steps: dict[int, list[tuple[int, str]]], journal: list[dict]) -> None:
    """From each change's effective step, every source within a row of its rows there plus G · shares per step; the
    rows there are those the run had trained (counted here); every step has G rows."""
    per_step = counts(steps)
    assert all(sum(c) == G for c in per_step.values())
    changes = [e for e in journal if e["shares"] is not None and e["effective_step"] <= max(per_step)]
    for number, entry in enumerate(changes):
        start = entry["effective_step"]
        end = changes[number + 1]["effective_step"] if number + 1 < len(changes) else max(per_step) + 1
        done = [sum(per_step[s][i] for s in range(start)) for i in range(2)]
        assert done == [entry["start_rows"]["easy"], entry["start_rows"]["hard"]]
        shares = [Fraction(entry["shares"]["easy"]), Fraction(entry["shares"]["hard"])]
        rows = list(done)
        for step in range(start, min(end, max(per_step) + 1)):
            rows = [r + c for r, c in zip(rows, per_step[step])]
            for i in range(2):
                assert abs(rows[i] - (done[i] + G * (step + 1 - start) * shares[i])) < 1, (step, entry)


class EditAt(pl.Callback):
    """Writes ``text`` to ``path`` when global step ``step`` starts (a person editing the weights file)."""

    def __init__(self, path: Path, step: int, text: str):
        self.path, self.step, self.text = path, step, text

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.path.write_text(self.text)


def test_a_weights_file_decision_acts_exactly_lag_steps_after_its_update(data: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.json"
    path.write_text('{"easy": 1, "hard": 3}')
    logger = CSVLogger(str(tmp_path), name="logs")
    module, dm = fit(data, tmp_path, WeightsFile(str(path), every=3), 16,
                     trainer={"callbacks": [EditAt(path, 7, '{"easy": 3, "hard": 1}')], "logger": logger,
                              "log_every_n_steps": 1})  # fmt: skip
    per_step = counts(steps_of(module))
    assert sorted(per_step) == list(range(16))
    # Update 3 acts from step 3 + 2; the edit made during step 7 is read at update 9 and acts from step 11.
    want = {**dict.fromkeys(range(5), (4, 4)), **dict.fromkeys(range(5, 11), (2, 6)), **dict.fromkeys(range(11, 16),
            (6, 2))}  # fmt: skip
    assert per_step == want
    journal = dm.mixture_journal
    assert [(e["update_step"], e["effective_step"], e["shares"]) for e in journal] == [
        (3, 5, {"easy": "1/4", "hard": "3/4"}), (6, 8, None), (9, 11, {"easy": "3/4", "hard": "1/4"}),
        (12, 14, None), (15, 17, None),
    ]  # fmt: skip
    assert MIXTURE_LAG == 2
    stats = journal[0]["inputs"]["stats"]
    assert stats["easy"]["rows"] == stats["hard"]["rows"] == 3 * G // 2  # the window's rows, counted per source
    assert dm.source_stats()["easy"]["weight"] == 0.75
    # Logged at each update: the shares in force from it and the window's loss per source.
    with open(next(Path(logger.log_dir).rglob("metrics.csv"))) as file:
        logged = list(csv.DictReader(file))
    weights = [(int(r["step"]), float(r["mixture/weight/hard"])) for r in logged if r.get("mixture/weight/hard")]
    # Lightning's "step" of a metric logged as step u begins is u - 1: updates 3 and 9 first appear at 2 and 8.
    assert weights[0] == (2, 0.75) and next(w for w in weights if w[1] == 0.25) == (8, 0.25)
    assert all(float(r["mixture/loss/easy"]) > 0 for r in logged if r.get("mixture/weight/hard"))


def test_skipped_data_provenance_and_inspect_follow_the_journal(data: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.json"
    path.write_text('{"easy": 1, "hard": 3}')
    module, dm = fit(data, tmp_path, WeightsFile(str(path), every=3), 10, skip_data=[[2, 4]])
    per_step = counts(steps_of(module))
    # Update 3 acts from training step 5, whose data step is 7 (data steps 2 and 3 were skipped).
    assert [(e["update_step"], e["effective_step"], e["data_step"]) for e in dm.mixture_journal][:2] == [
        (3, 5, 7),
        (6, 8, 10),
    ]
    assert [per_step[s] for s in range(10)] == [(4, 4)] * 5 + [(2, 6)] * 5
    # Provenance replays the journaled plan: each step's pieces name the sources of the rows trained.
    for step in (4, 5, 9):
        pieces = dm.provenance(step)
        rows_by_source = Counter()
        for source, _ in {(p.source, p.batch_row) for p in pieces}:
            rows_by_source[source] += 1
        assert (rows_by_source["easy"], rows_by_source["hard"]) == per_step[step]
    # inspect (no training): the shares in force, no update made.
    from lightning_d9d.cli import inspect

    fresh = datamodule(data, WeightsFile(str(path), every=3), num_workers=0)
    report = inspect(fresh, pl.Trainer(accelerator="cpu", logger=False), steps=8)
    assert "controller journal: 0 updates, 0 changes of shares; shares in force now: easy 50%, hard 50%" in report


def test_new_weights_on_resume_supersede_the_decisions_not_yet_in_force(data: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.json"
    path.write_text('{"easy": 1, "hard": 3}')
    fit(data, tmp_path / "full", WeightsFile(str(path), every=3), 8)
    # At the checkpoint of step 4, update 3's shares (from step 5) are journaled but not yet in force.
    checkpoint = str(tmp_path / "full" / "ckpt" / "step=4.ckpt")
    module, dm = fit(data, tmp_path / "changed", WeightsFile(str(path), every=3), 8, weights={"easy": 3, "hard": 1},
                     on_mixture_change="continue", ckpt_path=checkpoint)  # fmt: skip
    assert [counts(steps_of(module))[s] for s in range(4, 8)] == [(6, 2)] * 4
    assert [e["update_step"] for e in dm.mixture_journal] == [3, 6]  # the file unchanged since: shares kept


def test_a_global_batch_size_schedule_keeps_the_journals_shares_exact(data: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.json"
    path.write_text('{"easy": 1, "hard": 3}')
    module, dm = fit(data, tmp_path, WeightsFile(str(path), every=3), 10, global_batch_size=[[0, G], [6, 2 * G]])
    per_step = counts(steps_of(module))
    # G rows up to step 5, 2·G from step 6; the decision of update 3 (1/4, 3/4) from step 5 on, in both sizes.
    assert [per_step[s] for s in range(10)] == [(4, 4)] * 5 + [(2, 6)] + [(4, 12)] * 4
    assert dm.mixture_journal[0]["start_rows"] == {"easy": 20, "hard": 20}


def test_a_lightning_cli_config_takes_a_controller_by_class_path(data: Path) -> None:
    from lightning_d9d.cli import D9DCLI

    config = {
        "model": "lightning.pytorch.demos.boring_classes.BoringModel",
        "data": {
            "class_path": "lightning_d9d.PretrainingDataModule",
            "init_args": {
                "train_files": {"easy": str(data / "easy"), "hard": str(data / "hard")},
                "tokenizer": str(data / "tokenizer.json"),
                "mixture_controller": {"class_path": "lightning_d9d.mixtures.DoReMi",
                                       "init_args": {"reference_losses": {"easy": 1.0, "hard": 2.0}, "every": 7}},
            },
        },
    }  # fmt: skip
    cli = D9DCLI(args=["--config", json.dumps(config)], run=False)
    controller = cli.datamodule.mixture_controller
    assert isinstance(controller, DoReMi) and controller.every == 7
    assert controller.reference_losses == {"easy": 1.0, "hard": 2.0}


def test_loss_proportional_resumes_exactly_and_workers_give_the_same_rows(data: Path, tmp_path: Path) -> None:
    controller = dict(every=3, temperature=0.5, smoothing=0.1)
    full, dm = fit(data, tmp_path / "full", LossProportional(**controller), 16)
    steps, journal = steps_of(full), dm.mixture_journal
    assert sorted(steps) == list(range(16))
    assert [e["update_step"] for e in journal] == [3, 6, 9, 12, 15]
    assert all(e["shares"] is not None for e in journal)
    first = journal[0]["inputs"]["stats"]
    easy_loss, hard_loss = (first[n]["loss_sum"] / first[n]["tokens"] for n in ("easy", "hard"))
    assert hard_loss > easy_loss and Fraction(journal[0]["shares"]["hard"]) > Fraction(1, 2)
    # The softmax of the window's mean losses (written out here), quantised to millionths.
    z = [easy_loss / 0.5, hard_loss / 0.5]
    want = 0.9 * math.exp(z[1] - max(z)) / sum(math.exp(v - max(z)) for v in z) + 0.05
    assert abs(float(Fraction(journal[0]["shares"]["hard"])) - max(want, 1 / G)) <= 1e-6
    assert_rows_follow_the_journal(steps, journal)

    # Resumed inside a window (step 8: update 9 uses steps 6-8, two of them from before the checkpoint) and at an
    # update step (12): the FULL row sequence and the journal of the uninterrupted run.
    for at in (8, 12):
        resumed, rdm = fit(data, tmp_path / f"from{at}", LossProportional(**controller), 16,
                           ckpt_path=str(tmp_path / "full" / "ckpt" / f"step={at}.ckpt"))  # fmt: skip
        again = steps_of(resumed)
        assert sorted(again) == list(range(at, 16))
        assert [again[s] for s in range(at, 16)] == [steps[s] for s in range(at, 16)]
        assert rdm.mixture_journal == journal

    # Two DataLoader workers: the same rows and decisions as the in-process streams.
    workers, wdm = fit(data, tmp_path / "workers", LossProportional(**controller), 16, num_workers=2)
    assert [steps_of(workers)[s] for s in range(16)] == [steps[s] for s in range(16)]
    assert wdm.mixture_journal == journal
    saved = torch.load(tmp_path / "full" / "ckpt" / "step=12.ckpt", weights_only=True)["PretrainingDataModule"]
    assert [e["update_step"] for e in saved["mixture_control"]["journal"]["entries"]] == [3, 6, 9, 12]
    assert saved["mixture_control"]["controller"]["scores"].keys() == {"easy", "hard"}


def test_a_checkpoint_taken_mid_step_resumes_the_uninterrupted_run(data: Path, tmp_path: Path) -> None:
    """Saved at microbatch 1 of step 5 (4 microbatches a step): the data resumes at step 5's start, and the window
    of update 6 holds steps 3 and 4 only (step 5's first microbatch is trained again, not counted twice)."""
    from support import SaveAtBatch

    controller = dict(every=3, temperature=0.5)
    save = SaveAtBatch(str(tmp_path / "mid"), [[0, 5 * 4 + 1]])
    full, dm = fit(data, tmp_path / "full", LossProportional(**controller), 12, trainer={"callbacks": [save]})
    resumed, rdm = fit(data, tmp_path / "resumed", LossProportional(**controller), 12,
                       ckpt_path=str(tmp_path / "mid" / "mid-e0-b21.ckpt"))  # fmt: skip
    steps, again = steps_of(full), steps_of(resumed)
    assert sorted(again) == list(range(5, 12))
    assert [again[s] for s in range(5, 12)] == [steps[s] for s in range(5, 12)]
    assert rdm.mixture_journal == dm.mixture_journal


def test_doremi_fits_with_validation_losses_and_follows_its_recursion(data: Path, tmp_path: Path) -> None:
    reference = {"easy": 0.0, "hard": 50.0}  # only easy has excess loss: DoReMi moves share to it
    module, dm = fit(
        data,
        tmp_path,
        DoReMi(reference, every=2, step_size=0.3, smoothing=0.05),
        10,
        val_files={"hard": str(data / "val_hard")},
        val_steps=1,
        trainer={"val_check_interval": 16},
    )  # val_check_interval counts microbatches: validation runs after steps 4 and 8
    journal = dm.mixture_journal
    assert [e["update_step"] for e in journal] == [2, 4, 6, 8, 10]
    alpha = [0.5, 0.5]
    for entry in journal:
        stats = entry["inputs"]["stats"]
        excess = [max(stats[n]["loss_sum"] / stats[n]["tokens"] - reference[n], 0.0) for n in ("easy", "hard")]
        logits = [math.log(a) + 0.3 * x for a, x in zip(alpha, excess)]
        exps = [math.exp(v - max(logits)) for v in logits]
        alpha = [0.95 * e / sum(exps) + 0.025 for e in exps]
        floored = min(max(alpha[0], 1 / G), 1 - 1 / G)  # the loader keeps every source at a row per step at least
        assert abs(float(Fraction(entry["shares"]["easy"])) - floored) <= 1e-6
    assert Fraction(journal[-1]["shares"]["easy"]) >= Fraction(journal[0]["shares"]["easy"]) > Fraction(1, 2)
    # Validation ran after steps 4 and 8: later updates carry the hard source's validation loss, never easy's.
    assert journal[0]["inputs"]["stats"]["hard"]["val_loss"] is None
    assert journal[2]["inputs"]["stats"]["hard"]["val_loss"] > 0
    assert all(e["inputs"]["stats"]["easy"]["val_loss"] is None for e in journal)
    assert_rows_follow_the_journal(steps_of(module), journal)


class Negative:
    every = 2

    def update(self, step: int, stats: Any) -> dict[str, float]:
        return {"easy": 1.0, "hard": -0.5} if step == 4 else {"easy": 1.0, "hard": 1.0}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_bad_weights_stop_the_fit_with_one_error_naming_the_update_step(data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mixture controller Negative at update step 4 returned weight -0.5 for "
                       r"source 'hard': weights are numbers >= 0"):  # fmt: skip
        fit(data, tmp_path, Negative(), 8)
    with pytest.raises(ValueError, match=r"mixture_controller=LossProportional\(...\) needs a mixture"):
        fit(data, tmp_path, LossProportional(), 8, train_files=str(data / "hard"))


def test_two_ddp_ranks_decide_the_same_and_resume_a_one_rank_checkpoint(data: Path, tmp_path: Path) -> None:
    controller = {"every": 2, "temperature": 0.5}
    one, one_dm = fit(data, tmp_path / "one", LossProportional(**controller), 10)
    one_steps, one_journal = steps_of(one), one_dm.mixture_journal
    # Resumed at step 4 on 2 DDP processes (other data-parallel layout), then trained on with a live controller.
    config = {"root": str(data), "out": str(tmp_path / "two"), "devices": 2, "max_steps": 10,
              "ckpt_path": str(tmp_path / "one" / "ckpt" / "step=4.ckpt"),
              "controller": ["LossProportional", controller]}  # fmt: skip
    result = subprocess.run([sys.executable, str(TESTS / "mixture_control_script.py"), json.dumps(config)],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    journals = [json.loads((tmp_path / "two" / f"journal-rank{r}.json").read_text()) for r in (0, 1)]
    assert journals[0] == journals[1]  # every rank decided the same
    journal = journals[0]
    assert [e["update_step"] for e in journal] == [2, 4, 6, 8, 10]
    assert journal[:2] == one_journal[:2]  # replayed from the checkpoint, not recomputed
    for entry in journal[2:]:  # each rank trains half the rows: the statistics cover both ranks' rows
        assert sum(s["rows"] for s in entry["inputs"]["stats"].values()) == 2 * G
    steps: dict[int, list] = {s: one_steps[s] for s in range(4)}
    for r in (0, 1):
        for line in (tmp_path / "two" / f"rows-rank{r}.jsonl").read_text().splitlines():
            step, rows = json.loads(line)
            steps.setdefault(step, []).extend((source, row) for source, row in rows)
    assert sorted(steps) == list(range(10))
    # Steps 4-7 take shares the checkpoint's journal holds (update 4 acts from step 6, update 6 from step 8): the
    # one-rank run's rows, as a multiset per step (the ranks' rows arrive in rank order).
    for step in range(4, 8):
        assert sorted(steps[step]) == sorted(one_steps[step])
    assert_rows_follow_the_journal(steps, journal)
