"""Weighted mixtures in PretrainingDataModule: exact per-step shares in real batches, the same steps on any layout,
exact resume (mid-epoch, across a source's pass, across a phase, on another layout), deliberate changes of the mix
on resume, per-source counters and validation, and one clear error per bad input; and, for one corpus, the same
steps on any layout."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from support import RankDataModule, make_docs, run_steps, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule

K, G, M_SIZE = 4, 8, 2


def shouted(docs: list[str | None]) -> list[str | None]:
    """Documents in upper case: a word-level tokenizer gives them ids no lower-case document has."""
    return [doc.upper() if doc else doc for doc in docs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mixture")
    a, b, c = (
        make_docs(480, seed=3),
        shouted(make_docs(40, seed=4, long_every=1000, max_words=20)),
        [d.title() if d else d for d in make_docs(160)],
    )
    write_parquet(root / "a", a, files=3, row_group_size=20)
    write_parquet(root / "b", b, files=2, row_group_size=10, column="body")  # small: many passes
    write_parquet(root / "c", c, files=2, row_group_size=20)
    write_parquet(root / "empty", [None, ""] * 10, files=1, row_group_size=10)
    tok = train_tokenizer(a + b + c, root / "tokenizer.json")
    vocab = {name: {tok.token_to_id(w) for d in docs if d for w in d.split()} for name, docs in zip("abc", (a, b, c))}
    return {"root": root, "tok": tok, "vocab": vocab}


def sources(corpus: dict, names: str = "ab") -> dict:
    root = corpus["root"]
    every = {"a": str(root / "a"), "b": {"files": str(root / "b"), "text_column": "body"}, "c": str(root / "c")}
    return {name: every[name] for name in names}


def datamodule(corpus: dict, names: str = "ab", world: int = 1, rank: int = 0, **changes) -> RankDataModule:
    options = dict(
        train_files=sources(corpus, names), tokenizer=str(corpus["root"] / "tokenizer.json"), seq_len=16,
        global_batch_size=G, microbatch_size=M_SIZE, num_streams=K, num_workers=0, tokenizer_batch_size=8,
        bestfit_buffer_size=8, steps_per_epoch=1000, packing="bestfit_split",
    )  # fmt: skip
    options.update(changes)
    dm = RankDataModule(world=world, rank=rank, **options)
    dm.setup("fit")
    return dm


def per_stream_sequences(steps: list[list[tuple[int, str]]], plan: MixturePlan, first_step: int = 0) -> dict:
    """Each (source, stream)'s rows in order, cut out of one rank's (world size 1) steps by the plan's deal."""
    sequences: dict[tuple[int, int], list[str]] = {}
    for offset, rows in enumerate(steps):
        at = 0
        for stream, counts in enumerate(plan.stream_rows_of_step(first_step + offset, K)):
            for source, count in enumerate(counts):
                taken = rows[at : at + count]
                assert all(s == source for s, _ in taken)
                sequences.setdefault((source, stream), []).extend(d for _, d in taken)
                at += count
        assert at == len(rows)
    return sequences


# ---------------------------------------------------------------------------------------------- exact shares
@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_every_step_takes_exactly_the_planned_rows_of_each_source(corpus: dict, packing: str) -> None:
    weights = [[0, {"a": 0.7, "b": 0.3}], [6, {"a": 0.2, "b": 0.8}]]
    dm = datamodule(corpus, weights=weights, packing=packing)
    steps = run_steps(dm, 12)
    schedule = MixtureSchedule(["a", "b"], weights)
    plan = MixturePlan(schedule, G)
    taken = np.zeros(2)
    for step, rows in enumerate(steps):
        counts = Counter(source for source, _ in rows)
        assert (counts[0], counts[1]) == plan.rows_of_step(step)
        taken += (counts[0], counts[1])
        target = schedule.target_rows(step + 1, G)
        assert all(abs(t - float(w)) <= 1 for t, w in zip(taken, target, strict=True))
    # Each row is of its source only: its words are that source's (upper case for b).
    tok, vocab = corpus["tok"], corpus["vocab"]
    specials = {tok.token_to_id("<|bos|>"), tok.token_to_id("<unk>")}
    batches = iter(datamodule(corpus, weights=weights, packing=packing).train_dataloader())
    for _ in range(8):
        batch = next(batches)
        for i in range(len(batch)):
            name = "ab"[int(batch.sources[i])]
            ids = set(batch.input_ids[i].tolist()) - specials
            assert ids <= vocab[name], (name, ids - vocab[name])
    batches.close()


