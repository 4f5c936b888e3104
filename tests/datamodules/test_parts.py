"""The parts a DataModule is composed of, each on its own: a part's state round-trips (``state_dict`` → a fresh
part → ``load_state_dict`` → the same answers), and a part that saves nothing answers the same when built afresh
over the same inputs. The references are written by hand (the data steps of a skip, the microbatches of a phase),
not computed by the part under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import make_docs, small_corpus, small_run

from lightning_d9d.core.resume import InvalidDataState
from lightning_d9d.datamodules.data_parallel import DataParallel
from lightning_d9d.datamodules.observability import DataObservation
from lightning_d9d.datamodules.parts import HandedLoaders
from lightning_d9d.datamodules.pretraining.plan import RunPlan
from lightning_d9d.datamodules.pretraining.provenance import ProvenanceLedger
from lightning_d9d.parallel.topology import DataParallelTopology
from lightning_d9d.streaming.loading.loader import StreamPosition

STEPS = 12
# G 8 then 16 from step 4, m 2: M 4 then 8 on one replica; seq_len 16 then 24 from step 6.
SHAPES = dict(seq_len=[[0, 16], [6, 24]], global_batch_size=[[0, 8], [4, 16]])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus(tmp_path_factory.mktemp("parts"), make_docs(300, seed=3, max_words=30), row_group_size=20)


def test_the_run_plan_round_trips_its_state_into_a_fresh_plan(corpus: Path) -> None:
    trained = small_run(corpus, "concat", STEPS, skip_data=[[2, 4]], **SHAPES)
    state = trained.run_plan.state_dict()
    assert set(state) == {"mixture", "shapes", "edits", "steps_per_epoch"} and state["steps_per_epoch"] == STEPS
    unedited = small_run(corpus, "concat", STEPS, **SHAPES)  # the corpus' spec, before any edit
    fresh = RunPlan(unedited.settings, unedited.microbatch_size)  # no epoch length asked: the saved one is kept
    fresh.spec = unedited.corpus.train.spec
    fresh.load_state_dict(state, global_step=2)
    assert fresh.state_dict() == state
    assert fresh.steps_per_epoch == STEPS and fresh.holds_run
    # Skipping steps 2 and 3: training step s trains data step s + 2 from step 2 on.
    assert [fresh.data_step(s) for s in range(6)] == [0, 1, 4, 5, 6, 7]
    # M follows the data step's G: 8 / (1 · 2) = 4 before data step 4, 16 / 2 = 8 from it.
    assert [fresh.microbatches_at(s, 1) for s in range(4)] == [4, 4, 8, 8]
    assert [fresh.microbatches_at(s, 2) for s in range(4)] == [2, 2, 4, 4]
    assert [fresh.shape_at(s).seq_len for s in range(6)] == [16, 16, 16, 16, 24, 24]
    assert fresh.step_layout(0, 1) == trained.run_plan.step_layout(0, 1)
    assert fresh.spec.plan.to_dict() == trained.train_spec.plan.to_dict()
    asked = RunPlan(unedited.settings, unedited.microbatch_size, steps_per_epoch=5)
    asked.spec, asked.steps_per_epoch = unedited.corpus.train.spec, 5
    asked.load_state_dict(state, global_step=2)
    assert asked.steps_per_epoch == 5, "an epoch length asked wins over the saved one"


def test_a_malformed_plan_state_is_one_error_naming_its_field(corpus: Path) -> None:
    dm = small_run(corpus, "concat", STEPS, **SHAPES)
    state = dm.run_plan.state_dict()
    fresh = RunPlan(dm.settings, dm.microbatch_size)
    fresh.spec = dm.corpus.train.spec
    with pytest.raises(InvalidDataState, match=r"edits = .*the skips and exclusions a state records"):
        fresh.load_state_dict({**state, "edits": {"skips": "x"}}, global_step=0)
    with pytest.raises(InvalidDataState, match=r"steps_per_epoch = 0: a whole number of optimizer steps >= 1"):
        fresh.load_state_dict({**state, "steps_per_epoch": 0}, global_step=0)
    with pytest.raises(InvalidDataState, match=r"shapes = .*the shape schedule a checkpoint saves"):
        fresh.load_state_dict({**state, "shapes": {"seq_len": "x"}}, global_step=0)


def test_the_ledger_saves_nothing_and_a_fresh_one_reads_the_records_the_run_wrote(corpus: Path, tmp_path: Path) -> None:
    options = {"provenance_dir": str(tmp_path / "ledger"), "provenance_every": 3, **SHAPES}
    dm = small_run(corpus, "bestfit", STEPS, **options)
    batches = iter(dm.train_dataloader())
    for _ in range(dm.step_layout(0).before(7)):
        next(batches)
    dm.close_loaders()
    assert sorted(int(path.name) for path in (tmp_path / "ledger").iterdir()) == [3, 6]  # every 3 steps
    other = small_run(corpus, "bestfit", STEPS, **options)  # its own plan, no position: only the records
    fresh = ProvenanceLedger(other.run_plan, other.storage, str(tmp_path / "ledger"), 3)
    assert fresh.trained_until(StreamPosition()) == 6
    starts = fresh.replay_starts(7, other.train_spec, StreamPosition())
    assert {first for first, _ in starts.values()} == {6}
    assert fresh.provenance(range(4, 6), StreamPosition()) == dm.provenance(range(4, 6))


def test_the_streams_and_reports_continue_in_a_fresh_datamodule(corpus: Path) -> None:
    dm = small_run(corpus, "bestfit_split", STEPS, **SHAPES)
    batches = iter(dm.train_dataloader())
    for _ in range(dm.step_layout(0).before(5)):
        next(batches)
    state, stats, sources = dm.state_dict(), dm.stream_stats(), dm.source_stats()
    want = [next(batches) for _ in range(dm.step_layout(0).before(8) - dm.step_layout(0).before(5))]
    dm.close_loaders()
    fresh = small_run(corpus, "bestfit_split", STEPS, **SHAPES)
    fresh.load_state_dict(state)
    assert fresh.stream_stats() == stats and fresh.source_stats() == sources and stats["rows"] > 0
    batches = iter(fresh.train_dataloader())
    got = [next(batches) for _ in range(len(want))]
    fresh.close_loaders()
    assert len(got) == len(want) == 3 * 8  # steps 5-7 at G 16, m 2
    for a, b in zip(got, want):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)


def test_the_data_parallel_part_keeps_its_settings_and_resolves_without_a_trainer() -> None:
    topology = DataParallelTopology(dp_rank=1, dp_size=2, process_rank=1, world_size=2)
    part = DataParallel(topology, verify_peers=3)
    assert part.topology(None) is topology and part.verify_peers == 3
    part.setting = None  # resolved again under the new setting
    assert part.topology(None) == DataParallelTopology()
    with pytest.raises(ValueError, match="verify_peers"):
        DataParallel(verify_peers=-1)


def test_the_observation_part_counts_only_training_batches_while_a_fit_counts(corpus: Path) -> None:
    part = DataObservation(0.5)
    batch = next(iter(small_run(corpus, "concat", STEPS).train_dataloader()))
    part.count(batch, training=True)
    assert part.take() is None, "nothing is counted outside a fit with a logger"
    part.counting = True
    part.count(batch, training=False)
    assert part.take() is None, "validation batches are not counted"
    part.count(batch, training=True)
    counts = part.take()
    assert counts is not None and counts.tokens == int((batch.targets != -100).sum()) and part.take() is None
    assert counts.sources == {0: len(batch)}
    part.stop()
    assert not part.counting and part.data_wait_warning == 0.5
    with pytest.raises(ValueError, match="data_wait_warning must be a fraction"):
        DataObservation(2)


class _Loader:
    def __init__(self, closed: list[str], name: str):
        self.closed, self.name = closed, name

    def close(self) -> None:
        self.closed.append(self.name)


def test_the_handed_loaders_part_closes_a_replaced_loader_and_every_loader_at_the_end() -> None:
    closed: list[str] = []
    handed = HandedLoaders()
    first, validation = _Loader(closed, "train 1"), _Loader(closed, "val")
    assert handed.track(first) is first and handed.track(validation, "val/0") is validation
    second = handed.track(_Loader(closed, "train 2"))
    assert closed == ["train 1"] and handed.get("train") is second and handed.get("val/0") is validation
    handed.close()
    assert sorted(closed) == ["train 1", "train 2", "val"] and handed.get("train") is None
    held = handed.track(_Loader(closed, "dropped"))
    del held  # held weakly: a loader no one else holds is gone, and never closed twice
    assert handed.get("train") is None


def test_a_part_attribute_reads_the_parts_name_and_a_settable_one_writes_it(corpus: Path) -> None:
    dm = small_run(corpus, "concat", STEPS, **SHAPES)
    assert (dm.num_streams, dm.microbatch_size, dm.packing) == (4, 2, "concat")  # small_run's, as given
    assert dm.data_step(5) == 5 and dm.source_names == ["train"] and dm.provenance_every == dm.ledger.every
    dm.provenance_dir = "elsewhere"
    assert dm.ledger.provenance_dir == "elsewhere"
    spy = []
    dm.take_host_counts = lambda: spy.append(1)  # a read-through name may be shadowed, as a method may
    dm.take_host_counts()
    assert spy == [1] and dm.observation.take() is None
