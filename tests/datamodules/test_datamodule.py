"""D9DDataModule without a Trainer (notebook use), its inputs, batch types, validation sharding and state."""

from __future__ import annotations

import dataclasses
import pickle

import datasets
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from support import LengthDataset, pad_collate

from lightning_d9d import D9DDataModule, move_batch_to_device
from lightning_d9d.device.pin import map_tensors
from lightning_d9d.mapstyle.loader import CollateWithContext, PinnableBatch
from lightning_d9d.mapstyle.shard import validation_microbatches


def make_dm(**overrides) -> D9DDataModule:
    options = dict(global_batch_size=16, microbatch_size=4, sort_buffer_size=64, seed=3)
    options.update(overrides)
    dataset = options.pop("dataset", LengthDataset(150))
    return D9DDataModule(dataset, options.pop("collate_fn", pad_collate), **options)


def ids_of(loader) -> list[list[int]]:
    return [batch["ids"].tolist() for batch in loader]


def test_without_trainer_one_epoch_is_floor_n_over_g_steps_of_distinct_samples() -> None:
    dm = make_dm()
    dm.setup("fit")
    batches = ids_of(dm.train_dataloader())
    assert dm.steps_per_epoch == 150 // 16 and dm.microbatches_per_step == 4
    assert len(batches) == len(dm.train_dataloader()) == 9 * 4
    flat = [i for batch in batches for i in batch]
    assert len(flat) == 144 and len(set(flat)) == 144
    # A second pass is the next epoch: reshuffled, a different remainder dropped.
    second = [i for batch in ids_of(dm.train_dataloader()) for i in batch]
    assert dm.position.epoch == 1 and second != flat and len(set(second)) == 144


def test_sorting_pads_less_than_random_order() -> None:
    def padding(dm: D9DDataModule) -> float:
        dm.setup("fit")
        slots = real = 0
        for batch in dm.train_dataloader():
            slots += batch["tokens"].numel()
            real += batch["tokens"].sum().item()
        return 1 - real / slots

    dataset = LengthDataset(2048)
    sorted_padding = padding(make_dm(dataset=dataset, global_batch_size=64, microbatch_size=8, sort_buffer_size=1024))
    random_padding = padding(make_dm(dataset=dataset, global_batch_size=64, microbatch_size=8, sort_buffer_size=None))
    assert sorted_padding < random_padding / 4


def test_num_workers_do_not_change_the_order() -> None:
    orders = []
    for workers in (0, 2):
        dm = make_dm(num_workers=workers)
        dm.setup("fit")
        orders.append(ids_of(dm.train_dataloader()) + ids_of(dm.train_dataloader()))
    assert orders[0] == orders[1]


def test_sort_key_by_column_callable_and_method_agree() -> None:
    lengths = LengthDataset(120).lengths
    table = datasets.Dataset.from_dict({"id": list(range(120)), "n": lengths.tolist()})

    def collate(rows: list[dict]) -> dict:
        return {"ids": torch.tensor([row["id"] for row in rows])}

    by_column = make_dm(dataset=table, collate_fn=collate, sort_key="n")
    by_callable = make_dm(dataset=table, collate_fn=collate, sort_key=lambda i: int(lengths[i]))
    by_method = make_dm(dataset=LengthDataset(120), collate_fn=lambda s: {"ids": torch.tensor([x["id"] for x in s])})
    results = []
    for dm in (by_column, by_callable, by_method):
        dm.setup("fit")
        results.append(ids_of(dm.train_dataloader()))
    assert results[0] == results[1] == results[2]


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    ids: torch.Tensor
    tokens: torch.Tensor
    note: str = "kept"


