"""The data-parallel layout: from a strategy's sampler kwargs, from real DeviceMeshes (every rank of a world built
with torch's fake process group, in one process) and through a DataModule's ``data_parallel``; each error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch.distributed as dist
from support import LengthDataset, pad_collate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_d9d import D9DDataModule
from lightning_d9d.parallel.topology import (
    DataParallelTopology,
    check_data_parallel_setting,
    default_data_parallel_dims,
    model_parallelism,
    resolve_data_parallel,
)


@contextmanager
def world(rank: int, size: int) -> Iterator[None]:
    """This process as rank ``rank`` of a ``size``-process world (torch's fake backend: no peers needed)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def row_major_dp_rank(rank: int, shape: tuple[int, ...], dp_dims: list[int]) -> tuple[int, int]:
    """Independent reference: the coordinates of ``rank`` in a row-major mesh, and its index over ``dp_dims``."""
    coordinate, rest = [], rank
    for size in reversed(shape):
        rest, index = divmod(rest, size)
        coordinate.insert(0, index)
    dp_rank, dp_size = 0, 1
    for dim in dp_dims:
        dp_rank, dp_size = dp_rank * shape[dim] + coordinate[dim], dp_size * shape[dim]
    return dp_rank, dp_size


# ------------------------------------------------------------------------------------------------ sampler kwargs
@pytest.mark.parametrize(
    ("kwargs", "world_size", "rank", "expected"),
    [
        ({"num_replicas": 4, "rank": 2}, 4, 2, (2, 4, 1)),  # DDP / FSDP / DeepSpeed: every process a replica
        ({"num_replicas": 1, "rank": 0}, 2, 1, (0, 1, 2)),  # ModelParallelStrategy 1 × 2
        ({"num_replicas": 2, "rank": 1}, 4, 3, (1, 2, 2)),  # ModelParallelStrategy 2 × 2
        (None, 1, 0, (0, 1, 1)),  # a single device
    ],
)
def test_sampler_kwargs_give_the_strategy_layout(kwargs: dict | None, world_size: int, rank: int, expected) -> None:
    topology = DataParallelTopology.from_sampler_kwargs(kwargs, world_size, rank, "S")
    assert (topology.dp_rank, topology.dp_size, topology.peers_per_replica) == expected
    assert topology.process_rank == rank and topology.world_size == world_size
    assert topology.model_parallel == (expected[2] > 1)


@pytest.mark.parametrize(
    ("kwargs", "world_size", "message"),
    [
        (None, 2, "S gives no distributed_sampler_kwargs on 2 processes"),
        ({"rank": 0}, 2, r"lack integer num_replicas"),
        ({"num_replicas": "2", "rank": 0}, 2, r"lack integer num_replicas"),
        ({"num_replicas": 2, "rank": 2}, 2, r"are inconsistent: rank must be in \[0, num_replicas=2\)"),
        (
            {"num_replicas": 3, "rank": 0},
            4,
            r"the data-parallel size 3 \(S's distributed_sampler_kwargs .*\) does not ",
        ),
    ],
)
def test_sampler_kwargs_that_do_not_give_a_layout_are_one_error(kwargs, world_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataParallelTopology.from_sampler_kwargs(kwargs, world_size, 0, "S")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp_rank": 2, "dp_size": 2}, r"dp_rank=2 must be below dp_size=2"),
        ({"dp_size": 0}, r"dp_size must be an integer >= 1, got 0"),
        ({"process_rank": 4, "world_size": 4}, r"process_rank=4 must be below world_size=4"),
        ({"dp_size": 3, "world_size": 4}, r"the data-parallel size 3 .* does not divide the 4 processes"),
    ],
)
def test_a_topology_out_of_range_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataParallelTopology(**fields)


