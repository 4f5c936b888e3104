"""The peer check's digest (stable, sensitive to bytes, shape and dtype), its comparison of gathered digests
(one error naming the step and the processes that differ within a data-parallel replica), the line that says what
passed and the warning of a fit with nothing to compare. The collective itself runs under real processes in
tests/datamodules/test_model_parallel.py."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from support import fit, read_records

from lightning_d9d.parallel.peer_check import (
    PeerMismatchError,
    batch_digest,
    check_peer_digests,
    checked_summary,
    nothing_to_compare,
    steps_checked,
    verify_peer_step,
)
from lightning_d9d.text.collate import FlatteningCollator


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    extra: dict
    count: int = 3


def make_batch(**changes) -> Batch:
    fields = {"tokens": torch.arange(6).reshape(2, 3), "extra": {"mask": np.ones(3, dtype=bool), "names": ["a"]}}
    return Batch(**{**fields, **changes})


def test_equal_batches_give_equal_digests_and_any_difference_changes_it() -> None:
    base = batch_digest(make_batch())
    assert base == batch_digest(make_batch()) and len(base) == 16
    variants = [
        make_batch(tokens=torch.arange(6).reshape(3, 2)),  # shape
        make_batch(tokens=torch.arange(6, dtype=torch.int32).reshape(2, 3)),  # dtype
        make_batch(tokens=torch.tensor([[0, 1, 2], [3, 4, 6]])),  # a value
        make_batch(extra={"mask": np.zeros(3, dtype=bool), "names": ["a"]}),  # numpy
        make_batch(extra={"mask": np.ones(3, dtype=bool), "names": ["b"]}),  # a non-tensor leaf
        make_batch(count=4),
    ]
    assert len({base, *(batch_digest(v) for v in variants)}) == len(variants) + 1
    # Keys are read sorted, so insertion order does not matter; a list is not a tuple.
    assert batch_digest({"a": 1, "b": torch.ones(2)}) == batch_digest({"b": torch.ones(2), "a": 1})
    assert batch_digest([torch.ones(2)]) != batch_digest((torch.ones(2),))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.complex64])
def test_every_dtype_is_hashed_by_its_bytes(dtype: torch.dtype) -> None:
    a = torch.tensor([1, 0, 1, 1]).to(dtype)
    b = torch.tensor([1, 1, 1, 1]).to(dtype)
    assert batch_digest(a) == batch_digest(a.clone()) != batch_digest(b)
    assert batch_digest(a[::2]) == batch_digest(a[::2].contiguous()), "views hash as their values"
    assert batch_digest(torch.empty(0, dtype=dtype)) != batch_digest(torch.empty(0, 1, dtype=dtype))


def test_a_real_flat_batch_digests_stably() -> None:
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    assert batch_digest(FlatteningCollator()(samples)) == batch_digest(FlatteningCollator()(samples))
    assert batch_digest(FlatteningCollator()(samples)) != batch_digest(
        FlatteningCollator(context_parallel_size=2)(samples)
    )


def test_peers_that_agree_pass_and_peers_that_differ_are_named() -> None:
    # 4 processes, 2 replicas of 2 (tensor parallel): processes 0, 1 are dp rank 0; 2, 3 are dp rank 1.
    good = [(0, ["a", "b"]), (0, ["a", "b"]), (1, ["c", "d"]), (1, ["c", "d"])]
    check_peer_digests(7, good)
    bad = [(0, ["a", "b"]), (0, ["a", "x"]), (1, ["c", "d"]), (1, ["c", "d"])]
    with pytest.raises(
        PeerMismatchError, match=r"optimizer step 7: .* \(data-parallel rank 0: processes \[0\] vs \[1\]\)"
    ):
        check_peer_digests(7, bad)
    order = [(0, ["a", "b"]), (0, ["b", "a"])]
    with pytest.raises(PeerMismatchError, match=r"processes \[0\] vs \[1\]"):
        check_peer_digests(0, order)  # the same microbatches in another order differ too
    both = [(0, ["a"]), (0, ["a"]), (0, ["b"]), (1, ["c"]), (1, ["d"]), (1, ["d"])]
    with pytest.raises(PeerMismatchError, match=r"rank 0: processes \[0, 1\] vs \[2\]; data-parallel rank 1: "):
        check_peer_digests(0, both)


def test_replicas_that_all_train_the_same_data_are_warned_about() -> None:
    with pytest.warns(UserWarning, match="all 2 data-parallel replicas trained identical microbatches"):
        check_peer_digests(1, [(0, ["a"]), (1, ["a"])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_peer_digests(1, [(0, ["a"]), (1, ["b"])])


def test_one_process_has_nothing_to_compare() -> None:
    verify_peer_step(0, ["a"], 0)  # torch.distributed is not initialised here


def test_the_line_that_says_what_was_checked_names_steps_processes_and_replicas() -> None:
    assert steps_checked(0, 4) == "optimizer steps 0-4" and steps_checked(3, 3) == "optimizer step 3"
    assert checked_summary("optimizer steps 0-4", 2, 4) == (
        "peer check: optimizer steps 0-4 identical across the 2 processes of each of 2 data-parallel replicas"
    )
    assert checked_summary("optimizer step 0", 1, 8) == (
        "peer check: optimizer step 0 identical across the 8 processes of the one data-parallel replica"
    )
    assert nothing_to_compare(2, 2, 4) is None
    assert "each of the 4 data-parallel replicas has one process" in nothing_to_compare(2, 4, 4)
    assert "verify_peers=3 compares the processes of each data-parallel replica, but a single process: " in (
        nothing_to_compare(3, 1, 1)
    )


def test_a_fit_on_one_process_warns_that_the_check_proves_nothing(tmp_path) -> None:
    """A real Trainer fit with ``verify_peers=2`` on one process: one warning, and no claim of a passed check."""
    config = {"data": "d9d", "options": {"size": 32, "global_batch_size": 8, "microbatch_size": 2, "verify_peers": 2}}
    fit({**config, "record_dir": str(tmp_path), "runs": [{"name": "alone", "max_steps": 3}]})
    assert (tmp_path / "warnings-rank0.txt").read_text() == (
        "alone: NothingToCompareWarning: verify_peers=2 compares the processes of each data-parallel replica, but a "
        "single process: there are no peers to compare, so the check proves nothing\n"
    )
    assert len(read_records(tmp_path)) == 12, "the fit trains on: 3 steps of 4 microbatches"
