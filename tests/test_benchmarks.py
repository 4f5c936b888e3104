"""Smoke test of the benchmarks: each script's ``--quick`` run exits 0 and prints its table.

Timing and padding targets are not asserted here (they belong to the benchmark output and the README): a
loaded CI machine must not fail the suite on a slow run, and a quick run's figures are meaningless. What this
catches is a benchmark that no longer runs against the current public API, or whose correctness checks (the
verdicts with a ``(target: ...)`` that is not a figure: identical rows, equal ids, a resume that trains the
uninterrupted run's rows) fail. The runs share one fresh interpreter (tests/bench_smoke.py), which imports torch
and Lightning once instead of once per script.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# script -> text that only its table prints (a header cell and a verdict line)
EXPECTED = {
    "mixture.py": ("single corpus", "mixture / single-corpus tokens/s"),
    "mixture_control.py": ("LossProportional", "controller's own work / step time"),
    "padding.py": ("d9d-style", "ours/d9d"),
    "overhead.py": ("ours (sorted)", "median ratio"),
    "order_scale.py": ("torch.randperm", "peak RSS"),
    "resume_cost.py": ("resume @1e7 s", "naive skip"),
    "streaming.py": ("bare vs bare", "own work / tokenizer's"),
    "huge_document.py": ("(peak - before) / document", "whole call / pieces"),
    "token_budget.py": ("budget-free", "padding-free / padded tokens/s"),
    "token_cache.py": ("read() MB/s", "store of 1 M tokens uint32"),
    "cached_pass.py": ("cached / tok", "cached / tokenizing useful tokens/s"),
    "schedule.py": ("scheduled / fixed tok/s", "scheduled / fixed-shape useful tokens/s"),
    "cached_loaders.py": ("memmap copy loop, 1 process", "bestfit_split, 2 workers / concat, 2 workers"),
    "provenance.py": ("provenance s", "MiB per 10^5 steps"),
    "setup_scale.py": ("cache, again", "files holding the same text"),
    "setup_time.py": ("first count", "setup with a filled token cache / without a cache"),
    "tokenizer_backend.py": ("bare fast tokenizer M tok/s", "ceiling: token cache / bare fast tokenizer"),
}
# verdict lines each script's --quick run prints at least (one per target it checks)
MIN_VERDICTS = {
    "mixture.py": 1,
    "mixture_control.py": 4,  # the overhead and shares targets, the resumed rows and journal checks
    "padding.py": 2,
    "overhead.py": 4,
    "order_scale.py": 2,
    "resume_cost.py": 4,
    "streaming.py": 10,
    "huge_document.py": 2,
    "token_budget.py": 8,
    "token_cache.py": 4,
    "cached_pass.py": 3,  # 3 per packing; --quick runs bestfit_split alone (the full run: concat as well, 6)
    "schedule.py": 8,  # 8 per packing; --quick runs bestfit_split alone
    "cached_loaders.py": 5,  # 3 targets and 2 identical-rows checks; litdata adds one where it is installed
    "provenance.py": 2,
    "setup_scale.py": 3,  # one per configuration: no cache, a cache's first setup, its next
    "setup_time.py": 4,  # 2 targets and 2 checks per packing; --quick runs concat alone
    "tokenizer_backend.py": 6,  # concat: identical rows (tokenizers; token cache), pass and bare targets; setup; text
}


FIRST_BATCH = "streaming.py --quick --first-batch --packings bestfit_split --skip-full --grown-steps 2"


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every script's ``--quick`` run (and the first-batch mode), one after another in one fresh interpreter."""
    out = tmp_path_factory.mktemp("bench") / "runs.json"
    commands = [f"{script} --quick" for script in sorted(EXPECTED)] + [FIRST_BATCH]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("bench_smoke.py")), str(out), *commands],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_quick_benchmark_runs(script: str, smoke_runs: dict[str, dict]) -> None:
    done = smoke_runs[f"{script} --quick"]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    stdout = done["stdout"]
    for text in EXPECTED[script]:
        assert text in stdout, stdout
    verdicts = re.findall(r"^(PASS|FAIL): (.+)$", stdout, re.MULTILINE)
    assert len(verdicts) >= MIN_VERDICTS[script], stdout  # every target is judged, met or missed
    assert all("target" in text for _, text in verdicts), verdicts
    assert not [text for passed, text in verdicts if passed == "FAIL" and "(target: " in text], stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_first_batch_mode_of_the_streaming_benchmark_runs(smoke_runs: dict[str, dict]) -> None:
    """``streaming.py --first-batch``: a fresh DataModule per configuration, its first batch timed and judged
    (``--quick``: in the benchmark's own process, not a spawned one per configuration)."""
    done = smoke_runs[FIRST_BATCH]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    verdicts = re.findall(r"^(PASS|FAIL): (.+)$", done["stdout"], re.MULTILINE)
    judged = [text for _, text in verdicts if "first batch of a fresh start" in text and "target <= 5 s" in text]
    assert len(judged) == 2, done["stdout"]  # one corpus, alone and as a mixture of 2
