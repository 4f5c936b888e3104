"""PretrainingDataModule with ``token_cache``: the same rows as tokenizing, step by step and across passes, with an
empty, a partial (after a SIGKILL) or a complete cache, resumed and on another layout; a changed tokenizer or an
edited file never reads stale tokens and is said once; a damaged entry is named and rebuilt. And JSONL (plain,
gzip, zstd) sources: the rows of the same texts written as parquet with the same units, resumed mid-file exactly.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import TESTS, RankDataModule, make_docs, run_steps, train_tokenizer

from lightning_d9d.streaming.sources import source as source_module
from lightning_d9d.streaming.sources.source import RowGroupIndex
from lightning_d9d.streaming.tokens.token_cache import TokenCacheWarning

GROUPS, ROWS = 8, 16  # row groups (files) of ROWS documents each
STEPS = 36  # more than one pass over the corpus on every stream


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same texts as parquet (one row group per file) and as JSONL, gzip and zstd (one group per file)."""
    root = tmp_path_factory.mktemp("cached")
    docs = make_docs(GROUPS * ROWS, seed=21, max_words=40, long_every=11, long_words=150)
    train_tokenizer(docs, root / "tokenizer.json")
    train_tokenizer(docs[: GROUPS * ROWS // 3], root / "other-tokenizer.json")
    for kind in ("parquet", "jsonl", "gz", "zst", "uneven"):
        (root / kind).mkdir()
    # Units of 16 and of 120 documents: a run killed early has cached some short ones and none of the long ones.
    for f, size in enumerate([16, 120] * 4):
        part = make_docs(size, seed=100 + f, max_words=40)
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}), root / "uneven" / f"part-{f:03d}.parquet")
    for g in range(GROUPS):
        part = docs[g * ROWS : (g + 1) * ROWS]
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}), root / "parquet" / f"part-{g:03d}.parquet")
        lines = "".join(json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(part)).encode()
        (root / "jsonl" / f"part-{g:03d}.jsonl").write_bytes(lines)
        (root / "gz" / f"part-{g:03d}.jsonl.gz").write_bytes(gzip.compress(lines))
        # Frames of a few lines each: a group starts and ends inside frames.
        frames = [zstandard.ZstdCompressor().compress(lines[a : a + 700]) for a in range(0, len(lines), 700)]
        (root / "zst" / f"part-{g:03d}.jsonl.zst").write_bytes(b"".join(frames))
    return root


def datamodule(root: Path, kind: str = "parquet", cache: Path | None = None, **changes) -> RankDataModule:
    options = dict(
        train_files=str(root / kind), tokenizer=str(root / "tokenizer.json"), seq_len=24, global_batch_size=8,
        microbatch_size=2, num_streams=4, num_workers=0, steps_per_epoch=1000, tokenizer_batch_size=8,
        bestfit_buffer_size=16, token_cache=None if cache is None else str(cache),
    )  # fmt: skip
    options.update(changes)
    dm = RankDataModule(**options)
    dm.setup("fit")
    return dm


def global_steps(root: Path, world: int, steps: int, state: dict | None = None, **kw) -> list[Counter]:
    """Per step, the multiset of rows over every simulated rank (2 workers each)."""
    per_rank = []
    for rank in range(world):
        dm = datamodule(root, world=world, rank=rank, num_workers=2, **kw)
        if state is not None:
            dm.load_state_dict(state)
        per_rank.append(run_steps(dm, steps))
    return [Counter(row for rank in per_rank for row in rank[step]) for step in range(steps)]


