"""Starting silo-sim's processes (staging, hub, silo hosts) forked from one process that has already imported what
they need, instead of each importing it again.

Each of them would otherwise spend about a second of CPU importing torch and silokit (1.3 s on this 2-core machine,
three to four of them at once at start-up), and hold its own copy of torch's tables (about 300 MB private each). A
multiprocessing fork server imports them once; every process forked from it starts with them loaded and shares
those pages with its siblings until it writes them. Each child still runs the same `main(argv)` as its command
(`python -m silo_server.cli ...`), with its own stdout file, signal handlers and exit code, so the hub and the hosts
behave as they do when started by hand: every silo keeps its own certificate, files, state and TLS connection.

Nothing is forked after gRPC or OpenMP started threads: the fork server only imports (importing grpc starts no
threads; torch's thread pools start at the first parallel operation)."""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import subprocess
import sys
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

# What the staging process, the hub and a silo host import before their first line of work: torch, the algorithms,
# the data code, the wire. An import that fails here is only skipped (the child would fail on it with its message).
PRELOAD = ["silo_sim.launcher", "torch", "numpy", "PIL.Image", "silo_core.algorithms", "silo_core.data", "silo_client.client",
           "silo_server.app", "silo_server.cli", "silo_sim.prepare", "silo_sim.stage", "silo_sim.worker"]

# A forked child first runs silo-sim's main module again as __mp_main__ (multiprocessing's rule for `python -m`),
# which the fork server imported already; runpy warns about that, and nothing in it runs on import.
warnings.filterwarnings("ignore", message=r"'silo_sim\.cli' found in sys\.modules", category=RuntimeWarning)

_PR_SET_NAME = 15  # prctl: the name ps, top and /proc/PID/comm show (15 bytes)


def set_process_name(name: str) -> None:
    """Name this process for ps and top (its command line stays the fork server's). Best effort: Linux only."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _run(module: str, argv: list[str], name: str, stdout: str | tuple[Connection, Connection] | None,
         cwd: str, environ: dict[str, str]) -> None:
    """In the forked child: take the parent's working directory and environment as they are now (the fork server
    has those of its own start), route stdout and stderr as the command line would (to a log file, or to two pipes
    the parent reads), then run MODULE.main(argv) and exit with its code."""
    set_process_name(name)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    if isinstance(stdout, tuple):
        os.dup2(stdout[0].fileno(), 1)
        os.dup2(stdout[1].fileno(), 2)
    elif stdout is not None:
        fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: each line reaches the file as written
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [module, *argv]
    code = 1
    try:
        code = importlib.import_module(module).main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        import logging

        logging.shutdown()  # a forked child leaves through os._exit: flush what its handlers hold
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Forked:
    """A process started by Launcher, with the part of subprocess.Popen's interface silo-sim uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout: IO[str] | None = None,
                 stderr: IO[str] | None = None):
        self.process, self.stdout, self.stderr = process, stdout, stderr

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout or 0.0)
        return self.process.exitcode

    def terminate(self) -> None:
        if self.process.exitcode is None:
            self.process.terminate()

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()


class Launcher:
    """Forks silo-sim's processes from a fork server that imported PRELOAD once. The server starts at once and
    imports while silo-sim reads its options; the first `start` waits for it."""

    def __init__(self, preload: list[str] | None = None):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD if preload is None else preload)
        from multiprocessing import forkserver

        forkserver.ensure_running()

    def start(self, module: str, argv: list[str], name: str, log: Path | None = None) -> Forked:
        """Run `python -m MODULE ARGV` as a forked child named NAME, its output to LOG (None: silo-sim's own)."""
        process = self.context.Process(target=_run, args=(module, list(argv), name, str(log) if log else None,
                                                          os.getcwd(), dict(os.environ)), name=name, daemon=False)
        process.start()
        return Forked(process)

    def start_piped(self, module: str, argv: list[str], name: str) -> Forked:
        """As start, with the child's stdout and stderr pipes this process reads as `Forked.stdout` and
        `Forked.stderr` (text, line by line)."""
        pipes = [self.context.Pipe(duplex=False) for _ in range(2)]
        process = self.context.Process(target=_run, args=(module, list(argv), name, tuple(w for _, w in pipes),
                                                          os.getcwd(), dict(os.environ)), name=name, daemon=False)
        process.start()
        streams = []
        for reader, writer in pipes:
            writer.close()  # the child holds its copy: EOF here once it exits
            streams.append(open(os.dup(reader.fileno()), buffering=1, encoding="utf-8", errors="replace"))
            reader.close()
        return Forked(process, *streams)
