"""Topology: which data-parallel replica this process belongs to, so data is dealt by replica, never by process.

Tensor, context and pipeline peers of one replica must see the same samples. The replica is resolved from a
strategy's ``distributed_sampler_kwargs``, or from a ``DeviceMesh`` and its data-parallel dims (``dp_rank`` is the
row-major coordinate over them); a layout that cannot be resolved raises instead of falling back to processes.

Dims are told apart by name. Data-parallel by default: ``DATA_PARALLEL_DIM_NAMES``. Model-parallel (their processes
are peers that share data, so naming one as data-parallel is refused): Lightning's ``tensor_parallel``, the long names
``context_parallel``, ``pipeline_parallel``, ``sequence_parallel``, and any dim with ``tp``, ``cp``, ``pp`` or ``sp``
as a ``_``-separated part (torchtitan's ``tp``, ``cp``, ``pp`` and flattened ``dp_cp``, ``dp_shard_cp``).

Trade-off: names are all a mesh says about its dims, so unknown names must be spelled out and a model-parallel dim
under a name of its own is not recognised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL_DIM_NAMES = ("data_parallel", "dp", "dp_replicate", "dp_shard", "batch")
"""Mesh dims taken as data-parallel by default (Lightning's, torchtitan's and OLMo-core's names)."""

MODEL_PARALLEL_DIM_NAMES = ("tensor_parallel", "context_parallel", "pipeline_parallel", "sequence_parallel")
"""Mesh dims whose processes share data: Lightning's ``ModelParallelStrategy`` names its TP dim ``tensor_parallel``."""
MODEL_PARALLEL_DIM_PARTS = {"tp": "tensor", "cp": "context", "pp": "pipeline", "sp": "sequence"}
"""Short names (torchtitan's, Megatron's) that make a dim model-parallel, alone or as a part (``dp_cp``)."""

DataParallelSetting = Union[str, Sequence[str], "DeviceMesh", "DataParallelTopology", None]
"""What a DataModule's ``data_parallel`` accepts."""


@dataclasses.dataclass(frozen=True)
class DataParallelTopology:
    """This process's data-parallel replica: ``dp_rank`` of ``dp_size``, among ``world_size`` processes.

    Args:
        source: where the layout came from (for messages; not compared).

    Raises:
        ValueError: a value out of range, or a ``dp_size`` that does not divide ``world_size``.
    """

    dp_rank: int = 0
    dp_size: int = 1
    process_rank: int = 0
    world_size: int = 1
    source: str = dataclasses.field(default="a single process", compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_rank", "dp_size", "process_rank", "world_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < (1 if name in ("dp_size", "world_size") else 0):
                least = 1 if name in ("dp_size", "world_size") else 0
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} must be below dp_size={self.dp_size} ({self.source})")
        if self.process_rank >= self.world_size:
            raise ValueError(f"process_rank={self.process_rank} must be below world_size={self.world_size}")
        if self.world_size % self.dp_size:
            raise ValueError(
                f"the data-parallel size {self.dp_size} ({self.source}) does not divide the {self.world_size} "
                "processes: every data-parallel replica must have the same number of processes"
            )

    @property
    def peers_per_replica(self) -> int:
        """Processes that share one replica's data (its TP × CP × PP peers, itself included)."""
        return self.world_size // self.dp_size

    @property
    def model_parallel(self) -> bool:
        """Whether processes share a replica (so dealing by process would be wrong)."""
        return self.peers_per_replica > 1

    def describe(self) -> str:
        """A one-line description for messages."""
        return (
            f"data-parallel rank {self.dp_rank} of {self.dp_size} ({self.world_size} processes, "
            f"{self.peers_per_replica} per replica; from {self.source})"
        )

    # ------------------------------------------------------------------ resolvers
    @classmethod
    def from_sampler_kwargs(
        cls,
        kwargs: Mapping[str, Any] | None,
        world_size: int,
        process_rank: int,
        strategy: str = "the strategy",
    ) -> DataParallelTopology:
        """The layout a strategy's ``distributed_sampler_kwargs`` (``num_replicas``, ``rank``) describe.

        Raises:
            ValueError: no kwargs on more than one process, or malformed kwargs.
        """
        if kwargs is None:
            if world_size == 1:
                return cls(0, 1, process_rank, world_size, f"{strategy} (one process)")
            raise ValueError(
                f"{strategy} gives no distributed_sampler_kwargs on {world_size} processes, so which processes "
                "share a data-parallel replica is unknown; pass data_parallel=... (a DeviceMesh, the names of the "
                "strategy mesh's data-parallel dims, or a DataParallelTopology)"
            )
        source = f"{strategy}'s distributed_sampler_kwargs {dict(kwargs)}"
        missing = [key for key in ("num_replicas", "rank") if not _is_int(kwargs.get(key))]
        if missing:
            raise ValueError(f"{source} lack integer {' and '.join(missing)}: the data-parallel layout is unknown")
        replicas, rank = int(kwargs["num_replicas"]), int(kwargs["rank"])
        if not 0 <= rank < replicas:
            raise ValueError(f"{source} are inconsistent: rank must be in [0, num_replicas={replicas})")
        return cls(rank, replicas, process_rank, world_size, source)

    @classmethod
    def from_device_mesh(
        cls,
        mesh: DeviceMesh,
        dims: str | Sequence[str] | None = None,
        world_size: int | None = None,
    ) -> DataParallelTopology:
        """The layout of ``mesh`` (the world mesh, or a data-parallel sub-mesh) whose data-parallel dims are ``dims``.

        Args:
            dims: the data-parallel dims (``[]``: one replica; ``None``: by ``DATA_PARALLEL_DIM_NAMES``).

        Raises:
            ValueError: unknown, repeated or ambiguous dims, or a mesh that does not fit the processes.
        """
        names = tuple(mesh.mesh_dim_names or ())
        if len(names) != mesh.ndim:
            raise ValueError(
                f"the device mesh {mesh} has no dim names: name its dims (init_device_mesh(..., mesh_dim_names=...))"
            )
        chosen = default_data_parallel_dims(names) if dims is None else _named_dims(dims, names)
        import torch.distributed as dist

        process_rank = dist.get_rank()
        if world_size is None:
            world_size = dist.get_world_size()
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"process {process_rank} is not in the device mesh {mesh}")
        if mesh.size() != world_size and set(chosen) != set(names):
            raise ValueError(
                f"the device mesh {mesh} holds {mesh.size()} of the {world_size} processes and has dims that are not "
                f"data-parallel ({[n for n in names if n not in chosen]}): pass the world mesh, or the data-parallel "
                "sub-mesh alone (e.g. world_mesh['dp_replicate', 'dp_shard'])"
            )
        dp_rank, dp_size = 0, 1
        for index, name in enumerate(names):  # row-major over the chosen dims, in the mesh's order
            if name in chosen:
                dp_rank, dp_size = dp_rank * mesh.size(index) + coordinate[index], dp_size * mesh.size(index)
        source = f"the device mesh's dims {list(chosen)} of {dict(zip(names, mesh.mesh.shape))}"
        return cls(dp_rank, dp_size, process_rank, world_size, source)


