"""Run benchmark scripts' smoke modes one after another in this one process; write each one's exit code and output.

Usage: ``python tests/bench_smoke.py OUT.json "script.py --quick" ...``. One interpreter imports torch and Lightning
once for all of them (seconds each on 2 cores), so the smoke test costs the benchmarks' own work. A script that
raises is recorded with its traceback and the next one still runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import shlex
import sys
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(command: str) -> dict[str, object]:
    script, *args = shlex.split(command)
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(BENCHMARKS / script), *args]
    sys.path.insert(0, str(BENCHMARKS))  # as `python benchmarks/x.py` puts the script's folder first
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        code, _ = 1, err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = argv, path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    results = {command: run(command) for command in sys.argv[2:]}
    Path(sys.argv[1]).write_text(json.dumps(results))
