"""The branch's own privacy ledger: what this silo has spent, by its own count, per run and over its lifetime.

The hub reports epsilon too, but a branch that must answer for its patients' images cannot rest on the hub's
numbers: this ledger counts only the rounds THIS silo contributed to (record_round is called for each one), from
the privacy settings the silo itself applied, once for each update it released: a task trained again (by a silo
restarted before its upload was accepted) is charged again, while the same bytes sent again cost nothing. It lives
in one JSON file, `privacy-ledger.json`, in the silo's state folder, written atomically after every change, so a
restarted silo continues from it. A damaged file stops the silo (LedgerError): deleting it would forget privacy
already spent.

Two guarantees are tracked apart, because they protect different things against different adversaries:

- client_dp: client-level DP with distributed noise. The hub sees only the sum of the cohort's clipped, noised
  updates: one step of the Gaussian mechanism with noise multiplier z per round this silo contributed to, charged
  at sampling rate q = 1 (the hub knows whom it sampled, so no amplification by subsampling is claimed against
  it), accounted with silo_core.accounting.PrivacyAccountant("rdp", delta). It holds while at least the round's minimum
  number of cohort silos add their noise honestly.
- sample_dp: sample-level DP-SGD in this silo's local training. Its epsilon is what the silo's own DP-SGD
  accountant reports after the round (the run's running total, handed in); it holds against any hub.

Per run, the image-level epsilon is the smaller of the two that applied: client-level DP of the whole silo bounds
every image in it too. A guarantee applies to a run only if every round the silo contributed had it (one round
sent without it is unbounded under that guarantee, reported as inf), so a run with a round under neither has
image-level epsilon inf. A run without rounds has spent nothing (0.0).

Lifetime epsilon is the sum of the runs' image-level epsilons: basic composition across all runs and hubs. Each
run is accounted at its own delta (the policy's delta when the run began), so the lifetime guarantee holds at the
sum of those runs' deltas (lifetime_delta). In the file, an infinite epsilon is written as the string "inf" so
that the file stays standard JSON.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from silo_core.accounting import PrivacyAccountant  # numpy only: Opacus loads when an epsilon is computed
from silo_core.files import write_json_atomic

LEDGER_FILE = "privacy-ledger.json"
FORMAT = "silokit branch privacy ledger v1"
CLIENT_DP, SAMPLE_DP = "client_dp", "sample_dp"
GUARANTEES = {
    CLIENT_DP: {
        "name": "client-level DP with distributed noise",
        "accounting": "Gaussian mechanism on the cohort's sum, noise multiplier z, one step per round this silo "
                      "contributed to, sampling rate q = 1 (no amplification by subsampling claimed against the "
                      "hub); RDP accountant",
        "holds": "holds while at least the round's minimum number of cohort silos add their noise honestly",
    },
    SAMPLE_DP: {
        "name": "sample-level DP-SGD",
        "accounting": "epsilon as this silo's own DP-SGD accountant reports it after the round",
        "holds": "holds against any hub",
    },
}
COMPOSITION = ("image-level epsilon per run: the smaller of the client-level and sample-level epsilons that "
               "applied to every contributed round (inf when neither did); lifetime epsilon: the sum of the runs' "
               "image-level epsilons (basic composition), at the sum of those runs' deltas")
LEAVE_KINDS = ("refused", "breach", "budget")  # the reasons the silo client gives; others are kept as given
# The figures every audited message derived from a charged update carries (silo_client/outbox.epsilon_fields writes
# them, silo-audit reads them), and the key naming which of a task's releases the message belongs to.
EPSILON_KEYS = ("client", "sample", "image", "lifetime")
RELEASE = "release"


class LedgerError(ValueError):
    """The ledger file is damaged or a call does not fit it; the message names the file and what to do."""


@dataclass(frozen=True)
class RunEpsilon:
    """One run's epsilons. client/sample: None where that guarantee did not apply to any round, inf where it
    applied to some rounds but not all; image: the smaller that applied (inf if none, 0.0 before any round)."""

    client: float | None
    sample: float | None
    image: float


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _enc(value: float | None) -> float | str | None:
    if value is None:
        return None
    return "inf" if math.isinf(value) else float(value)


def _dec(value: Any) -> float | None:
    if value is None:
        return None
    return math.inf if value == "inf" else float(value)


def _is_eps(value: Any, none_ok: bool = True) -> bool:
    if value is None:
        return none_ok
    if value == "inf":
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_accountant(d: Any) -> str | None:
    """Why an accountant's JSON is unusable, or None (checked here so that reading needs no torch)."""
    if not isinstance(d, dict) or d.get("mechanism") not in ("rdp", "prv"):
        return "its client accountant has no mechanism rdp or prv"
    delta = d.get("delta")
    if not isinstance(delta, int | float) or not 0 < delta < 1:
        return f"its client accountant's delta {delta!r} is not in (0, 1)"
    history = d.get("history")
    if not isinstance(history, list):
        return "its client accountant has no history list"
    for step in history:
        ok = (isinstance(step, list) and len(step) == 3 and all(isinstance(x, int | float) for x in step)
              and step[0] > 0 and 0 < step[1] <= 1 and step[2] == int(step[2]) and step[2] >= 1)
        if not ok:
            return f"its client accountant has an invalid step {step!r}"
    return None


