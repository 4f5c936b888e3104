"""The token cache keeps what short runs tokenize, and epoch counts follow the files' content.

A run that stops inside its units keeps the documents it tokenized as partial entries (parquet, and a single-frame
``.jsonl.zst`` file that is one unit): a second short run reads them instead of tokenizing (the tokenizer never sees
a document the first run tokenized) and trains an uncached run's rows, a longer run completes them, and checkpoints
of runs resume to the same rows whatever the cache holds. After an edit that keeps a parquet footer (or a JSONL
file's size and modification time), a setup counts the new content's exact steps once a pass has stored its tokens:
the reference is the files' texts tokenized here and concat's arithmetic. A damaged partial entry is named, deleted
and its documents tokenized again; a unit whose whole entry holds no document replays as a unit without text.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import WORDS, RankDataModule, run_steps, train_tokenizer
from tokenizers import Tokenizer

from lightning_d9d.streaming.sources.source import _parquet_groups
from lightning_d9d.streaming.sources.storage import Storage
from lightning_d9d.streaming.tokens import tokenize
from lightning_d9d.streaming.tokens.token_cache import TokenCacheWarning

FILES, ROWS = 2, 240  # one unit per file and stream
G, SEQ = 8, 24
SHORT = 3  # steps: far fewer documents than a unit holds
PASS = 40  # steps: more than a pass, every unit read whole


def documents(count: int, seed: int) -> list[str | None]:
    """Distinct texts (each starts with its own number), some long, some empty."""
    rng = random.Random(seed)
    docs: list[str | None] = []
    for i in range(count):
        words = rng.randint(40, 70) if i % 9 == 4 else rng.randint(1, 12)
        docs.append(None if i % 31 == 7 else f"d{i} " + " ".join(rng.choice(WORDS) for _ in range(words)))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same texts as parquet files of one row group and as single-frame ``.jsonl.zst`` files."""
    root = tmp_path_factory.mktemp("short")
    docs = documents(FILES * ROWS, seed=3)
    train_tokenizer(docs, root / "tokenizer.json")
    for kind in ("parquet", "zst"):
        (root / kind).mkdir()
    for f in range(FILES):
        part = docs[f * ROWS : (f + 1) * ROWS]
        pq.write_table(pa.table({"text": pa.array(part, pa.string())}), root / "parquet" / f"part-{f}.parquet")
        lines = "".join(json.dumps({"text": text}) + "\n" for text in part).encode()
        (root / "zst" / f"part-{f}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (root / "docs.json").write_text(json.dumps(docs))
    return root


def datamodule(root: Path, files: Path, cache: Path | None, **changes) -> RankDataModule:
    options = dict(
        train_files=str(files), tokenizer=str(root / "tokenizer.json"), seq_len=SEQ, global_batch_size=G,
        microbatch_size=2, num_streams=FILES, num_workers=0, steps_per_epoch=1000, tokenizer_batch_size=8,
        packing="concat", token_cache=None if cache is None else str(cache),
    )  # fmt: skip
    options.update(changes)
    dm = RankDataModule(**options)
    dm.setup("fit")
    return dm


def tokenizer_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text handed to the tokenizer from here on, recorded by wrapping the real function."""
    seen: list[str] = []
    real = tokenize.encode_documents

    def encoding(tokenizer, texts):
        seen.extend(texts)
        return real(tokenizer, texts)

    monkeypatch.setattr(tokenize, "encode_documents", encoding)
    return seen


def own_ids(root: Path) -> dict[str, list[int]]:
    """Every document's ids, tokenized here (BOS not included)."""
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    docs = [doc for doc in json.loads((root / "docs.json").read_text()) if doc]
    return {doc: e.ids for doc, e in zip(docs, tokenizer.encode_batch(docs, add_special_tokens=False))}


def stored_documents(dm: RankDataModule, suffix: str) -> dict[str, list[int]]:
    """``{text: ids}`` of every document the cache's entries (``.tok``: whole units, ``.part``: partial ones) hold,
    each entry read whole from disk and matched to its rows' texts."""
    cache = dm.train_spec.sources[0].cache
    index, docs = cache.index, {}
    for group in range(len(index)):
        texts, rows = index.read_texts(group), int(index.num_rows[group])
        unit = cache.load(group, 0, rows) if suffix == ".tok" else cache.partial(group, 0, rows)
        if unit is None:
            continue
        for at, row in enumerate(unit.rows.tolist()):
            docs[texts[row]] = unit.ids(at).tolist()
    return docs


@pytest.mark.parametrize("kind", ["parquet", "zst"])
def test_a_short_run_keeps_its_tokens_and_a_second_one_reads_them(
    corpus: Path, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cache = corpus / kind, tmp_path / "cache"
    want = run_steps(datamodule(corpus, files, None), PASS)
    assert len(want) == PASS
    encoded = tokenizer_calls(monkeypatch)
    first = datamodule(corpus, files, cache)
    assert run_steps(first, SHORT) == want[:SHORT]
    first_encoded = list(encoded)
    assert 0 < len(first_encoded) < len(own_ids(corpus)) // 2  # it stopped inside its units
    assert not list(cache.rglob("*.tok"))  # no unit was read whole
    (line,) = datamodule(corpus, files, cache).token_cache_report()
    assert f"0 of {FILES} units cached (0 %), 0.0 MiB; {FILES} more in part" in line, line
    kept = stored_documents(first, ".part")
    reference = own_ids(corpus)
    # Every document the run tokenized is kept, with the ids the tokenizer gives it.
    assert sorted(kept) == sorted(first_encoded)
    assert all(ids == reference[text] for text, ids in kept.items())

    encoded.clear()
    second = datamodule(corpus, files, cache)
    got = run_steps(second, SHORT)
    assert len(got) == SHORT and got == want[:SHORT]
    # Its documents came from the cache: not one the first run tokenized went to the tokenizer again.
    assert not set(encoded) & set(first_encoded)
    counters = second.train_spec.sources[0].cache.cache.counters
    assert counters.partial_hits >= FILES and counters.hits == 0

    encoded.clear()
    third = datamodule(corpus, files, cache)
    got = run_steps(third, PASS)
    assert len(got) == PASS and got == want  # the partial entries extended to whole units on the way
    assert not set(encoded) & set(first_encoded)
    assert len(list(cache.rglob("*.tok"))) == FILES and not list(cache.rglob("*.part"))
    whole = stored_documents(third, ".tok")
    assert whole == reference


@pytest.mark.parametrize("kind", ["parquet", "zst"])
def test_checkpoints_resume_to_the_same_rows_over_partial_entries(corpus: Path, tmp_path: Path, kind: str) -> None:
    """States saved by uncached runs (before, inside and after what the partial entries hold) resume to the
    uninterrupted run's rows over a cache a short run left partial."""
    files, cache = corpus / kind, tmp_path / "cache"
    want = run_steps(datamodule(corpus, files, None), PASS)
    run_steps(datamodule(corpus, files, cache), SHORT + 2)
    assert list(cache.rglob("*.part")) and not list(cache.rglob("*.tok"))
    for step in (1, SHORT, 2 * SHORT + 3):
        saved = datamodule(corpus, files, None)
        assert len(run_steps(saved, step)) == step
        state = saved.state_dict()
        resumed = datamodule(corpus, files, cache)
        resumed.load_state_dict(state)
        got = run_steps(resumed, PASS - step)
        assert len(got) == PASS - step and got == want[step:], f"resumed at step {step}"


# ------------------------------------------------------------------------------------------------ counts
def footer_digest(path: Path) -> int:
    return _parquet_groups(str(path), "text", Storage())[2]


def split_words(text: str) -> str:
    """``text`` of the same length and first word, the rest cut into one-letter words: about twice the tokens."""
    first, rest = text.split(" ", 1)
    return first + " " + ("x " * len(rest))[: len(rest) - 1] + "y"


def exact_steps(root: Path, texts: list[str | None]) -> int:
    """concat's steps per pass over ``texts``, tokenized here: every document and its BOS in rows of SEQ + 1."""
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    kept = [text for text in texts if text]
    tokens = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(kept, add_special_tokens=False))
    return tokens // ((SEQ + 1) * G)


def write_file(path: Path, texts: list[str | None], kind: str) -> None:
    if kind == "parquet":
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, compression="none")
    else:
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_setup_counts_an_edited_unit_from_its_new_tokens_once_they_are_stored(
    corpus: Path, tmp_path: Path, kind: str
) -> None:
    """An edit the footer (or a JSONL file's size and time) cannot see: until a pass stores the new tokens a setup
    counts the old content's (documented), and from then on the new content's exact steps."""
    docs = json.loads((corpus / "docs.json").read_text())
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    suffix = ".parquet" if kind == "parquet" else ".jsonl"
    paths = [data / f"part-{f}{suffix}" for f in range(FILES)]
    parts = [docs[f * ROWS : (f + 1) * ROWS] for f in range(FILES)]
    for path, part in zip(paths, parts):
        write_file(path, part, kind)
    run_steps(datamodule(corpus, data, cache), PASS)  # every unit cached
    old = exact_steps(corpus, docs)
    assert datamodule(corpus, data, cache, steps_per_epoch=None).steps_per_epoch == old

    target, before = paths[1], paths[1].stat()
    digest = footer_digest(target) if kind == "parquet" else None
    edited = list(parts[1])
    for row in range(4, ROWS - 4):  # middle rows: more tokens, the same bytes
        text = edited[row]
        if not text or len(text) < 40:
            continue
        edited[row] = split_words(text)
        write_file(target, edited, kind)
        if digest is not None and footer_digest(target) != digest:  # a new minimum or maximum: another row
            edited[row] = text
            write_file(target, edited, kind)
        if exact_steps(corpus, parts[0] + edited) >= old + 3:
            break
    if digest is not None:
        assert footer_digest(target) == digest
    assert target.stat().st_size == before.st_size
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    new = exact_steps(corpus, parts[0] + edited)
    assert new >= old + 3

    # The count trusts a unit's one entry under its file's footer (layout): the old count, until a read stores more.
    assert datamodule(corpus, data, cache, steps_per_epoch=None).steps_per_epoch == old
    run_steps(datamodule(corpus, data, cache), PASS)  # stores the edited unit's tokens beside the old ones
    assert len(list(cache.rglob("*.tok"))) == FILES + 1
    for _ in range(2):  # and every later setup (the count record written by the first)
        assert datamodule(corpus, data, cache, steps_per_epoch=None).steps_per_epoch == new


