"""The vectorised step tensors against a straightforward per-token walk over the rows: inputs, targets, positions,
``cu_seqlens`` (with and without CP padding) and ``max_seqlen`` of every microbatch cut out of a step, on random
rows and flags and on the rows every packer makes, in every token dtype the loader hands over."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_d9d.core.tokens import IGNORE_INDEX
from lightning_d9d.streaming.loading.step_tensors import StepBlock, StepTensors, microbatch_tensors
from lightning_d9d.streaming.packing.bestfit import BestFitPacker, BestFitSplitPacker
from lightning_d9d.streaming.packing.concat import ConcatPacker
from lightning_d9d.streaming.packing.rows import (
    CP_PAD,
    NO_TARGET,
    START,
    RowBlock,
    bos_tensors,
    flagged_tensors,
    sequence_bounds,
)

BOS, PAD = 1, 0


@dataclass
class Expected:
    inputs: list
    targets: list
    positions: list
    cu_seqlens: list
    cu_seqlens_padded: list
    max_seqlen: int


def reference(tokens: np.ndarray, flags: np.ndarray | None, bos_id: int, cp: int) -> Expected:
    """One token at a time, as the conventions read: a sequence starts at a row start and at BOS (no flags) or a
    ``START`` flag; a ``NO_TARGET`` next token is no target; under CP, unflagged rows are one sequence each and
    ``cu_seqlens`` counts no ``CP_PAD`` position."""
    inputs, targets, positions, starts, pads_before, pads = [], [], [], [], [], 0
    for r, row in enumerate(tokens.tolist()):
        width = len(row) - 1
        for c in range(width):
            flat = r * width + c
            start = c == 0 or (row[c] == bos_id if flags is None else bool(flags[r, c] & START))
            if start:
                starts.append(flat)
                pads_before.append(pads)
            positions.append(0 if start else positions[-1] + 1)
            inputs.append(row[c])
            no_target = flags is not None and bool(flags[r, c + 1] & NO_TARGET)
            targets.append(IGNORE_INDEX if no_target else row[c + 1])
            if flags is not None and flags[r, c] & CP_PAD:
                pads += 1
    size = len(inputs)
    shape = tokens.shape[0], tokens.shape[1] - 1
    if cp > 1 and flags is None:
        padded = list(range(0, size + 1, shape[1]))
        real = padded
    else:
        padded = [*starts, size]
        real = [offset - before for offset, before in zip(padded, [*pads_before, pads])] if cp > 1 else padded
    lengths = [b - a for a, b in itertools.pairwise(padded)]
    return Expected(
        np.array(inputs).reshape(shape).tolist(), np.array(targets).reshape(shape).tolist(),
        np.array(positions).reshape(shape).tolist(), real, padded, max(lengths, default=0),
    )  # fmt: skip


def assert_matches(got, expected: Expected) -> None:
    for name in ("input_ids", "targets", "position_ids"):
        tensor = getattr(got, name)
        assert tensor.dtype == torch.int64 and tensor.is_contiguous(), name
    for name in ("cu_seqlens", "cu_seqlens_padded"):
        assert getattr(got, name).dtype == torch.int32, name
    assert got.input_ids.tolist() == expected.inputs
    assert got.targets.tolist() == expected.targets
    assert got.position_ids.tolist() == expected.positions
    assert got.cu_seqlens.tolist() == expected.cu_seqlens
    assert got.cu_seqlens_padded.tolist() == expected.cu_seqlens_padded
    assert got.max_seqlen == expected.max_seqlen


def check_every_microbatch(block: RowBlock, microbatch: int, cp: int, cuts: list[int] | None = None) -> None:
    """Each microbatch of the step (and a run of rows across microbatches), cut from the step's tensors, equals the
    walk over its own rows; so do the rows built on their own, the per-microbatch functions, and the step kept as
    the blocks it arrived in (``block`` cut at ``cuts``, empty blocks included), whose rows read as the joined ones."""
    step = StepBlock(block)
    bounds = [0, *sorted(min(cut, len(block)) for cut in cuts or [len(block) // 2]), len(block)]
    arrived = StepBlock(*[block.rows(start, stop) for start, stop in itertools.pairwise(bounds)])
    assert len(arrived) == len(block) and arrived.target_count() == block.target_count()
    assert np.array_equal(arrived.tokens, block.tokens)
    for name in ("flags", "sources"):
        assert (getattr(arrived, name) is None) == (getattr(block, name) is None), name
        assert getattr(block, name) is None or np.array_equal(getattr(arrived, name), getattr(block, name)), name
    aligned = [(start, min(start + microbatch, len(block))) for start in range(0, len(block), microbatch)]
    unaligned = [(start + 1, stop) for start, stop in aligned if stop - start > 2]  # cut apart, not split off
    for start, stop in aligned + unaligned:
        part = step.rows(start, stop)
        expected = reference(block.tokens[start:stop], None if block.flags is None else block.flags[start:stop],
                             BOS, cp)  # fmt: skip
        alone = RowBlock(part.tokens.copy(), None if part.flags is None else part.flags.copy(), part.sources)
        arrived_part = arrived.rows(start, stop)
        assert len(part) == len(arrived_part) == stop - start
        assert arrived_part.capacity == part.capacity == block.tokens.shape[1]
        for got in (microbatch_tensors(part, BOS, cp), microbatch_tensors(alone, BOS, cp),
                    microbatch_tensors(arrived_part, BOS, cp)):  # fmt: skip
            assert_matches(got, expected)
            if block.sources is None:
                assert got.sources is None
            else:
                assert got.sources.dtype == torch.int64 and got.sources.tolist() == block.sources[start:stop].tolist()
        if block.flags is None:
            inputs, targets, positions = bos_tensors(part.tokens, BOS)
        else:
            inputs, targets, positions = flagged_tensors(part.tokens, part.flags)
        assert inputs.tolist() == expected.inputs and targets.tolist() == expected.targets
        assert positions.tolist() == expected.positions
        cu, cu_padded, longest = sequence_bounds(part, positions, cp)
        assert (cu.tolist(), cu_padded.tolist(), longest) == (
            expected.cu_seqlens, expected.cu_seqlens_padded, expected.max_seqlen,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------ random rows
@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(0, 12),
    width=st.integers(1, 40),
    microbatch=st.integers(1, 5),
    flagged=st.booleans(),
    cp=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([np.uint16, np.int32]),
    seed=st.integers(0, 2**32 - 1),
    cuts=st.lists(st.integers(0, 12), max_size=4),
)
def test_random_rows_and_flags_match_the_walk(rows, width, microbatch, flagged, cp, dtype, seed, cuts) -> None:
    """Any flag bits anywhere (not only what a packer writes), BOS at random places, empty steps included, the step
    arriving in any number of blocks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, (rows, width + 1)).astype(dtype)  # small ids: BOS (1) comes often
    flags = rng.integers(0, 8, (rows, width + 1)).astype(np.uint8) if flagged else None
    sources = rng.integers(0, 3, rows).astype(np.int64)
    check_every_microbatch(RowBlock(tokens, flags, sources), microbatch, cp, cuts)


