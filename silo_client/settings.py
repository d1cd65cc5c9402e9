"""What one silo is set up with (SiloSettings: silo-client's options, or silo-sim's for a simulated silo) and what it
says once at start about the policy it follows."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from silo_client.policy import BranchPolicy
from silo_core.algorithms.base import SiloAlgorithm
from silo_core.data import DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS


@dataclass
class SiloSettings:
    hub: str
    certs: Path | None  # None only with insecure_dev_silo_id
    data: Path | None  # unlabeled images; a fully labeled site may have none
    device: str = "auto"
    state_dir: Path | None = None
    connect_timeout_s: float = 300.0  # give up when the hub has been unreachable this long (0: never)
    tls_refused_grace_s: float = 30.0  # ...or when the TLS handshake has been refused for certain this long
    sim_labels: Path | None = None  # simulation only: true labels, to report pseudo-label accuracy
    # Simulation only: wraps this silo's algorithm once it is built (silo-sim's attacking silos poison their results
    # after honest training: silo_sim/attacks.py). The simulator hands it in; the silo never imports simulation
    # code, and silo-client has no flag for it: a real branch never poisons.
    wrap_algorithm: Callable[[SiloAlgorithm], SiloAlgorithm] | None = None
    name: str = ""  # for log lines; identity itself comes from the certificate
    labeled: Path | None = None  # labeled images in ImageFolder layout (HASSLE: any site may hold some)
    # DEVELOPMENT ONLY: talk plaintext to a `silo-server --insecure-dev-only` hub on this machine, declaring this id.
    insecure_dev_silo_id: str | None = None
    crl: Path | None = None  # the CA's revocation list to check the hub against (default: crl.pem in the bundle)
    # A folder whose decoded images fit in this many MiB is held in memory; a bigger one is read from disk batch by
    # batch by loader_workers processes (silo_core.data.ImageFiles).
    cache_mb: float = DEFAULT_CACHE_MB
    loader_workers: int = DEFAULT_LOADER_WORKERS
    # Model factories ("package.module:callable") this silo's operator allows: the only code a run can make it import.
    model_factories: tuple[str, ...] = ()
    # The branch's privacy policy (silo-client --policy; silo_client/policy.py). None: follow the hub's terms (still
    # checking every task against them, and keeping the ledger and the audit).
    policy: BranchPolicy | None = None
    # Join ready on the count of image files and decode them at this silo's first task instead of before joining:
    # silo-sim's silos, most of which a short run never samples (Flower's simulation builds a client when sampled).
    load_when_sampled: bool = False


DEFAULT_DELTA = 1e-5  # the ledger's delta without a policy (a policy states its own)
_SAID_NO_POLICY = threading.Event()


def say_policy_once(log: logging.Logger, policy: BranchPolicy | None, state_dir: Path) -> None:
    """Once per process: with no policy the silo follows the hub's terms (and says so); with one, its floor."""
    if policy is None:
        if not _SAID_NO_POLICY.is_set():
            _SAID_NO_POLICY.set()
            log.info("no branch policy (--policy): this silo follows the hub's privacy terms, checks every task "
                     "against the terms pinned when it joins, and keeps its ledger and audit in %s", state_dir)
        return
    sa, dp, sd = policy.secure_aggregation, policy.client_dp, policy.sample_dp
    parts = [f"secure aggregation over >= {sa.min_cohort} silos" if sa.required else "",
             f"client-level DP (z >= {dp.min_noise_multiplier:g})" if dp.required else "",
             "DP-SGD" if sd.required else "",
             f"lifetime epsilon {policy.lifetime_epsilon:g}" if policy.lifetime_epsilon is not None else "",
             "no clear metrics" if not policy.clear_metrics else ""]
    log.info("branch policy: %s; ledger and audit in %s", ", ".join(p for p in parts if p) or "no floor beyond "
             "the allowed algorithms and models", state_dir)
