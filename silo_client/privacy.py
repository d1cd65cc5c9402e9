"""The silo's privacy layer: DP on its own update, and its half of secure aggregation over the wire.

A TRAIN task with typed privacy (silo.v1.TaskPrivacy, already checked against the run's pinned terms and this
branch's policy by the client) changes what happens to the local result:

- client_dp: the update is clipped to the round's norm and, with distributed noise, this silo's share of the
  Gaussian noise is added (security/dp.py) before anything leaves the process. The noise is never below what the
  pinned terms and the branch's policy require (`noise_std`, computed by the caller), whatever the task says.
- secagg_session: the result is not uploaded at all. The silo keeps it, starts a SecAgg+ session and uploads only
  its public keys, signed with its certificate (stage advertise_keys). The hub then hands out the share_keys,
  masked_input, consistency and unmask stages as SECAGG tasks; each answer goes back through Upload with
  UploadHeader.secagg_stage. The silo checks its neighbours' certificates and signatures, and reveals no share
  before it holds enough signatures over one survivor set (security/secagg/silo.py). A silo that has nothing to
  contribute still takes part with zeros, so the hub cannot tell it apart.

Under either, no clear per-silo metrics are sent (they are derived from the silo's data). Every message goes out
through the client's Outbox (`send_result`, `send_stage`), which checks it against the policy and audits it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from security.dp import SiloInstructions, privatize_update
from security.secagg import SecAggError, SiloSession
from security.secagg.graph import degree_for, threshold_for
from security.secagg.identity import PeerVerifier, SiloIdentity
from security.terms import Breach
from silo.v1 import silo_pb2
from silo_client.errors import SiloError
from silo_client.policy import BranchPolicy
from silo_core.algorithms.base import SiloResult
from silo_core.files import write_json_atomic
from silo_core.tensors import DTYPES, TensorSpec

log = logging.getLogger("silo_client")
SIGNED_SESSIONS_FILE = "secagg_signed_sessions.json"


@dataclass
class Pending:
    session: SiloSession
    tensors: dict[str, torch.Tensor]
    round: int
    # Writes the round's ledger entry and returns its figures: called just before the masked input leaves, the
    # first message derived from the update, so an attempt left or dropped before then charges nothing.
    charge: Callable[[], dict | None]
    epsilon: dict | None = None  # the ledger's figures once charged, for the audit of every later stage message
    answers: dict[str, bytes] = field(default_factory=dict)  # stage -> what we sent (resent if asked again)


@dataclass(frozen=True)
class SessionFloor:
    """What this silo requires of a secure-aggregation session: the run's pinned promises and its policy's."""

    min_cohort: int = 0  # the survivor set, signed by this many silos, must hold at least this many
    min_threshold: int = 0  # shares its neighbours must reveal before its masks can be removed
    threshold: float = 0.0  # the pinned shape: t as a fraction of k (0: none pinned) ...
    neighbours: int = 0  # ... and k when the hub fixes it (0: 3 ceil(log2 n))

    @classmethod
    def of(cls, pinned: silo_pb2.PrivacyTerms, policy: BranchPolicy | None) -> SessionFloor:
        """The stricter of the run's pinned terms and the branch's policy, line by line: a hub that promised a
        floor in its terms is held to it even where the policy asks for less (or the silo has none)."""
        sa, mine = pinned.secure_aggregation, policy.secure_aggregation if policy is not None else None
        return cls(min_cohort=max(sa.min_cohort, mine.min_cohort if mine else 0),
                   min_threshold=max(sa.min_threshold, mine.min_threshold if mine else 0),
                   threshold=sa.threshold if sa.enabled else 0.0, neighbours=sa.neighbours if sa.enabled else 0)

    def threshold_at(self, contributors: int) -> int:
        """The least t this silo accepts in a round whose sum must hold `contributors` silos: the pinned shape's t
        for a round of that many (the round samples at least as many, and k and t only grow with it), and never
        below min_threshold. The pinned min_threshold alone is the t of the run's smallest round: a hub could
        hand one silo a two-neighbour roster in a round of fifty, where its two neighbours unmask it."""
        if not self.threshold:
            return self.min_threshold
        try:
            t = threshold_for(degree_for(contributors, self.neighbours or None), self.threshold)
        except ValueError:  # too few for any round: the session's own checks refuse it
            return self.min_threshold
        return max(self.min_threshold, t)


class SiloPrivacy:
    """Transport-free: `send_result(task, tensors, metrics, skipped, charge)` uploads a result as usual and
    `send_stage(task_id, round, stage, payload, charge, tensors)` uploads a secure-aggregation stage message;
    each calls `charge` (silo_client/outbox.py Charge) once the policy allows the message, before it leaves.
    `identity` signs this silo's keys and `verifier` checks its neighbours' (None: an unsigned session, only under
    terms that say so: a hub in --insecure-dev-only mode)."""

    def __init__(self, send_result: Callable[..., int], send_stage: Callable[..., None],
                 identity: SiloIdentity | None = None, verifier: PeerVerifier | None = None,
                 state_dir: Path | None = None):
        self.send_result, self.send_stage = send_result, send_stage
        self.identity, self.verifier = identity, verifier
        self.pending: dict[str, Pending] = {}  # session (= task id) -> state
        # The sessions whose survivor set this silo signed, kept across restarts: a hub that runs one session id
        # again could replay those signatures to other silos of a later instance and unmask an input (a silo
        # signs one survivor set per session; the protocol's guarantee rests on that).
        self.signed_path = Path(state_dir) / SIGNED_SESSIONS_FILE if state_dir is not None else None
        self.signed_sessions: set[str] = self._read_signed()

    def _read_signed(self) -> set[str]:
        if self.signed_path is None or not self.signed_path.is_file():
            return set()
        try:
            sessions = json.loads(self.signed_path.read_text())["sessions"]
            if isinstance(sessions, list) and all(isinstance(s, str) for s in sessions):
                return set(sessions)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        raise SiloError(f"{self.signed_path} is damaged: restore it from a backup of this state folder (it lists "
                          "the secure-aggregation sessions this silo has signed, so that none is run twice)")

    def replayed_session(self, task: silo_pb2.TaskPrivacy) -> Breach | None:
        """A task that runs again a secure-aggregation session whose survivor set this silo signed: a breach (an
        honest hub draws a new session id for every attempt of every round)."""
        session = task.secagg_session
        if not session or session not in self.signed_sessions:
            return None
        return Breach("secure_aggregation.signed", "one survivor set signed per session", f"session {session[:40]} "
                      "again", f"a task runs secure-aggregation session {session[:40]} again, whose survivor set this "
                      "silo already signed: signatures replayed from it could unmask a silo's input")

    def _signed(self, session_id: str) -> None:
        self.signed_sessions.add(session_id)
        if self.signed_path is not None:
            write_json_atomic(self.signed_path, {"sessions": sorted(self.signed_sessions)})

    def submit(self, silo_id: str, run_id: str, task: silo_pb2.Task, result: SiloResult,
               expected: dict[str, TensorSpec], *, noise_std: float = 0.0, floor: SessionFloor = SessionFloor(),
               charge: Callable[[], dict | None] = lambda: None) -> str:
        """Apply the task's privacy to a local result and send what the protocol allows; `charge` writes the
        round's ledger entry (and returns its figures for the audit) before the update or its masked input
        leaves."""
        p = task.privacy
        secagg = bool(p.secagg_session)
        tensors = {} if result.skipped else dict(result.tensors)
        if secagg and result.skipped:  # take part with zeros: the hub learns only the sum
            tensors = {n: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for n, s in expected.items()}
        dp = p.client_dp
        if dp.enabled and tensors:
            instructions = SiloInstructions(clip_norm=dp.clip_norm, noise_std=max(dp.noise_std, noise_std),
                                            indicator_noise_std=dp.indicator_noise_std, adaptive=dp.adaptive,
                                            clip_tensors=list(dp.clip_tensors))
            tensors, stats = privatize_update(tensors, instructions)
            log.info("round %d: update norm %.4g, clip %.4g%s, noise std %.4g", task.round, stats["update_norm"],
                     instructions.clip_norm, " (clipped)" if stats["clipped"] else "", instructions.noise_std)
            tensors = {n: t.to(torch.float32) if t.is_floating_point() else t for n, t in tensors.items()}
        if not secagg:
            self.send_result(task, tensors, {}, result.skipped, None if result.skipped else charge)
            return "update sent (clipped" + (", noised)" if noise_std or dp.noise_std else ")")
        session_id = p.secagg_session
        cohort = max(floor.min_cohort, p.min_contributors)
        session = SiloSession(session_id, silo_id, identity=self.identity, verifier=self.verifier, run_id=run_id,
                              min_cohort=cohort, min_threshold=floor.threshold_at(cohort))
        self.pending = {session_id: Pending(session, tensors, task.round, charge)}
        payload = self.pending[session_id].answers["advertise_keys"] = session.advertise_keys()
        self.send_stage(task.task_id, task.round, "advertise_keys", payload, None, None)
        return "keys advertised for secure aggregation"

    def advertised(self, task_id: str) -> bytes | None:
        """The keys this silo advertised for the task's session, while it is under way (None: none)."""
        p = self.pending.get(task_id)
        return p.answers.get("advertise_keys") if p is not None else None

    def run_stage(self, task: silo_pb2.Task) -> None:
        """Answer one SECAGG task; a session that cannot go on says so (stage abort) and is forgotten."""
        stage, p = task.secagg_stage, self.pending.get(task.task_id)
        if p is None:
            self.send_stage(task.task_id, task.round, "abort", b"no session here (silo restarted?)", None, None)
            return
        if stage in p.answers:  # our answer was lost on the way: send the same bytes again
            self.send_stage(task.task_id, task.round, stage, p.answers[stage], lambda: p.epsilon, None)
            return
        tensors = None
        try:
            if stage == "share_keys":
                answer = p.session.share_keys(task.secagg_payload)
            elif stage == "masked_input":
                tensors = [[n, list(t.shape), "masked"] for n, t in sorted(p.tensors.items())]
                answer = p.session.masked_input(task.secagg_payload, p.tensors)
                if p.session.clipped_values:
                    log.warning("round %d: %d values outside the fixed-point range were clipped; widen "
                                "privacy.secure_aggregation.quantization at the hub", p.round, p.session.clipped_values)
                p.tensors = {}
            elif stage == "consistency":
                answer = p.session.consistency(task.secagg_payload)
                self._signed(task.task_id)  # before the signature leaves
            elif stage == "unmask":
                answer = p.session.unmask(task.secagg_payload)
            else:
                raise SecAggError(f"unknown stage {stage!r}")
        except SecAggError as err:
            log.warning("round %d: leaving secure aggregation: %s", task.round, err)
            self.pending.pop(task.task_id, None)
            self.send_stage(task.task_id, task.round, "abort", str(err).encode(), lambda: p.epsilon, None)
            return
        p.answers[stage] = answer

        def charge() -> dict | None:  # the masked input is charged once the policy lets it leave, and only once
            if stage == "masked_input" and p.epsilon is None:
                p.epsilon = p.charge()
            return p.epsilon

        self.send_stage(task.task_id, task.round, stage, answer, charge, tensors)
        log.info("round %d: secure aggregation %s sent (%d bytes)", task.round, stage, len(answer))
        if stage == "unmask":
            self.pending.pop(task.task_id, None)