def test_dataclass_batches_keep_their_type_through_pin_walk_and_transfer() -> None:
    dm = make_dm(collate_fn=lambda s: FrozenBatch(**{k: v for k, v in pad_collate(s).items()}))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, FrozenBatch)
    # The pin stage's tree walk reaches tensors inside dataclasses, dicts, lists and tuples.
    visited: list[tuple] = []
    tree = {"a": [batch, (batch.ids,)], "b": batch}
    rebuilt = map_tensors(tree, lambda t: visited.append(tuple(t.shape)) or t + 0)
    assert len(visited) == 5 and isinstance(rebuilt["a"][0], FrozenBatch) and rebuilt["a"][0].note == "kept"
    assert isinstance(rebuilt["a"][1], tuple)
    # On CPU the transfer hook is a pass-through: the very same object comes back.
    assert dm.transfer_batch_to_device(batch, torch.device("cpu"), 0) is batch
    assert move_batch_to_device(tree, "cpu") is tree


def test_pin_memory_follows_the_trainers_device_and_can_be_forced_off() -> None:
    dm = make_dm()
    dm.trainer = pl.Trainer(accelerator="cpu", logger=False)
    assert dm.resolve_pin_memory() is False  # a CPU trainer never pins, even where CUDA exists
    assert make_dm(pin_memory=False).resolve_pin_memory() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_pin_memory_is_off_without_an_accelerator() -> None:
    dm = make_dm(num_workers=0)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader_for_rank(0, 1)))
    assert not batch["tokens"].is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_forcing_pin_memory_without_cuda_is_one_clear_error() -> None:
    dm = make_dm(pin_memory=True)
    dm.setup("fit")
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        dm.train_dataloader()


def test_pinnable_batch_survives_worker_pickling() -> None:
    collate = CollateWithContext(pad_collate, pin=True)
    wrapped = pickle.loads(pickle.dumps(collate))([{"id": 1, "tokens": torch.ones(2)}])
    assert isinstance(wrapped, PinnableBatch) and wrapped.batch["ids"].tolist() == [1]


def test_yield_packs_hands_out_one_list_of_m_microbatches_per_step() -> None:
    plain, packed = make_dm(), make_dm(yield_packs=True)
    for dm in (plain, packed):
        dm.setup("fit")
    microbatches = ids_of(plain.train_dataloader())
    packs = list(packed.train_dataloader())
    assert len(packs) == len(packed.train_dataloader()) == 9
    assert all(isinstance(pack, list) and len(pack) == 4 for pack in packs)
    assert [mb["ids"].tolist() for pack in packs for mb in pack] == microbatches


def test_factory_is_called_in_prepare_data_and_setup() -> None:
    calls = []

    def factory() -> LengthDataset:
        calls.append(1)
        return LengthDataset(64)

    dm = D9DDataModule(factory, pad_collate, global_batch_size=16, microbatch_size=4)
    dm.prepare_data()
    dm.setup("fit")
    assert len(calls) == 2 and len(ids_of(dm.train_dataloader())) == 16


@pytest.mark.parametrize(("size", "world", "microbatch"), [(37, 2, 2), (10, 3, 4), (5, 4, 1), (64, 1, 8)])
def test_validation_shards_cover_every_sample_exactly_once(size: int, world: int, microbatch: int) -> None:
    indices = np.random.default_rng(size).permutation(size)
    shards = [validation_microbatches(indices, world, rank, microbatch) for rank in range(world)]
    seen = [int(i) for shard in shards for mb in shard for i in mb]
    assert sorted(seen) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_validation_loader_is_sorted_and_complete() -> None:
    dm = make_dm(val_dataset=LengthDataset(37, seed=1))
    dm.setup("fit")
    batches = list(dm.val_dataloader())
    ids = [i for batch in batches for i in batch["ids"].tolist()]
    assert sorted(ids) == list(range(37))
    lengths = LengthDataset(37, seed=1).lengths
    assert list(lengths[ids]) == sorted(lengths)


def test_state_round_trip_continues_with_identical_batches() -> None:
    dm = make_dm()
    dm.setup("fit")
    iterator = iter(dm.train_dataloader())
    seen = [next(iterator)["ids"].tolist() for _ in range(4 * 5 + 2)]  # 5 steps and 2 microbatches
    state = dm.state_dict()
    assert state["epoch"] == 0 and state["step"] == 5 and len(pickle.dumps(state)) < 1024
    rest = [batch["ids"].tolist() for batch in iterator]

    restored = make_dm()
    restored.setup("fit")
    restored.load_state_dict(state)
    # Resume starts at the beginning of the step that was in progress: its 2 microbatches are replayed.
    assert ids_of(restored.train_dataloader()) == seen[20:] + rest


