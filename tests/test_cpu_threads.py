"""CPU threads: the rule (cores left by the DataLoader workers, at least one), a user's choice respected
(``OMP_NUM_THREADS``, ``torch.set_num_threads``), and the ``lightning-d9d`` command applying it to a real CPU fit."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_d9d.core import cpu_threads
from lightning_d9d.core.cpu_threads import choose_cpu_threads, suggested_threads

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def torch_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """torch at a default of 4 threads, no OMP_NUM_THREADS; both as they were afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_TORCH_DEFAULT", 4)
    torch.set_num_threads(4)
    try:
        yield 4
    finally:
        torch.set_num_threads(before)


def test_the_workers_keep_their_cores() -> None:
    assert suggested_threads(1, 1, cores=2) == 1  # the demo on a 2-core machine
    assert suggested_threads(1, 0, cores=2) == 2
    assert suggested_threads(2, 1, cores=16) == 7
    assert suggested_threads(4, 8, cores=8) == 1, "at least one"


def test_a_users_choice_is_kept(torch_default: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert choose_cpu_threads(1, 1) is None and torch.get_num_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(3)  # torch.set_num_threads before the run
    assert choose_cpu_threads(1, 1) is None and torch.get_num_threads() == 3
    torch.set_num_threads(4)
    said = choose_cpu_threads(2, 0)  # two processes: the other one reads OMP_NUM_THREADS
    assert torch.get_num_threads() == 1 and cpu_threads.os.environ["OMP_NUM_THREADS"] == "1"
    assert said == (
        "CPU run: torch uses 1 intra-op thread(s) per training process, not 4 (2 cores, 2 process(es) of 0 "
        "DataLoader worker(s) each); set OMP_NUM_THREADS to choose"
    )


def test_the_command_gives_a_cpu_fit_the_cores_its_workers_leave(
    torch_default: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_d9d.cli import main

    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 3)
    monkeypatch.chdir(tmp_path)
    config = ["--config", str(REPO / "configs" / "d9d.yaml"), "--trainer.max_steps=1", "--trainer.logger=false"]
    options = ["--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.accelerator=cpu"]
    options += ["--data.init_args.num_workers=1", "--trainer.enable_progress_bar=false"]
    with caplog.at_level(logging.INFO):
        main(["fit", *config, *options])
    assert torch.get_num_threads() == 2, "3 cores - 1 worker (a process setting: the fit ran with it)"
    assert "CPU run: torch uses 2 intra-op thread(s) per training process, not 4" in caplog.text