def _check_run(run_id: str, run: Any) -> str | None:
    """Why one run's record is unusable, or None."""
    if not isinstance(run, dict):
        return f"run {run_id!r} is not a record"
    for key in ("delta", "client_accountant", "sample_epsilon", "rounds", "leaves", "sample_dp"):
        if key not in run:
            return f"run {run_id!r} lacks {key!r}"
    if not isinstance(run["delta"], int | float) or not 0 < run["delta"] < 1:
        return f"run {run_id!r} has delta {run['delta']!r}, not in (0, 1)"
    why = _check_accountant(run["client_accountant"])
    if why:
        return f"run {run_id!r}: {why}"
    if not _is_eps(run["sample_epsilon"]):
        return f"run {run_id!r} has sample_epsilon {run['sample_epsilon']!r}"
    if not isinstance(run["rounds"], list) or not isinstance(run["leaves"], list):
        return f"run {run_id!r}: rounds and leaves must be lists"
    for entry in run["rounds"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("round"), int):
            return f"run {run_id!r} has a round without a round number: {entry!r}"
        for key in ("client", "sample", "image", "lifetime"):
            if not _is_eps(entry.get(key), none_ok=key in ("client", "sample")):
                return f"run {run_id!r} round {entry['round']}: {key} is {entry.get(key)!r}"
        z = entry.get("client_dp_noise")
        if z is not None and not (isinstance(z, int | float) and z > 0):
            return f"run {run_id!r} round {entry['round']}: client_dp_noise is {z!r}"
        release = entry.get(RELEASE, 1)
        if not isinstance(release, int) or isinstance(release, bool) or release < 1:
            return f"run {run_id!r} round {entry['round']}: {RELEASE} is {release!r}, not a count from 1"
    return None