def default_data_parallel_dims(names: Sequence[str]) -> tuple[str, ...]:
    """The dims of a mesh with these names that are data-parallel by name; raises if none or ambiguous."""
    unknown = [n for n in names if n.startswith("dp") and n not in DATA_PARALLEL_DIM_NAMES]
    if unknown:
        raise ValueError(
            f"the device mesh's dims {list(names)} include {unknown}, whose meaning is ambiguous (a flattened "
            "'dp_cp' also holds context-parallel peers, which must share data): name the data-parallel dims, "
            "e.g. DataParallelTopology.from_device_mesh(mesh, ['dp_replicate', 'dp_shard'])"
        )
    found = tuple(n for n in names if n in DATA_PARALLEL_DIM_NAMES)
    if not found:
        raise ValueError(
            f"the device mesh's dims {list(names)} include no data-parallel dim (one of "
            f"{list(DATA_PARALLEL_DIM_NAMES)}): name them, data_parallel=DataParallelTopology.from_device_mesh(mesh, "
            "['<dim>', ...]) (from_device_mesh(mesh, []) for a single replica)"
        )
    return found


def model_parallelism(name: str) -> str | None:
    """The parallelism whose peers share data that a dim of this name holds (``"tensor"``, ...), or ``None``."""
    if name in MODEL_PARALLEL_DIM_NAMES:
        return name.split("_")[0]
    return next((MODEL_PARALLEL_DIM_PARTS[p] for p in name.split("_") if p in MODEL_PARALLEL_DIM_PARTS), None)


def _named(dims: str | Sequence[str]) -> tuple[str, ...]:
    return (dims,) if isinstance(dims, str) else tuple(dims)


