import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free port for a server a test starts as a process: picked as silo-sim picks the hub's, below the ephemeral
    range, so that no port 0 bind or outgoing connection takes it before the process binds it."""
    from silo_sim.federation import free_port_outside_ephemeral_range

    return free_port_outside_ephemeral_range("127.0.0.1")


class Processes:
    """Starts real processes and guarantees they are gone when the test ends."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.logdir / f"{name}.log", "a")
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        proc.name = name
        self.procs.append(proc)
        return proc

    def start_silo(self, silo, port: int, *extra: str, name: str | None = None,
                   connect_timeout: int = 120) -> subprocess.Popen:
        """A `silo-client` process for a staged silo (silo_sim.stage.SiloSpec) on one thread, dialling the hub on
        127.0.0.1:port over mutual TLS with the silo's own bundle; `extra` adds flags."""
        return self.start(name or silo.name, "-m", "silo_client.cli", "--data", str(silo.data), "--certs",
                          str(silo.certs), "--hub", f"127.0.0.1:{port}", "--state-dir", str(silo.state_dir),
                          "--threads", "1", "--connect-timeout", str(connect_timeout), *extra)

    def log(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def processes(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = Processes(logs)
    yield procs
    procs.stop_all()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pytest_configure(config):
    """Under pytest-xdist the workers share the machine's cores: each worker's in-process torch gets its share, so
    two workers training at once do not oversubscribe the cores (the processes the tests start set their own)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(scope="session", autouse=True)
def sim_data_cache(tmp_path_factory):
    """silo-sim's PNG cache of in-memory datasets (silo_sim/stage.py as_files) for this test session only: shared
    by its tests and the processes they start, never the user's ~/.cache."""
    before = os.environ.get("SILOKIT_CACHE_DIR")
    os.environ["SILOKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("silokit-cache"))
    yield Path(os.environ["SILOKIT_CACHE_DIR"])
    if before is None:
        os.environ.pop("SILOKIT_CACHE_DIR", None)
    else:
        os.environ["SILOKIT_CACHE_DIR"] = before
