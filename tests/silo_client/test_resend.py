"""A hub that reports a silo's upload lost and asks for the same task again gets the same bytes back, over real
gRPC: the silo does not train and release a second update, its privacy ledger charges the task once, and its
audit (two uploads of one release) still agrees with the ledger."""

from __future__ import annotations

import json

from security.audit import AUDIT_FILE
from security.secagg.messages import MAX_JSON_BYTES
from silo.v1 import silo_pb2
from silo_client.client import SiloClient, SiloSettings
from silo_client.ledger import LEDGER_FILE
from silo_server.app import HubApp
from silo_server.config import parse_config
from silo_server.state.registry import Refusal
from silo_server.wire.intake import TaskView
from silo_tools.audit import main as silo_audit
from tests.silo_client.test_cli_errors import write_images
from tests.silo_client.test_receive import run_dev_silos, semifl_hub_config

SILOS = ("dev-1", "dev-2")


def hub_config(tmp_path, **rounds):
    return semifl_hub_config(tmp_path, SILOS, rounds=rounds)


def audited(state, kind):
    records = [json.loads(line) for line in (state / AUDIT_FILE).read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


def run_with_first_upload_failing(tmp_path, refusal: Refusal, **rounds):
    """A two-round federation whose hub fails dev-1's first upload with `refusal` after reading every byte of it.
    Returns the rounds' records and (silo, round, task, sha256) of every upload the hub read."""
    app = HubApp(hub_config(tmp_path, **rounds), insecure_dev_only=True)
    received: list[tuple[str, int, str, str]] = []
    accept = app.hub.upload

    def failing_upload(silo_id, header, chunks):
        if header["secagg_stage"]:
            return accept(silo_id, header, chunks)
        data = b"".join(c for _, c in chunks)
        received.append((silo_id, header["round"], header["task_id"], header["sha256"]))
        if silo_id == "dev-1" and header["round"] == 1 and len([r for r in received if r[0] == "dev-1"]) == 1:
            raise refusal
        return accept(silo_id, header, iter([(0, data)] if data else []))

    app.hub.upload = failing_upload
    return run_dev_silos(app, tmp_path, SILOS), received


def test_a_task_asked_again_after_a_lost_upload_gets_the_same_bytes_and_one_charge(tmp_path, capsys) -> None:
    # Every byte reached the hub, which then says it never arrived.
    history, received = run_with_first_upload_failing(
        tmp_path, Refusal("UNAVAILABLE", "lost", "the hub lost this upload; send it again"))
    assert [r.silos_reported for r in history] == [2, 2]
    dev1 = [r for r in received if r[0] == "dev-1"]
    assert [r[1] for r in dev1] == [1, 1, 2]
    assert dev1[0][2:] == dev1[1][2:]  # the same task, the same bytes: nothing trained or released again

    state = tmp_path / "state-dev-1"
    ledger = json.loads((state / LEDGER_FILE).read_text())
    (run,) = ledger["runs"].values()
    assert [(e["round"], e["task"], e["release"]) for e in run["rounds"]] == [
        (1, dev1[0][2], 1), (2, dev1[2][2], 1)]
    uploads = audited(state, "upload")
    assert [(u["round"], u["sha256"], u["epsilon"]["release"]) for u in uploads] == [
        (1, dev1[0][3], 1), (1, dev1[0][3], 1), (2, dev1[2][3], 1)]
    assert uploads[0]["epsilon"] == uploads[1]["epsilon"]
    capsys.readouterr()
    assert silo_audit(["verify", str(state)]) == 0
    assert "agrees with the ledger (2 rounds in 1 runs)" in capsys.readouterr().out


def test_an_upload_the_hub_refused_is_not_sent_again_while_the_hub_offers_its_task(tmp_path) -> None:
    """The hub received dev-1's update and refused it (its content): the same bytes, or an update retrained the
    same way, would be refused again, so dev-1 waits the task out; the round closes after its quorum."""
    history, received = run_with_first_upload_failing(
        tmp_path, Refusal("INVALID_ARGUMENT", "update_norm", "the update's norm is above security.max_update_norm"),
        quorum=0.5, wait_after_quorum_s=3)
    assert [r.round for r in history] == [1, 2] and history[0].silos_reported == 1
    assert [r[1] for r in received if r[0] == "dev-1"] == [1, 2]  # one refused upload in round 1, none resent


def test_the_largest_secure_aggregation_input_reaches_a_silo_in_one_task(tmp_path) -> None:
    """A stage's input (unmask requests carry every survivor's certificate) may be up to MAX_JSON_BYTES and rides
    in one Task: the hub's send cap and the client's receive cap must both hold it."""
    app = HubApp(hub_config(tmp_path), insecure_dev_only=True)
    payload = bytes(range(256)) * (MAX_JSON_BYTES // 256)
    app.hub.poll_task = lambda silo_id: TaskView("SECAGG", round=1, task_id="t", secagg_stage="unmask",
                                                 secagg_payload=payload)
    app.hub.start_poll = lambda silo_id, run_id: None
    app.hub.end_poll = lambda silo_id: None
    port = app.start_server()
    write_images(tmp_path / "images", n=4)
    client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", device="cpu",
                                     state_dir=tmp_path / "state", insecure_dev_silo_id="dev-1"))
    try:
        task = client.stub.NextTask(silo_pb2.NextTaskRequest(run_id=app.hub.run_id), timeout=60)
        assert task.secagg_payload == payload and len(payload) == MAX_JSON_BYTES
    finally:
        client.close()
        app.stop(0)


def test_a_secure_round_asked_again_after_its_keys_were_lost_gets_the_same_keys_and_no_second_training(tmp_path):
    # advertise_keys never reached the hub: it offers the same TRAIN task again. Training again would release a
    # second update (and charge DP-SGD's ledger twice for one release); the silo sends the same keys again.
    silos = ("dev-1", "dev-2", "dev-3")
    config = hub_config(tmp_path, total=1, silos_per_round_count=3, min_silos=3)
    config = config.model_copy(update={
        "security": config.security.model_copy(update={"allowed_silos": list(silos)}),
        "privacy": parse_config({"data": {"labeled": {"kind": "demo"}}, "privacy": {"secure_aggregation": {
            "enabled": True, "min_cohort": 3, "dropouts": 0}}}, base=tmp_path).privacy})
    app = HubApp(config, insecure_dev_only=True)
    advertised: list[tuple[str, str, str]] = []
    accept = app.hub.upload

    def losing_first_keys(silo_id, header, chunks):
        data = b"".join(c for _, c in chunks)
        if header["secagg_stage"] == "advertise_keys":
            advertised.append((silo_id, header["task_id"], header["sha256"]))
            if silo_id == "dev-1" and len([a for a in advertised if a[0] == "dev-1"]) == 1:
                raise Refusal("UNAVAILABLE", "lost", "the hub lost this message; send it again")
        return accept(silo_id, header, iter([(0, data)] if data else []))

    app.hub.upload = losing_first_keys
    history = run_dev_silos(app, tmp_path, silos)
    assert len(history) == 1 and history[0].secagg is not None and history[0].secagg.contributors == 3
    dev1 = [a for a in advertised if a[0] == "dev-1"]
    assert len(dev1) == 2 and dev1[0] == dev1[1]  # the same task, the same keys: not trained again