def _named_dims(dims: str | Sequence[str], names: tuple[str, ...]) -> tuple[str, ...]:
    chosen = _named(dims)
    missing = [d for d in chosen if d not in names]
    if missing:
        raise ValueError(f"the device mesh has no dim {missing[0]!r}; its dims are {list(names)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"data-parallel dims {list(chosen)} name a dim twice")
    shared = next((d for d in chosen if model_parallelism(d)), None)
    if shared is not None:
        candidates = [n for n in names if not model_parallelism(n)]
        valid = [n for n in candidates if n in DATA_PARALLEL_DIM_NAMES] or candidates
        raise ValueError(
            f"the data-parallel dims {list(chosen)} include the device mesh's dim {shared!r}, which holds "
            f"{model_parallelism(shared)}-parallel peers: they must train the same rows, so it cannot be "
            "data-parallel (each peer would train other rows, silently). The data-parallel dims of this mesh "
            f"{list(names)} are {f'{valid} (or [] for a single replica)' if valid else 'none: [] (a single replica)'}"
        )
    return chosen


def check_data_parallel_setting(value: Any) -> DataParallelSetting:
    """A DataModule's ``data_parallel`` as given, checked (lists become tuples)."""
    if value is None or isinstance(value, DataParallelTopology) or _is_device_mesh(value):
        return value
    names = (value,) if isinstance(value, str) else value
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names):
        if len(set(names)) != len(names):
            raise ValueError(f"data_parallel names a dim twice: {list(names)}")
        return value if isinstance(value, str) else tuple(names)
    raise ValueError(
        "data_parallel must be None (the strategy's distributed_sampler_kwargs), a mesh dim name or a list of "
        f"them (of the strategy's device_mesh), a DeviceMesh or a DataParallelTopology; got {value!r}"
    )


def resolve_data_parallel(
    setting: DataParallelSetting,
    sampler_kwargs: Mapping[str, Any] | None,
    strategy_mesh: DeviceMesh | None,
    world_size: int,
    process_rank: int,
    strategy: str = "the strategy",
) -> DataParallelTopology:
    """The topology a ``data_parallel`` setting asks for, under a strategy.

    Args:
        setting: ``None`` (the sampler kwargs), dim names of ``strategy_mesh``, a ``DeviceMesh`` or a topology.

    Raises:
        ValueError: the setting cannot be resolved, or a topology of another process or world size.
    """
    setting = check_data_parallel_setting(setting)
    if setting is None:
        return DataParallelTopology.from_sampler_kwargs(sampler_kwargs, world_size, process_rank, strategy)
    if isinstance(setting, DataParallelTopology):
        if (setting.process_rank, setting.world_size) != (process_rank, world_size):
            raise ValueError(
                f"data_parallel={setting} is for process {setting.process_rank} of {setting.world_size}, but this is "
                f"process {process_rank} of {world_size}"
            )
        return setting
    if _is_device_mesh(setting):
        return DataParallelTopology.from_device_mesh(setting, None, world_size)
    if strategy_mesh is None:
        raise ValueError(
            f"data_parallel={setting!r} names device-mesh dims, but {strategy} has no device_mesh; pass a "
            "DeviceMesh (data_parallel=mesh) or its dims as a DataParallelTopology "
            f"(data_parallel=DataParallelTopology.from_device_mesh(mesh, {list(_named(setting))!r}))"
        )
    return DataParallelTopology.from_device_mesh(strategy_mesh, setting, world_size)


def check_across_processes(topology: DataParallelTopology) -> None:
    """Confirm with one all-gather that every replica has ``peers_per_replica`` processes.

    Raises:
        ValueError: processes that disagree (the same error on every process).
    """
    import torch.distributed as dist

    if topology.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    layouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, (topology.dp_rank, topology.dp_size))
    sizes = sorted({size for _, size in layouts})
    if len(sizes) > 1:
        by_size = {size: [r for r, (_, s) in enumerate(layouts) if s == size] for size in sizes}
        raise ValueError(f"processes disagree on the data-parallel size: {by_size} (size: processes)")
    members: dict[int, list[int]] = {}
    for process, (dp_rank, _) in enumerate(layouts):
        members.setdefault(dp_rank, []).append(process)
    uneven = {dp: ranks for dp, ranks in sorted(members.items()) if len(ranks) != topology.peers_per_replica}
    if uneven or len(members) != topology.dp_size:
        raise ValueError(
            f"data-parallel replicas must each hold {topology.peers_per_replica} processes (dp_size "
            f"{topology.dp_size} of {topology.world_size}), but the processes of each dp rank are {members}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_device_mesh(value: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


__all__ = [
    "DATA_PARALLEL_DIM_NAMES",
    "MODEL_PARALLEL_DIM_NAMES",
    "MODEL_PARALLEL_DIM_PARTS",
    "DataParallelSetting",
    "DataParallelTopology",
    "check_across_processes",
    "check_data_parallel_setting",
    "default_data_parallel_dims",
    "model_parallelism",
    "resolve_data_parallel",
]
