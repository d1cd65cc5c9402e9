"""silo-sim's processes forked from a fork server that imported torch and silokit once (silo_sim/launcher.py): a
child runs its command's main as `python -m` would, with the parent's working directory and environment of the
moment, its own output file, name and exit code, and can be stopped."""

from __future__ import annotations

import json
import subprocess

import pytest

from silo_sim.launcher import Launcher


@pytest.fixture(scope="module")
def launcher():
    return Launcher()


def test_a_child_runs_the_command_with_torch_already_imported_and_the_parents_directory_and_environment(
        launcher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # after the fork server started (or not): the child must still see these
    monkeypatch.setenv("SILOKIT_LAUNCHER_TEST", "now")
    facts, log = tmp_path / "facts.json", tmp_path / "child.log"
    child = launcher.start("tests.silo_sim.forked_target", [str(facts), "return"], "silokit-test", log)
    assert child.wait(timeout=60) == 3 and child.returncode == 3 and child.poll() == 3
    seen = json.loads(facts.read_text())
    assert seen == {"torch_loaded_before_main": True, "cwd": str(tmp_path), "marker": "now", "name": "silokit-test",
                    "argv": [str(facts), "return"]}
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]  # both streams, each line as written


def test_sys_exit_sets_the_exit_code_and_piped_output_is_read_line_by_line(launcher, tmp_path):
    child = launcher.start_piped("tests.silo_sim.forked_target", [str(tmp_path / "f.json"), "raise"], "silokit-t2")
    assert list(child.stdout) == ["to stdout\n"] and list(child.stderr) == ["to stderr\n"]
    assert child.wait(timeout=60) == 7


def test_a_running_child_times_out_a_wait_and_stops_on_terminate(launcher, tmp_path):
    facts = tmp_path / "facts.json"
    child = launcher.start("tests.silo_sim.forked_target", [str(facts), "sleep"], "silokit-t3", tmp_path / "log")
    for _ in range(200):
        if facts.exists():
            break
        child.process.join(0.05)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.terminate()
    assert child.wait(timeout=30) == -15  # SIGTERM, as subprocess.Popen reports it
    child.kill()  # already gone: a no-op, as silo-sim's terminate() may call it