def test_bos_ids_beyond_the_token_dtype_and_one_token_rows() -> None:
    tokens = np.array([[5, 1, 7], [1, 1, 2]], np.uint16)
    got = StepTensors(RowBlock(tokens), 70_000).microbatch(0, 2)  # no token can be BOS: one sequence per row
    assert got.position_ids.tolist() == [[0, 1], [0, 1]] and got.cu_seqlens.tolist() == [0, 2, 4]
    single = np.array([[1, 4], [4, 1], [1, 1]], np.int32)
    check_every_microbatch(RowBlock(single), 2, 1)


# ------------------------------------------------------------------------------------------------ packers' rows
def documents(rng: np.random.Generator, count: int, longest: int) -> list[np.ndarray]:
    lengths = rng.integers(1, longest, count)
    return [np.concatenate([[BOS], rng.integers(2, 9000, n - 1)]).astype(np.int32) for n in lengths]


def packed(packing: str, cp: int, seed: int) -> RowBlock:
    """Rows the packer makes of random documents (as the loader hands them over: uint16 ids)."""
    rng = np.random.default_rng(seed)
    capacity, rows = 65, 24
    docs = iter(documents(rng, 4000, 3 * capacity // 2))  # a third of them longer than a row
    if packing == "concat":
        packer = ConcatPacker(capacity)
        while packer.available < rows * capacity:
            doc = next(docs)
            packer.add(doc, np.zeros(1, np.int64), None)
        return RowBlock(packer.take(rows).astype(np.uint16))
    if packing == "bestfit":
        crop = BestFitPacker(capacity, 40, cp_multiple=2 * cp, pad_id=PAD)

        def refill() -> None:
            doc = next(docs)
            crop.add(doc[:capacity], len(doc), (0, 0))

        tokens, flags = crop.take(rows, refill)
    else:
        split = BestFitSplitPacker(capacity, PAD, 40, cp_multiple=2 * cp)
        tokens, flags = split.take(rows, lambda: split.add(next(docs), (0, 0)))
    return RowBlock(tokens.astype(np.uint16), flags, rng.integers(0, 2, rows).astype(np.int64))


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("packing", ["concat", "bestfit", "bestfit_split"])
def test_every_packings_rows_match_the_walk(packing: str, cp: int) -> None:
    for seed in range(3):
        block = packed(packing, cp, seed)
        if packing != "concat" and cp > 1:
            assert (block.flags & CP_PAD).any()  # the CP path is exercised
        for microbatch in (1, 5, 8, 24):
            check_every_microbatch(block, microbatch, cp)


def test_a_steps_tensors_are_built_once_and_its_microbatches_share_no_rows() -> None:
    step = StepBlock(packed("bestfit_split", 1, 0))
    first, second = microbatch_tensors(step.rows(0, 8), BOS, 1), microbatch_tensors(step.rows(8, 16), BOS, 1)
    assert step.tensors(BOS, 1) is step.tensors(BOS, 1)
    first.input_ids.fill_(-1)  # a microbatch's tensors are its own rows only
    assert (second.input_ids != -1).all()


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("packing", ["concat", "bestfit_split"])
def test_runs_built_together_equal_runs_cut_one_at_a_time(packing: str, cp: int) -> None:
    """Runs of every size asked of one step (a size that does not divide the rows included: its last run is
    shorter), built all at once per size, equal the same rows cut on their own; no two fields share memory."""
    block = packed(packing, cp, 3)
    together = StepTensors(block, BOS, cp)
    for size in (7, 8, 3, 24, 5):
        for start in range(0, len(block), size):
            stop = min(start + size, len(block))
            got = together.microbatch(start, stop)
            alone = StepTensors(block.rows(start, stop), BOS, cp).microbatch(0, stop - start)
            assert (got.sources is None) == (alone.sources is None) == (block.sources is None)
            for name in ("input_ids", "targets", "position_ids", "sources", "cu_seqlens", "cu_seqlens_padded"):
                mine, theirs = getattr(got, name), getattr(alone, name)
                if theirs is not None:
                    assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), (size, start, name)
            assert got.max_seqlen == alone.max_seqlen
            assert got.cu_seqlens.data_ptr() != got.cu_seqlens_padded.data_ptr()
            assert got.input_ids.is_contiguous() and got.position_ids.is_contiguous()
    assert together.microbatch(0, 8) is together.microbatch(0, 8)  # built once per size