def test_restored_epoch_end_rolls_into_the_next_epoch() -> None:
    dm = make_dm()
    dm.setup("fit")
    ids_of(dm.train_dataloader())
    state = dm.state_dict()
    expected_next = ids_of(dm.train_dataloader())
    restored = make_dm()
    restored.setup("fit")
    restored.load_state_dict(state)
    assert ids_of(restored.train_dataloader()) == expected_next


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 4}, "seed: checkpoint 3, this run 4"),
        ({"dataset": LengthDataset(151)}, "num_samples: checkpoint 150, this run 151"),
        ({"global_batch_size": 32}, "global_batch_size: checkpoint 16, this run 32"),
        ({"dataset": LengthDataset(150, seed=9)}, "sort_keys_digest: checkpoint"),
    ],
)
def test_resuming_into_another_order_names_both_values(change: dict, message: str) -> None:
    dm = make_dm()
    dm.setup("fit")
    state = dm.state_dict()
    other = make_dm(**change)
    other.setup("fit")
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)


def test_restart_epoch_option_accepts_another_order() -> None:
    dm = make_dm()
    dm.setup("fit")
    iterator = iter(dm.train_dataloader())
    for _ in range(12):
        next(iterator)
    state = dm.state_dict()
    other = make_dm(seed=4, on_order_mismatch="restart_epoch")
    other.setup("fit")
    with pytest.warns(UserWarning, match="restarting epoch 0"):
        other.load_state_dict(state)
    fresh = make_dm(seed=4)
    fresh.setup("fit")
    assert ids_of(other.train_dataloader()) == ids_of(fresh.train_dataloader())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"global_batch_size": 0}, "global_batch_size must be a positive integer, got 0"),
        ({"microbatch_size": -1}, "microbatch_size must be a positive integer, got -1"),
        ({"global_batch_size": 18}, "global_batch_size=18 is not divisible by data-parallel size × microbatch_size"),
        ({"sort_buffer_size": 8}, "sort_buffer_size=8 is smaller than global_batch_size=16"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
        (
            {"on_order_mismatch": "ignore"},
            "on_order_mismatch must be one of \\[.raise., .restart_epoch.\\], got .ignore.",
        ),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        (
            {"global_batch_size": [[0, 16], [10, 32]]},
            r"global_batch_size=\[\[0, 16\], \[10, 32\]\] has phases, but a map-style epoch is planned whole .* "
            "PretrainingDataModule's",
        ),
        (
            {"global_batch_size": None, "global_batch_tokens": [[0, 512]], "microbatch_tokens": 128},
            r"global_batch_tokens=\[\[0, 512\]\] has phases",
        ),
    ],
)
def test_bad_constructor_arguments_name_the_value(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_dm(**options)


class NoKeys(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "tokens": torch.ones(3)}


class MixedKeys(NoKeys):
    def sort_key(self, index: int):
        return None if index % 7 == 0 else index


class LateStringKey(NoKeys):
    """Numbers everywhere but one string deep in the data: numpy would coerce them all to strings."""

    def sort_key(self, index: int):
        return "x" if index == 99 else index


def table_with_lengths(lengths: list) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"n": lengths})


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"dataset": LengthDataset(10)},
            ValueError,
            "the training dataset has 10 samples, fewer than one global batch",
        ),
        ({"dataset": NoKeys()}, ValueError, "sort_buffer_size=64 asks for length sorting, but no sort key was found"),
        ({"dataset": NoKeys(), "sort_key": "length"}, ValueError, "sort_key='length' names a column, but the dataset"),
        (
            {"dataset": datasets.Dataset.from_dict({"n": list(range(100))}), "sort_key": "len"},
            ValueError,
            r"sort_key column 'len' is not in the dataset; its columns are \['n'\]",
        ),
        ({"dataset": MixedKeys()}, TypeError, "sort keys are not comparable with each other"),
        (
            {"dataset": LateStringKey()},
            TypeError,
            r"sample 99 has sort key 'x' \(key types seen: \['int', 'str'\]",
        ),
        (
            {"dataset": table_with_lengths([5] * 90 + [None] + [5] * 9), "sort_key": "n"},
            TypeError,
            "sort_key column 'n' has a null/NaN key at row 90",
        ),
        (
            {"dataset": table_with_lengths([5.0] * 95 + [float("nan")] * 5), "sort_key": "n"},
            TypeError,
            "sort_key column 'n' has a null/NaN key at row 95",
        ),
        (
            {"dataset": table_with_lengths(["a"] * 100), "sort_key": "n"},
            TypeError,
            "sort_key column 'n' has type string; sort keys must be integers or floats",
        ),
        ({"dataset": 42}, TypeError, "train_dataset must be a map-style dataset"),
    ],
)
def test_bad_data_gives_one_clear_error_at_setup(options: dict, error: type, message: str) -> None:
    dm = make_dm(**options)
    with pytest.raises(error, match=message):
        dm.setup("fit")


