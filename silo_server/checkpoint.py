"""Hub checkpoints: after every round, atomically; tensors as safetensors, everything else as JSON. Also the
exported models (the final one and the best round's by validation accuracy).

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

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from silo_core.algorithms.base import HubState
from silo_core.files import write_json_atomic
from silo_core.selection import BestRound

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


# ------------------------------------------------------------------------------------------ exported models

BEST_MODEL = "best_model.safetensors"


def write_model(path: Path, model: torch.nn.Module, metadata: dict[str, str] | None = None) -> Path:
    """A served model's weights as safetensors, atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata)
    os.replace(tmp, path)
    return path


def save_best_model(state_dir: Path, model: torch.nn.Module, run_id: str, best: BestRound) -> Path:
    """The best round's model so far, with its round and validation accuracy in the file's own metadata, so that a
    restarted hub knows what it holds even if it crashed before that round's checkpoint."""
    return write_model(Path(state_dir) / BEST_MODEL, model, {
        "run_id": run_id, "round": str(best.round), "validation_accuracy": repr(best.accuracy)})


def load_best_round(state_dir: Path, run_id: str) -> BestRound:
    """What best_model.safetensors in state_dir holds for this run; an empty record when there is none (or it is
    another run's, or unreadable: the next round replaces it)."""
    path = Path(state_dir) / BEST_MODEL
    if not path.is_file():
        return BestRound()
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("run_id") != run_id:
            return BestRound()
        return BestRound(round=int(meta["round"]), accuracy=float(meta["validation_accuracy"]))
    except (OSError, ValueError, KeyError, SafetensorError):
        return BestRound()
