"""Data dealt by data-parallel rank under Lightning's ModelParallelStrategy (real processes, CPU/gloo).

One 2-process launch runs every fit in turn (Lightning re-runs the script per rank; its start-up is paid once):
D9DDataModule on 1×2 (data × tensor parallel), 2×1 and plain DDP, resumed across 1×2 → 2×1 and 2×1 → 1×2;
TextDataModule with padding-free token budgets laid out for context parallelism on 1×2 and 2×1, resumed
1×2 → 2×1; PretrainingDataModule (a two-source mixture packed ``bestfit_split``) on 1×2, 2×1 and plain DDP,
resumed 1×2 → 2×1, and laid out for context parallelism (``bestfit``, c = 2) on 1×2 and 2×1; a DataModule that
deals by process under TP (the peer check must stop it at step 0); and a mesh dim that does not exist. A
4-process launch runs D9DDataModule and PretrainingDataModule on 2×2, the latter resumed on 4×1. Every
microbatch of every process is recorded.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import (
    LengthDataset,
    digest,
    fit_in_processes,
    make_docs,
    make_texts,
    pad_collate,
    per_rank_microbatches,
    ranked_rows,
    read_records,
    run_steps,
    snake_dealt,
    train_tokenizer,
    write_parquet,
)

from lightning_d9d import D9DDataModule, PretrainingDataModule, TextDataModule

G, M_SIZE, SIZE, VAL_SIZE = 8, 2, 48, 13  # D9D: 6 steps of 8 samples, microbatches of 2
D9D = {"size": SIZE, "val_size": VAL_SIZE, "global_batch_size": G, "microbatch_size": M_SIZE, "sort_buffer_size": 16}
TEXT_BUDGET = {"global_batch_tokens": 512, "microbatch_tokens": 128}  # P = 4 microbatches a step
LAYOUTS = {
    "d_tp": (1, 2),
    "d_dp": (2, 1),
    "d_ddp": (2, 1),
    "ddp_mesh_remedy": (2, 1),
    "d_tp_to_dp": (2, 1),
    "d_dp_to_tp": (1, 2),
}
LAYOUTS |= {"t_tp": (1, 2), "t_dp": (2, 1), "t_tp_to_dp": (2, 1), "d_2x2": (2, 2)}
LAYOUTS |= {"p_tp": (1, 2), "p_dp": (2, 1), "p_ddp": (2, 1), "p_tp_to_dp": (2, 1)}
LAYOUTS |= {"p_cp_tp": (1, 2), "p_cp_dp": (2, 1), "p_2x2": (2, 2), "p_2x2_to_4x1": (4, 1)}
P_CP = {"context_parallel_size": 2, "packing": "bestfit"}  # rows laid out for 2 CP ranks
P_G, P_M_SIZE, P_STEPS = 8, 2, 4  # pretraining: 4 steps of 8 rows, microbatches of 2, K = 4 streams


@pytest.fixture(scope="module")
def pretraining_options(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A two-source mixture packed bestfit_split (long documents split, short rows padded)."""
    root = tmp_path_factory.mktemp("mp_pretraining")
    web, books = make_docs(80, seed=7, max_words=20, long_every=9, long_words=60), make_docs(30, seed=8)
    write_parquet(root / "web", web, files=2, row_group_size=10)
    write_parquet(root / "books", books, files=1, row_group_size=10)
    write_parquet(root / "val", make_docs(30, seed=9), files=1, row_group_size=10)
    train_tokenizer(web + books, root / "tokenizer.json")
    return {
        "train_files": {"web": str(root / "web"), "books": str(root / "books")},
        "weights": {"web": 3, "books": 1},
        "val_files": str(root / "val"),
        "tokenizer": str(root / "tokenizer.json"),
        "packing": "bestfit_split",
        "seq_len": 16,
        "global_batch_size": P_G,
        "microbatch_size": P_M_SIZE,
        "num_streams": 4,
        "steps_per_epoch": P_STEPS,
        "val_steps": 2,
        "tokenizer_batch_size": 8,
        "bestfit_buffer_size": 8,
        "num_workers": 0,
    }


