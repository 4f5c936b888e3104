"""DataParallel: the part of a DataModule that says which processes share data, resolved per ``setup``.

It owns the ``data_parallel`` and ``verify_peers`` settings and the topology they give under one trainer, kept
with the trainer it was resolved under so that a DataModule reused by another Trainer resolves again. It saves
nothing in a checkpoint: the layout is the run's, and the data position never depends on it.

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


class DataParallel:
    """``data_parallel``, ``verify_peers``, and the topology they give under a trainer.

    Args:
        setting: which processes share data (see ``resolve_data_parallel``); ``None`` follows the strategy.
        verify_peers: steps at the start of each fit whose microbatches peers compare (0: off).

    Raises:
        ValueError: a setting that is no data-parallel layout, or ``verify_peers`` below 0.
    """

    def __init__(self, setting: DataParallelSetting = None, verify_peers: int = 0):
        self._setting: DataParallelSetting = None
        self._verify_peers = 0
        self._topology: tuple[Any, DataParallelTopology] | None = None  # (the trainer it was resolved under, it)
        self.setting, self.verify_peers = setting, verify_peers

    @property
    def setting(self) -> DataParallelSetting:
        return self._setting

    @setting.setter
    def setting(self, value: DataParallelSetting) -> None:
        self._setting = check_data_parallel_setting(value)
        self._topology = None  # resolved again under the new setting

    @property
    def verify_peers(self) -> int:
        return self._verify_peers

    @verify_peers.setter
    def verify_peers(self, value: int) -> None:
        self._verify_peers = non_negative_int("verify_peers", value)

    def resolve(self, trainer: pl.Trainer | None) -> DataParallelTopology:
        """Resolve the layout under ``trainer`` and confirm it across processes (under a Trainer, a collective).

        Raises:
            ValueError: a layout that cannot be resolved or that processes disagree on.
        """
        topology = self._resolved(trainer)
        if trainer is not None:
            check_across_processes(topology)
        self._topology = (trainer, topology)
        return topology

    def topology(self, trainer: pl.Trainer | None) -> DataParallelTopology:
        """The layout under ``trainer``: the one resolved at ``setup``, or resolved now (no collective here)."""
        if self._topology is None or self._topology[0] is not trainer:
            self._topology = (trainer, self._resolved(trainer))
        return self._topology[1]

    def _resolved(self, trainer: pl.Trainer | None) -> DataParallelTopology:
        setting = self._setting
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


def _process_layout() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
