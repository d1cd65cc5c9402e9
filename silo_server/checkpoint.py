"""Hub checkpoints: after every round, atomically; tensors as safetensors, everything else as JSON.

Layout under the state dir:  checkpoints/round-000005/{state.safetensors, state.json} and a LATEST file naming the
newest complete one. A checkpoint directory is written under a temporary name and renamed into place, then LATEST is
replaced atomically, so a crash at any instant leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from silo_core.algorithms.base import HubState
from silo_core.files import write_json_atomic

KEEP = 2


def save_checkpoint(state_dir: Path, state: HubState, info: dict[str, Any]) -> Path:
    root = Path(state_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{state.round:06d}"
    tmp = root / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in state.tensors.items()}, str(tmp / "state.safetensors"))
    write_json_atomic(tmp / "state.json", {"round": state.round, "meta": state.meta, **info})
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / "LATEST")
    for old in sorted(p for p in root.glob("round-*") if p.is_dir() and not p.name.endswith(".tmp"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(state_dir: Path) -> tuple[HubState, dict[str, Any]] | None:
    root = Path(state_dir) / "checkpoints"
    latest = root / "LATEST"
    if not latest.is_file():
        return None
    folder = root / latest.read_text().strip()
    try:
        info = json.loads((folder / "state.json").read_text())
        tensors = load_file(str(folder / "state.safetensors"))
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"checkpoint {folder} is unreadable ({err}); move {root} aside to start over"
        ) from None
    state = HubState(round=int(info.pop("round")), tensors=tensors, meta=info.pop("meta", {}))
    return state, info
