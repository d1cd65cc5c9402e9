"""Hub checkpoints: after every round, atomically; tensors as safetensors, everything else as JSON. Also the
exported models (the final one and the best round's by validation accuracy).

Layout under the state dir:  checkpoints/round-000005/{state.safetensors, state.json, manifest.json} and a LATEST
file naming the newest complete one. A checkpoint directory is written under a temporary name and renamed into
place, then LATEST is replaced atomically, so a crash at any instant leaves the previous checkpoint intact.

Resuming trusts nothing in the state folder: LATEST must name a round directory inside checkpoints/, each file must
match the sha256 that manifest.json recorded when it was written, the round must lie in 0..total_rounds and every
tensor must be finite and fit the model. A checkpoint that fails is skipped (with a warning naming the file) for the
newest earlier one that passes; when none passes, CheckpointError says which file and how to recover.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from silo_core.algorithms.base import HubState
from silo_core.files import write_json_atomic
from silo_core.selection import BestRound

log = logging.getLogger("silo_server")

KEEP = 2
TENSORS, INFO, MANIFEST = "state.safetensors", "state.json", "manifest.json"
ROUND_DIR = re.compile(r"round-(\d+)")


class CheckpointError(ValueError):
    """No checkpoint in the state folder can be resumed from; the message names the file and the way out."""


class _Unusable(Exception):
    """Why one checkpoint failed verification: the file at fault and the reason."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_checkpoint(state_dir: Path, state: HubState, info: dict[str, Any]) -> Path:
    root = Path(state_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{state.round:06d}"
    tmp = root / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in state.tensors.items()}, str(tmp / TENSORS))
    write_json_atomic(tmp / INFO, {"round": state.round, "meta": state.meta, **info})
    # Last, from the files as they lie on disk: resume tells a flipped or truncated file from a good one by these.
    write_json_atomic(tmp / MANIFEST, {"sha256": {f: _sha256(tmp / f) for f in (TENSORS, INFO)}})
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / "LATEST")
    for old in sorted(p for p in root.glob("round-*") if p.is_dir() and not p.name.endswith(".tmp"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(state_dir: Path, *, total_rounds: int | None = None,
                check: Callable[[HubState], object] | None = None) -> tuple[HubState, dict[str, Any]] | None:
    """The newest checkpoint that verifies, as (state, the rest of state.json); None when there is none at all.

    `total_rounds` bounds the round; `check(state)` raises when the tensors do not fit the model (the hub passes
    its algorithm's served_model, which loads them strictly into a freshly built network: cheap, no training).
    A bad newest checkpoint is skipped for an earlier one with a WARNING; CheckpointError when none verifies."""
    root = Path(state_dir) / "checkpoints"
    latest = root / "LATEST"
    rounds = {int(m[1]): p for p in (root.iterdir() if root.is_dir() else ())
              if (m := ROUND_DIR.fullmatch(p.name)) and p.is_dir()}
    if not latest.is_file() and not rounds:
        return None
    problems: list[_Unusable] = []
    candidates = sorted(rounds, reverse=True)
    try:
        named = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = None
    if named is None:  # a crash between the first round's rename and LATEST, or a lost file
        problems.append(_Unusable(latest, "is missing or unreadable"))
    elif (m := ROUND_DIR.fullmatch(named)) is None:
        # Never followed: a path with `..`, an absolute one or garbage. The newest round directory stands in.
        problems.append(_Unusable(latest, f"does not name a round-N directory in {root} ({named[:100]!r})"))
    else:
        candidates = [n for n in candidates if n <= int(m[1])]
        if int(m[1]) not in rounds:
            problems.append(_Unusable(root / named, "is missing"))
    for n in candidates:
        try:
            state, info = _load_verified(rounds[n], n, total_rounds, check)
        except _Unusable as bad:
            problems.append(bad)
            continue
        for bad in problems:
            log.warning("checkpoint %s %s; resuming from %s instead", bad.path, bad.why, rounds[n])
        return state, info
    found = "; ".join(str(bad) for bad in problems)
    raise CheckpointError(f"no checkpoint in {root} can be resumed: {found}. Restore the newest from a backup, or "
                          f"move {state_dir} aside (mv {state_dir} {state_dir}.bad) to start the run afresh")


def _load_verified(folder: Path, n: int, total_rounds: int | None,
                   check: Callable[[HubState], object] | None) -> tuple[HubState, dict[str, Any]]:
    """One checkpoint directory, fully verified; _Unusable names the file at fault otherwise."""
    where = folder.resolve()
    if where.parent != folder.parent.resolve():  # a symlink out of checkpoints/
        raise _Unusable(folder, f"leads outside {folder.parent} (to {where})")
    for name in (TENSORS, INFO):
        path = folder / name
        if not path.is_file() or path.resolve().parent != where:
            raise _Unusable(path, "is missing or not a plain file in its checkpoint")
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            sums = json.loads(manifest.read_text())["sha256"]
            wrong = [name for name in (TENSORS, INFO) if sums.get(name) != _sha256(folder / name)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise _Unusable(manifest, f"is unreadable ({err})") from None
        if wrong:
            raise _Unusable(folder / wrong[0], f"does not match the sha256 in {MANIFEST}: the file is corrupt")
    try:
        info = json.loads((folder / INFO).read_text())
    except (OSError, ValueError) as err:
        raise _Unusable(folder / INFO, f"is unreadable ({err})") from None
    round_ = info.get("round") if isinstance(info, dict) else None
    # bool is an int to Python; a huge round would end the run at once, a negative one replay rounds.
    if type(round_) is not int or round_ < 0 or (total_rounds is not None and round_ > total_rounds):
        allowed = ">= 0" if total_rounds is None else f"in 0..{total_rounds} (rounds.total)"
        raise _Unusable(folder / INFO, f"holds round {round_!r}, not a whole number {allowed}")
    if round_ != n:
        raise _Unusable(folder / INFO, f"holds round {round_} but lies in {folder.name}")
    if not isinstance(info.get("meta", {}), dict):
        raise _Unusable(folder / INFO, "holds a 'meta' that is not a JSON object")
    try:
        tensors = load_file(str(folder / TENSORS))
    except (OSError, SafetensorError) as err:
        raise _Unusable(folder / TENSORS, f"is unreadable ({err})") from None
    for name, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and not torch.isfinite(t).all():
            raise _Unusable(folder / TENSORS, f"holds NaN or infinite values in {name}")
    state = HubState(round=info.pop("round"), tensors=tensors, meta=info.pop("meta", {}))
    if check is not None:
        try:
            check(state)
        except Exception as err:  # whatever the algorithm's loader raises: a strict load_state_dict says why
            why = " ".join(str(err).split())
            raise _Unusable(folder / TENSORS, f"does not fit the model ({why[:300]})") from None
    if not manifest.is_file():
        log.warning("checkpoint %s has no %s (written before checkpoints carried checksums): resuming from it "
                    "unverified", folder, MANIFEST)
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
    """What best_model.safetensors in state_dir holds for this run; an empty record when there is none, or it is
    another run's, or it is corrupt (with a warning): the next best round replaces the file."""
    path = Path(state_dir) / BEST_MODEL
    if not path.is_file():
        return BestRound()
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("run_id") != run_id:
            return BestRound()
        best = BestRound(round=int(meta["round"]), accuracy=float(meta["validation_accuracy"]))
        # The whole file, not just its header: a truncated or NaN model must not be named in the model card.
        # Round 0 is the initial model: the hub keeps it when no round beats the hub's labels alone.
        if best.round < 0 or not 0.0 <= best.accuracy <= 1.0:
            raise ValueError(f"round {best.round} and accuracy {best.accuracy} are out of range")
        bad = [k for k, v in load_file(str(path)).items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"NaN or infinite values in {bad[0]}")
        return best
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        log.warning("%s is unusable (%s): ignored; the next best round on the validation split replaces it",
                    path, err)
        return BestRound()