@pytest.fixture(scope="module")
def text_options(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mp_text")
    texts = make_texts(240, seed=5)
    (root / "data").mkdir()
    pq.write_table(pa.table({"text": texts[:200]}), root / "data" / "train.parquet")
    pq.write_table(pa.table({"text": texts[200:]}), root / "data" / "validation.parquet")
    train_tokenizer(texts, root / "tokenizer.json", kind="bpe")
    return {
        "dataset": str(root / "data"),
        "tokenizer": str(root / "tokenizer.json"),
        "val_split": "validation",
        "max_length": 32,
        "sort_buffer_size": 64,
        "num_workers": 0,
        "cache_dir": str(root / "hf_cache"),
        "padding_free": True,
        "context_parallel_size": 2,
        **TEXT_BUDGET,
    }


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, text_options: dict, pretraining_options: dict) -> dict:
    root = tmp_path_factory.mktemp("mp2")
    ckpt = {name: str(root / f"ckpt_{name}") for name in ("d_tp", "d_dp", "t_tp", "p_tp")}
    text = {"data": "text", "options": text_options}
    pretraining = {"data": "pretraining", "options": pretraining_options}
    runs = [
        {"name": "d_tp", "strategy": [1, 2], "every_n_train_steps": 3, "ckpt_dir": ckpt["d_tp"],
         "options": {"verify_peers": 2}},
        {"name": "d_dp", "strategy": [2, 1], "every_n_train_steps": 3, "ckpt_dir": ckpt["d_dp"]},
        {"name": "d_ddp", "strategy": "ddp", "options": {"verify_peers": 1}},
        {"name": "d_tp_to_dp", "strategy": [2, 1], "ckpt_path": f"{ckpt['d_tp']}/epoch=0-step=3.ckpt"},
        {"name": "d_dp_to_tp", "strategy": [1, 2], "ckpt_path": f"{ckpt['d_dp']}/epoch=0-step=3.ckpt"},
        {"name": "t_tp", "strategy": [1, 2], "every_n_train_steps": 2, "ckpt_dir": ckpt["t_tp"], **text},
        {"name": "t_dp", "strategy": [2, 1], **text},
        {"name": "t_tp_to_dp", "strategy": [2, 1], "ckpt_path": f"{ckpt['t_tp']}/epoch=0-step=2.ckpt", **text},
        {"name": "p_tp", "strategy": [1, 2], "every_n_train_steps": 2, "ckpt_dir": ckpt["p_tp"], **pretraining,
         "options": {**pretraining_options, "verify_peers": 2}},
        {"name": "p_dp", "strategy": [2, 1], **pretraining},
        {"name": "p_ddp", "strategy": "ddp", **pretraining},
        {"name": "p_tp_to_dp", "strategy": [2, 1], "ckpt_path": f"{ckpt['p_tp']}/epoch=0-step=2.ckpt", **pretraining},
        {"name": "p_cp_tp", "strategy": [1, 2], **pretraining, "options": {**pretraining_options, **P_CP}},
        {"name": "p_cp_dp", "strategy": [2, 1], **pretraining, "options": {**pretraining_options, **P_CP}},
        {"name": "broken", "data": "d9d_by_process", "strategy": [1, 2], "options": {**D9D, "verify_peers": 1},
         "expect_error": "optimizer step 0"},
        {"name": "bad_dims", "strategy": [1, 2], "options": {"data_parallel": ["dp_shard"]},
         "expect_error": "the device mesh has no dim 'dp_shard'"},
        {"name": "tp_as_dp", "strategy": [1, 2], "options": {"data_parallel": ["tensor_parallel"]},
         "expect_error": "include the device mesh's dim 'tensor_parallel'"},
        {"name": "ddp_mesh", "data": "d9d_mesh", "strategy": "ddp",
         "options": {**D9D, "mesh": {"shape": [2], "names": ["replica"]}}, "expect_error": "no data-parallel dim"},
        {"name": "ddp_mesh_remedy", "data": "d9d_mesh", "strategy": "ddp",
         "options": {**D9D, "mesh": {"shape": [2], "names": ["replica"], "dims": ["replica"]}}},
    ]  # fmt: skip
    config = {"data": "d9d", "options": D9D, "record_dir": str(root / "records"), "devices": 2}
    result = fit_in_processes({**config, "runs": [{"max_epochs": 1, **run} for run in runs]}, timeout=400)
    return {"root": root, "records": root / "records", "log": result.stdout + result.stderr}


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory: pytest.TempPathFactory, pretraining_options: dict) -> Path:
    root = tmp_path_factory.mktemp("mp4")
    config = {"data": "d9d", "options": {**D9D, "verify_peers": 1}, "record_dir": str(root), "devices": 4}
    # 2×2 saves stream states gathered from 4 processes (each stream from its replica's 2 peers); 4×1 resumes.
    pretraining = {"data": "pretraining", "options": pretraining_options}
    runs = [
        {"name": "d_2x2", "strategy": [2, 2]},
        {"name": "p_2x2", "strategy": [2, 2], "every_n_train_steps": 2, "ckpt_dir": str(root / "ckpt"), **pretraining},
        {"name": "p_2x2_to_4x1", "strategy": [4, 1], "ckpt_path": str(root / "ckpt" / "epoch=0-step=2.ckpt"),
         **pretraining},
    ]  # fmt: skip
    result = fit_in_processes({**config, "runs": [{"max_epochs": 1, **run} for run in runs]}, timeout=500)
    (root / "log.txt").write_text(result.stdout + result.stderr)
    return root


