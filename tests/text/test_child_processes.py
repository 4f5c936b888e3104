"""No orphans: killing a process while ``prepare_data`` tokenizes with ``num_proc=2`` leaves no worker running.

A real process runs ``TextDataModule.prepare_data`` (``datasets``' pool of tokenizing workers and its manager
process); the test records its child processes while the map runs, kills the parent with SIGKILL or SIGTERM,
and asserts every recorded child is gone within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import make_texts, train_tokenizer, write_parquet

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc")

TOKENIZE = """
import sys
from lightning_d9d import TextDataModule

data, tokenizer, cache = sys.argv[1:4]
module = TextDataModule(dataset=data, tokenizer=tokenizer, max_length=64, global_batch_size=8,
                        microbatch_size=8, num_proc=2, cache_dir=cache)
module.prepare_data()
print("finished", flush=True)
"""


def children(pid: int) -> set[int]:
    """The children of ``pid``'s threads; none once it has ended (its /proc entry may go while it is listed)."""
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found |= {int(child) for child in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Enough text that tokenizing it with two workers takes seconds."""
    root = tmp_path_factory.mktemp("orphans")
    texts = make_texts(2_000, seed=4)
    train_tokenizer(texts, root / "tokenizer.json")
    with open(root / "data.jsonl", "w") as file:
        for index in range(200_000):
            file.write(json.dumps({"text": texts[index % len(texts)]}) + "\n")
    return root / "data.jsonl", root / "tokenizer.json"


@pytest.mark.slow
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_prepare_data_leaves_no_tokenizing_worker(
    signal_number: int, corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    data, tokenizer = corpus
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", TOKENIZE, str(data), str(tokenizer), str(tmp_path / "cache")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    recorded: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        # The map runs once the pool's two workers and the manager process exist.
        while len(recorded) < 3 and process.poll() is None and time.monotonic() < deadline:
            recorded |= descendants(process.pid)
            time.sleep(0.05)
        assert process.poll() is None, "prepare_data finished before it could be killed: give it more text"
        assert len(recorded) >= 3, f"the tokenizing pool did not start: children {recorded}"
        time.sleep(0.5)  # let the workers get into their tasks
        recorded |= descendants(process.pid)
        os.kill(process.pid, signal_number)
        process.wait(timeout=30)
        assert process.returncode == -signal_number  # it was killed mid-map, not finished
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in recorded) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = sorted(pid for pid in recorded if alive(pid))
        assert not survivors, f"child processes {survivors} outlived their killed parent"
    finally:  # whatever failed, leave no process of this test behind
        if process.poll() is None:
            recorded |= descendants(process.pid)
            process.kill()
            process.wait()
        for pid in recorded:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


LOADERS = """
import sys, time
from lightning_d9d import PretrainingDataModule, TextDataModule

kind, data, tokenizer, cache = sys.argv[1:5]
if kind == "pretraining":
    module = PretrainingDataModule(train_files=data, val_files=data, tokenizer=tokenizer, seq_len=32,
                                   global_batch_size=4, microbatch_size=2, num_streams=2, num_workers=2,
                                   steps_per_epoch=50, val_steps=20)
else:
    module = TextDataModule(dataset=data, tokenizer=tokenizer, max_length=64, global_batch_size=8,
                            microbatch_size=8, num_workers=2, val_split="train", cache_dir=cache)
module.prepare_data()
module.setup("fit")
train, val = iter(module.train_dataloader()), iter(module.val_dataloader())
next(train), next(val)
print("iterating", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def small_parquet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loader_orphans")
    texts = make_texts(600, seed=6)
    train_tokenizer(texts, root / "tokenizer.json")
    write_parquet(root / "data", texts, files=2, row_group_size=50)
    return root / "data", root / "tokenizer.json"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretraining", "text"])
def test_killing_the_trainer_ends_its_train_and_validation_workers_at_once(
    kind: str, small_parquet: tuple[Path, Path], tmp_path: Path
) -> None:
    """Both loaders' workers (2 each) are alive when the parent is SIGKILLed; all are gone within 2 s, less than
    torch's own worker watchdog takes (it looks at its parent only every 5 s, and never while a batch is read)."""
    data, tokenizer = small_parquet
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", LOADERS, kind, str(data), str(tokenizer), str(tmp_path / "cache")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    recorded: set[int] = set()
    try:
        line = process.stdout.readline()
        assert line.strip() == "iterating", process.stderr.read()
        recorded = descendants(process.pid)
        assert len(recorded) >= 4, f"expected 2 train and 2 validation workers, found {sorted(recorded)}"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        killed = time.monotonic()
        while any(alive(pid) for pid in recorded) and time.monotonic() < killed + 2:
            time.sleep(0.05)
        survivors = sorted(pid for pid in recorded if alive(pid))
        assert not survivors, f"workers {survivors} outlived their killed parent by 2 s"
    finally:
        if process.poll() is None:
            recorded |= descendants(process.pid)
            process.kill()
            process.wait()
        for pid in recorded:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