def entries(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.tok"))


def text_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row groups whose texts are read from here on (a cached unit is read from its entry instead)."""
    reads: list[int] = []
    real = RowGroupIndex._read_column

    def counted(self, group, *args):
        reads.append(group)
        return real(self, group, *args)

    monkeypatch.setattr(RowGroupIndex, "_read_column", counted)
    return reads


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_rows_are_the_same_without_a_cache_and_with_an_empty_and_a_complete_one(
    corpus: Path, tmp_path: Path, packing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uncached = datamodule(corpus, packing=packing)
    want = run_steps(uncached, STEPS)
    assert uncached.source_stats()["train"]["passes"] > 1, "the run must cross a pass"
    cache = tmp_path / "cache"
    assert run_steps(datamodule(corpus, packing=packing, cache=cache), STEPS) == want  # empty: filled on the way
    assert len(entries(cache)) == GROUPS  # every unit stored once it was read whole
    warm = datamodule(corpus, packing=packing, cache=cache)
    reads = text_reads(monkeypatch)
    assert run_steps(warm, STEPS) == want
    assert reads == [], "a complete cache reads no text"
    assert warm.stream_stats() == uncached.stream_stats()  # the counters replay too
    assert warm.train_spec.sources[0].cache.cache.counters.hits > 0
    # A resume restores best-fit buffers from the cached tokens: still no text read, the same rows.
    saved = datamodule(corpus, packing=packing, cache=cache)
    run_steps(saved, 9)
    resumed = datamodule(corpus, packing=packing, cache=cache)
    reads.clear()
    resumed.load_state_dict(saved.state_dict())
    assert run_steps(resumed, STEPS - 9) == want[9:]
    assert reads == []


def test_a_cache_left_partial_by_a_sigkill_gives_the_same_rows_and_resumes_exactly(corpus: Path, tmp_path: Path):
    uneven = dict(train_files=str(corpus / "uneven"))
    want = run_steps(datamodule(corpus, **uneven), STEPS)
    cache = tmp_path / "cache"
    script = f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS)!r})
        from test_token_cache_rows import datamodule
        from pathlib import Path
        dm = datamodule(Path({str(corpus)!r}), "uneven", cache=Path({str(cache)!r}), num_workers=2)
        batches = iter(dm.train_dataloader())
        next(batches)  # the first block: each stream has read about one of its units
        os.kill(os.getpid(), signal.SIGKILL)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=TESTS / "streaming", timeout=120)
    assert done.returncode == -signal.SIGKILL
    partial = len(entries(cache))
    assert 0 < partial < 8, f"{partial} of 8 units cached: not a partial cache"
    # The partial cache: a fresh run, and a resume (on this layout and on two ranks) of a state saved on it.
    assert run_steps(datamodule(corpus, cache=cache, **uneven), STEPS) == want
    dm = datamodule(corpus, cache=tmp_path / "other", **uneven)  # an empty cache of its own when the state is saved
    run_steps(dm, 7)
    state = dm.state_dict()
    resumed = datamodule(corpus, cache=cache, **uneven)
    resumed.load_state_dict(state)
    assert run_steps(resumed, STEPS - 7) == want[7:]
    elastic = global_steps(corpus, 2, STEPS - 7, state=state, cache=cache, **uneven)
    assert elastic == [Counter(rows) for rows in want[7:]]


def test_another_tokenizer_or_an_edited_file_never_reads_stale_tokens_and_says_so_once(
    corpus: Path, tmp_path: Path
) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for path in sorted((corpus / "parquet").iterdir())[:6]:
        (data / path.name).write_bytes(path.read_bytes())
    run_steps(datamodule(corpus, cache=cache, train_files=str(data), num_streams=2), 10)
    other = dict(train_files=str(data), num_streams=2, tokenizer=str(corpus / "other-tokenizer.json"))
    want = run_steps(datamodule(corpus, **other), 10)
    with pytest.warns(UserWarning, match=r"holds tokens of 1 other tokenizer or settings version\(s\)"):
        got = run_steps(datamodule(corpus, cache=cache, **other), 10)
    assert got == want
    # One file rewritten with other words: its digest changes, so its old entries are never looked up.
    table = pq.read_table(data / "part-002.parquet")
    texts = [" ".join(reversed(text.split())) if text else text for text in table.column("text").to_pylist()]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), data / "part-002.parquet")
    want = run_steps(datamodule(corpus, train_files=str(data), num_streams=2), 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        edited = datamodule(corpus, cache=cache, train_files=str(data), num_streams=2)
    said = [str(w.message) for w in caught if "changed since their tokens were cached" in str(w.message)]
    assert len(said) == 1 and "'part-002.parquet'" in said[0], said
    assert run_steps(edited, 10) == want


def test_file_sets_whose_files_share_names_are_never_said_changed_and_an_edit_names_its_set(
    corpus: Path, tmp_path: Path
) -> None:
    # Two sources whose files have the same names relative to their folders (web/part-000 and code/part-000),
    # cached partly: neither source's files are said changed, run after run.
    web, code, cache = tmp_path / "web", tmp_path / "code", tmp_path / "cache"
    for folder, first in ((web, 0), (code, 4)):
        folder.mkdir()
        for g in range(4):
            source = corpus / "parquet" / f"part-{first + g:03d}.parquet"
            (folder / f"part-{g:03d}.parquet").write_bytes(source.read_bytes())
    mixture = dict(train_files={"web": str(web), "code": str(code)}, weights={"web": 0.9, "code": 0.1})
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm = datamodule(corpus, cache=cache, **mixture)
        assert not [str(w.message) for w in caught if "changed since" in str(w.message)]
        run_steps(dm, 3)
    # An edit of web's part-001 is said once, naming its file set.
    table = pq.read_table(web / "part-001.parquet")
    texts = [" ".join(reversed(text.split())) if text else text for text in table.column("text").to_pylist()]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), web / "part-001.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        datamodule(corpus, cache=cache, **mixture)
    said = [str(w.message) for w in caught if "changed since" in str(w.message)]
    assert len(said) == 1 and "of train_files['web']" in said[0] and "'part-001.parquet'" in said[0], said


def test_a_damaged_entry_is_named_and_rebuilt_never_read_as_tokens(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    want = run_steps(datamodule(corpus, cache=cache), STEPS)
    damaged = entries(cache)[3]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    truncated = entries(cache)[5]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    with pytest.warns(TokenCacheWarning) as caught:
        assert run_steps(datamodule(corpus, cache=cache), STEPS) == want
    named = " ".join(str(w.message) for w in caught)
    assert damaged.name in named and truncated.name in named
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenCacheWarning)  # rebuilt: read cleanly now
        assert run_steps(datamodule(corpus, cache=cache), STEPS) == want


def test_a_cache_that_cannot_be_written_warns_once_and_tokenizes_on(corpus: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    blocked = cache / datamodule(corpus, cache=cache).train_spec.sources[0].cache.cache.digest
    blocked.write_text("a file where the version's folder would be")  # every write fails, as on a broken mount
    want = run_steps(datamodule(corpus), 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_steps(datamodule(corpus, cache=cache), 8) == want
    said = [str(w.message) for w in caught if issubclass(w.category, TokenCacheWarning)]
    stores = [message for message in said if "cannot store tokens" in message]
    assert len(stores) == 1 and "stops writing" in stores[0], said  # not a warning and a try per unit
    assert len(said) == 2 and "cannot read token cache entry" in " ".join(said), said
    assert blocked.read_text() == "a file where the version's folder would be"


def test_a_token_cache_that_is_a_file_is_refused_at_setup(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("not a folder")
    with pytest.raises(ValueError, match=r"token_cache='.*tokens' is a file: give a folder"):
        datamodule(corpus, cache=tmp_path / "tokens")
    with pytest.raises(ValueError, match=r"token_cache='.*tokens/sub/dir' lies inside the file '.*tokens'"):
        datamodule(corpus, cache=tmp_path / "tokens" / "sub" / "dir")


@pytest.mark.parametrize("kind", ["jsonl", "gz", "zst"])
@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_jsonl_gives_the_rows_of_the_same_texts_as_parquet_and_is_cached_alike(
    corpus: Path, tmp_path: Path, kind: str, packing: str
) -> None:
    want = run_steps(datamodule(corpus, packing=packing), STEPS)
    assert run_steps(datamodule(corpus, kind, packing=packing), STEPS) == want
    assert run_steps(datamodule(corpus, kind, packing=packing, cache=tmp_path / "c", num_workers=2), STEPS) == want
    assert run_steps(datamodule(corpus, kind, packing=packing, cache=tmp_path / "c"), STEPS) == want
    assert list((tmp_path / "c" / "jsonl-layouts").iterdir()), "the layouts are kept beside the tokens"


@pytest.mark.parametrize("kind", ["jsonl", "gz", "zst"])
def test_a_resume_inside_a_jsonl_file_is_exact_and_a_mixture_may_mix_formats(
    corpus: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source_module, "JSONL_GROUP_BYTES", 900)  # several groups (units) per file
    uninterrupted = run_steps(datamodule(corpus, kind), STEPS)
    dm = datamodule(corpus, kind)
    assert len(dm.train_spec.sources[0].index) > 2 * GROUPS
    run_steps(dm, 5)
    state = dm.state_dict()
    resumed = datamodule(corpus, kind)
    resumed.load_state_dict(state)
    assert run_steps(resumed, STEPS - 5) == uninterrupted[5:]
    mixed = {"web": str(corpus / kind), "books": str(corpus / "parquet")}
    both = run_steps(datamodule(corpus, train_files=mixed, weights={"web": 1, "books": 1}), 6)
    assert {source for step in both for source, _ in step} == {0, 1}


def test_a_malformed_jsonl_line_is_named_or_skipped(corpus: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad"
    data.mkdir()
    lines = (corpus / "jsonl" / "part-000.jsonl").read_text().splitlines()
    lines[7] = '{"text": "unterminated'
    (data / "a.jsonl").write_text("\n".join(lines) + "\n")
    (data / "b.jsonl").write_text((corpus / "jsonl" / "part-001.jsonl").read_text())
    with pytest.raises(ValueError, match=r"line 8 of .*a\.jsonl"):
        run_steps(datamodule(corpus, train_files=str(data), num_streams=2), 20)
    with pytest.warns(UserWarning, match=r"skipped 1 malformed line\(s\) among lines 1\.\.16 of JSONL file"):
        skipped = datamodule(corpus, train_files=str(data), num_streams=2, on_malformed="skip")
        run_steps(skipped, 20)
    with pytest.raises(ValueError, match="on_malformed must be 'error' or 'skip', got 'ignore'"):
        datamodule(corpus, on_malformed="ignore")