def test_a_single_corpus_batch_says_source_0(corpus: dict) -> None:
    dm = PretrainingDataModule(
        train_files=str(corpus["root"] / "a"), tokenizer=str(corpus["root"] / "tokenizer.json"), seq_len=16,
        global_batch_size=G, microbatch_size=M_SIZE, num_streams=K, num_workers=0, steps_per_epoch=5,
    )  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert torch.equal(batch.sources, torch.zeros(M_SIZE, dtype=torch.int64))
    assert dm.source_names == ["train"]
    dm.close_loaders()


# ---------------------------------------------------------------------------------------------- layouts
def global_steps(corpus: dict, world: int, workers: int, steps: int, state: dict | None = None, **kw) -> list:
    """Per step, the multiset of rows over every simulated rank."""
    per_rank = []
    for rank in range(world):
        dm = datamodule(corpus, world=world, rank=rank, num_workers=workers, **kw)
        if state is not None:
            dm.load_state_dict(state)
        per_rank.append(run_steps(dm, steps))
    return [Counter(row for rank in per_rank for row in rank[step]) for step in range(steps)]


def test_the_rows_of_every_step_are_the_same_on_any_world_size_and_workers(corpus: dict) -> None:
    weights = {"a": 0.6, "b": 0.4}
    alone = global_steps(corpus, 1, 0, 6, weights=weights)
    assert global_steps(corpus, 2, 0, 6, weights=weights, microbatch_size=1) == alone
    assert global_steps(corpus, 2, 2, 6, weights=weights) == alone
    assert global_steps(corpus, 1, 2, 6, weights=weights) == alone


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_one_corpus_gives_the_same_rows_on_any_world_size_and_resumes_on_another(corpus: dict, packing: str) -> None:
    single = dict(train_files=str(corpus["root"] / "a"), packing=packing)
    alone = global_steps(corpus, 1, 0, 8, **single)
    assert global_steps(corpus, 2, 0, 8, microbatch_size=1, **single) == alone
    state, _ = state_after(datamodule(corpus, **single), 3)
    assert global_steps(corpus, 2, 2, 5, state=state, **single) == alone[3:]


# ---------------------------------------------------------------------------------------------- resume
def state_after(dm: PretrainingDataModule, steps: int) -> tuple[dict, list]:
    rows = run_steps(dm, steps)
    return dm.state_dict(), rows


@pytest.mark.parametrize(
    ("weights", "saved_at", "why"),
    [
        ({"a": 0.5, "b": 0.5}, 3, "mid-epoch"),
        ({"a": 0.2, "b": 0.8}, 9, "after b's first pass"),
        ([[0, {"a": 0.7, "b": 0.3}], [5, {"b": 1}], [8, {"a": 1, "b": 1}]], 4, "across two phase changes"),
    ],
)
def test_a_resume_continues_with_exactly_the_uninterrupted_steps(corpus, weights, saved_at, why) -> None:
    total = 14
    uninterrupted = run_steps(datamodule(corpus, weights=weights), total)
    dm = datamodule(corpus, weights=weights)
    state, before = state_after(dm, saved_at)
    assert before == uninterrupted[:saved_at]
    if why == "after b's first pass":
        assert dm.source_stats()["b"]["passes"] >= 1
    resumed = datamodule(corpus, weights=weights)
    resumed.load_state_dict(state)
    assert run_steps(resumed, total - saved_at) == uninterrupted[saved_at:]
    # On another layout: two ranks with two workers each resume the same global steps.
    other = global_steps(corpus, 2, 2, total - saved_at, state=state, weights=weights)
    assert other == [Counter(rows) for rows in uninterrupted[saved_at:]]