def test_a_cached_unit_without_documents_is_counted_as_one_without_text(corpus: Path, tmp_path: Path) -> None:
    """A unit of empty texts (JSONL) replays from its (empty) whole entry as a unit without text, as when read: the
    same rows and the same counters as a run without a cache."""
    docs = json.loads((corpus / "docs.json").read_text())
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    parts = [docs[:ROWS], [""] * 40, docs[ROWS:]]
    for f, part in enumerate(parts):  # JSONL: no statistics to prove a group text-free before it is read
        write_file(data / f"part-{f}.jsonl", part, "jsonl")
    uncached = datamodule(corpus, data, None)
    want = run_steps(uncached, PASS)
    for _ in range(2):  # filling the cache, then reading every unit from it
        dm = datamodule(corpus, data, cache)
        got = run_steps(dm, PASS)
        assert len(got) == PASS and got == want
        assert dm.stream_stats() == uncached.stream_stats()
    assert dm.train_spec.sources[0].cache.cache.counters.hits >= len(parts)


def test_a_damaged_partial_entry_is_named_deleted_and_its_documents_tokenized_again(
    corpus: Path, tmp_path: Path
) -> None:
    files, cache = corpus / "parquet", tmp_path / "cache"
    want = run_steps(datamodule(corpus, files, None), SHORT)
    run_steps(datamodule(corpus, files, cache), SHORT)
    damaged = sorted(cache.rglob("*.part"))[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in its tokens
    damaged.write_bytes(bytes(data))
    with pytest.warns(TokenCacheWarning, match=rf"{damaged.name}.*unusable, its arrays fail their CRC-32 check"):
        dm = datamodule(corpus, files, cache)
        got = run_steps(dm, SHORT)
    assert len(got) == SHORT and got == want
    counters = dm.train_spec.sources[0].cache.cache.counters
    assert (counters.bad, counters.partial_hits) == (1, FILES - 1)
