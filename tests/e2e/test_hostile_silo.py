"""One hostile silo against a running federation: a `silo-server` process over mutual TLS on 127.0.0.1, two honest
`silo-client` processes, and silo-003, an enrolled silo with a valid certificate driven from this test by a
hand-written gRPC client. The same federation also runs without silo-003; the attacked run must end with the
two honest silos' rounds done and a model within a point of the clean run's.

silo-003's attacks, in order:
- flood: 400 concurrent NextTask long-polls and 300 Upload streams that never send a header, from its one
  certificate (the hub once ran out of its 256 RPC slots this way, locking every other silo out);
- take over: it joins declaring 10^9 images and, sampled in round 1, uploads weight 1e9 with a per-unit delta
  inside the norm bound (the hub once took it, and the mean became the attacker's update);
  (refused, it then reports a skip, as a silo with nothing to contribute does);
- stall: sampled in round 2 it goes silent, holding the round open, and its certificate is revoked once the
  honest silos have reported; the round must go on at once rather than wait out the deadline.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from security import pki, tls
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_core.tensors import encode, sha256_hex
from silo_sim.stage import StagedFederation, stage_federation
from tests.conftest import Processes, free_port, wait_for

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}
ROUNDS = 2
DEADLINE_S = 240.0


def _stage(root: Path, port: int, min_silos: int) -> StagedFederation:
    return stage_federation(
        root, num_silos=3, labels_per_class=2, unlabeled_limit=48, test_per_class=10, seed=5,
        hub_config={
            "run": {"threads": 1, "device": "cpu"},
            "server": {"port": port, "linger_s": 2.0, "upload_header_timeout_s": 2.0},
            "algorithm": {"name": "semifl", "options": TINY},  # aggregation: uniform, every weight is 1
            "rounds": {"total": ROUNDS, "min_silos": min_silos, "quorum": 0.5, "deadline_s": DEADLINE_S},
            "security": {"max_update_norm": 50.0},
        },
    )


def _start(root: Path, procs: Processes, min_silos: int, before_silos=None) -> tuple[StagedFederation, int]:
    port = free_port()
    staged = _stage(root, port, min_silos)
    procs.start(f"hub-{root.name}", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    wait_for(lambda: "hub listening on" in procs.log(f"hub-{root.name}"), 120, "the hub to listen")
    if before_silos is not None:
        before_silos(staged, port)
    for s in staged.silos[:2]:
        procs.start(f"{s.name}-{root.name}", "-m", "silo_client.cli", "--data", str(s.data), "--certs", str(s.certs),
                    "--hub", f"127.0.0.1:{port}", "--state-dir", str(s.state_dir), "--threads", "1",
                    "--device", "cpu", "--connect-timeout", "120")
    return staged, port


def _finish(staged: StagedFederation, procs: Processes, root: Path) -> dict:
    hub = next(p for p in procs.procs if p.name == f"hub-{root.name}")
    assert hub.wait(timeout=300) == 0, procs.log(f"hub-{root.name}")
    for p in procs.procs:
        if p.name.startswith("silo-") and p.name.endswith(root.name):
            assert p.wait(timeout=60) == 0, procs.log(p.name)  # the honest silos finished the run
    return json.loads((staged.hub_state_dir / "history.json").read_text())


class Attacker:
    """silo-003 with its real certificate and a client of its own."""

    def __init__(self, staged: StagedFederation, port: int):
        self.spec = staged.silos[2]
        self.staged = staged
        self.channel = tls.secure_channel(f"127.0.0.1:{port}", self.spec.certs)
        self.stub = silo_pb2_grpc.FederationStub(self.channel)
        self.run_id = ""

    def join(self) -> None:
        reply = self.stub.Join(silo_pb2.JoinRequest(num_unlabeled=10**9, device="cpu", client_version="0.1.0"),
                               timeout=30)
        self.run_id = reply.run.run_id

    def next_train(self, round_: int) -> silo_pb2.Task:
        def poll():
            try:
                task = self.stub.NextTask(silo_pb2.NextTaskRequest(run_id=self.run_id), timeout=60)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # one of its own flood still held
                return None
            return task if task.kind == silo_pb2.Task.TRAIN and task.round == round_ else None

        return wait_for(poll, 240, f"silo-003's task for round {round_}", poll=0.2)

    def flood(self) -> tuple[list, threading.Event]:
        hold = threading.Event()

        def silent() -> Iterator[silo_pb2.UploadMessage]:
            hold.wait(60)
            return
            yield

        calls = [self.stub.NextTask.future(silo_pb2.NextTaskRequest(run_id=self.run_id), timeout=120)
                 for _ in range(400)]
        calls += [self.stub.Upload.future(silent(), timeout=120) for _ in range(300)]
        return calls, hold

    def inflated_upload(self, task: silo_pb2.Task) -> grpc.RpcError:
        tensors = {}
        for spec in task.expected:
            shape = tuple(spec.shape)
            if spec.name == "weight":
                tensors[spec.name] = torch.tensor([1e9])
            else:  # 1e9 x a per-unit change of norm ~1e-3 per tensor: inside max_update_norm
                tensors[spec.name] = torch.full(shape, 1e9 * 1e-4 / max(1, int(torch.tensor(shape).prod())) ** 0.5)
        payload = encode(tensors)
        header = silo_pb2.UploadHeader(run_id=self.run_id, task_id=task.task_id, round=task.round,
                                       total_bytes=len(payload), sha256=sha256_hex(payload))
        messages = [silo_pb2.UploadMessage(header=header)] + [
            silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=o, data=payload[o:o + (1 << 16)]))
            for o in range(0, len(payload), 1 << 16)]
        with pytest.raises(grpc.RpcError) as info:
            self.stub.Upload(iter(messages), timeout=60)
        return info.value

    def skip(self, task: silo_pb2.Task) -> None:
        header = silo_pb2.UploadHeader(run_id=self.run_id, task_id=task.task_id, round=task.round, total_bytes=0,
                                       sha256=sha256_hex(b""), skipped=True)
        assert self.stub.Upload(iter([silo_pb2.UploadMessage(header=header)]), timeout=60).accepted

    def revoke(self) -> None:
        pki.revoke(self.staged.ca_dir, self.spec.name)
        shutil.copy(self.staged.ca_dir / "crl.pem", self.staged.root / "pki" / "hub" / "crl.pem")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict, str]:
    logs = tmp_path_factory.mktemp("logs")
    procs = Processes(logs)
    try:
        clean_root = tmp_path_factory.mktemp("clean")
        staged, _ = _start(clean_root, procs, min_silos=2)
        clean = _finish(staged, procs, clean_root)

        root = tmp_path_factory.mktemp("attacked")
        seen: dict = {}

        def attack_first(staged: StagedFederation, port: int) -> None:
            # silo-003 joins (ready) before the honest silos have loaded their images: round 1 samples it
            seen["attacker"] = attacker = Attacker(staged, port)
            wait_for(lambda: _joins(attacker), 60, "silo-003 to join")
            calls, hold = attacker.flood()
            time.sleep(2.0)
            seen["flood_refused"] = sum(1 for c in calls if c.done() and c.exception() is not None
                                        and c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
            seen["hold"] = hold

        staged, port = _start(root, procs, 3, attack_first)
        attacker, hub_log = seen["attacker"], f"hub-{root.name}"
        task = attacker.next_train(1)
        refusal = attacker.inflated_upload(task)
        seen["inflated"] = (refusal.code().name, refusal.details())
        seen["hold"].set()
        attacker.skip(task)
        attacker.next_train(2)
        for s in staged.silos[:2]:  # silent: only the honest silos report round 2
            wait_for(lambda s=s: f"round 2: update from {s.name}" in procs.log(hub_log), 240, f"{s.name}'s report")
        started = time.time()
        attacker.revoke()
        wait_for(lambda: "round 2 done" in procs.log(hub_log), DEADLINE_S, "round 2 to go on without silo-003")
        seen["round2_after_revocation_s"] = time.time() - started
        history = _finish(staged, procs, root)
        attacker.channel.close()
        return clean, history, seen, procs.log(hub_log)
    finally:
        procs.stop_all()


def _joins(attacker: Attacker) -> bool:
    try:
        attacker.join()
        return True
    except grpc.RpcError:
        return False


def test_the_honest_silos_finish_with_the_model_of_a_clean_run(runs) -> None:
    clean, attacked, seen, hub_log = runs
    first, second = attacked["rounds"]
    assert (first["silos_sampled"], first["silos_reported"], first["silos_skipped"], first["attempt"]) == (3, 3, 1, 1)
    assert (second["silos_sampled"], second["silos_reported"], second["attempt"]) == (3, 2, 1)
    final, baseline = attacked["rounds"][-1]["test_accuracy"], clean["rounds"][-1]["test_accuracy"]
    assert abs(final - baseline) <= 0.01, (final, baseline)
    assert "Concurrent RPC limit exceeded" not in hub_log


def test_a_flood_from_one_certificate_is_refused_at_once_and_logged_once(runs) -> None:
    _, _, seen, hub_log = runs
    # 400 long-polls and 300 silent uploads: one of each held, every other refused at once
    assert seen["flood_refused"] >= 698
    # logged once per burst (at most once a minute), not once per refused call
    assert 1 <= hub_log.count("silo silo-003 has more calls open than allowed") <= 5
    assert "refused stream_idle from silo-003: no upload header within 2 s" in hub_log


def test_an_inflated_weight_is_refused(runs) -> None:
    _, attacked, seen, hub_log = runs
    code, details = seen["inflated"]
    assert code == "INVALID_ARGUMENT" and "weight must be exactly 1" in details
    assert all(r.get("aggregated_weight", 2.0) == 2.0 for r in attacked["rounds"])


def test_a_silo_revoked_while_sampled_leaves_its_round_at_once(runs) -> None:
    _, attacked, seen, hub_log = runs
    assert seen["round2_after_revocation_s"] < 30  # not the 240 s deadline
    assert attacked["rounds"][1]["round_seconds"] < DEADLINE_S / 2
    assert "silo silo-003 is revoked: it leaves the run and its round" in hub_log
