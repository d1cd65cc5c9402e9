"""The hub's records of the run: its id, the round history, the initial model's scores, scoring a model on the
hub's validation split and test set, and checkpoints (silo_server/state/checkpoint.py writes and verifies the files)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from security.audit import AuditLog
from silo_core.algorithms.base import HubState
from silo_core.files import write_json_atomic
from silo_core.rounds import RoundRecord, Scores, records_from_json
from silo_server.rounds.breaker import BreakerHunt
from silo_server.state.checkpoint import MANIFEST, CheckpointError, load_latest, save_checkpoint

log = logging.getLogger("silo_server")

Scorer = Callable[[HubState], dict[str, float]]

# The breaker search and the privacy accountant as of the round's last refused sum: a checkpoint is written only
# when a round is applied, so without this file a hub restarted in the middle of a search would start it over from
# the cohort that failed, and forget the epsilon the refused (but unmasked) sums spent.
HUNT_FILE = "breaker_hunt.json"


class RunRecords:
    def __init__(self, state_dir: Path, *, evaluate: Scorer | None = None, validate: Scorer | None = None,
                 privacy: Any = None, audit: AuditLog | None = None):
        self.state_dir = Path(state_dir)
        self.audit = audit  # the hub's audit: every checkpoint written goes in it with its files' sha256
        self.evaluate = evaluate  # the test set, where the hub has one
        self.validate_model = validate  # the hub's validation split: validation_* per round, model selection
        self.privacy = privacy  # HubPrivacy or None: its accountant is checkpointed with the rounds
        self.history: list[RoundRecord] = []
        self.initial = Scores()  # the initial model's scores, before round 1
        # Rounds whose applied sum held each silo's update, over the whole run: checkpointed, so that the card and
        # the gauge still count the rounds before a restart.
        self.contributed: dict[str, int] = {}
        # Called once each checkpoint is written: the hub app then writes what must not run ahead of it.
        self.after_save: Callable[[], None] | None = None
        self.hunt: BreakerHunt | None = None  # the round loop's, checkpointed with it
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = self._load_or_make_run_id()

    def _load_or_make_run_id(self) -> str:
        path = self.state_dir / "run.json"
        if path.is_file():
            return json.loads(path.read_text())["run_id"]
        run_id = uuid.uuid4().hex
        write_json_atomic(path, {"run_id": run_id, "created": time.time()})
        return run_id

    # ------------------------------------------------------------------ scores
    @property
    def scores_anything(self) -> bool:
        return self.validate_model is not None or self.evaluate is not None

    def score(self, state: HubState) -> Scores:
        """The served model's scores on the validation split and the test set, where the hub has them."""
        validation = self.validate_model(state) if self.validate_model is not None else None
        test = self.evaluate(state) if self.evaluate is not None else None
        return Scores.measured(test=test, validation=validation)

    def score_initial(self, state: HubState) -> None:
        """What the hub's labels alone taught the model before the silos start from it; scoring it now also pays
        the evaluation's first-call costs before round 1 rather than in it."""
        self.history = []
        self.initial = self.score(state)
        if self.initial != Scores():
            log.info("initial model (the hub's labels alone): %s",
                     json.dumps({k: short(v) for k, v in self.initial.to_json().items()}))

    # ------------------------------------------------------------------ checkpoints
    def load(self, total_rounds: int, check: Callable[..., Any]) -> tuple[HubState, dict[str, int]] | None:
        """Load and verify the latest checkpoint (silo_server/state/checkpoint.py says what is checked): its history,
        initial scores, rounds contributed and privacy accountant come back here; the state and the images each
        silo declared are returned. None when there is none; CheckpointError says which file and how to recover."""
        loaded = load_latest(self.state_dir, total_rounds=total_rounds, check=check)
        if loaded is None:
            return None
        state, info = loaded
        if info.get("run_id", self.run_id) != self.run_id:
            raise CheckpointError(
                f"{self.state_dir / 'checkpoints'} holds run {info['run_id']}, but {self.state_dir / 'run.json'} "
                f"names run {self.run_id} (missing, or from another run): restore run.json from the same backup as "
                "the checkpoints, or move checkpoints/ aside to start a new run. Resuming under another run id "
                "would make every silo pin the terms and open its privacy ledger again")
        declared = per_silo_counts(info, "declared_images")
        self.history = self._with_checkpoint_times(records_from_json(info.get("history", [])))
        self.initial = Scores.from_json(info.get("initial", {}))
        self.contributed = per_silo_counts(info, "rounds_contributed")
        after = self._refused_after(state.round) or {}
        if self.privacy is not None:
            self.privacy.load_state_dict(after.get("privacy") or info.get("privacy"))
        if self.hunt is not None:
            self.hunt.restore(after.get("breaker_hunt") or info.get("breaker_hunt") or {})
        log.info("resumed from checkpoint after round %d", state.round)
        return state, declared

    def save_refused(self, round_number: int) -> None:
        """After a refused secure sum in `round_number`: keep the breaker search and the accountant as they now
        stand."""
        saved: dict[str, Any] = {"run_id": self.run_id, "round": round_number}
        if self.hunt is not None:
            saved["breaker_hunt"] = self.hunt.to_json()
        if self.privacy is not None:
            saved["privacy"] = self.privacy.state_dict()
        write_json_atomic(self.state_dir / HUNT_FILE, saved)

    def _refused_after(self, checkpoint_round: int) -> dict[str, Any] | None:
        """What a refused sum in the round after the checkpoint saved, if any (older ones are in the checkpoint
        already)."""
        try:
            saved = json.loads((self.state_dir / HUNT_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("cannot read %s (%s): the breaker search and the privacy accountant go on from the "
                        "checkpoint's", HUNT_FILE, err)
            return None
        if not isinstance(saved, dict) or saved.get("run_id") != self.run_id:
            return None
        if saved.get("round") != checkpoint_round + 1:
            return None
        return {k: v for k, v in saved.items() if k in ("breaker_hunt", "privacy") and isinstance(v, dict)}

    def _with_checkpoint_times(self, history: list[RoundRecord]) -> list[RoundRecord]:
        """A checkpoint cannot hold its own write time; history.json, written just after it, has it. Only that
        timing is taken from it (the verified checkpoint stays the record of everything else)."""
        try:
            saved = json.loads((self.state_dir / "history.json").read_text())
            times = {r.round: r.checkpoint_seconds for r in records_from_json(saved.get("rounds", []))}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return history
        if saved.get("run_id") != self.run_id:
            return history
        return [replace(r, checkpoint_seconds=times.get(r.round)) if r.checkpoint_seconds is None else r
                for r in history]

    def save(self, state: HubState, declared_images: dict[str, int]) -> None:
        history, initial = [r.to_json() for r in self.history], self.initial.to_json()
        info: dict[str, Any] = {"run_id": self.run_id, "history": history, "initial": initial,
                                # fixed for the run: a restarted hub must not let a silo declare more
                                "declared_images": declared_images, "rounds_contributed": dict(self.contributed)}
        if self.privacy is not None:
            info["privacy"] = self.privacy.state_dict()  # the accountant: a restarted hub continues the same count
        if self.hunt is not None:  # a search for a secure-sum breaker outlives the round it began in
            info["breaker_hunt"] = self.hunt.to_json()
        folder = save_checkpoint(self.state_dir, state, info)
        self.write_history()
        if self.audit is not None:
            manifest = json.loads((folder / MANIFEST).read_text())
            self.audit.append("model_written", run=self.run_id, round=state.round,
                              file=str(folder.relative_to(self.state_dir)), sha256=manifest["sha256"])
        if self.after_save is not None:
            self.after_save()

    def credit(self, silo_ids: set[str]) -> None:
        """These silos' updates are in the round being applied: one more round each."""
        for silo_id in silo_ids:
            self.contributed[silo_id] = self.contributed.get(silo_id, 0) + 1

    def write_history(self) -> None:
        """history.json: what silo-sim, the benchmarks and an operator read while the run goes on."""
        write_json_atomic(self.state_dir / "history.json", {"run_id": self.run_id, "initial": self.initial.to_json(),
                                                            "rounds": [r.to_json() for r in self.history]})


def per_silo_counts(info: dict[str, Any], key: str) -> dict[str, int]:
    """A checkpoint's count per silo under `key`, keeping only whole non-negative numbers."""
    return {str(k): int(v) for k, v in (info.get(key) or {}).items()
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def short(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v