# ------------------------------------------------------------------------------------------------ device meshes
MESHES = [
    ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), [0, 1]),  # torchtitan: FSDP × replication × TP
    ((2, 2, 1, 2), ("pp", "dp_shard", "cp", "tp"), [1]),  # PP and CP peers share data
    ((2, 3), ("data_parallel", "tensor_parallel"), [0]),  # Lightning's ModelParallelStrategy mesh
    ((2, 2, 2), ("batch", "cp", "tp"), [0]),  # torchtitan's data-loading mesh
    ((4,), ("dp",), [0]),  # pure data parallelism
]


@pytest.mark.parametrize(("shape", "names", "dp_dims"), MESHES)
def test_every_rank_of_a_mesh_gets_its_row_major_data_parallel_coordinate(shape, names, dp_dims) -> None:
    size = 1
    for s in shape:
        size *= s
    seen = {}
    for rank in range(size):
        with world(rank, size):
            topology = DataParallelTopology.from_device_mesh(mesh(shape, names))
        assert (topology.dp_rank, topology.dp_size) == row_major_dp_rank(rank, shape, dp_dims)
        assert topology.process_rank == rank and topology.world_size == size
        seen.setdefault(topology.dp_rank, []).append(rank)
    assert all(len(ranks) == size // topology.dp_size for ranks in seen.values()), "equal peers per replica"


def test_named_dims_in_any_order_give_the_mesh_order_and_a_data_parallel_sub_mesh_agrees() -> None:
    shape, names = (2, 2, 2), ("a", "b", "c")
    for rank in range(8):
        with world(rank, 8):
            world_mesh = mesh(shape, names)
            named = DataParallelTopology.from_device_mesh(world_mesh, ["c", "a"])
            assert (named.dp_rank, named.dp_size) == row_major_dp_rank(rank, shape, [0, 2])
            sub = DataParallelTopology.from_device_mesh(world_mesh["a", "c"], ["a", "c"])
            assert (sub.dp_rank, sub.dp_size, sub.world_size) == (named.dp_rank, 4, 8)
            titan = mesh(shape, ("dp_replicate", "dp_shard", "tp"))
            assert DataParallelTopology.from_device_mesh(titan["dp_replicate", "dp_shard"]) == (
                DataParallelTopology.from_device_mesh(titan)
            )
            assert DataParallelTopology.from_device_mesh(world_mesh, []).dp_size == 1


@pytest.mark.parametrize(
    ("names", "dims", "sub", "message"),
    [
        (("data_parallel", "tensor_parallel"), ["dp_shard"], None,
         r"the device mesh has no dim 'dp_shard'; its dims are \['data_parallel', 'tensor_parallel'\]"),
        (("dp_cp", "tp"), None, None, r"include \['dp_cp'\], whose meaning is ambiguous"),
        (("cp", "tp"), None, None, r"the device mesh's dims \['cp', 'tp'\] include no data-parallel dim"),
        (("dp", "dp"), None, None, None),  # torch refuses duplicate names itself
        (("dp_shard", "tp"), ["dp_shard", "dp_shard"], None, r"name a dim twice"),
        (("dp_replicate", "dp_shard", "tp"), None, ("dp_shard", "tp"),
         r"holds 4 of the 8 processes and has dims that are not data-parallel \(\['tp'\]\)"),
    ],
)  # fmt: skip
def test_a_mesh_without_the_data_parallel_dims_is_one_clear_error(names, dims, sub, message) -> None:
    shape = (2, 2, 2)[: len(names)]
    size = 1
    for s in shape:
        size *= s
    with world(0, 8 if sub else size):
        if message is None:
            with pytest.raises((RuntimeError, ValueError)):
                mesh(shape, names)
            return
        device_mesh = mesh((2, 2, 2), names) if sub else mesh(shape, names)
        with pytest.raises(ValueError, match=message):
            DataParallelTopology.from_device_mesh(device_mesh[sub] if sub else device_mesh, dims)


MP_MESHES = [  # (shape, names, the dims named as data-parallel, the refused dim, its kind, what is valid)
    (
        (1, 2),
        ("data_parallel", "tensor_parallel"),
        ["tensor_parallel"],
        "tensor_parallel",
        "tensor",
        "['data_parallel'] (or [] for a single replica)",
    ),  # Lightning's ModelParallelStrategy mesh
    (
        (2, 2),
        ("data_parallel", "tensor_parallel"),
        ["data_parallel", "tensor_parallel"],
        "tensor_parallel",
        "tensor",
        "['data_parallel'] (or [] for a single replica)",
    ),
    (
        (2, 2, 2),
        ("dp_shard", "cp", "tp"),
        ["dp_shard", "cp"],
        "cp",
        "context",
        "['dp_shard'] (or [] for a single replica)",
    ),
    (
        (2, 2, 2),
        ("pp", "dp_replicate", "dp_cp"),
        ["dp_replicate", "dp_cp"],
        "dp_cp",
        "context",
        "['dp_replicate'] (or [] for a single replica)",
    ),  # torchtitan's flattened dp × cp
    ((2, 2), ("pp", "layers"), ["pp"], "pp", "pipeline", "['layers'] (or [] for a single replica)"),
    ((2, 2), ("sp", "tp"), ["sp"], "sp", "sequence", "none: [] (a single replica)"),
]


@pytest.mark.parametrize(("shape", "names", "dims", "refused", "kind", "valid"), MP_MESHES)
def test_a_model_parallel_dim_named_as_data_parallel_is_refused_naming_it_and_the_valid_dims(
    shape, names, dims, refused, kind, valid
) -> None:
    """Its peers would each be a replica of their own: other rows each, which no peer check can see."""
    size = shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
    message = (
        f"the data-parallel dims {dims} include the device mesh's dim '{refused}', which holds {kind}-parallel "
        f"peers: they must train the same rows, so it cannot be data-parallel (each peer would train other rows, "
        f"silently). The data-parallel dims of this mesh {list(names)} are {valid}"
    )
    with world(size - 1, size):
        device_mesh = mesh(shape, names)
        with pytest.raises(ValueError) as direct:
            DataParallelTopology.from_device_mesh(device_mesh, dims)
        with pytest.raises(ValueError) as named:  # names of a strategy's mesh: the CLI's and a config's way
            resolve_data_parallel(dims, None, device_mesh, size, size - 1, "ModelParallelStrategy")
    assert str(direct.value) == str(named.value) == message


def test_a_mesh_without_a_data_parallel_dim_under_ddp_names_the_remedy_that_works_there() -> None:
    """DDP has no device_mesh, so dim names cannot be resolved: the hint names ``from_device_mesh``, which works."""
    with world(1, 2):
        own = mesh((2,), ("replica",))
        with pytest.raises(ValueError, match=r"include no data-parallel dim") as error:
            resolve_data_parallel(own, None, None, 2, 1, "DDPStrategy")
        assert "data_parallel=DataParallelTopology.from_device_mesh(mesh, ['<dim>', ...])" in str(error.value)
        assert "from_device_mesh(mesh, []) for a single replica" in str(error.value)
        remedy = DataParallelTopology.from_device_mesh(own, ["replica"])
        assert resolve_data_parallel(remedy, None, None, 2, 1, "DDPStrategy") == DataParallelTopology(1, 2, 1, 2)
        single = DataParallelTopology.from_device_mesh(own, [])
        assert resolve_data_parallel(single, None, None, 2, 1, "DDPStrategy") == DataParallelTopology(0, 1, 1, 2)


def test_default_dims_follow_the_known_names() -> None:
    assert default_data_parallel_dims(("pp", "dp_replicate", "dp_shard", "cp", "tp")) == ("dp_replicate", "dp_shard")
    assert default_data_parallel_dims(("data_parallel", "tensor_parallel")) == ("data_parallel",)
    kinds = {n: model_parallelism(n) for n in ("tp", "cp", "pp", "dp_shard_cp", "tensor_parallel", "context_parallel")}
    assert kinds == {"tp": "tensor", "cp": "context", "pp": "pipeline", "dp_shard_cp": "context",
                     "tensor_parallel": "tensor", "context_parallel": "context"}  # fmt: skip
    assert [model_parallelism(n) for n in ("data_parallel", "dp_replicate", "batch", "ep", "stp", "a")] == [None] * 6


# ------------------------------------------------------------------------------------------------ the setting
def test_resolve_follows_the_setting() -> None:
    with world(3, 4):
        strategy_mesh = mesh((2, 2), ("data_parallel", "tensor_parallel"))
        kwargs = {"num_replicas": 2, "rank": 1}
        by_kwargs = resolve_data_parallel(None, kwargs, strategy_mesh, 4, 3, "ModelParallelStrategy")
        by_name = resolve_data_parallel("data_parallel", None, strategy_mesh, 4, 3)
        by_mesh = resolve_data_parallel(strategy_mesh, None, None, 4, 3)
        assert by_kwargs == by_name == by_mesh == DataParallelTopology(1, 2, 3, 4)
        with pytest.raises(ValueError, match=r"names device-mesh dims, but DDPStrategy has no device_mesh") as error:
            resolve_data_parallel("dp", None, None, 4, 3, "DDPStrategy")
        assert "data_parallel=DataParallelTopology.from_device_mesh(mesh, ['dp'])" in str(error.value)
        with pytest.raises(ValueError, match=r"is for process 0 of 4, but this is process 3 of 4"):
            resolve_data_parallel(DataParallelTopology(0, 2, 0, 4), None, None, 4, 3)


@pytest.mark.parametrize("value", [3, "", ["dp", ""], ["dp", "dp"], [1]])
def test_a_malformed_setting_is_refused(value) -> None:
    with pytest.raises(ValueError, match="data_parallel"):
        check_data_parallel_setting(value)
    with pytest.raises(ValueError, match="data_parallel"):
        D9DDataModule(LengthDataset(16), pad_collate, global_batch_size=8, data_parallel=value)


def test_without_a_trainer_a_given_topology_deals_that_replica() -> None:
    topology = DataParallelTopology(dp_rank=1, dp_size=2, process_rank=3, world_size=4)
    dm = D9DDataModule(LengthDataset(64), pad_collate, global_batch_size=8, microbatch_size=2, data_parallel=topology)
    dm.setup("fit")
    assert (dm.dp_size, dm.dp_rank, dm.microbatches_per_step) == (2, 1, 2)
    mine = [batch["ids"].tolist() for batch in dm.train_dataloader()]
    assert mine == [batch["ids"].tolist() for batch in dm.train_dataloader_for_rank(1, 2)]
    plain = D9DDataModule(LengthDataset(64), pad_collate, global_batch_size=8, microbatch_size=2, data_parallel="dp")
    plain.setup("fit")
    assert (plain.dp_size, plain.dp_rank) == (1, 0), "names need a trainer's mesh: a single replica without one"


def test_a_data_parallel_size_that_does_not_divide_the_global_batch_names_it() -> None:
    dm = D9DDataModule(
        LengthDataset(64), pad_collate, global_batch_size=6, microbatch_size=2,
        data_parallel=DataParallelTopology(dp_rank=0, dp_size=2, process_rank=0, world_size=4),
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"global_batch_size=6 is not divisible by data-parallel size × microbatch_size"
    ):
        dm.setup("fit")
    with pytest.raises(ValueError, match="verify_peers must be an integer >= 0, got -1"):
        D9DDataModule(LengthDataset(16), pad_collate, global_batch_size=8, verify_peers=-1)


def test_inspect_reports_the_data_parallel_size_of_a_model_parallel_strategy() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_d9d.cli import inspect

    dm = D9DDataModule(LengthDataset(64), pad_collate, global_batch_size=8, microbatch_size=2)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(1, 2), logger=False)
    report = inspect(dm, trainer, steps=1)
    assert "world size: 2\ndata-parallel size: 1 (each replica's 2 processes share data)" in report
    assert "global batch: 8 samples = 1 rank(s) x 4 microbatch(es) per step x 2 samples" in report
