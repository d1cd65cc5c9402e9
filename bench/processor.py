"""The processor a benchmark ran on, for every benchmark's machine record: figures depend on it (bench/README.md)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_name() -> str:
    """The processor's model name, "AMD EPYC" say; platform.processor() is empty on Linux."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
