"""The ledger charges a release only once the branch's policy lets it leave: an upload or a masked input the
policy's size clause stops is neither charged nor audited (before, the charge was written first, so a round that
never left the branch counted against its lifetime epsilon and `silo-audit verify` flagged it as sent unaudited)."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from security.audit import AuditLog
from silo.v1 import silo_pb2
from silo_client.outbox import Outbox, PolicyStop
from silo_client.policy import BranchPolicy


class HubEnd:
    """The far end of Upload: what arrived, in order with the charges (the stub's one method the Outbox calls)."""

    def __init__(self, events: list[str]):
        self.events = events

    def Upload(self, messages, timeout):  # noqa: N802 - the gRPC method's name
        header = next(messages).header
        self.events.append(f"sent {header.secagg_stage or 'upload'} {header.total_bytes}")
        return silo_pb2.UploadReply()


@pytest.fixture
def outbox(tmp_path):
    events: list[str] = []
    box = Outbox(HubEnd(events), AuditLog(tmp_path / "audit.jsonl"), BranchPolicy(max_upload_bytes=1000),
                 lambda: {"serial": "", "fingerprint": ""})
    box.pin("run-1", "terms")
    return box, events, tmp_path / "audit.jsonl"


def charge_into(events: list[str]):
    def charge() -> dict:
        events.append("charge")
        return {"client": 1.0}
    return charge


def audited(path) -> list[str]:
    return [json.loads(line)["kind"] for line in path.read_text().splitlines()] if path.exists() else []


def test_an_upload_over_the_policys_size_is_neither_charged_nor_sent(outbox):
    box, events, audit = outbox
    task = silo_pb2.Task(task_id="t1", round=1)
    with pytest.raises(PolicyStop) as stop:
        box.upload(task, {"delta/w": torch.zeros(500)}, {}, False, charge_into(events))
    assert stop.value.refusal.clause == "max_upload_bytes"
    assert events == [] and "upload" not in audited(audit) and box.last_upload is None
    size = box.upload(task, {"delta/w": torch.zeros(100)}, {}, False, charge_into(events))
    assert events == ["charge", f"sent upload {size}"] and audited(audit).count("upload") == 1
    assert box.last_upload.epsilon == {"client": 1.0}


def test_a_stage_message_over_the_policys_size_is_neither_charged_nor_sent(outbox):
    box, events, audit = outbox
    with pytest.raises(PolicyStop):
        box.stage("s1", 1, "masked_input", b"x" * 1001, charge_into(events))
    assert events == [] and "secagg:masked_input" not in audited(audit)
    box.stage("s1", 1, "masked_input", b"x" * 900, charge_into(events))
    assert events == ["charge", "sent masked_input 900"]


def test_the_size_clause_counts_the_header_as_the_audit_does(outbox):
    # The payload alone was checked while the audit recorded payload + header: a silo's own audit could show a
    # message over its policy's limit as sent.
    box, events, audit = outbox
    with pytest.raises(PolicyStop):  # 1,000 bytes of payload fit the limit alone, not with their header
        box.stage("s1", 1, "masked_input", b"x" * 1000, charge_into(events))
    assert events == []
    box.stage("s1", 1, "masked_input", b"x" * 900, charge_into(events))
    sent = [json.loads(line)["bytes"] for line in audit.read_text().splitlines()
            if json.loads(line)["kind"] == "secagg:masked_input"]
    assert len(sent) == 1 and 900 < sent[0] <= 1000


class RefusingHubEnd(HubEnd):
    def Upload(self, messages, timeout):  # noqa: N802 - the gRPC method's name
        header = next(messages).header
        self.events.append(f"refused {header.secagg_stage}")
        raise Refused()


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "keys do not parse"


def test_secure_aggregation_keys_the_hub_refused_mark_the_task_refused_so_they_are_not_sent_again(tmp_path):
    # A refused advertise_keys (not a lost one): the client's resend of the same keys would be refused once a second
    # until the round closed; the task is waited out, as a refused clear upload's is.
    events: list[str] = []
    box = Outbox(RefusingHubEnd(events), AuditLog(tmp_path / "audit.jsonl"), None,
                 lambda: {"serial": "", "fingerprint": ""})
    box.pin("run-1", "terms")
    with pytest.raises(grpc.RpcError):
        box.stage("t1", 1, "advertise_keys", b"{}", None)
    assert events == ["refused advertise_keys"] and box.refused_tasks == {"t1"}
