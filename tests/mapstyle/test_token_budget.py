"""Token-budget plans without a Trainer: budgets hold, every sample at most once, the plan ignores world size and
workers, padding-free rows follow the varlen conventions, ``step_label_tokens`` counts what a causal LM predicts,
and every bad input is one clear error at construction or ``setup``."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import datasets
import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import (
    TESTS,
    LengthDataset,
    RecordingModule,
    make_texts,
    pad_collate,
    planned_token_steps,
    train_tokenizer,
)

from lightning_d9d import D9DDataModule, FlatBatch, FlatteningCollator, TextBatch, TextDataModule
from lightning_d9d.mapstyle.plan import InvalidLengthError, TokenBudget, pack, plan_epoch
from lightning_d9d.text.collate import IGNORE_INDEX, CausalLMCollator

BUDGET, STEP = 512, 2048  # P = 4 microbatches per step


def token_dm(dataset: object = None, **overrides: object) -> D9DDataModule:
    options: dict = dict(global_batch_tokens=STEP, microbatch_tokens=BUDGET, sort_buffer_size=64, seed=0)
    options.update(overrides)
    return D9DDataModule(dataset if dataset is not None else LengthDataset(400), pad_collate, **options)


def cost(lengths: np.ndarray, padding_free: bool, multiple: int = 1) -> int:
    return int(lengths.sum()) if padding_free else len(lengths) * (-(-int(lengths.max()) // multiple) * multiple)


def per_step_samples(dm: D9DDataModule, world_size: int, epoch: int, num_workers: int = 0) -> list[list[int]]:
    """Sorted sample ids of every step, collected over ``world_size`` simulated ranks."""
    dm.num_workers = num_workers
    per_step = dm.global_batch_tokens // dm.microbatch_tokens // world_size
    steps: dict[int, list[int]] = {}
    for rank in range(world_size):
        for number, batch in enumerate(dm.train_dataloader_for_rank(rank, world_size, epoch)):
            steps.setdefault(number // per_step, []).extend(batch["ids"].tolist())
    return [sorted(steps[step]) for step in sorted(steps)]


def ordered_steps(dm: D9DDataModule, world_size: int, epoch: int, num_workers: int = 0) -> list[list[list[int]]]:
    """Every step's microbatches (sample ids) in order, rebuilt from ``world_size`` simulated ranks: microbatch k of
    a step goes to rank k, then back down (a snake: 0 1 1 0 0 1 ... for two ranks), each rank keeping its share in
    order; the dealing is written out here, so two layouts agree only if every sample has the same place."""
    dm.num_workers = num_workers
    microbatches = dm.global_batch_tokens // dm.microbatch_tokens
    per_rank = [[b["ids"].tolist() for b in dm.train_dataloader_for_rank(rank, world_size, epoch)] for rank in
                range(world_size)]  # fmt: skip
    steps = len(per_rank[0]) // (microbatches // world_size)
    assert all(len(batches) == steps * microbatches // world_size for batches in per_rank)
    taken, out = [0] * world_size, []
    for _ in range(steps):
        step = []
        for k in range(microbatches):
            lap, offset = divmod(k, world_size)
            owner = offset if lap % 2 == 0 else world_size - 1 - offset
            step.append(per_rank[owner][taken[owner]])
            taken[owner] += 1
        out.append(step)
    return out


# ------------------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("sort_buffer_size", [64, None], ids=["sorted", "unsorted"])
def test_every_microbatch_is_within_budget_and_every_sample_trains_at_most_once(
    padding_free: bool, sort_buffer_size: int | None
) -> None:
    dataset = LengthDataset(400)
    dm = token_dm(dataset, padding_free=padding_free, sort_buffer_size=sort_buffer_size)
    dm.setup("fit")
    for epoch in (0, 1):
        batches = list(dm.train_dataloader_for_rank(0, 1, epoch))
        assert len(batches) == dm.steps_in_epoch(epoch) * 4
        ids = [i for batch in batches for i in batch["ids"].tolist()]
        assert len(ids) == len(set(ids)), "a sample trained twice"
        for batch in batches:
            assert cost(dataset.lengths[batch["ids"].numpy()], padding_free) <= BUDGET
        # Only fewer than one step's worth is left out: the dropped samples' tokens fit in P microbatches.
        dropped = np.setdiff1d(np.arange(len(dataset)), ids)
        assert dataset.lengths[dropped].sum() < STEP
        # Exactly the rule's steps, in order, written out in the test (not the planner the loader follows): every
        # sample trains except the tail the rule leaves.
        planned = planned_token_steps(dataset.lengths, BUDGET, 4, sort_buffer_size, 0, epoch, padding_free)
        got = [batch["ids"].tolist() for batch in batches]
        assert len(got) == len(planned) * 4 and got == [mb for step in planned for mb in step]
        assert dm.plan.epoch(epoch).dropped_samples == len(dropped)


def test_padded_microbatches_count_the_collates_rounding() -> None:
    dataset = LengthDataset(400)
    collate = CausalLMCollator(pad_to_multiple_of=8)
    dm = D9DDataModule(
        [{"input_ids": np.ones(n, dtype=np.int64)} for n in dataset.lengths],
        collate,
        sort_key=lambda i: int(dataset.lengths[i]),
        global_batch_tokens=STEP,
        microbatch_tokens=BUDGET,
        sort_buffer_size=64,
    )
    dm.setup("fit")
    assert dm.budget.pad_to_multiple_of == 8  # read from the collate_fn
    batches = list(dm.train_dataloader_for_rank(0, 1))
    assert batches and all(batch.input_ids.numel() <= BUDGET for batch in batches)
    assert max(batch.input_ids.numel() for batch in batches) > 0.8 * BUDGET


@pytest.mark.slow
def test_the_plan_is_the_same_on_any_world_size_and_worker_count() -> None:
    dm = token_dm(LengthDataset(400), seed=1)
    dm.setup("fit")
    for epoch in (0, 1):
        one = per_step_samples(dm, 1, epoch)
        assert len(one) == dm.steps_in_epoch(epoch)
        assert per_step_samples(dm, 2, epoch) == one
        assert per_step_samples(dm, 4, epoch, num_workers=2) == one
        ordered = ordered_steps(dm, 1, epoch)
        assert len(ordered) == len(one)
        assert ordered_steps(dm, 2, epoch) == ordered
        assert ordered_steps(dm, 4, epoch, num_workers=2) == ordered
    # Epochs are reshuffled and pack into their own number of steps (seed 1: 10 then 9).
    assert [dm.steps_in_epoch(epoch) for epoch in (0, 1)] == [10, 9]
    assert per_step_samples(dm, 1, 0) != per_step_samples(dm, 1, 1)


def test_the_plan_is_a_pure_function_of_its_inputs() -> None:
    lengths = LengthDataset(3000).lengths
    budget = TokenBudget(4096, 1024, padding_free=True)
    first, again = plan_epoch(lengths, budget, 256, 7, 3), plan_epoch(lengths.copy(), budget, 256, 7, 3)
    for field in ("order", "bounds", "step_group", "step_label_tokens"):
        assert np.array_equal(getattr(first, field), getattr(again, field))
    other_seed = plan_epoch(lengths, budget, 256, 8, 3)
    assert not np.array_equal(first.order, other_seed.order)


def test_padding_free_fills_the_budget_and_padded_holds_mostly_real_tokens() -> None:
    lengths = np.clip(np.random.default_rng(0).lognormal(4.0, 1.0, 20_000), 2, 1024).astype(np.int64)
    free = plan_epoch(lengths, TokenBudget(8 * 4096, 4096, padding_free=True), 4096, 0, 0)
    padded = plan_epoch(lengths, TokenBudget(8 * 8192, 8192), 4096, 0, 0)
    assert free.tokens.sum() / (len(free.tokens) * 4096) >= 0.98
    assert padded.tokens.sum() / (len(padded.tokens) * 8192) >= 0.92
    assert free.costs.max() <= 4096 and padded.costs.max() <= 8192


def test_step_microbatches_are_dealt_in_snake_order() -> None:
    dm = token_dm(LengthDataset(400))
    dm.setup("fit")
    plan = dm.plan.epoch(0)
    expected = {0: [0, 3], 1: [1, 2]}  # snake dealing of P = 4 over W = 2: 0, 1, 1, 0
    for rank, ks in expected.items():
        got = dm.plan.rank_microbatches(0, 2, 2, rank)
        assert [m.tolist() for m in got] == [plan.microbatch(2, k).tolist() for k in ks]


# ------------------------------------------------------------------------------------------------ text batches
@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("token_text")
    texts = make_texts(500, seed=3)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts[:450]}), root / "parquet" / "train.parquet")
    pq.write_table(pa.table({"text": texts[450:]}), root / "parquet" / "validation.parquet")
    train_tokenizer(texts, root / "tokenizer.json", kind="bpe")
    return {"parquet": root / "parquet", "tokenizer": root / "tokenizer.json", "cache": root / "cache"}


def text_dm(corpus: dict[str, Path], **overrides: object) -> TextDataModule:
    options: dict = dict(
        dataset=str(corpus["parquet"]),
        tokenizer=str(corpus["tokenizer"]),
        max_length=64,
        global_batch_tokens=1024,
        microbatch_tokens=256,
        sort_buffer_size=128,
        num_workers=0,
        cache_dir=str(corpus["cache"]),
    )
    options.update(overrides)
    dm = TextDataModule(**options)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def labels_after_shift(batch: TextBatch | FlatBatch) -> int:
    """Targets a Hugging Face causal LM trains on: labels[..., 1:] != -100 (it drops the first position)."""
    return int((batch.labels[..., 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize(
    "mode",
    [
        {"padding_free": True},
        {},
        {"padding_side": "left"},
        {"global_batch_tokens": None, "microbatch_tokens": None, "global_batch_size": 16, "microbatch_size": 4},
        {"global_batch_tokens": None, "microbatch_tokens": None, "global_batch_size": 16, "sort_buffer_size": None},
    ],
    ids=["padding-free", "padded", "padded-left", "sample-counts", "sample-counts-unsorted"],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_step_label_tokens_is_the_steps_real_target_count_over_all_ranks(
    text_corpus: dict, mode: dict, num_workers: int
) -> None:
    dm = text_dm(text_corpus, num_workers=num_workers, **mode)
    world = 2
    per_rank = dm.microbatches_per_step // world if dm.budget is None else dm.budget.microbatches_per_step // world
    counted: dict[int, int] = {}
    declared: dict[int, set[int]] = {}
    for rank in range(world):
        for number, batch in enumerate(dm.train_dataloader_for_rank(rank, world)):
            step = number // per_rank
            counted[step] = counted.get(step, 0) + labels_after_shift(batch)
            declared.setdefault(step, set()).add(batch.step_label_tokens)
    assert len(counted) == dm.steps_in_epoch(0) > 3
    for step, total in counted.items():
        assert declared[step] == {total}, f"step {step}: batches say {declared[step]}, labels count {total}"


def test_padding_free_batches_follow_the_varlen_conventions(text_corpus: dict) -> None:
    dm = text_dm(text_corpus, padding_free=True)
    documents = {tuple(row.tolist()) for row in dm.train_dataset["input_ids"]}
    seen = 0
    for batch in dm.train_dataloader():
        assert isinstance(batch, FlatBatch)
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (1, batch.num_tokens)
        assert batch.num_tokens <= 256
        assert batch.cu_seqlens.dtype == torch.int32 and int(batch.cu_seqlens[0]) == 0
        assert int(batch.cu_seqlens[-1]) == batch.num_tokens
        lengths = torch.diff(batch.cu_seqlens).tolist()
        assert batch.max_seqlen == max(lengths)
        for start, length in zip(batch.cu_seqlens[:-1].tolist(), lengths):
            ids = batch.input_ids[0, start : start + length]
            assert tuple(ids.tolist()) in documents
            assert batch.position_ids[0, start : start + length].tolist() == list(range(length))
            assert batch.labels[0, start] == IGNORE_INDEX
            assert torch.equal(batch.labels[0, start + 1 : start + length], ids[1:])
            seen += 1
    assert seen > 300
    validation = text_dm(text_corpus, padding_free=True, val_split="validation")
    val_ids = [tuple(b.input_ids[0, s:e].tolist()) for b in validation.val_dataloader() for s, e in _spans(b)]
    assert sorted(val_ids) == sorted(tuple(row.tolist()) for row in validation.val_dataset["input_ids"])


def _spans(batch: FlatBatch) -> list[tuple[int, int]]:
    bounds = batch.cu_seqlens.tolist()
    return list(itertools.pairwise(bounds))


def test_padded_token_budget_batches_stay_within_budget(text_corpus: dict) -> None:
    dm = text_dm(text_corpus, val_split="validation")
    batches = list(dm.train_dataloader())
    assert all(isinstance(b, TextBatch) and b.input_ids.numel() <= 256 for b in batches)
    assert len(batches) == dm.steps_in_epoch(0) * 4
    val = list(dm.val_dataloader())
    assert sum(b.input_ids.shape[0] for b in val) == len(dm.val_dataset)
    assert all(b.input_ids.numel() <= 256 for b in val)


def test_resume_without_a_trainer_continues_with_the_same_batches(text_corpus: dict) -> None:
    first = text_dm(text_corpus, padding_free=True)
    whole_epoch = list(text_dm(text_corpus, padding_free=True).train_dataloader())
    iterator = iter(first.train_dataloader())
    for _ in range(3 * 4 + 2):  # inside step 3's accumulation window
        next(iterator)
    state = first.state_dict()
    assert state["step"] == 3 and state["fingerprint"]["padding_free"] is True
    rest = list(iterator)
    assert len(whole_epoch) == first.steps_in_epoch(0) * 4 and len(rest) == len(whole_epoch) - 14 >= 6
    restored = text_dm(text_corpus, padding_free=True)
    restored.load_state_dict(state)
    again = list(restored.train_dataloader())
    # The resumed epoch starts at step 3 (the checkpoint's unfinished step, all its microbatches) and runs to the end
    # of the epoch: the batches an uninterrupted epoch trains from step 3 on, in order.
    assert len(again) == len(whole_epoch) - 12 == len(rest) + 2
    for a, b in zip(again, whole_epoch[12:], strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    for a, b in zip(again[2:], rest, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
    other_budget = text_dm(text_corpus, padding_free=True, microbatch_tokens=128)
    with pytest.raises(ValueError, match=r"microbatch_tokens: checkpoint 256, this run 128"):
        other_budget.load_state_dict(state)
    padded = text_dm(text_corpus)
    with pytest.raises(ValueError, match=r"padding_free: checkpoint True, this run False"):
        padded.load_state_dict(state)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"global_batch_size": 16, "global_batch_tokens": 2048, "microbatch_tokens": 512},
            r"exactly one of global_batch_size .* and global_batch_tokens .*got both: global_batch_size=16, "
            r"global_batch_tokens=2048",
        ),
        ({}, r"exactly one of global_batch_size .* and global_batch_tokens .*got neither"),
        ({"global_batch_tokens": 2048}, r"global_batch_tokens=2048 needs microbatch_tokens"),
        (
            {"global_batch_tokens": 2048, "microbatch_tokens": 512, "microbatch_size": 4},
            r"microbatch_size=4 counts samples, but global_batch_tokens=2048",
        ),
        ({"global_batch_size": 16, "microbatch_tokens": 512}, r"microbatch_tokens=512 goes with global_batch_tokens"),
        ({"global_batch_size": 16, "padding_free": True}, r"padding_free=True needs token budgets"),
        (
            {"global_batch_tokens": 2000, "microbatch_tokens": 512},
            r"global_batch_tokens=2000 is not a multiple of microbatch_tokens=512.*e\.g\. \[512, 1024, 2048, 4096\]",
        ),
        ({"global_batch_tokens": 0, "microbatch_tokens": 512}, r"global_batch_tokens must be a positive integer"),
        ({"global_batch_tokens": 2048, "microbatch_tokens": -1}, r"microbatch_tokens must be a positive integer"),
    ],
    ids=["both", "neither", "no-microbatch-tokens", "microbatch-size", "microbatch-tokens", "padding-free-samples",
         "not-a-multiple", "zero", "negative"],
)  # fmt: skip
def test_bad_batch_settings_are_one_clear_error_at_construction(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        D9DDataModule(LengthDataset(50), pad_collate, **options)


def test_collators_that_contradict_the_padding_mode_are_refused() -> None:
    with pytest.raises(ValueError, match=r"CausalLMCollator pads them .* use FlatteningCollator"):
        D9DDataModule(LengthDataset(50), CausalLMCollator(), global_batch_tokens=512, microbatch_tokens=256,
                      padding_free=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"FlatteningCollator concatenates .* pass padding_free=True"):
        D9DDataModule(LengthDataset(50), FlatteningCollator(), global_batch_tokens=512, microbatch_tokens=256)


def test_steps_that_do_not_divide_among_replicas_name_the_dp_size() -> None:
    dm = token_dm(LengthDataset(400), global_batch_tokens=3 * BUDGET)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"3 microbatches per step do not divide among dp_size=2 data-parallel"):
        dm.train_dataloader_for_rank(0, 2)


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_sample_longer_than_microbatch_tokens_is_named_at_setup(padding_free: bool) -> None:
    dataset = LengthDataset(400)
    dataset.lengths[[57, 300]] = [700, 900]
    dm = token_dm(dataset, padding_free=padding_free)
    with pytest.raises(
        ValueError,
        match=r"training sample 57 has 700 tokens, more than microbatch_tokens=512; 2 sample\(s\) do not fit a "
        r"microbatch, the longest is sample 300 with 900 tokens. Use microbatch_tokens >= 900",
    ):
        dm.setup("fit")
    rounding = token_dm(LengthDataset(400), microbatch_tokens=430, global_batch_tokens=4 * 430, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match=r"has 430 tokens \(padded to a multiple of 8: 432\), more than"):
        rounding.setup("fit")


class Lengths(torch.utils.data.Dataset):
    def __init__(self, keys: list):
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "tokens": torch.ones(3)}

    def sort_key(self, index: int):
        return self.keys[index]


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        ([5] * 30 + ["long"] + [5] * 9, TypeError, r"training sample 30 has length 'long' \(str\); token budgets"),
        ([5] * 12 + [None] + [5] * 27, TypeError, r"training sample 12 has length None \(NoneType\)"),
        ([5.0] * 7 + [2.5] + [5.0] * 32, ValueError, r"training sample 7 has length 2\.5; token budgets count tokens"),
        ([5.0] * 3 + [float("nan")] + [5.0] * 36, ValueError, r"training sample 3 has length nan"),
        ([5] * 20 + [0] + [5] * 19, ValueError, r"training sample 20 has length 0; .*a whole number >= 1"),
        ([(1, 2)] * 40, TypeError, r"training sample 0 has length \(1, 2\) \(tuple\)"),
    ],
    ids=["string", "none", "fraction", "nan", "zero", "tuple"],
)
def test_lengths_that_are_not_whole_numbers_name_the_sample_at_setup(keys: list, error: type, message: str) -> None:
    dm = D9DDataModule(Lengths(keys), pad_collate, global_batch_tokens=64, microbatch_tokens=32)
    with pytest.raises(InvalidLengthError, match=message) as caught:
        dm.setup("fit")
    assert isinstance(caught.value, error)  # one class, both a ValueError and a TypeError


def test_a_column_of_strings_is_refused_as_lengths() -> None:
    table = datasets.Dataset.from_dict({"id": list(range(40)), "n": [str(i) for i in range(40)]})
    dm = D9DDataModule(table, pad_collate, sort_key="n", global_batch_tokens=64, microbatch_tokens=32)
    message = r"token budgets read every sample's length from sort_key: sort_key column 'n' has type string"
    with pytest.raises(InvalidLengthError, match=message):
        dm.setup("fit")


def test_missing_lengths_and_too_little_data_are_errors_at_setup() -> None:
    no_keys = D9DDataModule([{"id": i} for i in range(50)], pad_collate, global_batch_tokens=64, microbatch_tokens=32)
    with pytest.raises(ValueError, match=r"token budgets need every sample's length: pass sort_key"):
        no_keys.setup("fit")
    tiny = token_dm(LengthDataset(20), global_batch_tokens=64 * BUDGET)
    with pytest.raises(ValueError, match=r"packs into \d+ microbatches, fewer than one step's 64"):
        tiny.setup("fit")
    no_val_lengths = token_dm(LengthDataset(400), val_dataset=[{"id": 0, "tokens": torch.ones(3)}])
    with pytest.raises(ValueError, match=r"validation dataset has no lengths"):
        no_val_lengths.setup("fit")


def test_a_trainer_that_would_not_reload_the_train_loader_every_epoch_is_refused(tmp_path: Path) -> None:
    def fit(**options: object) -> pl.Trainer:
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, default_root_dir=str(tmp_path), **options)  # fmt: skip
        trainer.fit(RecordingModule(str(tmp_path)), datamodule=token_dm(LengthDataset(400)))
        return trainer

    with pytest.raises(ValueError, match=r"reload_dataloaders_every_n_epochs=2\) would keep one epoch's train loader"):
        fit(reload_dataloaders_every_n_epochs=2)
    assert fit().reload_dataloaders_every_n_epochs == 1


def test_validation_microbatches_hold_every_sample_once_within_budget() -> None:
    lengths = LengthDataset(500, seed=4).lengths
    for padding_free in (False, True):
        packed = pack(lengths, TokenBudget(2048, 512, padding_free))
        parts = np.split(packed.order, np.cumsum(packed.sizes)[:-1])
        assert sorted(np.concatenate(parts).tolist()) == list(range(500))
        assert max(cost(lengths[part], padding_free) for part in parts) <= 512


def test_the_plan_stage_does_not_import_lightning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, lightning_d9d.mapstyle.plan; print(any(m.startswith('lightning.') "
         "or m == 'lightning' for m in sys.modules))"],
        capture_output=True, text=True, cwd=TESTS, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
