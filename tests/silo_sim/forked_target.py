"""A command for tests/silo_sim/test_launcher.py to run through silo_sim.launcher: it reports, as JSON in the file
named by its first argument, what a forked child finds when its main starts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    out, behaviour = Path(argv[0]), argv[1]
    facts = {"torch_loaded_before_main": "torch" in sys.modules, "cwd": os.getcwd(),
             "marker": os.environ.get("SILOKIT_LAUNCHER_TEST"), "name": Path("/proc/self/comm").read_text().strip(),
             "argv": sys.argv[1:]}
    out.write_text(json.dumps(facts))
    print("to stdout")
    print("to stderr", file=sys.stderr)
    if behaviour == "sleep":
        time.sleep(60)
    if behaviour == "raise":
        raise SystemExit(7)
    return 3
