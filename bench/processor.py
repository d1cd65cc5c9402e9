"""Where a benchmark ran, one record for every benchmark: its figures depend on the processor (bench/README.md)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The processor's model name, "AMD EPYC" say; platform.processor() is empty on Linux."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine record every benchmark writes beside its figures. The CPU and the vector instructions torch
    picked its kernels for are in it because the same command with the same torch and threads ends a few tenths
    to a point apart on another processor, and torch's thread count because at 1 thread against 2 its sums run in
    another order and the same cell ends up to 0.6 points apart."""
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def processor(info: dict[str, Any]) -> str:
    """"AMD EPYC, AVX2": a machine record's processor and torch's kernels for it."""
    return f"{info['cpu']}, {info['cpu_capability']}"


def cpus(info: dict[str, Any]) -> str:
    """"2 CPUs (AMD EPYC, AVX2)" for a report's machine line; records from before the processor was kept give
    "2 CPUs"."""
    return f"{info.get('cpu_count', '?')} CPUs" + (f" ({processor(info)})" if "cpu" in info else "")
