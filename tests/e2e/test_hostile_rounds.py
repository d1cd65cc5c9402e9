"""Hostile silos cannot slow the rounds (issue 35), over the real wire: a `silo-server` process with secure
aggregation over mutual TLS, six honest silos and silo-007, which sends a weight no honest silo could (hosted by
one silo-sim worker process, every silo with its own certificate and connection), and two hand-written clients
with valid certificates:

- silo-008 joins, is sampled, sends its result in the clear (refused: the round is securely aggregated)
  and then stays silent: the round closes rounds.wait_after_quorum_s after its quorum, not at its deadline;
- silo-009 never joins and floods the hub with 10,000 NextTask calls under a wrong run id on 4 threads: refused
  at its rate, logged a few times, counted per silo.

silo-007 breaks every secure sum it is in; the hub finds it by group testing and quarantines it within 5 failed
attempts (silo-008 joins after that, so the round it is left out of is an applied one), and the run finishes. Honest rounds keep their pace: each attacked round's time within 2x of the same
run's clean rounds."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request

import grpc
import torch

from security import tls
from security.terms import SIGNED_SECAGG, TYPED_TERMS
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_core.tensors import encode, sha256_hex
from silo_sim.stage import stage_federation
from tests.conftest import free_port, wait_for

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}
ROUNDS, DEADLINE_S, FLOOD = 8, 240.0, 10_000


def test_a_flood_a_silent_silo_and_a_sum_breaker_do_not_slow_the_honest_rounds(tmp_path, processes):
    port, metrics_port = free_port(), free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=9, labels_per_class=2, unlabeled_limit=180, test_per_class=5, seed=7,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 2.0, "linger_s": 10.0, "min_linger_s": 5.0},
            "metrics": {"port": metrics_port, "final_scrape_s": 0},
            "algorithm": {"name": "semifl", "options": TINY},
            # min_silos counts the honest six: a quarantined or departed silo no longer counts as ready
            "rounds": {"total": ROUNDS, "min_silos": 6, "silos_per_round": 1.0, "quorum": 0.5, "deadline_s": DEADLINE_S,
                       "wait_after_quorum_s": 1.0, "liveness_s": 600},
            "privacy": {"secure_aggregation": {"enabled": True, "threshold": 0.5, "dropouts": 0, "min_cohort": 3,
                                               "stage_deadline_s": 30}},
        },
    )
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    spec = {"hub": f"127.0.0.1:{port}", "device": "cpu", "threads": 1, "connect_timeout_s": 120,
            "load_when_sampled": True,
            "silos": [{"name": s.name, "certs": str(s.certs), "data": str(s.data), "state_dir": str(s.state_dir),
                       "labels": str(s.labels), "attack": "weight" if s.name == "silo-007" else None}
                      for s in staged.silos[:7]]}
    (tmp_path / "worker.json").write_text(json.dumps(spec))
    processes.start("worker", "-m", "silo_sim.worker", "--spec", str(tmp_path / "worker.json"))

    # The breaker is found first (so that the rounds below are applied, and their records say what happened).
    log_path = processes.logdir / "hub.log"
    wait_for(lambda: "silo silo-007 is quarantined" in log_path.read_text(), 600, "silo-007's quarantine")

    # silo-008: sampled in the next round, sends its result in the clear (refused), then silent for good.
    silent = staged.silos[7]
    channel = tls.secure_channel(f"127.0.0.1:{port}", silent.certs)
    stub = silo_pb2_grpc.FederationStub(channel)
    join = silo_pb2.JoinRequest(num_unlabeled=20, device="cpu", protocol_version=2,
                                features=[TYPED_TERMS, SIGNED_SECAGG])
    run_id = wait_for(lambda: _join(stub, join), 120, "silo-008 to join")
    task = wait_for(lambda: _train_task(stub, run_id), 240, "silo-008's first task")
    tensors = {e.name: torch.zeros(tuple(e.shape)) + (1.0 if e.name == "weight" else 0.0) for e in task.expected}
    payload = encode(tensors)
    header = silo_pb2.UploadHeader(run_id=run_id, task_id=task.task_id, round=task.round, total_bytes=len(payload),
                                   sha256=sha256_hex(payload))
    try:
        stub.Upload(iter([silo_pb2.UploadMessage(header=header),
                          silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=0, data=payload))]), timeout=30)
        raise AssertionError("a result in the clear was accepted in a securely aggregated round")
    except grpc.RpcError as err:
        assert "never accepted in the clear" in err.details()
    silent_round = task.round
    channel.close()

    # silo-009 floods once the round after silo-008's has begun.
    wait_for(lambda: f"round {silent_round + 1} attempt" in log_path.read_text(), 600, "the next round")
    flooder = staged.silos[8]
    lines_before = log_path.read_text().count("\n")
    codes = _flood(flooder.certs, port)
    flood_lines = [ln for ln in log_path.read_text().splitlines()[lines_before:] if "silo-009" in ln]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()

    assert hub.wait(timeout=900) == 0, processes.log("hub")[-4000:]
    log = processes.log("hub")
    rounds = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))  # the run finished

    # The flood: refused at its rate, counted per silo, a handful of log lines for 10,000 calls.
    assert len(codes) == FLOOD and set(codes) <= {"RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}
    assert codes.count("RESOURCE_EXHAUSTED") >= FLOOD * 0.9
    assert len(flood_lines) < 10, flood_lines
    counted = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'silokit_hub_silo_refusals_total\{reason="(\w+)",silo="silo-009"\} (\S+)', metrics)}
    assert counted["call_rate"] > FLOOD * 0.9  # the rest: more than one NextTask open at once, from 4 threads
    assert counted["call_rate"] + counted.get("too_many_calls", 0) == codes.count("RESOURCE_EXHAUSTED")

    # The silent silo: left out of its round one second after the quorum, not at the 240 s deadline.
    first = next(r for r in rounds if r["round"] == silent_round)
    assert "silo-008" in first["silos_left_out"] and first["quorum_wait_seconds"] < 10
    assert first["round_seconds"] < DEADLINE_S / 4

    # The breaker: quarantined within 5 failed attempts; no applied round holds its input.
    quarantine = json.loads((staged.hub_state_dir / "quarantine.json").read_text())["quarantined"]
    assert [q["silo"] for q in quarantine] == ["silo-007"] and quarantine[0]["attempts"] <= 5
    assert "silo silo-007 is quarantined" in log
    assert all(r["secagg_u3"] >= 3 for r in rounds)
    assert rounds[-1]["silos_sampled"] == 6  # neither silo-007 nor silo-008 any more

    # Honest pace: every round's applied attempt within 2x of the clean rounds' (after the breaker was found and
    # silo-008 left, outside the flood).
    attacked = {silent_round, silent_round + 1} | {r["round"] for r in rounds if r.get("attempt", 1) > 1}
    clean = [r["round_seconds"] for r in rounds if r["round"] not in attacked]
    assert clean, rounds
    slowest_clean = max(clean)
    for r in rounds:
        if r["round"] in attacked:
            assert r["round_seconds"] <= 2 * slowest_clean + 1.0, (r["round"], r["round_seconds"], clean)


def _join(stub, request) -> str | None:
    try:
        return stub.Join(request, timeout=10).run.run_id
    except grpc.RpcError:
        return None


def _train_task(stub, run_id: str) -> silo_pb2.Task | None:
    task = stub.NextTask(silo_pb2.NextTaskRequest(run_id=run_id), timeout=30)
    return task if task.kind == silo_pb2.Task.TRAIN else None


def _flood(certs, port: int) -> list[str]:
    """FLOOD NextTask calls under a wrong run id from one certificate, 64 in flight at any time (a client that does
    not wait for answers: the hub pauses a few refusals per silo and answers the rest at once)."""
    channel = tls.secure_channel(f"127.0.0.1:{port}", certs)
    stub = silo_pb2_grpc.FederationStub(channel)
    codes: list[str] = []
    done = threading.Event()
    lock = threading.Lock()
    issued = [0]

    def issue() -> None:
        with lock:
            if issued[0] >= FLOOD:
                return
            issued[0] += 1
        call = stub.NextTask.future(silo_pb2.NextTaskRequest(run_id="not-this-run"), timeout=30)
        call.add_done_callback(finish)

    def finish(call) -> None:
        try:
            call.result()
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        with lock:
            codes.append(code)
            if len(codes) >= FLOOD:
                done.set()
        issue()

    started = time.time()
    for _ in range(64):
        issue()
    done.wait(300)
    channel.close()
    print(f"flood: {len(codes)} calls in {time.time() - started:.1f} s", file=sys.stderr)
    return codes