def test_global_batch_not_divisible_by_simulated_world_size() -> None:
    dm = make_dm(global_batch_size=16, microbatch_size=4)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"data-parallel size × microbatch_size = 3 × 4 = 12"):
        dm.train_dataloader_for_rank(0, 3)


def test_simulated_ranks_partition_each_step() -> None:
    dm = make_dm(global_batch_size=32, microbatch_size=2)
    dm.setup("fit")
    single = ids_of(dm.train_dataloader_for_rank(0, 1))
    per_rank = [ids_of(dm.train_dataloader_for_rank(rank, 4)) for rank in range(4)]
    for step in range(dm.steps_per_epoch):
        expected = sorted(i for mb in single[step * 16 : (step + 1) * 16] for i in mb)
        got = sorted(i for rank in per_rank for mb in rank[step * 4 : (step + 1) * 4] for i in mb)
        assert got == expected
        # Order and rank too: the step's 16 microbatches are dealt in a snake, 0 1 2 3 3 2 1 0 0 1 ..., each rank
        # keeping them in the global batch's order (written out here, not taken from the library's dealer).
        global_batch = [list(mb) for mb in single[step * 16 : (step + 1) * 16]]
        laps = [range(4) if lap % 2 == 0 else range(3, -1, -1) for lap in range(4)]
        owners = [rank for lap in laps for rank in lap]
        for rank in range(4):
            mine = [list(mb) for mb in per_rank[rank][step * 4 : (step + 1) * 4]]
            assert mine == [mb for mb, owner in zip(global_batch, owners, strict=True) if owner == rank], (step, rank)


def test_column_sort_keys_follow_a_shuffled_or_selected_view() -> None:
    lengths = LengthDataset(300).lengths
    view = (
        datasets.Dataset.from_dict({"id": list(range(300)), "n": lengths.tolist()}).shuffle(seed=1).select(range(200))
    )
    view_lengths = [int(lengths[row["id"]]) for row in view]

    def collate(rows: list[dict]) -> dict:
        return {"ids": torch.tensor([row["id"] for row in rows])}

    by_column = make_dm(dataset=view, collate_fn=collate, sort_key="n")
    by_callable = make_dm(dataset=view, collate_fn=collate, sort_key=lambda i: view_lengths[i])
    for dm in (by_column, by_callable):
        dm.setup("fit")
    assert ids_of(by_column.train_dataloader()) == ids_of(by_callable.train_dataloader())


def test_a_loop_broken_off_mid_epoch_continues_where_it_stopped() -> None:
    full = make_dm()
    full.setup("fit")
    epoch = ids_of(full.train_dataloader())
    dm = make_dm()
    dm.setup("fit")
    first = []
    for batch in dm.train_dataloader():
        first.append(batch["ids"].tolist())
        if len(first) == 7:
            break
    assert first + ids_of(dm.train_dataloader()) == epoch