# ---------------------------------------------------------------------------------------------- changing the mix
def test_other_weights_on_resume_are_refused_naming_old_and_new_shares(corpus: dict) -> None:
    state, _ = state_after(datamodule(corpus, weights={"a": 1, "b": 1}), 2)
    resumed = datamodule(corpus, weights={"a": 3, "b": 1})
    with pytest.raises(ValueError, match=r"checkpoint \{a 50%, b 50%\}, now \{a 75%, b 25%\}"):
        resumed.load_state_dict(state)
    later_phase = datamodule(corpus, weights=[[0, {"a": 1, "b": 1}], [50, {"a": 1}]])
    with pytest.raises(ValueError, match=r"from step 50 .*checkpoint \{a 50%, b 50%\}, now \{a 100%\}"):
        later_phase.load_state_dict(state)


def test_continue_under_new_weights_keeps_every_source_where_it_stopped(corpus: dict) -> None:
    first, then = {"a": 0.75, "b": 0.25}, {"a": 0.25, "b": 0.75}
    saved_at, after = 5, 8
    dm = datamodule(corpus, weights=first)
    state, before = state_after(dm, saved_at)
    resumed = datamodule(corpus, weights=then, on_mixture_change="continue")
    resumed.load_state_dict(state)
    following = run_steps(resumed, after)
    # A checkpoint of the continued run resumes it exactly under the same (new) weights, without "continue".
    resumed_again = datamodule(corpus, weights=then, on_mixture_change="continue")
    resumed_again.load_state_dict(state)
    again_state, first_part = state_after(resumed_again, 3)
    once_more = datamodule(corpus, weights=then)
    once_more.load_state_dict(again_state)
    assert first_part + run_steps(once_more, after - 3) == following
    # The new shares count from the resume step, every source from the rows it had given.
    plan = resumed.train_spec.plan
    given = [sum(1 for rows in before for s, _ in rows if s == i) for i in range(2)]
    assert plan.start_step == saved_at and list(plan.start_rows) == given
    for offset, rows in enumerate(following):
        counts = Counter(s for s, _ in rows)
        assert (counts[0], counts[1]) == plan.rows_of_step(saved_at + offset)
    # Each source's rows, stream by stream, are exactly the next ones of that source's sequence: none skipped,
    # none repeated (the reference: a long run under any shares, since a source's rows never depend on them).
    equal = {"a": 1, "b": 1}
    reference = per_stream_sequences(run_steps(datamodule(corpus, weights=equal), 20), plan_of(equal))
    got = per_stream_sequences(before, plan_of(first))
    for key, rows in per_stream_sequences(following, plan, saved_at).items():
        got[key] = got.get(key, []) + rows
    for key, rows in got.items():
        assert len(reference[key]) >= len(rows) and rows == reference[key][: len(rows)], key


def plan_of(weights) -> MixturePlan:
    return MixturePlan(MixtureSchedule(list(weights if isinstance(weights, dict) else "ab"), weights), G)


def test_a_source_added_on_resume_starts_fresh(corpus: dict) -> None:
    state, _ = state_after(datamodule(corpus, weights={"a": 1, "b": 1}), 4)
    grown = datamodule(corpus, names="abc", weights={"a": 1, "b": 1, "c": 2})
    with pytest.raises(ValueError, match=r"now \{a 25%, b 25%, c 50%\}"):
        grown.load_state_dict(state)
    grown = datamodule(corpus, names="abc", weights={"a": 1, "b": 1, "c": 2}, on_mixture_change="continue")
    grown.load_state_dict(state)
    following = run_steps(grown, 6)
    c_rows = per_stream_sequences(following, grown.train_spec.plan, 4)
    fresh = datamodule(corpus, names="c", weights={"c": 1})
    reference = per_stream_sequences(run_steps(fresh, 6), plan_of({"c": 1}))
    for stream in range(K):
        rows = c_rows.get((2, stream), [])
        assert rows and rows == reference[(0, stream)][: len(rows)]
    assert grown.source_stats()["c"]["rows"] == sum(1 for rows in following for s, _ in rows if s == 2)


