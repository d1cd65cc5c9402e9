"""One attempt of a round while it is open: its plan and bundle, the silos sampled and what each has done, the running
sums (or the update files of a robust rule), its privacy state and its byte and memory counts. The round loop
(round_loop.py) opens and closes it; the silos' calls (silo_server/wire/intake.py) fill it under the hub's lock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from silo_core.algorithms.base import RoundPlan
from silo_core.tensors import TensorSpec
from silo_server.rounds.aggregate import RunningSum
from silo_server.rounds.robust import UpdateStore


@dataclass
class Broadcast:
    """A round's model for the live silos outside its sample (HubAlgorithm.broadcasts_model). One per round, shared
    by its attempts, so a silo receives the round's model once even when the round is retried."""

    received: set[str] = field(default_factory=set)  # silos that downloaded it without being sampled
    bytes_down: int = 0
    closed: bool = False  # the round's record is written: no more downloads (they would go uncounted)


@dataclass
class ActiveTask:
    round: int
    attempt: int
    task_id: str
    plan: RoundPlan
    bundle: bytes
    bundle_sha256: str
    hyperparameters_json: str  # the algorithm's plan hyperparameters, as the wire carries them
    sampled: set[str]
    deadline: float
    expected: dict[str, TensorSpec]  # what uploads must hold, in wire dtypes
    started: float = field(default_factory=time.time)
    reported: set[str] = field(default_factory=set)
    report_seconds: list[float] = field(default_factory=list)  # seconds from the round's opening to each report
    quorum_wait: float | None = None  # set when the round closed this long after its quorum, without the rest
    skipped: set[str] = field(default_factory=set)
    downloaded: set[str] = field(default_factory=set)
    sums: RunningSum = field(default_factory=RunningSum)
    bytes_up: int = 0
    bytes_down: int = 0
    open: bool = True
    privacy: Any = None  # RoundPrivacy when privacy is on (silo_server/rounds/privacy.py)
    accepted: dict[str, TensorSpec] | None = None  # what uploads must hold, when it differs from plan.expected
    weight_caps: dict[str, float] = field(default_factory=dict)  # the most weight each sampled silo may carry
    gone: set[str] = field(default_factory=set)  # sampled silos known to have left the round (revoked, aborted)
    rss_at_open: int | None = None  # hub RSS when the task opened, and its peak until the task closed (Linux)
    rss_peak_collecting: int | None = None
    # Under a robust aggregation rule (not mean): the individual updates, one file each, instead of `sums`
    # (which then holds only the silos' metrics).
    updates: UpdateStore | None = None
    broadcast: Broadcast | None = None  # set when the algorithm hands the round's model to every live silo
    # Hyperparameters the hub adds to every plan (privacy.sample_dp). On the wire they travel as the task's typed
    # privacy (silo.v1.TaskPrivacy.sample_dp), which a silo checks against the run's terms; the in-process transport
    # adds them to the plan as they are.
    round_hyperparameters: dict[str, Any] = field(default_factory=dict)
