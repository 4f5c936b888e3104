"""Global batch size and seq_len in phases under a real Trainer: Lightning accumulates exactly each step's
microbatches (no window straddles two phases, gradients whole), 1 and 2 DDP ranks train the same global batches
through a ramp and a length change, and a resume before, at or after a boundary continues exactly, on the same and
on another layout, also from a checkpoint written on an epoch's last batch (2 → 1 and 1 → 2 processes, compared
microbatch by microbatch with an uninterrupted run on the resuming layout).

``StepSizes`` answers two Lightning internals (the epoch loop's accumulation end and the automatic optimisation's
zero-grad) from the DataModule: the gradient test pins them down, so a Lightning upgrade that changes them fails here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from support import (
    build_datamodule,
    fit,
    fit_in_processes,
    make_docs,
    per_rank_microbatches,
    ranked_rows,
    read_records,
    train_tokenizer,
    write_parquet,
)

# G: 8 → 16 at step 3 → 8 at step 5; seq_len: 16 → 32 at step 4 → 8 at step 6. With m = 2 on one rank, M is
# 4, 4, 4, 8, 8, 4, ...: an epoch of 7 steps puts step 3's window at microbatch 12, not a multiple of its M = 8, where
# Lightning's own rule (batch count modulo accumulate_grad_batches) would end and zero the windows in the wrong place.
SIZES = [[0, 8], [3, 16], [5, 8]]
SEQ_LENS = [[0, 16], [4, 32], [6, 8]]
STEPS_PER_EPOCH = 7
TOTAL_STEPS = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shape_schedule")
    docs = make_docs(160, seed=5, max_words=20, long_every=9, long_words=60)
    write_parquet(root / "train", docs, files=2, row_group_size=10)
    write_parquet(root / "val", make_docs(40, seed=6), files=1, row_group_size=10)
    train_tokenizer(docs + make_docs(40, seed=6), root / "tokenizer.json")
    return root


def config(tmp: Path, data: Path, runs: list[dict], devices: int = 1, **changes: Any) -> dict:
    options = dict(
        train_files=str(data / "train"), val_files=str(data / "val"), tokenizer=str(data / "tokenizer.json"),
        seq_len=SEQ_LENS, global_batch_size=SIZES, microbatch_size=2, num_streams=4, val_steps=2,
        steps_per_epoch=STEPS_PER_EPOCH, tokenizer_batch_size=8, bestfit_buffer_size=24, num_workers=0,
        packing="bestfit_split",
    )  # fmt: skip
    options.update(changes)
    return {"data": "pretraining", "options": options, "record_dir": str(tmp / "records"),
            "ckpt_dir": str(tmp / "ckpt"), "devices": devices, "runs": runs}  # fmt: skip


def size_at(step: int) -> int:
    return [g for start, g in SIZES if start <= step][-1]


def seq_len_at(step: int) -> int:
    return [n for start, n in SEQ_LENS if start <= step][-1]


def by_step(records: list[dict], run: str) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record["run"] == run and record["kind"] == "train":
            steps[record["step"]].append(record)
    return dict(steps)


def global_rows(records: list[dict], run: str) -> dict[int, list[str]]:
    """Step -> the digests of its rows in order over the data-parallel ranks (rank 0's microbatches in order, then
    rank 1's, …; :func:`support.ranked_rows`): equal across layouts only if every row has the same place in the
    global batch and went to the rank that place names."""
    mine = [r for r in records if r["run"] == run and r["kind"] == "train"]
    return {
        step: ranked_rows([[row for rows in microbatches for row in rows] for microbatches in per_rank])
        for (_, step), per_rank in per_rank_microbatches(mine, "rows").items()
    }


def test_lightning_accumulates_each_steps_microbatches_and_nothing_else(data: Path, tmp_path: Path) -> None:
    runs = [dict(name="full", max_steps=TOTAL_STEPS)]
    fit(config(tmp_path, data, runs))
    records = read_records(tmp_path / "records", run="full")
    steps = by_step(records, "full")
    assert sorted(steps) == list(range(TOTAL_STEPS)), "one optimizer step per planned step, across the epoch end"
    gradients = {}
    for line in (tmp_path / "records" / "steps-rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        gradients[record["step"]] = record["grad"]
    assert sorted(gradients) == list(range(TOTAL_STEPS))
    for step, microbatches in steps.items():
        m = size_at(step) // 2
        assert len(microbatches) == m, f"step {step}: {len(microbatches)} microbatches, planned {m}"
        assert {r["accumulate"] for r in microbatches} == {m}, f"step {step}: Lightning divided by another M"
        assert {r["seq_len"] for r in microbatches} == {seq_len_at(step)}
        weight = microbatches[0]["weight"]
        assert all(r["weight"] == weight for r in microbatches), f"step {step}: the optimizer stepped mid-window"
        # Lightning divides each microbatch's loss (w - s)² by M and zeroes the gradient only at a step's start.
        expected = sum(2 * (weight - r["scale"]) for r in microbatches) / m
        assert gradients[step] == pytest.approx(expected, rel=1e-4, abs=1e-6), f"step {step}: a partial window"
        assert {r["epoch"] for r in microbatches} == {step // STEPS_PER_EPOCH}
        assert {r["step_targets"] for r in microbatches} == {sum(r["targets"] for r in microbatches)}


@pytest.mark.slow
def test_one_two_and_four_ranks_train_the_same_steps_and_resume_exactly_around_every_boundary(
    data: Path, tmp_path: Path
) -> None:
    one_dir, ckpt1 = tmp_path / "one", tmp_path / "one" / "ckpt"
    # Checkpoints after steps 2, 3, 4, 5, 6 (before and at the boundaries 3, 4, 5, 6) and mid-window in step 3.
    one = config(one_dir, data, [dict(name="full", max_steps=TOTAL_STEPS, every_n_train_steps=1, save_at=[[0, 14]])])
    fit(one)
    full = global_rows(read_records(one_dir / "records"), "full")
    assert [len(full[s]) for s in range(TOTAL_STEPS)] == [size_at(s) for s in range(TOTAL_STEPS)]
    resumed = [
        dict(name="full", max_steps=TOTAL_STEPS, every_n_train_steps=1),
        dict(name="from_one_before", max_steps=TOTAL_STEPS, ckpt_path=str(ckpt1 / "epoch=0-step=3.ckpt")),
        dict(name="from_one_mid_window", max_steps=TOTAL_STEPS, ckpt_path=str(ckpt1 / "mid-e0-b14.ckpt")),
        dict(
            name="from_one_at",
            max_steps=TOTAL_STEPS,
            ckpt_path=str(ckpt1 / "epoch=0-step=4.ckpt"),
            options={"num_workers": 2, "microbatch_size": 1},
        ),
        dict(name="from_one_after", max_steps=TOTAL_STEPS, ckpt_path=str(ckpt1 / "epoch=0-step=6.ckpt")),
        dict(name="tensor_parallel", max_steps=TOTAL_STEPS, strategy=[1, 2]),  # both processes: one replica
    ]
    two_dir = tmp_path / "two"
    ledger = {"provenance_dir": str(two_dir / "ledger"), "provenance_every": 3}
    fit_in_processes(config(two_dir, data, resumed, devices=2, **ledger), timeout=600)
    two = read_records(two_dir / "records")
    # Each rank recorded its own streams: a query finds every stream's record and names the step's rows.
    asker = build_datamodule(config(two_dir, data, [], **ledger))
    asker.setup("fit")
    assert {first for first, _ in asker.ledger.replay_starts(7, asker.train_spec, asker.position).values()} == {6}
    assert {piece.batch_row for piece in asker.provenance(7)} == set(range(size_at(7)))
    assert global_rows(two, "full") == full, "1 and 2 ranks train the same global batch in every step"
    for step, microbatches in by_step(two, "full").items():  # bestfit_split pads: each replica's count differs
        targets = sum(r["targets"] for r in microbatches)
        assert {r["step_targets"] for r in microbatches} == {targets}, f"step {step}: the step's targets, all ranks"
    for rank in (0, 1):
        peer = [r for r in two if r["rank"] == rank]
        assert global_rows(peer, "tensor_parallel") == full, f"tensor-parallel process {rank}: the replica's steps"
    for name, start in (("from_one_before", 3), ("from_one_mid_window", 3), ("from_one_at", 4), ("from_one_after", 6)):
        got = global_rows(two, name)
        assert min(got) == start and got == {s: rows for s, rows in full.items() if s >= start}, name
    four_dir = tmp_path / "four"
    fit_in_processes(config(four_dir, data, [dict(name="full", max_steps=TOTAL_STEPS)], devices=4), timeout=600)
    assert global_rows(read_records(four_dir / "records"), "full") == full, "4 ranks too"
    back_dir = tmp_path / "back"
    back = [
        dict(name="from_two_at", max_steps=TOTAL_STEPS, ckpt_path=str(two_dir / "ckpt" / "epoch=0-step=5.ckpt")),
        dict(
            name="from_two_next_epoch", max_steps=TOTAL_STEPS, ckpt_path=str(two_dir / "ckpt" / "epoch=1-step=8.ckpt")
        ),
    ]
    fit(config(back_dir, data, back))
    records = read_records(back_dir / "records")
    for name, start in (("from_two_at", 5), ("from_two_next_epoch", 8)):
        got = global_rows(records, name)
        assert got == {s: rows for s, rows in full.items() if s >= start}, name


def test_the_progress_bar_counts_optimizer_steps_of_every_size(data: Path, tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar
    from support import RecordingModule, build_datamodule

    seen: list[tuple[int, int]] = []

    class Positions(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            bar = trainer.progress_bar_callback.train_progress_bar
            seen.append((bar.n, bar.total))

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS_PER_EPOCH, logger=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[TQDMProgressBar(), Positions()],
    )  # fmt: skip
    datamodule = build_datamodule(config(tmp_path, data, []))
    trainer.fit(RecordingModule(str(tmp_path / "records")), datamodule=datamodule)
    ends = [sum(size_at(s) // 2 for s in range(step + 1)) for step in range(STEPS_PER_EPOCH)]
    expected = [(sum(1 for end in ends if end <= i + 1), STEPS_PER_EPOCH) for i in range(ends[-1])]
    assert seen == expected, "after each microbatch: the optimizer steps completed, of the epoch's 7"


# Elastic resume at an epoch's end (issue 44): epochs of 5 steps, so the checkpoint after step 4 ends epoch 0. Each
# schedule puts a G boundary in another place relative to that end: "ramp" before it (3) and after it (6), "at_end" at
# it (5, and more than doubling, so a 1-process epoch 0 has fewer microbatches than a 2-process epoch 1), "fixed" none.
ELASTIC_SCHEDULES = {"ramp": [[0, 8], [3, 16], [6, 8]], "at_end": [[0, 8], [5, 32]], "fixed": [[0, 8]]}
ELASTIC_EPOCH, ELASTIC_STEPS = 5, 10
# The first step each resume trains, by checkpoint: the end of epoch 0 as ModelCheckpoint(every_n_train_steps) saves
# it (on the epoch's last batch) and as saved at the epoch's end, mid-epoch 0 at the ramp's first boundary, and
# mid-epoch 1.
ELASTIC_CHECKPOINTS = {
    "epoch=0-step=5.ckpt": 5, "end-epoch=0.ckpt": 5, "epoch=0-step=3.ckpt": 3, "epoch=1-step=7.ckpt": 7,
}  # fmt: skip


def elastic_runs(tmp: Path, layout: str, resume_from: str | None) -> list[dict]:
    """Per schedule: the uninterrupted run on ``layout`` (checkpointing every step and at each epoch's end), and where
    ``resume_from`` names the other layout, a resume from each of its checkpoints."""
    runs = []
    for name, sizes in ELASTIC_SCHEDULES.items():
        options = {"global_batch_size": sizes, "steps_per_epoch": ELASTIC_EPOCH, "seq_len": 16}
        ckpt_dir = str(tmp / layout / name)
        runs.append(dict(name=f"{name}-full", max_steps=ELASTIC_STEPS, options=options, ckpt_dir=ckpt_dir,
                         every_n_train_steps=1, epoch_end_ckpt=True))  # fmt: skip
        for file in ELASTIC_CHECKPOINTS if resume_from else ():
            path = str(tmp / resume_from / name / file)
            runs.append(dict(name=f"{name}-from-{file}", max_steps=ELASTIC_STEPS, options=options, ckpt_path=path))
    return runs


def microbatch_sequence(records: list[dict], run: str, start: int = 0) -> list[tuple]:
    """Every microbatch ``run`` trained from step ``start`` on, in training order: (step, rank, index in the epoch,
    Lightning's accumulation count, digest of all its tensors)."""
    return [
        (r["step"], r["rank"], r["batch_idx"], r["accumulate"], r["digest"])
        for r in records
        if r["run"] == run and r["step"] >= start
    ]


def step_weights(records: list[dict], run: str, start: int = 0) -> list[tuple[int, float]]:
    """The weight each optimizer step of ``run`` trained with (equal only if every earlier step was a whole window)."""
    return sorted({(r["step"], r["weight"]) for r in records if r["run"] == run and r["step"] >= start})


def assert_resumed_exactly(records: list[dict], run: str, start: int, processes: int, sizes: list) -> None:
    got, want = microbatch_sequence(records, run), microbatch_sequence(records, run.split("-")[0] + "-full", start)
    # Counted by hand from the schedule: G(s) / (processes × microbatch_size 2) microbatches per rank and step.
    expected = sum(processes * ([g for first, g in sizes if first <= s][-1] // (2 * processes))
                   for s in range(start, ELASTIC_STEPS))  # fmt: skip
    assert len(want) == expected, f"{run}: the uninterrupted run trained {len(want)} microbatches, planned {expected}"
    assert len(got) == len(want) and got == want, f"{run}: resumed at step {start}, not the uninterrupted microbatches"
    resumed, uninterrupted = step_weights(records, run), step_weights(records, run.split("-")[0] + "-full", start)
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted]
    assert [w for _, w in resumed] == pytest.approx([w for _, w in uninterrupted], rel=1e-5, abs=1e-7), run


@pytest.mark.slow
def test_an_elastic_resume_at_or_around_an_epoch_end_trains_the_uninterrupted_microbatches(
    data: Path, tmp_path: Path
) -> None:
    # 1 process first, then 2 DDP processes (uninterrupted, and resumed from the 1-process checkpoints), then 1
    # process resumed from the 2-process checkpoints, and once more from a checkpoint that such a resume wrote.
    one, two = tmp_path / "one_records", tmp_path / "two_records"
    fit({**config(tmp_path, data, elastic_runs(tmp_path, "one", None)), "record_dir": str(one)})
    ddp = {**config(tmp_path, data, elastic_runs(tmp_path, "two", "one"), devices=2), "record_dir": str(two)}
    fit_in_processes(ddp, timeout=600)
    back = [run for run in elastic_runs(tmp_path, "one", "two") if "ckpt_path" in run]
    chained = []
    for run in back:  # the resumes at the epoch's end checkpoint every step, and one resumes from mid-epoch 1
        if run["name"].endswith("-from-epoch=0-step=5.ckpt"):
            run.update(ckpt_dir=str(tmp_path / "chain" / run["name"]), every_n_train_steps=1)
            path = str(tmp_path / "chain" / run["name"] / "epoch=1-step=7.ckpt")
            name = run["name"].split("-")[0] + "-chained"
            chained.append(dict(name=name, max_steps=ELASTIC_STEPS, options=run["options"], ckpt_path=path))
    fit({**config(tmp_path, data, back + chained), "record_dir": str(one)})
    for records, processes in ((read_records(one), 1), (read_records(two), 2)):
        for name, sizes in ELASTIC_SCHEDULES.items():
            full = by_step(records, f"{name}-full")
            assert sorted(full) == list(range(ELASTIC_STEPS)), f"{name} on {processes} process(es)"
            for file, start in ELASTIC_CHECKPOINTS.items():
                assert_resumed_exactly(records, f"{name}-from-{file}", start, processes, sizes)
            if processes == 1:  # a checkpoint written after a 2 → 1 resume at the epoch's end resumes exactly too
                assert_resumed_exactly(records, f"{name}-chained", 7, processes, sizes)
    for name in ELASTIC_SCHEDULES:  # both layouts train the same global batches, row by row in rank order
        assert global_rows(read_records(one), f"{name}-full") == global_rows(read_records(two), f"{name}-full"), name