def test_a_renamed_source_is_refused_naming_both_names_and_the_way_that_works(corpus: dict) -> None:
    root = corpus["root"]
    weights = {"a": 1, "b": 1}
    state, before = state_after(datamodule(corpus, weights=weights), 3)
    renamed = datamodule(corpus, train_files={"a": str(root / "a"), "bb": sources(corpus)["b"]})
    with pytest.raises(ValueError) as refused:
        renamed.load_state_dict(state)
    message = str(refused.value)
    assert "'b' is in the checkpoint but not in this run, and 'bb' is in this run but not in the checkpoint" in message
    assert "use the checkpoint's name 'b' again" in message and "on_mixture_change='continue'" in message
    assert "weights=[[0, <the checkpoint's weights>], [S, {..., 'b': 0, 'bb': <weight>}]]" in message
    assert "on_order_mismatch" not in message
    # The ways it names work: the old name continues exactly; or 'b' kept at weight 0 from the resume step on,
    # beside a new source (here other files) that starts fresh, under on_mixture_change="continue".
    uninterrupted = run_steps(datamodule(corpus, weights=weights), 6)
    same_name = datamodule(corpus, weights=weights)
    same_name.load_state_dict(state)
    assert before + run_steps(same_name, 3) == uninterrupted
    replaced = {"a": str(root / "a"), "b": sources(corpus)["b"], "bb": str(root / "c")}
    phases = [[0, weights], [3, {"a": 1, "bb": 1}]]
    replacing = datamodule(corpus, train_files=replaced, weights=phases, on_mixture_change="continue")
    replacing.load_state_dict(state)
    after = run_steps(replacing, 3)
    assert {source for rows in after for source, _ in rows} == {0, 2}  # a and bb, no row of b
    # A source removed without a new one: the same advice, without the renaming part.
    shrunk = datamodule(corpus, names="a")
    with pytest.raises(ValueError, match=r"'b' is in the checkpoint but not in this run: a source cannot be removed on "
                       r"resume\)\. To stop reading 'b', keep 'b' in train_files, give it weight 0"):  # fmt: skip
        shrunk.load_state_dict(state)


def test_a_removed_source_or_changed_files_are_refused(corpus: dict) -> None:
    state, _ = state_after(datamodule(corpus, names="abc", weights={"a": 1, "b": 1, "c": 1}), 2)
    shrunk = datamodule(corpus, names="ab", on_mixture_change="continue")
    with pytest.raises(ValueError, match=r"'c' is in the checkpoint but not in this run"):
        shrunk.load_state_dict(state)
    swapped = datamodule(corpus, names="abc", on_mixture_change="continue", allow_shared_files=True)
    swapped.train_files = {**swapped.train_files, "c": str(corpus["root"] / "a")}  # a's files, shared on purpose
    swapped.train_spec = None
    swapped.setup("fit")
    with pytest.raises(ValueError, match=r"sources\['c'\]: checkpoint"):
        swapped.load_state_dict(state)
    other_k = datamodule(corpus, names="abc", num_streams=2)
    with pytest.raises(ValueError, match="num_streams: checkpoint 4, this run 2"):
        other_k.load_state_dict(state)


# ---------------------------------------------------------------------------------------------- counters, validation
def test_source_stats_count_each_sources_rows_and_passes(corpus: dict) -> None:
    dm = datamodule(corpus, weights={"a": 1, "b": 3}, packing="concat")
    steps = run_steps(dm, 10)
    stats = dm.source_stats()
    for i, name in enumerate("ab"):
        rows = sum(1 for step in steps for s, _ in step if s == i)
        assert stats[name]["rows"] == rows and stats[name]["tokens"] == rows * 17  # concat: every token a document's
        assert stats[name]["documents"] > 0 and stats[name]["padding"] == 0
    assert stats["b"]["passes"] > 1 > stats["a"]["passes"] > 0


def test_validation_per_source_gives_one_loader_each_in_order(corpus: dict) -> None:
    root = corpus["root"]
    dm = datamodule(corpus, val_files={"b": {"files": str(root / "b"), "text_column": "body"}, "a": str(root / "a")},
                    val_steps=3)  # fmt: skip
    assert dm.val_source_names == ["b", "a"]
    loaders = dm.val_dataloader()
    assert len(loaders) == 2
    vocab, specials = corpus["vocab"], {corpus["tok"].token_to_id("<|bos|>"), corpus["tok"].token_to_id("<unk>")}
    for index, (name, loader) in enumerate(zip("ba", loaders)):
        batches = list(loader)
        assert len(batches) == 3
        for batch in batches:
            assert torch.equal(batch.sources, torch.full((len(batch),), index))
            assert set(batch.input_ids.flatten().tolist()) - specials <= vocab[name]


