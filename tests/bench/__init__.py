"""Helpers for the benchmark tests: the benchmarks are scripts, not packages, so tests load them by path."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str):
    """Import the script at ROOT/relative as module `name` (registered in sys.modules: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
