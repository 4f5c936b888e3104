"""Setup's progress bars: drawn on a terminal for enough work (many files, a large JSONL scan, a sampled corpus),
never without a terminal, for little work, on another rank or inside a DataLoader worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import make_docs, stream_spec, train_tokenizer, write_parquet

from lightning_d9d.core import progress
from lightning_d9d.streaming.sources.jsonl_scan import scan_jsonl
from lightning_d9d.streaming.sources.source import RowGroupIndex
from lightning_d9d.streaming.streams.estimate import estimate_pass


def jsonl_files(root: Path, count: int, lines: int = 50) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(count):
        path = root / f"part-{number}.jsonl"
        path.write_text("".join(json.dumps({"text": f"doc {number} {i}"}) + "\n" for i in range(lines)))
        paths.append(str(path))
    return paths


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr seen as a terminal (pytest's capture is not one), rank 0."""
    monkeypatch.setattr(progress, "_on_terminal", lambda: True)
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_many_files_show_a_bar_on_a_terminal(tmp_path: Path, terminal: None, capsys: pytest.CaptureFixture) -> None:
    files = jsonl_files(tmp_path, progress.MIN_ITEMS)
    index = RowGroupIndex.scan(files, "text")
    assert index.total_rows == 50 * progress.MIN_ITEMS
    assert "reading footers and layouts" in capsys.readouterr().err


def test_few_files_or_no_terminal_show_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    RowGroupIndex.scan(jsonl_files(tmp_path / "many", progress.MIN_ITEMS), "text")  # no terminal
    monkeypatch.setattr(progress, "_on_terminal", lambda: True)
    RowGroupIndex.scan(jsonl_files(tmp_path / "few", progress.MIN_ITEMS - 1), "text")  # little work
    assert capsys.readouterr().err == ""


def test_another_rank_or_a_worker_shows_none(monkeypatch: pytest.MonkeyPatch, terminal: None) -> None:
    assert progress.shows_progress(100, 8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not progress.shows_progress(100, 8)
    monkeypatch.delenv("LOCAL_RANK")
    seen = list(torch.utils.data.DataLoader(WorkerCheck(), num_workers=1, batch_size=None))
    assert seen == [False]


class WorkerCheck(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> bool:
        progress._on_terminal = lambda: True  # this worker's copy of the module only
        return progress.shows_progress(100, 8)


def test_a_large_jsonl_scan_shows_its_bytes(
    tmp_path: Path, terminal: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (path,) = jsonl_files(tmp_path, 1, lines=2000)
    monkeypatch.setattr(progress, "MIN_SCAN_BYTES", 1024)
    layout = scan_jsonl(path, group_bytes=4096)
    assert layout.num_lines == 2000
    assert "scanning part-0.jsonl" in capsys.readouterr().err


def test_the_pass_estimate_shows_its_sample(terminal: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    docs = make_docs(200, seed=1)
    files = write_parquet(tmp_path / "train", docs, files=2, row_group_size=10)
    index = RowGroupIndex.scan([str(path) for path in files], "text")
    spec = stream_spec(train_tokenizer(docs), index, "bestfit")
    capsys.readouterr()
    tokens, rows = estimate_pass(spec)
    assert tokens > 0 and rows > 0
    assert "estimating one pass" in capsys.readouterr().err
