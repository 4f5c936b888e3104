"""DataParallelMixin: a DataModule's data-parallel layout, resolved once per ``setup`` from its trainer.

Trade-off: by default the layout is the strategy's ``distributed_sampler_kwargs``, so a strategy whose kwargs hide
model parallelism needs ``data_parallel`` set.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_d9d.core.checks import non_negative_int
from lightning_d9d.parallel.topology import (
    DataParallelSetting,
    DataParallelTopology,
    check_across_processes,
    check_data_parallel_setting,
    resolve_data_parallel,
)


class DataParallelMixin:
    """``data_parallel``, ``verify_peers``, and the topology they give under the DataModule's trainer."""

    _data_parallel: DataParallelSetting = None
    _verify_peers: int = 0
    _topology: tuple[Any, DataParallelTopology] | None = None  # (the trainer it was resolved under, the topology)

    @property
    def data_parallel(self) -> DataParallelSetting:
        """Which processes share data (see ``resolve_data_parallel``)."""
        return self._data_parallel

    @data_parallel.setter
    def data_parallel(self, value: DataParallelSetting) -> None:
        self._data_parallel = check_data_parallel_setting(value)
        self._topology = None

    @property
    def verify_peers(self) -> int:
        """Steps at the start of each fit whose microbatches peers compare (0: off)."""
        return self._verify_peers

    @verify_peers.setter
    def verify_peers(self, value: int) -> None:
        self._verify_peers = non_negative_int("verify_peers", value)

    def resolve_topology(self) -> DataParallelTopology:
        """Resolve the data-parallel layout and confirm it across processes (under a Trainer, a collective).

        Raises:
            ValueError: a layout that cannot be resolved or that processes disagree on.
        """
        trainer = self._trainer
        topology = self._resolved(trainer)
        if trainer is not None:
            check_across_processes(topology)
        self._topology = (trainer, topology)
        return topology

    @property
    def topology(self) -> DataParallelTopology:
        """The data-parallel layout (resolved at ``setup``, or now if asked before; no collective here)."""
        trainer = self._trainer
        if self._topology is None or self._topology[0] is not trainer:
            self._topology = (trainer, self._resolved(trainer))
        return self._topology[1]

    def _resolved(self, trainer: pl.Trainer | None) -> DataParallelTopology:
        setting = self._data_parallel
        if trainer is None:
            if isinstance(setting, DataParallelTopology):
                return setting
            if setting is not None and not isinstance(setting, (str, tuple)):  # a DeviceMesh: torch.distributed's
                return resolve_data_parallel(setting, None, None, *_process_layout())
            return DataParallelTopology()
        strategy = trainer.strategy
        sampler_kwargs = trainer.distributed_sampler_kwargs if setting is None else None
        mesh = getattr(strategy, "device_mesh", None) if isinstance(setting, (str, tuple)) else None
        return resolve_data_parallel(
            setting, sampler_kwargs, mesh, trainer.world_size, trainer.global_rank, type(strategy).__name__
        )

    @property
    def dp_size(self) -> int:
        """The data-parallel size: replicas the data is dealt among (1 without a trainer)."""
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank (shared with its model-parallel peers)."""
        return self.topology.dp_rank

    @property
    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)


def _process_layout() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
