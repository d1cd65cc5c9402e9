"""The committed gRPC stubs must be exactly what the .proto generates: a stale stub is a silent wire bug."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stubs_match_the_proto(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed; run python proto/generate.py"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale; run python proto/generate.py and commit the result"
        )


def test_stub_declares_the_five_calls():
    from silo.v1 import silo_pb2

    service = silo_pb2.DESCRIPTOR.services_by_name["Federation"]
    assert sorted(m.name for m in service.methods) == ["Download", "Join", "Leave", "NextTask", "Upload"]
    leave = service.methods_by_name["Leave"]
    assert not leave.server_streaming and not leave.client_streaming
    download, upload = service.methods_by_name["Download"], service.methods_by_name["Upload"]
    assert download.server_streaming and not download.client_streaming
    assert upload.client_streaming and not upload.server_streaming
