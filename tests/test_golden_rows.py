"""Golden rows: every configuration of ``tests/golden/make_row_digests.py`` yields exactly the committed batches, and
checkpoints written by earlier code (``tests/golden/checkpoints``) resume to exactly the batches that followed them.

The committed digests are the reference: they were made by the code of their commit, not by the code under test.
Beside them, entries that must coincide are compared with each other (a resume continues its uninterrupted run, a
run over a filled token cache repeats the run that filled it), so a golden file regenerated from wrong rows would
still fail here.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

import checkpoint_fixtures as fixtures
import make_row_digests as golden

REGENERATE = (
    "The rows of these configurations changed:\n{lines}\n"
    "A change of rows is a change users see (other batches, other resumes). If it is deliberate, regenerate with "
    "`python tests/golden/make_row_digests.py --write` in a commit whose message says why the rows changed; "
    "never to make this test pass (docs/testing.md)."
)


@pytest.fixture(scope="module")
def computed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return golden.compute(root=tmp_path_factory.mktemp("golden"))


def test_every_configuration_yields_its_golden_rows(computed: dict) -> None:
    want = golden.read_golden()
    missing, added = sorted(set(want) - set(computed)), sorted(set(computed) - set(want))
    assert not missing and not added, f"configurations removed {missing}, added {added}: " + REGENERATE.format(
        lines="(the set of configurations)"
    )
    lines = golden.changed(computed, want)
    assert not lines, REGENERATE.format(lines="\n".join(lines))
    assert len(computed) >= 30


def test_a_changed_row_is_named_with_its_configuration_and_first_batch(computed: dict) -> None:
    altered = copy.deepcopy(computed)
    entry = altered["pretraining/bestfit/resume"]
    entry["per_batch"][5] = "0" * 16
    entry["sha256"] = "0" * 64
    lines = golden.changed(computed, altered)
    assert lines == [f"pretraining/bestfit/resume: 32 batches, golden 32; first at batch 5; shapes {entry['shapes']}"]
    shorter = copy.deepcopy(computed)
    shorter["d9d/padded"] |= {"batches": 119, "per_batch": computed["d9d/padded"]["per_batch"][:-1], "sha256": "x"}
    assert golden.changed(computed, shorter)[0].startswith("d9d/padded: 120 batches, golden 119; same batches as far")


def batches(computed: dict, name: str) -> list[str]:
    return computed[name]["per_batch"]


def test_entries_that_must_coincide_do(computed: dict) -> None:
    m = 4  # microbatches per step: G 8 / microbatch_size 2
    for packing in ("concat", "bestfit"):  # a resume at step 3 continues the uninterrupted run exactly
        assert batches(computed, f"pretraining/{packing}/resume") == batches(computed, f"pretraining/{packing}")
    for name in [n for n in computed if n.endswith("/token_cache")]:  # filled, then read: the same rows
        rows = batches(computed, name)
        assert len(rows) == 24 * m and rows[: 12 * m] == rows[12 * m :], name
    # Workers and in-process give the same rows.
    assert batches(computed, "pretraining/concat/workers2") == batches(computed, "pretraining/concat")
    assert batches(computed, "pretraining/bestfit_split/workers2") == batches(computed, "pretraining/bestfit_split")
    # skip_data [[2, 4]] at a resume at step 2: steps 0, 1 as before, then step 2 trains step 4's rows, and so on.
    skipped, full = batches(computed, "pretraining/bestfit/skip_data"), batches(computed, "pretraining/bestfit")
    assert len(skipped) == 8 * m and skipped[: 2 * m] == full[: 2 * m] and skipped[2 * m : 6 * m] == full[4 * m :]
    # An exclusion at step 3 keeps steps 0..2 and changes a later one.
    excluded, split = (
        batches(computed, "pretraining/bestfit_split/exclude_documents"),
        batches(computed, "pretraining/bestfit_split"),
    )
    assert excluded[: 3 * m] == split[: 3 * m] and excluded != split
    d9d = batches(computed, "d9d/padded")  # 120 samples, 8 per step: 15 steps of 4 microbatches per epoch
    assert len(d9d) == 2 * 60 and batches(computed, "d9d/resume") == d9d[:60]
    # Every entry holds every microbatch it should: 8 steps of 4, unless its configuration says otherwise.
    counts = {"/token_cache": 24 * m, "/validation": 4 * m + 4, "/world2": 2 * 8 * 4}
    for name, entry in computed.items():
        if name.startswith("pretraining/") and "phases" not in name and "g_by" not in name:
            want = next((n for suffix, n in counts.items() if name.endswith(suffix)), 8 * m)
            assert entry["batches"] == want, name


@pytest.mark.parametrize("kind", sorted(fixtures.KINDS))
def test_a_checkpoint_written_by_earlier_code_resumes_exactly(kind: str, tmp_path: Path) -> None:
    want = fixtures.expected(kind)
    got = fixtures.resume(kind, tmp_path)
    assert len(got) == len(want["after"]) == (want["max_steps"] - want["saved_after_step"]) * 4
    first = next((i for i, (a, b) in enumerate(zip(got, want["after"])) if a != b), None)
    assert got == want["after"], f"{kind}: microbatch {first} after the checkpoint differs from the uninterrupted run"


def test_every_state_version_of_one_run_was_saved_before_the_same_batches() -> None:
    # The fixtures of one configuration written by the code of different days (state version 2, then 3, whose plan
    # is nested): the uninterrupted runs they were saved from trained the same microbatches after the save.
    v2, v3 = fixtures.expected("pretraining"), fixtures.expected("pretraining_v3")
    assert (v2["state_version"], v3["state_version"]) == (2, 3)
    assert len(v3["after"]) == 20 and v3["after"] == v2["after"] and v3["before"] == v2["before"]
