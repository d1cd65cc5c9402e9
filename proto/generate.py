"""Regenerate the Python stubs in silo/v1/ from proto/silo/v1/*.proto (needs the dev extra: grpcio-tools).

    python proto/generate.py            # writes into the repository
    python proto/generate.py --out DIR  # writes into DIR (tests compare that with the committed stubs)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT)
    for path in generate(parser.parse_args().out):
        print(path)
    sys.exit(0)
