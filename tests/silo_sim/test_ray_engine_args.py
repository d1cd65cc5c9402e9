"""The Ray engine's sizing and flag checks (silo_sim/ray_engine.py), without starting Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from security.secagg.params import SecAggParams
from silo_server.rounds.breaker import Quarantine, QuarantineList
from silo_sim.cli import build_parser
from silo_sim.federation import host_threads, hub_waits_for, silos_stopped, stopped_early
from silo_sim.prepare import clear_run_state
from silo_sim.ray_engine import HostedShare, actor_count, check_engine_args, pack_share, unpack_share


def test_actors_fill_the_cluster_at_one_silos_request_capped_at_the_silos():
    assert actor_count({"CPU": 16.0}, silos=100, silo_cpus=1, silo_gpus=0, workers=None) == 16
    assert actor_count({"CPU": 16.0}, silos=100, silo_cpus=2, silo_gpus=0, workers=None) == 8
    assert actor_count({"CPU": 16.0}, silos=6, silo_cpus=1, silo_gpus=0, workers=None) == 6
    # GPUs bound it when each silo asks for some: 2 GPUs at a quarter each hold 8 actors, though 16 CPUs hold 16.
    assert actor_count({"CPU": 16.0, "GPU": 2.0}, silos=100, silo_cpus=1, silo_gpus=0.25, workers=None) == 8
    assert actor_count({"CPU": 16.0, "GPU": 2.0}, silos=100, silo_cpus=0, silo_gpus=0.5, workers=None) == 4
    # A cluster too small for one silo's request still gets one actor (Ray then waits for room and says so).
    assert actor_count({"CPU": 1.0}, silos=10, silo_cpus=4, silo_gpus=0, workers=None) == 1
    assert actor_count({"CPU": 16.0}, silos=10, silo_cpus=1, silo_gpus=0, workers=3) == 3
    assert actor_count({"CPU": 16.0}, silos=2, silo_cpus=1, silo_gpus=0, workers=5) == 2


def test_a_ray_silo_host_trains_on_the_cpus_its_actor_reserved_not_the_drivers_share():
    # A 2-core laptop driving a 64-CPU cluster at --silo-cpus 8: 8 threads, not 2 // hosts.
    assert host_threads(cores=2, hosts=8, silo_cpus=8.0) == 8
    # A local Ray on 16 cores with 2 hosts at the default 1 CPU each: 1 thread, as reserved (not 8).
    assert host_threads(cores=16, hosts=2, silo_cpus=1.0) == 1
    assert host_threads(cores=16, hosts=2, silo_cpus=0.0) == 1  # a GPU-only request still gets a thread
    assert host_threads(cores=16, hosts=2) == 8  # worker processes share this machine's cores


@pytest.mark.parametrize(("flags", "message"), [
    (["--ray-address", "127.0.0.1:6379"], "--ray-address only apply to Ray actors: add --engine ray"),
    (["--silo-cpus", "2", "--silo-gpus", "1"], "--silo-cpus, --silo-gpus only apply to Ray actors: add --engine ray"),
    (["--ship-silo-files"], "--ship-silo-files only apply to Ray actors: add --engine ray"),
    (["--engine", "ray", "--silo-gpus", "-1"], "--silo-cpus and --silo-gpus must be 0 or more"),
    (["--engine", "ray", "--silo-cpus", "0"], "--silo-cpus 0 with no --silo-gpus would request nothing"),
    (["--engine", "ray", "--device", "cuda"], "--device cuda with --engine ray: give each silo host a GPU share"),
])
def test_bad_engine_flags_are_named(flags, message):
    if "--engine" in flags:
        pytest.importorskip("ray")  # --engine ray checks that Ray is there first
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_engine_args(build_parser().parse_args(flags))


def test_good_engine_flags_pass():
    check_engine_args(build_parser().parse_args([]))
    pytest.importorskip("ray")
    check_engine_args(build_parser().parse_args(["--engine", "ray", "--silo-cpus", "0", "--silo-gpus", "0.5"]))


def test_shipped_silo_files_unpack_elsewhere_with_the_same_bytes_and_fresh_state(tmp_path):
    """--ship-silo-files: a host spec's certificates, images, labels and branch policies travel as one archive and
    the unpacked spec points at the copies (a node without the sim's folder), each silo with a new state folder."""
    staged = tmp_path / "staged"
    spec = {"hub": "10.0.0.1:50051", "metrics_port_file": str(staged / "worker-0.metrics_port"), "silos": []}
    for name in ("silo-001", "silo-002"):
        base = staged / name
        (base / "certs").mkdir(parents=True)
        (base / "images" / "sub").mkdir(parents=True)
        (base / "certs" / "cert.pem").write_bytes(b"cert of " + name.encode())
        (base / "images" / "sub" / "0.png").write_bytes(bytes(range(256)) + name.encode())
        (base / "labels.json").write_text("[1, 2]")
        policy = None
        if name == "silo-001":  # --silo-policy 1=FILE: one silo with a policy, the other without
            policy = tmp_path / "policies" / "strict.yaml"
            policy.parent.mkdir()
            policy.write_text("secure_aggregation: required\n")
        spec["silos"].append({"name": name, "certs": str(base / "certs"), "data": str(base / "images"),
                              "labeled": None, "labels": str(base / "labels.json"), "state_dir": str(base / "state"),
                              "policy": str(policy) if policy else None})
    node = tmp_path / "node"
    unpacked = unpack_share(spec, pack_share(spec), node)
    assert unpacked["hub"] == spec["hub"] and unpacked["metrics_port_file"] == str(node / "metrics_port")
    assert unpacked["ended_file"] == str(node / "ended.json")  # the sim's own folder may not exist on the node
    for before, after in zip(spec["silos"], unpacked["silos"], strict=True):
        assert after["name"] == before["name"] and after["labeled"] is None
        for key in ("certs", "data", "labels"):
            assert after[key].startswith(str(node)) and not after[key].startswith(str(staged))
        assert (Path(after["certs"]) / "cert.pem").read_bytes() == (Path(before["certs"]) / "cert.pem").read_bytes()
        assert (Path(after["data"]) / "sub" / "0.png").read_bytes() == (Path(before["data"]) / "sub" / "0.png").read_bytes()
        assert Path(after["labels"]).read_text() == "[1, 2]"
        assert after["state_dir"] == str(node / before["name"] / "state")
    first, second = unpacked["silos"]
    assert first["policy"].startswith(str(node)) and Path(first["policy"]).read_text() == "secure_aggregation: required\n"
    assert second["policy"] is None


def test_the_sweep_removes_only_this_runs_copies_whose_actor_is_gone(tmp_path) -> None:
    from silo_sim.ray_engine import SHARE_PREFIX, sweep_dead_shares

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a process that no longer exists
    folders = {name: tmp_path / f"{SHARE_PREFIX}{name}" for name in (
        f"run1-{gone.pid}-abc", f"run1-{os.getpid()}-def", f"run2-{gone.pid}-ghi", "run1-notapid-jkl")}
    for folder in folders.values():
        (folder / "silo-001" / "certs").mkdir(parents=True)
        (folder / "silo-001" / "certs" / "key.pem").write_text("secret")
    assert sweep_dead_shares("run1", tmp_path) == [folders[f"run1-{gone.pid}-abc"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{SHARE_PREFIX}{name}" for name in folders if name != f"run1-{gone.pid}-abc")


def test_prometheus_targets_wait_for_each_actors_node_address_not_its_bare_port(tmp_path):
    """An actor writes its bare port first and its node's HOST:PORT once the driver collects it; read too early,
    the bare port would become a 127.0.0.1 target where nothing listens."""
    from types import SimpleNamespace

    from silo_sim.federation import _wait_for_metrics_ports

    port_file = tmp_path / "worker-0.metrics_port"
    port_file.write_text("4321")  # the actor's own write, before its address reached the driver
    calls = []

    def check():  # the driver's poll: on its third call the actor's address has arrived
        calls.append(1)
        if len(calls) == 3:
            port_file.write_text("10.0.0.5:4321")

    staged = SimpleNamespace(hub_state_dir=tmp_path)
    ports = _wait_for_metrics_ports(staged, [port_file], [None], tmp_path, timeout=10, check=check,
                                    pending=lambda: ":" not in port_file.read_text())
    assert ports["workers"] == ["10.0.0.5:4321"] and len(calls) == 3


def test_silos_whose_ray_actor_returned_or_died_count_as_stopped(tmp_path):
    # Under --engine ray the sim watched only for dead actors: a silo that left by its policy (or an actor out of
    # restarts) left the hub waiting for rounds.min_silos forever, where the worker engine stops and says why.
    (tmp_path / "hub.yaml").write_text("rounds: {min_silos: 3}\n")
    staged = SimpleNamespace(root=tmp_path, hub_config=tmp_path / "hub.yaml", hub_state_dir=tmp_path / "hub",
                             silos=[SimpleNamespace(name=f"silo-00{i}") for i in (1, 2, 3)])

    def share(index, names, **kw):  # staged.silos[w::hosts], as silo-sim deals them
        return HostedShare(index, {"silos": [{"name": n} for n in names]}, **kw)

    running = [share(0, ["silo-001", "silo-003"]), share(1, ["silo-002"])]
    assert [s.poll() for s in running] == [None, None]
    assert silos_stopped(staged, running, tmp_path, lambda: "waiting_for_silos") is None
    returned = [share(0, ["silo-001", "silo-003"], results={"silo-001": 0, "silo-003": 3}), running[1]]
    said = silos_stopped(staged, returned, tmp_path, lambda: "waiting_for_silos")
    assert said is not None and "1 of 3 silos stopped" in said and "silo-003 exited with code 3" in said
    assert "--hub-set rounds.min_silos=2" in said
    assert silos_stopped(staged, returned, tmp_path, lambda: "training") is None  # a round under way goes on
    dead = [running[0], share(1, ["silo-002"], dead=True)]
    assert dead[1].poll() == 1
    said = silos_stopped(staged, dead, tmp_path, lambda: "waiting_for_silos")
    assert said is not None and "silo-002 its host worker-1 exited with code 1" in said
    # A silo the hub quarantined still runs, but no longer counts for rounds.min_silos (either engine)
    staged.hub_state_dir.mkdir()
    QuarantineList(staged.hub_state_dir).add(Quarantine("silo-001", 4, 2, "breaks the sum", "2026-11-29T00:00:00"))
    said = silos_stopped(staged, running, tmp_path, lambda: "waiting_for_silos")
    assert said is not None and "silo-001 quarantined by the hub in round 4" in said


def test_under_secure_aggregation_the_stall_check_counts_the_fewest_silos_a_round_samples(tmp_path):
    # Only rounds.min_silos was compared: three silos left of four met min_silos 3 while the hub waited for the 4
    # a secure round of the default shape samples, and silo-sim waited for ever.
    (tmp_path / "hub.yaml").write_text("rounds: {min_silos: 3}\nprivacy: {secure_aggregation: {enabled: true}}\n")
    staged = SimpleNamespace(root=tmp_path, hub_config=tmp_path / "hub.yaml", hub_state_dir=tmp_path / "hub",
                             silos=[SimpleNamespace(name=f"silo-00{i}") for i in (1, 2, 3, 4)])
    assert hub_waits_for(staged) == SecAggParams(enabled=True).fewest_sampled() == 4
    hosts = [HostedShare(0, {"silos": [{"name": "silo-001"}, {"name": "silo-003"}]}, results={"silo-003": 3}),
             HostedShare(1, {"silos": [{"name": "silo-002"}, {"name": "silo-004"}]})]
    said = silos_stopped(staged, hosts, tmp_path, lambda: "waiting_for_silos")
    assert said is not None and "leaving fewer than the 4 the hub waits for" in said
    assert "the fewest a securely aggregated round samples" in said and "rounds.min_silos=" not in said


def test_a_reused_workdir_starts_without_the_earlier_runs_state(tmp_path):
    for d in ("hub/state", "silos/silo-001/state", "silos/silo-001/images"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "hub" / "state" / "run.json").write_text("{}")
    (tmp_path / "silos" / "silo-001" / "state" / "privacy_ledger.json").write_text("{}")
    assert clear_run_state(tmp_path) == [tmp_path / "hub" / "state", tmp_path / "silos" / "silo-001" / "state"]
    assert not (tmp_path / "hub" / "state").exists() and (tmp_path / "silos" / "silo-001" / "images").is_dir()


def test_a_run_the_hub_ended_early_is_told_from_one_it_was_stopped_in(tmp_path):
    staged = SimpleNamespace(hub_state_dir=tmp_path)
    assert stopped_early(staged) is None  # no card: not ended early
    (tmp_path / "model_card.json").write_text(json.dumps({"stopped_early": None, "rounds": 2}))
    assert stopped_early(staged) is None
    (tmp_path / "model_card.json").write_text(json.dumps({"stopped_early": "privacy budget spent"}))
    assert stopped_early(staged) == "privacy budget spent"
