"""``python tests/fit_script.py '<json config>'``: run ``support.fit`` as a script (Lightning's DDP launcher
re-runs the main script in each rank's process, so a multi-process fit needs one)."""

import faulthandler
import json
import sys

from support import fit

if __name__ == "__main__":
    faulthandler.enable()  # a crash at exit then shows where it happened
    fit(json.loads(sys.argv[1]))