def test_validation_sources_are_training_sources_and_the_ones_without_are_said_once(corpus: dict, caplog) -> None:
    root = corpus["root"]
    with pytest.raises(ValueError, match=r"val_files names \['zz'\], which is not a training source: a validation "
                       r"source is named after the training source it measures, one of \['a', 'b'\]"):  # fmt: skip
        datamodule(corpus, val_files={"a": str(root / "a"), "zz": str(root / "c")})
    # Lightning's logger stops propagating (so misses caplog's root handler) when it was imported before any root
    # handler existed: then caplog's handler is attached to it directly.
    logger = logging.getLogger("lightning.pytorch")
    attached = not logger.propagate
    if attached:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            dm = datamodule(corpus, names="abc", val_files={"b": sources(corpus)["b"]}, val_steps=1)
            partly = [record.getMessage() for record in caplog.records if "no validation data" in record.getMessage()]
            caplog.clear()
            datamodule(corpus, names="ab", val_files={"b": sources(corpus)["b"], "a": str(root / "a")}, val_steps=1)
            every = [record.getMessage() for record in caplog.records if "no validation data" in record.getMessage()]
    finally:
        if attached:
            logger.removeHandler(caplog.handler)
    assert partly == [
        "val_files validates ['b'] only: training sources ['a', 'c'] have no validation data (no validation loss is "
        "measured for them)"
    ]  # once, though setup parses the sources again
    assert every == [] and dm.val_source_names == ["b"] and len(dm.val_dataloader()) == 1


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weights": {"a": 1, "z": 1}}, r"unknown sources \['z'\].*the sources are \['a', 'b'\]"),
        ({"weights": {"a": -1, "b": 1}}, r"weights\['a'\].* = -1 is negative"),
        ({"weights": {"a": 0, "b": 0}}, r"all 0.*needs a weight > 0"),
        ({"weights": [[0, {"a": 1}], [0, {"b": 1}]]}, r"strictly increasing steps: from_step=0 follows from_step=0"),
        ({"weights": [[3, {"a": 1, "b": 1}]]}, r"first phase must start at step 0, got from_step=3"),
        ({"on_mixture_change": "ignore"}, r"on_mixture_change must be one of \['raise', 'continue'\], got 'ignore'"),
        ({"train_files": {}}, r"train_files=\{\} names no source"),
        ({"train_files": {"a": {"path": "x"}}}, r"train_files\['a'\] = \{'path': 'x'\} is not valid"),
    ],
)
def test_bad_mixture_input_names_the_value(corpus: dict, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        datamodule(corpus, **change)


def test_weights_without_sources_and_a_source_without_text_are_errors(corpus: dict) -> None:
    root = corpus["root"]
    with pytest.raises(ValueError, match=r"weights=\{'a': 1\} needs a mixture"):
        datamodule(corpus, train_files=str(root / "a"), weights={"a": 1})
    with pytest.raises(ValueError, match=r"train_files\['e'\] hold no text"):
        datamodule(corpus, train_files={"a": str(root / "a"), "e": str(root / "empty")})
    write_parquet(root / "tiny", ["one document", "two"], files=1, row_group_size=2)
    with pytest.raises(ValueError, match=r"train_files\['t'\]: the files hold 2 rows, fewer than num_streams=4"):
        datamodule(corpus, train_files={"a": str(root / "a"), "t": str(root / "tiny")})
    with pytest.raises(ValueError, match=r"train_files\['b'\]=.*matches no file"):
        datamodule(corpus, train_files={"a": str(root / "a"), "b": str(Path(root) / "nothing" / "*.parquet")})


def test_a_file_two_sources_hold_is_refused_naming_both_before_any_file_is_read(corpus: dict) -> None:
    root = corpus["root"]
    junk = root / "junk"
    junk.mkdir(exist_ok=True)
    (junk / "x.parquet").write_text("not parquet")  # read first, it would fail: the check comes before any read
    same = {"a": str(root / "a"), "b": str(root / "a"), "j": str(junk)}
    with pytest.raises(ValueError, match=r"train_files\['a'\] and train_files\['b'\] both hold '.*a/part-000\.parquet' "
                       r"and 2 more files: .*allow_shared_files=True"):  # fmt: skip
        datamodule(corpus, train_files=same)
    # An overlapping glob, a file reached through a symlinked folder: the same file, named as the first source has it.
    (root / "a_link").symlink_to(root / "a", target_is_directory=True)
    claimed_twice = r"train_files\['a'\] and train_files\['c'\] both hold '.*/a/part-001\.parquet':"
    for other in (str(root / "a" / "part-*1.parquet"), str(root / "a_link" / "part-001.parquet")):
        with pytest.raises(ValueError, match=claimed_twice):
            datamodule(corpus, train_files={"a": str(root / "a"), "b": sources(corpus)["b"], "c": other})
    with pytest.raises(ValueError, match=r"val_files\['a'\] and val_files\['c'\] both hold '.*c/part-000\.parquet'"):
        datamodule(corpus, names="abc", val_files={"a": str(root / "c"), "c": [str(root / "c" / "part-000.parquet")]})
    # Meant duplicates: accepted when asked for; a training file may also be a validation file.
    shared = datamodule(corpus, train_files={"a": str(root / "a"), "b": str(root / "a")}, allow_shared_files=True)
    assert shared.source_names == ["a", "b"]
    assert datamodule(corpus, val_files={"a": str(root / "a")}).val_source_names == ["a"]
    with pytest.raises(ValueError, match=r"allow_shared_files must be True or False, got 'yes'"):
        datamodule(corpus, allow_shared_files="yes")


def test_inspect_prints_the_phases_expected_passes_and_realised_shares(corpus: dict) -> None:
    from lightning_d9d.cli import inspect

    weights = [[0, {"a": 0.7, "b": 0.3}], [3, {"a": 1}]]
    report = inspect(datamodule(corpus, weights=weights), None, 6)
    assert "phase steps 0-2: a 70%, b 30%" in report and "phase steps 3-: a 100%, b 0%" in report
    assert "expected passes over 1000 steps: a " in report
    assert "realised shares of the first 6 steps: a 85.4% (target 85.0%), b 14.6% (target 15.0%)" in report


@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_a_stream_gives_the_same_rows_however_they_are_grouped_into_blocks(corpus: dict, packing: str) -> None:
    """``TokenStream.blocks(sizes)``: blocks of any size, 0 included; an empty block leaves the position as it was."""
    from lightning_d9d.streaming.streams.stream import TokenStream

    spec = datamodule(corpus, packing=packing).train_spec.sources[0]
    fixed = TokenStream(spec, 1).blocks(itertools.repeat(2))
    want = [next(fixed)[0] for _ in range(4)]  # 4 blocks of G / K = 2 rows
    fixed.close()
    sizes = [0, 3, 0, 0, 1, 2, 0, 2]
    stream = TokenStream(spec, 1)
    blocks = stream.blocks(iter(sizes))
    got, states = [], []
    for _ in sizes:
        block, state = next(blocks)
        got.append(block)
        states.append(state)
    blocks.close()
    assert [len(block) for block in got] == sizes
    assert np.array_equal(np.concatenate([b.tokens for b in got]), np.concatenate([b.tokens for b in want]))
    if packing == "bestfit_split":
        assert np.array_equal(np.concatenate([b.flags for b in got]), np.concatenate([b.flags for b in want]))
    for before, after, size in zip(states, states[1:], sizes[1:]):
        assert after.blocks == before.blocks + 1
        if size == 0:
            assert after.packing.to_dict().keys() == before.packing.to_dict().keys()
            assert str(after.packing.to_dict()) == str(before.packing.to_dict()) and after.counters == before.counters
    # A stream reset from the state after an empty block continues exactly.
    resumed = TokenStream(spec, 1, states[3]).blocks(iter(sizes[4:]))
    rest = [next(resumed)[0] for _ in sizes[4:]]
    resumed.close()
    assert np.array_equal(np.concatenate([b.tokens for b in rest]), np.concatenate([b.tokens for b in got[4:]]))


def test_per_source_validation_works_beside_a_single_training_corpus(corpus: dict) -> None:
    root = corpus["root"]
    dm = datamodule(corpus, train_files=str(root / "a"), val_files={"c": str(root / "c"), "a": str(root / "a")},
                    val_steps=1)  # fmt: skip
    assert dm.source_names == ["train"] and dm.val_source_names == ["c", "a"]
    for index, loader in enumerate(dm.val_dataloader()):
        (batch,) = list(loader)
        assert batch.sources.tolist() == [index] * len(batch)
    with pytest.raises(ValueError, match=r"val_files\['c'\] text_column must be a non-empty column name, got ''"):
        datamodule(corpus, val_files={"c": {"files": str(root / "c"), "text_column": ""}})


def test_a_corrupted_mixture_state_is_one_error_naming_the_field(corpus: dict) -> None:
    from lightning_d9d.core.resume import InvalidDataState

    state, _ = state_after(datamodule(corpus), 3)
    bad = {**state, "streams": {**state["streams"]}}
    stream = bad["streams"][0]
    reader = stream["sources"]["b"]["packing"]["reader"]
    bad["streams"][0] = {**stream, "sources": {**stream["sources"], "b": {**stream["sources"]["b"], "packing": {
        **stream["sources"]["b"]["packing"], "reader": {**reader, "slot": 999}}}}}  # fmt: skip
    with pytest.raises(InvalidDataState, match=r"streams\.0\.sources\.b\.packing\.reader\.slot = 999"):
        datamodule(corpus).load_state_dict(bad)
    with pytest.raises(InvalidDataState, match=r"mixture = .*expected the mixture plan"):
        datamodule(corpus).load_state_dict({**state, "plan": {**state["plan"], "mixture": {"schedule": 1}}})
    with pytest.raises(InvalidDataState, match=r"streams\.1\.sources = <missing>: the state must hold 'sources'"):
        datamodule(corpus).load_state_dict({**state, "streams": {**state["streams"], 1: {"kind": "concat"}}})


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 0.6, "b": 0.2, "c": 0.1, "d": 0.1},
        [
            [0, {"a": 0.3, "b": 0.01, "c": 0.3, "d": 0.001}],
            [3, {"a": 1}],
            [7, {"b": 0.5, "c": 0.5}],
            [12, {"a": 1, "c": 3}],
        ],
        [[0, {"a": 1, "b": 1, "c": 1, "d": 1}], [2, {"c": 1}], [5, {"a": 0.001, "b": 0.999}], [9, {"a": 1, "b": 1}]],
        # After its pauses, earliest-deadline alone would leave a source a row off at step 13: the plan's
        # whole-row correction applies, and the streams must follow it too.
        [[0, {"a": 1, "b": 0.5, "c": 1, "d": 0.5}], [5, {"a": 0.5, "b": 2, "c": 1}], [10, {"a": 0.01, "d": 0.5}]],
    ],
)
def test_a_streams_step_by_step_quotas_are_the_plans(weights) -> None:
    """What the streams follow (``quotas_from``, one step after another) is ``rows_of_step`` of every step."""
    import itertools

    plan = MixturePlan(MixtureSchedule(["a", "b", "c", "d"], weights), 4)
    for start in (0, 4, 11):
        got = list(itertools.islice(plan.quotas_from(start), 20))
        assert got == [plan.rows_of_step(step) for step in range(start, start + 20)]


@pytest.mark.slow
def test_growing_buffers_give_the_same_rows_on_any_layout_and_resume_exactly_mid_growth(corpus: dict) -> None:
    """Buffers of 40 pieces grow from 16 by 4 per row: every source's buffer grows through the first steps."""
    weights, grows = {"a": 0.5, "b": 0.5}, dict(bestfit_buffer_size=40)
    alone = global_steps(corpus, 1, 0, 8, weights=weights, **grows)
    assert global_steps(corpus, 2, 0, 8, weights=weights, microbatch_size=1, **grows) == alone
    assert global_steps(corpus, 2, 2, 8, weights=weights, **grows) == alone
    dm = datamodule(corpus, weights=weights, **grows)
    state, _ = state_after(dm, 3)
    sizes = [len(s.packing.buffer) for k in dm.position.states.values() for s in k.sources.values()]
    assert max(sizes) < 40, sizes  # still growing at the checkpoint
    for world, workers in ((1, 0), (2, 2)):
        assert global_steps(corpus, world, workers, 5, state=state, weights=weights, **grows) == alone[3:]
