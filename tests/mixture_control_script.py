"""``python tests/mixture_control_script.py '<json config>'``: ``mixture_control_support.fit_and_save`` as a script, so
Lightning's DDP launcher can re-run it in each rank's process."""

import json
import sys

from mixture_control_support import fit_and_save

if __name__ == "__main__":
    fit_and_save(json.loads(sys.argv[1]))