def read_ledger(path: Path) -> dict[str, Any]:
    """The ledger file's content, checked; LedgerError naming the file if it is damaged."""

    def damaged(why: str) -> LedgerError:
        return LedgerError(f"privacy ledger {path} is damaged ({why}); restore it from a backup. Never delete it: "
                           "that would forget the privacy this silo has already spent")

    try:
        data = json.loads(Path(path).read_text())
    except UnicodeDecodeError as err:
        raise damaged(f"not text: {err}") from None
    except ValueError as err:
        raise damaged(f"not JSON: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise damaged(f"its format is not {FORMAT!r}")
    if not isinstance(data.get("delta"), int | float) or not 0 < data["delta"] < 1:
        raise damaged(f"its delta {data.get('delta')!r} is not in (0, 1)")
    if not isinstance(data.get("runs"), dict):
        raise damaged("it has no runs record")
    for run_id, run in data["runs"].items():
        why = _check_run(run_id, run)
        if why:
            raise damaged(why)
    return data


def _lifetime_delta(runs: dict[str, Any], exclude_run: str | None = None) -> float:
    return sum((float(run["delta"]) for r, run in runs.items() if r != exclude_run and run["rounds"]), 0.0)


def _accountant(run: dict[str, Any]) -> PrivacyAccountant:
    return PrivacyAccountant.from_json(run["client_accountant"])


class BranchLedger:
    """The ledger of one silo (one state folder). One silo process writes it at a time; a new process on the
    same folder continues where the last one left it."""

    def __init__(self, state_dir: Path, delta: float = 1e-5):
        if not 0 < delta < 1:
            raise LedgerError(f"privacy ledger in {state_dir}: delta must be in (0, 1), got {delta}")
        self.path = Path(state_dir) / LEDGER_FILE
        self.delta = float(delta)
        if self.path.exists():
            self._data = read_ledger(self.path)  # other deltas are fine: each run keeps its own
        else:
            # Written at the first round charged or the first leave: a silo that spends nothing writes no ledger,
            # and a silo-sim host's thousand silos pay for none at start.
            self._data = {"format": FORMAT, "delta": self.delta, "guarantees": GUARANTEES,
                          "composition": COMPOSITION, "runs": {}}
            self.path.parent.mkdir(parents=True, exist_ok=True)

    # -- reading
    def _run(self, run_id: str) -> dict[str, Any]:
        run = self._data["runs"].get(run_id)
        if run is None:
            raise LedgerError(f"privacy ledger {self.path} has no run {run_id!r}; call begin_run for it first")
        return run

    def runs(self) -> dict[str, dict[str, Any]]:
        """A copy of the file's per-run records, with infinite epsilons as float('inf')."""
        out = copy.deepcopy(self._data["runs"])
        for run in out.values():
            run["sample_epsilon"] = _dec(run["sample_epsilon"])
            for entry in run["rounds"]:
                for key in ("client", "sample", "image", "lifetime"):
                    entry[key] = _dec(entry.get(key))
        return out

    def run_delta(self, run_id: str) -> float:
        """The delta the run is accounted at: the policy's when the run began (a restarted silo whose policy has
        another delta keeps the run's), or this ledger's for a run not begun yet."""
        run = self._data["runs"].get(run_id)
        return float(run["delta"]) if run is not None else self.delta

    def sample_total(self, run_id: str) -> float:
        """The run's DP-SGD total recorded so far (0.0 before any)."""
        run = self._data["runs"].get(run_id)
        return (_dec(run["sample_epsilon"]) or 0.0) if run is not None else 0.0

    def run_epsilon(self, run_id: str) -> RunEpsilon:
        """The run's figures as of its last recorded round (RunEpsilon(None, None, 0.0) before any)."""
        rounds = self._run(run_id)["rounds"]
        if not rounds:
            return RunEpsilon(None, None, 0.0)
        return self._stored(rounds[-1])

    @staticmethod
    def _stored(entry: dict[str, Any]) -> RunEpsilon:
        image = _dec(entry["image"])
        return RunEpsilon(_dec(entry["client"]), _dec(entry["sample"]), math.inf if image is None else image)

    def first_terms(self, run_id: str) -> str | None:
        """The terms digest this silo pinned when it first joined the run (None: a run it has no record of)."""
        run = self._data["runs"].get(run_id)
        return run.get("terms_sha256") if run is not None and run.get("begun") else None

    def breach_left(self, run_id: str) -> dict[str, Any] | None:
        """The silo's last departure from the run for a breach of its terms or policy, if it left it so."""
        run = self._data["runs"].get(run_id)
        breaches = [leave for leave in (run or {}).get("leaves", []) if leave.get("kind") == "breach"]
        return breaches[-1] if breaches else None

    def lifetime_epsilon(self, exclude_run: str | None = None) -> float:
        """Sum of the runs' image-level epsilons (basic composition), at lifetime_delta."""
        return sum((self.run_epsilon(r).image for r in self._data["runs"] if r != exclude_run), 0.0)

    def lifetime_delta(self, exclude_run: str | None = None) -> float:
        """The delta of the lifetime epsilon: the sum of the deltas of the runs that spent anything."""
        return _lifetime_delta(self._data["runs"], exclude_run)

    def releases(self, run_id: str, round_number: int, task: str = "") -> int:
        """How many times this run's ledger charged a release of `task` in round `round_number` (entries written
        before releases were numbered count as one each)."""
        return sum(1 for e in self._run(run_id)["rounds"] if e["round"] == round_number and e.get("task", "") == task)

    def client_epsilon_after(self, run_id: str, noise_multiplier: float) -> float:
        """This run's client-level epsilon after one more contributed round at `noise_multiplier` (q = 1); inf
        when a round of this run was already sent without client-level DP. A run not begun yet starts at 0."""
        run = self._data["runs"].get(run_id)
        if run is None:
            return PrivacyAccountant("rdp", self.delta).epsilon_after(noise_multiplier, 1.0)
        if any(e.get("client_dp_noise") is None for e in run["rounds"]):
            return math.inf
        return _accountant(run).epsilon_after(noise_multiplier, 1.0)

    # -- writing
    def _commit(self, data: dict[str, Any]) -> None:
        """Write a changed copy, and only then take it as this object's state (a failed write changes nothing)."""
        data["delta"] = self.delta
        write_json_atomic(self.path, data)
        self._data = data

    def _new_run(self, run_id: str) -> dict[str, Any]:
        return {"run": run_id, "delta": self.delta, "started": _now(), "hub": None, "terms_sha256": None,
                "client_dp_noise": None, "sample_dp": False, "begun": False,
                "client_accountant": {"mechanism": "rdp", "delta": self.delta, "history": []},
                "sample_epsilon": None, "rounds": [], "leaves": [], "changes": []}

    def begin_run(self, run_id: str, *, hub_serial: str, hub_fingerprint: str, terms_sha256: str,
                  client_dp_noise: float | None, sample_dp: bool) -> None:
        """Start a run's record. A run already begun (a restarted silo) keeps its record and charges; settings
        that differ from the first ones are kept in its `changes`, never overwritten."""
        if not run_id:
            raise LedgerError(f"privacy ledger {self.path}: a run needs a non-empty run id")
        data = copy.deepcopy(self._data)
        run = data["runs"].setdefault(run_id, self._new_run(run_id))
        settings = {"hub": {"serial": hub_serial, "fingerprint": hub_fingerprint}, "terms_sha256": terms_sha256,
                    "client_dp_noise": client_dp_noise, "sample_dp": bool(sample_dp)}
        if not run.get("begun"):
            run.update(settings, begun=True)
        else:
            changed = {k: v for k, v in settings.items() if run.get(k) != v}
            if not changed:
                return
            run["changes"].append({"time": _now(), **changed})
        # Kept in memory until the run's first round or leave is written with it: beginning a run spends nothing,
        # and a silo-sim host's thousand silos joining write no file each.
        self._data = data

    def record_round(self, run_id: str, round_number: int, *, client_dp_noise: float | None,
                     sample_epsilon: float | None, task: str = "") -> RunEpsilon:
        """Charge one release of an update this silo trained: one client-level step when client_dp_noise is set,
        and the run's sample-level total when sample_epsilon is given. Every call is a new release and is charged,
        the same task included: a silo that trains a task again (its first upload failed, or it restarted) sends
        a new noised update, and a hub that reports uploads lost must not get fresh samples for free. The entry's
        `release` numbers the task's releases from 1 (`releases`); resending the same bytes charges nothing and is
        the client's to do without calling this."""
        run = self._run(run_id)
        if client_dp_noise is not None and not (math.isfinite(client_dp_noise) and client_dp_noise > 0):
            raise LedgerError(f"privacy ledger {self.path}: run {run_id!r} round {round_number}: client_dp_noise "
                              f"must be a positive number or None, got {client_dp_noise}")
        if sample_epsilon is not None and not sample_epsilon >= 0:  # NaN fails this too
            raise LedgerError(f"privacy ledger {self.path}: run {run_id!r} round {round_number}: sample_epsilon "
                              f"must be >= 0 or None, got {sample_epsilon}")
        data = copy.deepcopy(self._data)
        run = data["runs"][run_id]
        accountant = _accountant(run)
        if client_dp_noise is not None:
            accountant.step(float(client_dp_noise), 1.0)
            run["client_accountant"] = accountant.to_json()
        if sample_epsilon is not None:
            # The running total only grows; a smaller one (a reset DP-SGD ledger) never lowers what was spent.
            run["sample_epsilon"] = _enc(max(_dec(run["sample_epsilon"]) or 0.0, float(sample_epsilon)))
        release = 1 + self.releases(run_id, round_number, task)
        entry = {"round": int(round_number), "task": str(task), RELEASE: release, "time": _now(),
                 "client_dp_noise": None if client_dp_noise is None else float(client_dp_noise),
                 "sample_dp": sample_epsilon is not None}
        rounds = [*run["rounds"], entry]
        n = len(rounds)
        with_client = sum(e["client_dp_noise"] is not None for e in rounds)
        with_sample = sum(bool(e["sample_dp"]) for e in rounds)
        client = None if with_client == 0 else (accountant.epsilon() if with_client == n else math.inf)
        sample = None if with_sample == 0 else (_dec(run["sample_epsilon"]) if with_sample == n else math.inf)
        image = min((x for x in (client, sample) if x is not None), default=math.inf)
        others = sum((self.run_epsilon(r).image for r in data["runs"] if r != run_id), 0.0)
        run["rounds"] = rounds
        entry.update(client=_enc(client), sample=_enc(sample), image=_enc(image), lifetime=_enc(others + image))
        entry["lifetime_delta"] = _lifetime_delta(data["runs"])
        self._commit(data)
        return RunEpsilon(client, sample, image)

    def record_leave(self, run_id: str, kind: str, clause: str, message: str) -> None:
        """Why the silo left a run ("refused", "breach", "budget"). A run refused before it began gets a record
        of its own, with no rounds."""
        data = copy.deepcopy(self._data)
        run = data["runs"].setdefault(run_id, self._new_run(run_id))
        run["leaves"].append({"time": _now(), "kind": kind, "clause": clause, "message": message})
        self._commit(data)
