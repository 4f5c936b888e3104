"""CPU threads: how many intra-op threads torch gives a training process that runs on the CPU.

torch starts one intra-op thread per core. On a small CPU machine they spin against the DataLoader workers (each a
process of its own, busy reading, tokenizing or collating) and steps get several times slower. A CPU run started by
the ``lightning-d9d`` command gives each training process the cores its workers leave:
``max(1, cores // processes - workers)``, unless the user chose: ``OMP_NUM_THREADS`` set, or
``torch.set_num_threads`` called with another value than torch's default before the run.

Trade-off: a rule from counts alone; a machine shared with other jobs may want fewer threads, a model whose compute
dwarfs the loader's more (set ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import os

import torch

_TORCH_DEFAULT = torch.get_num_threads()  # torch's own choice, taken before any user code of the run


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def suggested_threads(processes: int, workers: int, cores: int | None = None) -> int:
    """Intra-op threads per training process: the cores left after its DataLoader workers, at least 1.

    Args:
        processes: training processes on this machine.
        workers: DataLoader worker processes of each.
        cores: the machine's cores (``None``: :func:`available_cores`).
    """
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, processes) - workers)


def choose_cpu_threads(processes: int, workers: int) -> str | None:
    """Set torch's intra-op threads for a CPU run, unless the user chose; the line that says so, or ``None``.

    Args:
        processes: training processes on this machine.
        workers: DataLoader worker processes of each.
    """
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() != _TORCH_DEFAULT:
        return None
    threads = suggested_threads(processes, workers)
    if threads == torch.get_num_threads():
        return None
    torch.set_num_threads(threads)
    if processes > 1:  # the other training processes start from this one and read it
        os.environ["OMP_NUM_THREADS"] = str(threads)
    return (
        f"CPU run: torch uses {threads} intra-op thread(s) per training process, not {_TORCH_DEFAULT} ("
        f"{available_cores()} cores, {processes} process(es) of {workers} DataLoader worker(s) each); set "
        "OMP_NUM_THREADS to choose"
    )