# ------------------------------------------------------------------------------------------------ references
@pytest.fixture(scope="module")
def d9d_steps() -> dict[int, list[int]]:
    """Step -> the sample ids of its global batch in order, from one replica without a Trainer."""
    dm = D9DDataModule(
        LengthDataset(SIZE), pad_collate, global_batch_size=G, microbatch_size=M_SIZE, sort_buffer_size=16
    )
    dm.setup("fit")
    steps: dict[int, list[int]] = defaultdict(list)
    for number, batch in enumerate(dm.train_dataloader_for_rank(0, 1)):
        steps[number // (G // M_SIZE)] += batch["ids"].tolist()
    return dict(steps)


@pytest.fixture(scope="module")
def text_steps(text_options: dict) -> dict[int, list[str]]:
    """Step -> the digests of its microbatches in order, from one replica without a Trainer."""
    dm = TextDataModule(**text_options)
    dm.prepare_data()
    dm.setup("fit")
    steps: dict[int, list[str]] = defaultdict(list)
    per_step = TEXT_BUDGET["global_batch_tokens"] // TEXT_BUDGET["microbatch_tokens"]
    for number, batch in enumerate(dm.train_dataloader_for_rank(0, 1)):
        steps[number // per_step].append(digest(batch))
    return dict(steps)


def one_replica_steps(options: dict) -> dict[int, list[str]]:
    """Step -> the digests of its rows in order, from one replica without a Trainer."""
    dm = PretrainingDataModule(**options)
    dm.setup("fit")
    return {step: [d for _, d in rows] for step, rows in enumerate(run_steps(dm, P_STEPS))}


@pytest.fixture(scope="module")
def pretraining_steps(pretraining_options: dict) -> dict[int, list[str]]:
    return one_replica_steps(pretraining_options)


# ------------------------------------------------------------------------------------------------ helpers
def by_process(records: list[dict]) -> dict[tuple, dict[int, list[tuple]]]:
    """(epoch, step, dp_rank) -> process -> its microbatches (batch_idx, digest) in order."""
    grouped: dict[tuple, dict[int, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(records, key=lambda r: (r["rank"], r["epoch"], r["step"], r["batch_idx"])):
        grouped[(r["epoch"], r["step"], r["dp_rank"])][r["rank"]].append((r["batch_idx"], r["digest"]))
    return grouped


def one_per_replica(records: list[dict]) -> list[dict]:
    """The records of the lowest process of every data-parallel rank (its peers trained the same)."""
    first = {}
    for r in records:
        first[r["dp_rank"]] = min(first.get(r["dp_rank"], r["rank"]), r["rank"])
    return [r for r in records if r["rank"] == first[r["dp_rank"]]]


def global_per_step(records: list[dict], key: str) -> dict[int, list]:
    """Step -> its global batch in order, rebuilt from the replicas' microbatches (one process per replica; ``key``:
    ``ids`` or ``digest`` for map-style steps, dealt in a snake (:func:`support.snake_dealt`), or ``rows``, each
    row's digest cut to ``run_steps``' 16 characters, rank 0's rows then rank 1's (:func:`support.ranked_rows`)).
    Equal across layouts only if every sample or row has the same place and went to the replica that place names."""
    out = {}
    for (_, step), per_rank in per_rank_microbatches(records, key).items():
        if key == "rows":
            out[step] = ranked_rows([[row[:16] for rows in microbatches for row in rows] for microbatches in per_rank])
        elif key == "ids":
            out[step] = [i for microbatch in snake_dealt(per_rank) for i in microbatch]
        else:
            out[step] = snake_dealt(per_rank)
    return out


def assert_layout(records: list[dict], dp: int, tp: int, microbatches: int) -> None:
    """Peers identical in the same order, replicas disjoint, M microbatches per process per step."""
    assert {r["rank"] for r in records} == set(range(dp * tp))
    assert {r["rank"]: r["dp_rank"] for r in records} == {rank: rank // tp for rank in range(dp * tp)}
    for where, processes in by_process(records).items():
        sequences = list(processes.values())
        assert len(processes) == tp and all(s == sequences[0] for s in sequences), f"peers differ at {where}"
        assert len(sequences[0]) == microbatches, f"{len(sequences[0])} microbatches at {where}, not M={microbatches}"
    assert {r["accumulate"] for r in records if r["kind"] == "train"} == {microbatches}
    for step in {r["step"] for r in records}:
        replicas = [[r["digest"] for r in records if r["step"] == step and r["dp_rank"] == d] for d in range(dp)]
        assert all(not set(a) & set(b) for i, a in enumerate(replicas) for b in replicas[i + 1 :]), step


def assert_validation_shared(val: list[dict], dp: int, tp: int) -> None:
    """Validation split among the ``dp`` replicas, the ``tp`` peers of each running the same microbatches."""
    processes_by_place = by_process(val)
    assert {where[2] for where in processes_by_place} == set(range(dp)), "validation split among replicas"
    for where, processes in processes_by_place.items():
        assert len(processes) == tp and len({tuple(s) for s in processes.values()}) == 1, where


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.parametrize("run", ["d_tp", "d_dp", "d_ddp"])
def test_d9d_peers_share_replicas_split_and_every_layout_trains_the_same_global_batches(
    two_processes: dict, d9d_steps: dict, run: str
) -> None:
    dp, tp = LAYOUTS[run]
    records = read_records(two_processes["records"], run=run)
    assert_layout(records, dp, tp, G // (dp * M_SIZE))
    assert global_per_step(records, "ids") == d9d_steps


@pytest.mark.slow
@pytest.mark.parametrize("run", ["d_tp", "d_dp", "d_ddp"])
def test_validation_is_split_among_replicas_and_identical_on_peers(two_processes: dict, run: str) -> None:
    dp, tp = LAYOUTS[run]
    val = read_records(two_processes["records"], "val", run=run)
    assert_validation_shared(val, dp, tp)
    assert sorted(i for r in one_per_replica(val) for i in r["ids"]) == list(range(VAL_SIZE))


@pytest.mark.slow
@pytest.mark.parametrize(("run", "source"), [("d_tp_to_dp", "d_tp"), ("d_dp_to_tp", "d_dp")])
def test_resume_across_a_layout_change_continues_the_same_global_batches(
    two_processes: dict, d9d_steps: dict, run: str, source: str
) -> None:
    before = [r for r in read_records(two_processes["records"], run=source) if r["step"] < 3]
    resumed = read_records(two_processes["records"], run=run)
    assert min(r["step"] for r in resumed) == 3
    dp, tp = LAYOUTS[run]
    assert_layout(resumed, dp, tp, G // (dp * M_SIZE))
    combined = global_per_step(before, "ids") | global_per_step(resumed, "ids")
    assert combined == d9d_steps


@pytest.mark.slow
def test_text_token_budgets_under_tensor_parallelism_resume_on_another_layout(
    two_processes: dict, text_steps: dict
) -> None:
    per_step = TEXT_BUDGET["global_batch_tokens"] // TEXT_BUDGET["microbatch_tokens"]
    for run in ("t_tp", "t_dp"):
        dp, tp = LAYOUTS[run]
        records = read_records(two_processes["records"], run=run)
        assert_layout(records, dp, tp, per_step // dp)
        assert global_per_step(records, "digest") == text_steps
    before = [r for r in read_records(two_processes["records"], run="t_tp") if r["step"] < 2]
    resumed = read_records(two_processes["records"], run="t_tp_to_dp")
    assert_layout(resumed, 2, 1, per_step // 2)
    assert global_per_step(before, "digest") | global_per_step(resumed, "digest") == text_steps
    for run in ("t_tp", "t_dp"):
        assert_validation_shared(read_records(two_processes["records"], "val", run=run), *LAYOUTS[run])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["p_tp", "p_dp", "p_ddp"])
def test_pretraining_streams_are_dealt_by_replica_and_every_layout_trains_the_same_global_batches(
    two_processes: dict, pretraining_steps: dict, run: str
) -> None:
    dp, tp = LAYOUTS[run]
    records = read_records(two_processes["records"], run=run)
    assert_layout(records, dp, tp, P_G // (dp * P_M_SIZE))
    assert global_per_step(records, "rows") == pretraining_steps
    assert_validation_shared(read_records(two_processes["records"], "val", run=run), dp, tp)


@pytest.mark.slow
def test_pretraining_rows_laid_out_for_context_parallelism_are_the_same_on_every_layout(
    two_processes: dict, pretraining_options: dict
) -> None:
    """Peers get the same microbatches (``cu_seqlens_padded`` included: the digest covers every tensor)."""
    reference = one_replica_steps({**pretraining_options, **P_CP})
    for run in ("p_cp_tp", "p_cp_dp"):
        dp, tp = LAYOUTS[run]
        records = read_records(two_processes["records"], run=run)
        assert_layout(records, dp, tp, P_G // (dp * P_M_SIZE))
        assert global_per_step(records, "rows") == reference, run


@pytest.mark.slow
def test_pretraining_resumed_from_tensor_parallel_on_data_parallel_continues_the_same_global_batches(
    two_processes: dict, pretraining_steps: dict
) -> None:
    before = [r for r in read_records(two_processes["records"], run="p_tp") if r["step"] < 2]
    resumed = read_records(two_processes["records"], run="p_tp_to_dp")
    assert min(r["step"] for r in resumed) == 2
    assert_layout(resumed, 2, 1, P_G // (2 * P_M_SIZE))
    assert global_per_step(before, "rows") | global_per_step(resumed, "rows") == pretraining_steps


@pytest.mark.slow
def test_the_peer_check_stops_data_dealt_by_process_under_tensor_parallelism(two_processes: dict) -> None:
    for rank in (0, 1):
        errors = (two_processes["records"] / f"errors-rank{rank}.txt").read_text()
        assert (
            "broken: PeerMismatchError: optimizer step 0: processes of one data-parallel replica trained "
            "different microbatches (data-parallel rank 0: processes [0] vs [1])"
        ) in errors
        assert "bad_dims: ValueError: the device mesh has no dim 'dp_shard'; its dims are ['data_parallel', " in errors
    broken = read_records(two_processes["records"], run="broken")
    assert {r["step"] for r in broken} == {0}, "stopped at the end of the first step"


@pytest.mark.slow
def test_the_peer_check_says_what_it_compared_and_warns_when_there_is_nothing_to_compare(two_processes: dict) -> None:
    """d_tp and p_tp check 2 steps and their validation run on 1 × 2; d_ddp (every process a replica) cannot."""
    lines = two_processes["log"].splitlines()
    said = sorted(line[line.index("peer check:") :] for line in lines if "peer check:" in line)
    one = "identical across the 2 processes of the one data-parallel replica"
    assert said == sorted(
        [f"peer check: optimizer steps 0-1 {one}"] * 2
        + [f"peer check: the validation run at step {step} {one}" for step in (4, SIZE // G)]
    )
    warned = (two_processes["records"] / "warnings-rank0.txt").read_text().splitlines()
    assert warned == [
        "d_ddp: NothingToCompareWarning: verify_peers=1 compares the processes of each data-parallel replica, but "
        "each of the 2 data-parallel replicas has one process (data_parallel counts every process as a replica: "
        "right under DDP or FSDP; under tensor, context or pipeline parallelism it names the wrong dims and peers "
        "train different rows): there are no peers to compare, so the check proves nothing"
    ]


@pytest.mark.slow
def test_model_parallel_dims_named_as_data_parallel_are_refused_before_training(two_processes: dict) -> None:
    """``ModelParallelStrategy``'s own TP dim named as data-parallel: each peer its own replica, refused at setup."""
    for rank in (0, 1):
        errors = (two_processes["records"] / f"errors-rank{rank}.txt").read_text()
        assert (
            "tp_as_dp: ValueError: the data-parallel dims ['tensor_parallel'] include the device mesh's dim "
            "'tensor_parallel', which holds tensor-parallel peers"
        ) in errors
        assert (
            "The data-parallel dims of this mesh ['data_parallel', 'tensor_parallel'] are ['data_parallel']" in errors
        )
    assert read_records(two_processes["records"], run="tp_as_dp") == []


@pytest.mark.slow
def test_under_ddp_a_mesh_without_a_data_parallel_dim_names_a_remedy_that_trains(
    two_processes: dict, d9d_steps: dict
) -> None:
    errors = (two_processes["records"] / "errors-rank0.txt").read_text()
    hint = "name them, data_parallel=DataParallelTopology.from_device_mesh(mesh, ['<dim>', ...])"
    assert "ddp_mesh: ValueError: the device mesh's dims ['replica'] include no data-parallel dim" in errors
    assert hint in errors
    records = read_records(two_processes["records"], run="ddp_mesh_remedy")  # the hint followed
    assert_layout(records, 2, 1, G // (2 * M_SIZE))
    assert global_per_step(records, "ids") == d9d_steps


@pytest.mark.slow
def test_two_by_two_peers_share_and_replicas_split(four_processes: Path, d9d_steps: dict) -> None:
    records = read_records(four_processes, run="d_2x2")
    assert_layout(records, 2, 2, G // (2 * M_SIZE))
    assert global_per_step(records, "ids") == d9d_steps
    val = read_records(four_processes, "val", run="d_2x2")
    assert sorted(i for r in one_per_replica(val) for i in r["ids"]) == list(range(VAL_SIZE))
    for where, processes in by_process(val).items():
        assert len({tuple(s) for s in processes.values()}) == 1, where
    log = (four_processes / "log.txt").read_text()
    each = "identical across the 2 processes of each of 2 data-parallel replicas"
    assert f"peer check: optimizer step 0 {each}" in log
    assert f"peer check: the validation run at step {SIZE // G} {each}" in log


@pytest.mark.slow
def test_pretraining_on_two_by_two_resumes_on_four_replicas_from_states_its_peers_saved(
    four_processes: Path, pretraining_steps: dict
) -> None:
    records = read_records(four_processes, run="p_2x2")
    assert_layout(records, 2, 2, P_G // (2 * P_M_SIZE))
    assert global_per_step(records, "rows") == pretraining_steps
    resumed = read_records(four_processes, run="p_2x2_to_4x1")
    assert min(r["step"] for r in resumed) == 2
    assert_layout(resumed, 4, 1, P_G // (4 * P_M_SIZE))
    before = [r for r in records if r["step"] < 2]
    assert global_per_step(before, "rows") | global_per_step(resumed, "rows") == pretraining_steps
