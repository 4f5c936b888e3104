"""The README's newcomer commands are what CI and users actually run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    demo, tests = readme_commands()[:2]
    assert "lightning-d9d fit --config configs/demo.yaml" in demo
    assert "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_readme_names_no_local_paths() -> None:
    for path in [ROOT / "README.md", *ROOT.glob("lightning_d9d/**/*.py"), *ROOT.glob("configs/*.yaml")]:
        text = path.read_text()
        assert "/work/" not in text and "/root/" not in text and "/tmp/" not in text, path
