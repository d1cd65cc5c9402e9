"""A silo: dials out to the hub, joins, long-polls for tasks, trains locally, uploads summable results.

Images never leave this process: only what the algorithm's silo half returns (weighted deltas, counts) is sent.
The hub being away (down, restarting, unreachable) is normal: the silo backs off and reconnects, and joins again
when the hub no longer knows it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from security.audit import AUDIT_FILE, AuditLog
from security.secagg.identity import PeerVerifier, SiloIdentity
from security.secagg.messages import MAX_TASK_MESSAGE_BYTES
from security.terms import (
    FEATURES,
    FIRST_RELEASE,
    POLICY,
    PROTOCOL_VERSION,
    SIGNED_SECAGG,
    clear_metrics_allowed,
    describe,
    task_breaches,
    terms_sha256,
)
from security.terms import as_dict as terms_dict
from security.tls import insecure_dev_channel, read_bundle, secure_channel
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.budget import DP_SGD_LIMITS, TaskBudget
from silo_client.connection import TRANSIENT, WAIT_TASK_CAP_S, Connection, Outcome, Phase
from silo_client.errors import SiloError, SiloLeft, UpdateUnsendable
from silo_client.hub_link import (
    HUB_CHECK_EVERY_S,
    HubCertificateCheck,
    HubCertificateUnchecked,
    HubTlsRefused,
    describe_rpc_error,
    retry_after_s,
)
from silo_client.ledger import BranchLedger
from silo_client.local_data import load_branch_data, usable_count
from silo_client.metrics import SiloMetricFamilies, SiloMetrics
from silo_client.outbox import Charge, Outbox, PolicyStop, SentUpload, metrics_allowed, update_to_send
from silo_client.policy import Refusal, allowed_factories, check_run, required_noise_std
from silo_client.privacy import SessionFloor, SiloPrivacy
from silo_client.run_checks import (
    PROCESS_CHECKS,
    check_architecture,
    check_counts_for,
    check_data_for,
    check_model_allowed,
    check_upload_fits,
    count_image_files,
    data_key,
    described,
    guards_against_hub,
    least_update_bytes,
    model_spec_of,
    rehearse,
    sample_dp_unkept,
    tells_clear_facts,
)
from silo_client.settings import DEFAULT_DELTA, SiloSettings, say_policy_once
from silo_core.algorithms import ALGORITHMS, get_algorithm
from silo_core.algorithms.base import RoundPlan, SiloAlgorithm, SiloData
from silo_core.data import (
    IMAGE_EXTENSIONS,
    DataError,
    ImageFiles,
)
from silo_core.tensors import CodecError, TensorSpec, assemble, decode
from silo_core.training import resolve_device

VERSION = "0.2.0"
NEXT_TASK_TIMEOUT_S = 330.0  # above the hub's longest long-poll (server.long_poll_s, at most 300 s)
_TERMS_SAID: set[tuple[str, str]] = set()  # (run, terms hash) whose terms this process has logged


def run_here(work: Callable[..., Any], *args: Any) -> Any:
    return work(*args)


class SiloClient:
    """One silo. `run_work` runs its heavy work (loading its images, each task: download, training, upload):
    here, on the silo's own thread, by default. silo-sim hosts many silos in one process and passes a function that
    runs the work of all of them on one shared thread instead, one job at a time: torch then keeps a single team of
    OpenMP threads, which spin between operations; with a team per silo thread (more threads than cores) OpenMP
    stops spinning and local training ran 5-30% slower a round (bench/systems, deployment overhead)."""

    def __init__(self, settings: SiloSettings, run_work: Callable[..., Any] = run_here,
                 stop_event: threading.Event | None = None, metrics: SiloMetrics | None = None):
        self.s = settings
        # Always kept; served only when the caller serves them (silo-client --metrics-port, silo-sim workers).
        self.metrics = metrics or SiloMetrics(SiloMetricFamilies(), settings.name or "silo")
        self.log = logging.getLogger(f"silo_client.{settings.name}" if settings.name else "silo_client")
        self.run_work = run_work
        self.stop_event = stop_event or threading.Event()
        self.device = resolve_device(settings.device)
        if settings.data is None and settings.labeled is None:
            raise DataError("no data: pass --data with the folder of this silo's unlabeled images and/or --labeled "
                            "with a folder of labeled images (one sub-folder per class)")
        self.num_files = count_image_files(settings.data) if settings.data is not None else 0
        self.num_labeled_files = count_image_files(settings.labeled, "--labeled") if settings.labeled is not None else 0
        if self.num_files == 0 and settings.data is not None and self.num_labeled_files == 0:
            raise DataError(f"data folder {settings.data} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                            f"point --data at the folder of this silo's images")
        options = [
            ("grpc.max_receive_message_length", MAX_TASK_MESSAGE_BYTES), ("grpc.max_send_message_length", 8 << 20),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 0),
        ]
        bundle = None
        if settings.insecure_dev_silo_id:
            self.log.warning("INSECURE DEVELOPMENT MODE: plaintext to %s, declaring silo id %s without a certificate; "
                             "never use this with real data", settings.hub, settings.insecure_dev_silo_id)
            self.channel = insecure_dev_channel(settings.hub, settings.insecure_dev_silo_id, options)
        elif settings.certs is None:
            raise SiloError("no certificate bundle given: pass --certs with a bundle from `silo-certs issue-silo`")
        else:
            bundle = read_bundle(settings.certs, "client")  # read and checked once: for the channel and the identity
            self.channel = secure_channel(settings.hub, bundle, options=options)
        # A handshake of our own before joining checks the hub's certificate against the CRL, and tells a
        # verification failure that will not fix itself from a hub that is merely away.
        self.hub_check = HubCertificateCheck(settings.hub, settings.certs, settings.crl,
                                             enabled=settings.certs is not None and not settings.insecure_dev_silo_id)
        self.state_dir = self._state_dir()
        self.policy = settings.policy
        # What leaves the branch: one door (Outbox), audited before it is sent; the silo's own privacy ledger.
        self.audit = AuditLog(self.state_dir / AUDIT_FILE)
        self.ledger = BranchLedger(self.state_dir, delta=self.policy.delta if self.policy else DEFAULT_DELTA)
        self.factories = allowed_factories(self.policy, settings.model_factories)
        self.pinned: silo_pb2.PrivacyTerms | None = None  # the run's terms, checked and pinned at its first join
        self.pinned_for = ""  # that run's id
        self.accepted = b""  # described() of the run description (and the hub's identity) its terms were checked with
        self.stub = silo_pb2_grpc.FederationStub(self.channel)
        self.outbox = Outbox(self.stub, self.audit, self.policy, self.hub_check.identity)
        self.run: silo_pb2.RunDescription | None = None
        self.model_checked_for = b""  # described() of the run whose model this silo checked it may and can build
        self.silo_id = ""
        self.algorithm: SiloAlgorithm | None = None
        self.data: SiloData | None = None
        self.data_key: tuple[int, int] | None = None
        self.rounds_done: list[int] = []
        self.skipped_images = 0
        self.skipped_at_load = 0  # files refused when the folders were loaded; the rest were found while training
        identity = verifier = None
        if bundle is not None:  # secure aggregation: this silo signs its keys, checks its neighbours'
            identity = SiloIdentity.of(bundle.cert, bundle.key, bundle.dir)
            verifier = PeerVerifier(self.hub_check.trusted_ca, self.hub_check.revoked)
        self.privacy = SiloPrivacy(send_result=self._upload, send_stage=self._send_stage, identity=identity,
                                   verifier=verifier, state_dir=self.state_dir)
        say_policy_once(self.log, self.policy, self.state_dir)
        # What the silo does next (join, wait for a task, back off, stop): one state machine decides.
        self.connection = Connection(settings.connect_timeout_s, settings.tls_refused_grace_s)
        self.left: SiloLeft | None = None  # set when this branch's policy ended its part in the run

    # ------------------------------------------------------------------ state
    def _state_dir(self) -> Path:
        """Where this silo keeps its state (ledger, audit, algorithm state): --state-dir, else beside its data."""
        if self.s.state_dir is not None:
            folder = Path(self.s.state_dir)
        else:
            anchor = self.s.data if self.s.data is not None else self.s.labeled
            folder = anchor.parent / f".silokit-state-{anchor.name}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    # ------------------------------------------------------------------ setup from the run description
    def _join(self) -> None:
        """Join the hub's run. A silo without its images for this run joins as `preparing` first (the run says the
        image size to load them at), loads them and tries the model on its device, and only then joins ready: the
        hub samples ready silos only, so round 1 does not wait on a silo's loading.

        Only the loading and the model's set-up go through `run_work`: the handshakes and Join calls wait on the
        hub, and a silo-sim host's silos wait for them side by side instead of one after another on the shared
        work thread (at 1,000 silos the waits were half of the joins' time to round 1).

        With load_when_sampled the silo joins ready at once on its file count and loads at its first task
        (_load_if_deferred); files found unreadable then lower its count at its next join."""
        self.hub_check.check()
        loaded = self.data is not None
        if self.policy is not None:
            # A branch with a policy says nothing of its data before it has checked the run's terms: at every join,
            # since a hub restarted on another state folder answers with a new run whose terms are not pinned yet.
            self._accept_terms(self._announce(preparing=True, with_counts=False))
        run = self._announce(preparing=not loaded and not self.s.load_when_sampled)
        self._accept_terms(run)  # before loading any image
        self._check_model(run)
        if loaded and self.data_key == data_key(run):
            self.run_work(self._set_up, run)
        elif self.s.load_when_sampled:
            # What the files tell without decoding them is checked now, so that such a silo still fails at its start.
            check_counts_for(run.algorithm, self._silo_algorithm(run), self.num_files, self.num_labeled_files,
                             self.s.sim_labels is not None)
            self.data, self.algorithm = None, None
            self.metrics.joined(str(self.device), self.num_files, 0)  # unlabeled files, as after loading
            return
        else:
            self.run_work(self._prepare, run)
            run = self._announce(preparing=False)  # with the counts of the images that did load
            self._accept_terms(run)  # the run may have been replaced or described otherwise (a hub restart) meanwhile
            self.run_work(self._set_up, run)
        self.metrics.joined(str(self.device), len(self.data.images), self.skipped_images)

    def _load_if_deferred(self) -> None:
        """At the first task of a silo that joined before loading (load_when_sampled): load, set up, rehearse."""
        if self.algorithm is None:
            self._prepare(self.run)
            self.metrics.joined(str(self.device), len(self.data.images), self.skipped_images)

    def _prepare(self, run: silo_pb2.RunDescription) -> None:
        """Load this silo's images at the run's size, set up its algorithm and try the model on the device."""
        self.data, self.data_key = self._load(run), data_key(run)
        self._set_up(run)
        spec = self.algorithm.model_spec
        PROCESS_CHECKS.once(("rehearse", repr(spec), str(self.device)),
                            lambda: rehearse(spec, self.data, self.device))

    def _announce(self, preparing: bool, with_counts: bool = True) -> silo_pb2.RunDescription:
        num_images = usable_count(self.data.images) if self.data is not None else self.num_files
        num_labeled = usable_count(self.data.labeled_images) if self.data is not None else self.num_labeled_files
        features = [f for f in FEATURES if f != SIGNED_SECAGG or self.privacy.identity is not None]
        features = [f for f in features if f != POLICY or self.policy is not None]
        pinned = self.pinned if self.run is not None and self.pinned_for == self.run.run_id else None
        quiet = pinned is not None and not tells_clear_facts(pinned)
        reply = self.outbox.join(silo_pb2.JoinRequest(
            client_version=VERSION, num_unlabeled=num_images if with_counts else 0,
            num_labeled=num_labeled if with_counts else 0, capabilities=list(ALGORITHMS),
            device="" if quiet else str(self.device),
            skipped_images=self.skipped_images if with_counts and not quiet else 0, preparing=preparing,
            protocol_version=PROTOCOL_VERSION, features=features,
        ), timeout=30)
        run = reply.run
        if self.run is None or run.run_id != self.run.run_id:
            self.log.info("joined run %s as %s: %s, %s, %d rounds", run.run_id[:8], reply.silo_id, run.algorithm,
                          run.model, run.total_rounds)
        self.run, self.silo_id = run, reply.silo_id
        return run

    # ------------------------------------------------------------------ the run's terms and this branch's policy
    def _accept_terms(self, run: silo_pb2.RunDescription) -> None:
        """Check a run's privacy terms against this branch's policy, before any image is read, and pin them for
        the run; a later join of the same run (the hub restarted) must state the same terms. Leaves (SiloLeft)
        when they fall short. A later join that describes the same run otherwise (another algorithm, model or
        factory, upload size; another hub certificate) is checked against the policy again, and its model again."""
        accepted = described(run) + self.hub_check.seen.fingerprint.encode()
        if self.pinned is not None and run.run_id == self.pinned_for:
            if terms_sha256(run.terms) != terms_sha256(self.pinned):
                self._leave(Refusal("breach", "terms", terms_sha256(self.pinned)[:16], terms_sha256(run.terms)[:16],
                                    "the hub states other privacy terms than those pinned when this silo joined the "
                                    "run; a run's terms may not change"))
            # The chunk size is the hub's wire setting, not a term: a hub restarted with another wire.chunk_bytes
            # accepts only the new size.
            self.outbox.pin(run.run_id, terms_sha256(self.pinned), int(run.chunk_bytes))
            if accepted == self.accepted:
                return
        if run.protocol_version < PROTOCOL_VERSION:
            # Protocol 1 carried privacy instructions as a JSON string this silo no longer reads: following such a
            # hub could send a result in the clear that it meant to be masked or noised.
            self.outbox.pin(run.run_id, "")
            self._leave(Refusal("refused", "protocol", f"protocol {PROTOCOL_VERSION}",
                                f"protocol {run.protocol_version or 1}",
                                f"the hub speaks wire protocol {run.protocol_version or 1} and states no privacy terms "
                                f"this silo can check; the hub must run silokit {FIRST_RELEASE[PROTOCOL_VERSION]} or "
                                f"newer (upgrade the hub first, then the branches)"))
        digest = terms_sha256(run.terms)
        self.outbox.pin(run.run_id, digest, int(run.chunk_bytes))
        self.audit.append("terms", hub=self.hub_check.identity(), run=run.run_id, terms=terms_dict(run.terms),
                          terms_sha256=digest, protocol_version=run.protocol_version)
        # A restarted silo: the run's terms were pinned by an earlier process, and its ledger holds them.
        first = self.ledger.first_terms(run.run_id)
        if first is not None and first != digest:
            self._leave(Refusal("breach", "terms", first[:16], digest[:16], "the hub states other privacy terms than "
                                "those this silo pinned when it first joined the run (its privacy ledger); a run's "
                                "terms may not change"))
        left = self.ledger.breach_left(run.run_id)
        if left is not None:
            self._leave(Refusal("breach", str(left.get("clause", "terms")), "no return after a breach",
                                f"run {run.run_id[:8]} again", f"this silo left run {run.run_id[:8]} for a breach "
                                f"({left.get('message', '')}); it does not join that run again"))
        unkept = sample_dp_unkept(run, self._silo_algorithm(run))
        if unkept is not None:
            self._leave(unkept)
        if self.policy is not None:
            dp = run.terms.client_dp
            one_round = self.ledger.client_epsilon_after(run.run_id, dp.noise_multiplier) if dp.enabled else None
            refusal = check_run(self.policy, run, factories=self.factories,
                                lifetime_spent=self.ledger.lifetime_epsilon(exclude_run=run.run_id),
                                client_epsilon_one_round=one_round, model_bytes=least_update_bytes(run))
            if refusal is not None:
                self._leave(refusal)
        self.pinned, self.pinned_for, self.accepted = silo_pb2.PrivacyTerms(), run.run_id, accepted
        self.pinned.CopyFrom(run.terms)
        dp = run.terms.client_dp
        self.ledger.begin_run(run.run_id, hub_serial=self.hub_check.identity()["serial"],
                              hub_fingerprint=self.hub_check.seen.fingerprint, terms_sha256=digest,
                              client_dp_noise=dp.noise_multiplier if guards_against_hub(dp) else None,
                              sample_dp=run.terms.sample_dp.enabled)
        if (run.run_id, digest) not in _TERMS_SAID:  # once per process and run: a silo-sim host has hundreds
            _TERMS_SAID.add((run.run_id, digest))
            for line in describe(run.terms):
                self.log.info("run %s terms: %s", run.run_id[:8], line)

    def _leave(self, refusal: Refusal) -> None:
        """Record why, tell the hub (typed), note it in the ledger, and stop taking part (SiloLeft)."""
        self.log.error("%s: %s (%s)", {"refused": "refusing the run", "breach": "policy breach, leaving the run",
                                       "budget": "privacy budget reached, leaving the run"}[refusal.kind],
                       refusal.message, refusal.clause)
        if self.outbox.run_id:
            self.ledger.record_leave(self.outbox.run_id, refusal.kind, refusal.clause, refusal.message)
        self.metrics.departed(refusal.kind)
        self.outbox.leave(refusal)
        raise SiloLeft(refusal)

    def _check_task(self, task: silo_pb2.Task) -> None:
        """A task must ask for no less than the pinned terms promise (security/terms.py task_breaches)."""
        replayed = self.privacy.replayed_session(task.privacy)
        breaches = [*([replayed] if replayed else []), *task_breaches(self.pinned or silo_pb2.PrivacyTerms(),
                                                                       task.privacy)]
        if breaches:
            b = breaches[0]
            self._leave(Refusal("breach", b.clause, b.pinned, b.asked, f"round {task.round}: {b.message}",
                                task.round))

    def _check_model(self, run: silo_pb2.RunDescription) -> None:
        """The run's model is one this silo may build (check_model_allowed) and builds the same here as at the
        hub (check_architecture); checked once per run description."""
        if self.model_checked_for == described(run):
            return
        check_model_allowed(run, self.factories)
        check_upload_fits(run)
        try:
            PROCESS_CHECKS.once(("architecture", run.SerializeToString(deterministic=True)),
                                lambda: check_architecture(run, model_spec_of(run)))
        except ValueError as err:  # the factory cannot be imported or built here
            raise SiloError(f"cannot build the run's model here: {err}") from None
        self.model_checked_for = described(run)

    def _set_up(self, run: silo_pb2.RunDescription) -> None:
        """The run's algorithm and model, checked against the loaded images."""
        self.data.silo_id, self.data.run_id = self.silo_id, run.run_id
        silo = self._silo_algorithm(run)
        check_data_for(run.algorithm, silo, self.data)
        if self.data.num_labeled and not silo.trains_on_labeled:
            self.log.warning("algorithm %s does not train on labeled images at silos; the %d in %s are ignored",
                             run.algorithm, self.data.num_labeled, self.s.labeled)
        options = get_algorithm(run.algorithm).options.model_validate(json.loads(run.algorithm_options_json or "{}"))
        self._check_model(run)
        self.algorithm = silo(options, model_spec_of(run), self.device)
        if self.s.wrap_algorithm is not None:  # simulation only (SiloSettings.wrap_algorithm)
            self.algorithm = self.s.wrap_algorithm(self.algorithm)

    @staticmethod
    def _silo_algorithm(run: silo_pb2.RunDescription) -> type[SiloAlgorithm]:
        silo = get_algorithm(run.algorithm).silo
        if silo is None:
            raise SiloError(f"algorithm {run.algorithm} runs at the hub only; silos have nothing to do")
        return silo

    def _load(self, run: silo_pb2.RunDescription) -> SiloData:
        data, skipped = load_branch_data(self.s, run, state_dir=self.state_dir, silo_id=self.silo_id,
                                         files=self.num_files + self.num_labeled_files, log=self.log)
        self.skipped_images = self.skipped_at_load = skipped
        return data

    def _count_unreadable(self, round_: int) -> None:
        """Files that turned out unreadable while training (read lazily) join the skipped count: logged, exported
        as silokit_silo_unreadable_images and declared to the hub at the next join. Never fatal."""
        found = sum(len(x.skipped) for x in (self.data.images, self.data.labeled_images) if isinstance(x, ImageFiles))
        total = self.skipped_at_load + found
        if total != self.skipped_images:
            self.log.warning("round %d: %d more image files found unreadable and skipped (%d skipped in all)", round_,
                             total - self.skipped_images, total)
            self.skipped_images = total
            self.metrics.unreadable(total)

    # ------------------------------------------------------------------ one task
    def _download(self, task: silo_pb2.Task) -> dict[str, torch.Tensor]:
        stream = self.outbox.download(silo_pb2.DownloadRequest(run_id=self.run.run_id, task_id=task.task_id),
                                      task.round, timeout=600)
        payload = assemble(((c.offset, c.data) for c in stream), task.bundle_bytes, task.bundle_sha256,
                           max_bytes=max(task.bundle_bytes, 1))
        self.metrics.received(len(payload))
        tensors = decode(payload)
        # float16 on the wire (wire.half_precision) is widened back before training.
        return {k: (v.float() if v.dtype == torch.float16 else v) for k, v in tensors.items()}

    def _plan(self, task: silo_pb2.Task) -> RoundPlan:
        """The round's plan: the task's fields and its downloaded bundle (TRAIN and RECEIVE alike)."""
        self.hub_check.check(unless_checked_within_s=HUB_CHECK_EVERY_S)
        expected = {s.name: TensorSpec(tuple(s.shape), s.dtype) for s in task.expected}
        tensors = self._download(task)
        return RoundPlan(round=task.round, tensors=tensors,
                         hyperparameters=json.loads(task.hyperparameters_json or "{}"), expected=expected,
                         class_thresholds=list(task.class_thresholds), groups=self.algorithm.result_groups(expected))

    def _receive(self, task: silo_pb2.Task) -> None:
        """Not sampled, but the algorithm hands every silo the round's model (FedSEAL's ensemble_every_round): use
        it, send nothing."""
        self._load_if_deferred()
        plan = self._plan(task)
        started = time.time()
        self.algorithm.receive_model(plan, self.data)
        self._count_unreadable(task.round)
        self.log.info("round %d: not sampled; received the model and used it in %.1fs, nothing sent", task.round,
                      time.time() - started)

    def _budget(self, task: silo_pb2.Task) -> TaskBudget:
        return TaskBudget(self.policy, self.ledger, self.pinned, self.run.run_id, task)

    def _upload(self, task: silo_pb2.Task, tensors: dict[str, torch.Tensor], metrics: dict[str, float],
                skipped: bool, charge: Charge | None) -> int:
        """Send a result in the clear (through the Outbox, which keeps it for the same task asked again)."""
        size = self.outbox.upload(task, tensors, metrics, skipped, charge)
        self.metrics.sent(size)
        return size

    def _send_stage(self, task_id: str, round_number: int, stage: str, payload: bytes, charge: Charge | None,
                    tensors: list | None = None) -> None:
        self.outbox.stage(task_id, round_number, stage, payload, charge, tensors)
        self.metrics.sent(len(payload))

    def _resend(self, task: silo_pb2.Task, sent: SentUpload) -> None:
        """The hub asks again for a task whose result this silo already sent (it says the upload never arrived, or
        it lost it): the same bytes go again with the same ledger figures. Training again would release a second,
        differently noised update, which a hub could ask for over and over."""
        self._upload(task, sent.tensors, sent.metrics, sent.skipped, lambda: sent.epsilon)
        if task.round not in self.rounds_done:
            self.rounds_done.append(task.round)
        self.log.warning("round %d: the hub asked again for task %s, whose result this silo already sent; sent the "
                         "same bytes again (no new training, nothing more charged to the privacy ledger)", task.round,
                         task.task_id)

    def _train(self, task: silo_pb2.Task) -> None:
        sent = self.outbox.last_upload
        if sent is not None and sent.task_id == task.task_id:
            self._resend(task, sent)
            return
        keys = self.privacy.advertised(task.task_id)
        if keys is not None:  # a secure round whose advertised keys were lost on the way: the same keys again
            self._send_stage(task.task_id, task.round, "advertise_keys", keys, None)
            self.log.warning("round %d: the hub asked again for task %s, whose keys this silo already advertised for "
                             "secure aggregation; sent the same keys again (no new training, nothing more charged)",
                             task.round, task.task_id)
            return
        self._load_if_deferred()
        self._check_task(task)
        budget = self._budget(task)
        refusal = budget.refusal_before_training()
        if refusal is not None:
            self._leave(refusal)
        plan = self._plan(task)
        private = task.HasField("privacy")
        sd = task.privacy.sample_dp
        # Which of this branch's own limits, if any, stops DP-SGD in this run (by the ledger before this round).
        leave_at_limit = budget.policy_clause_binding_dp_sgd() if sd.enabled else None
        if sd.enabled:  # DP-SGD as the pinned terms say, within this branch's own budgets
            # At the smaller of the terms' delta and the one the ledger accounts this run at (the policy's when the
            # run began, not a restarted process's): an epsilon that holds at a delta holds at any larger one, so
            # the figure is true both for the hub's budget and in this branch's ledger.
            ours = self.ledger.run_delta(self.run.run_id)
            delta = min(sd.delta, ours) if sd.delta > 0 else ours
            plan.hyperparameters["sample_dp"] = {"noise_multiplier": sd.noise_multiplier, "clip_norm": sd.clip_norm,
                                                 "delta": delta, "epsilon_budget": budget.sample_dp_limit()}
        expected = plan.expected
        started = time.time()
        result = self.algorithm.local_update(plan, self.data)
        metrics = {**result.metrics, "train_seconds": time.time() - started}
        self._count_unreadable(task.round)
        in_clear = not (task.privacy.secagg_session or task.privacy.client_dp.enabled)  # else privacy.py encodes it
        try:  # our own bug, or a float16 overflow, must not reach the hub as garbage
            tensors = {} if result.skipped else update_to_send(result.tensors, expected, plan.groups, in_clear)
        except CodecError as err:
            raise UpdateUnsendable(task.task_id, task.round, str(err)) from None

        def charge() -> dict:  # the ledger's entry, written once the policy allows what leaves and before it does
            return budget.charge(metrics, self.metrics, skipped=result.skipped)

        if not in_clear:  # silo_client/privacy.py decides what leaves, and when to charge
            sent = self.privacy.submit(self.silo_id, self.run.run_id, task, result, expected,
                                       noise_std=required_noise_std(self.policy, self.pinned, task.privacy),
                                       floor=SessionFloor.of(self.pinned, self.policy), charge=charge)
        else:
            # Only the clear metrics the terms ask for leave (none under sample-level DP: DP-SGD covers only the
            # update); the Outbox keeps them all in when the policy says so.
            asked = clear_metrics_allowed(self.pinned, task.privacy if private else None)
            self._upload(task, tensors, metrics_allowed(metrics, asked), result.skipped,
                         None if result.skipped else charge)
            sent = "skipped (nothing passed the threshold)" if result.skipped else "update sent"
        if sd.enabled and "sample_dp_epsilon" in metrics:
            spent = " (budget reached: no more training)" if metrics.get("sample_dp_budget_spent") else ""
            self.log.info("round %d: sample-level DP epsilon %.4g at delta %g%s", task.round,
                          metrics["sample_dp_epsilon"], plan.hyperparameters["sample_dp"]["delta"], spent)
        self.rounds_done.append(task.round)
        self.metrics.trained(task.round, metrics["train_seconds"], metrics, result.skipped)
        self.log.info("round %d: %s in %.1fs (%d of %d pseudo-labeled)", task.round, sent,
                      metrics["train_seconds"], int(metrics.get("pl_selected", 0)), int(metrics.get("pl_total", 0)))
        if leave_at_limit is not None and metrics.get("sample_dp_budget_spent"):
            self._leave(Refusal("budget", leave_at_limit, f"{plan.hyperparameters['sample_dp']['epsilon_budget']:g}",
                                f"{metrics.get('sample_dp_epsilon', 0.0):.4g}",
                                f"round {task.round}: one more round of DP-SGD would pass this branch's "
                                f"{DP_SGD_LIMITS[leave_at_limit]}", task.round))

    # ------------------------------------------------------------------ the loop
    def run_forever(self) -> int:
        """Take part until the hub says the run is done (returns 0). Raises SiloError when the hub (or TLS) refuses
        this silo for good and SiloLeft when this branch's policy ends its part. What to do next is decided by the
        connection's state machine (silo_client/connection.py); this loop only carries its steps out."""
        connection = self.connection
        while not self.stop_event.is_set():
            outcome = self._attempt(connection.phase)
            step = connection.after(outcome, time.time())
            self.metrics.phase(step.phase.value)
            if step.log:
                self.log.warning("%s", step.log)
            if step.phase is Phase.DONE:
                return 0
            if step.phase is Phase.REFUSED:
                raise SiloError(step.error)
            if step.phase is Phase.LEFT:
                raise self.left
            if step.wait_s:
                self.stop_event.wait(step.wait_s)
        return 0

    def _attempt(self, phase: Phase) -> Outcome:
        """One step of `phase`: join, or poll the hub and carry out the task it gives. Whatever happens comes back
        as an Outcome for the state machine to judge; nothing is decided here."""
        try:
            if phase is Phase.JOINING:
                self._join()  # its image work goes through run_work
                return Outcome("joined")
            # The hub holds the call until it has work for this silo (up to its server.long_poll_s, and a second
            # short of this deadline), so an idle silo costs it almost nothing.
            task = self.outbox.poll(silo_pb2.NextTaskRequest(
                run_id=self.run.run_id, last_round_done=self.rounds_done[-1] if self.rounds_done else 0,
            ), timeout=NEXT_TASK_TIMEOUT_S)
            self.metrics.contact()
            kind = silo_pb2.Task.Kind.Name(task.kind)
            if kind == "DONE":
                self.log.info("the hub says the run is over (%s); %d rounds contributed", task.message,
                              len(self.rounds_done))
                return Outcome("done", message=task.message)
            if kind == "TRAIN" and task.task_id in self.outbox.refused_tasks:
                # The hub refused this task's update (its content, its size) and offers the task until the round
                # closes: neither the same bytes nor a retrained update would pass, so wait it out quietly.
                return Outcome("task", task_kind="WAIT", retry_after=WAIT_TASK_CAP_S)
            work = {"TRAIN": self._train, "RECEIVE": self._receive, "SECAGG": self.privacy.run_stage}.get(kind)
            if work is not None:
                self.run_work(work, task)
            return Outcome("task", task_kind=kind, retry_after=task.retry_after_s)
        except grpc.RpcError as err:
            code = err.code()
            self.metrics.hub_error(code.name)
            message = describe_rpc_error(err, self.s.hub) if code.name in TRANSIENT else (err.details() or "")
            return Outcome("rpc_error", code=code.name, message=message,
                           retry_after=retry_after_s(err) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)
        except CodecError as err:
            return Outcome("bad_bundle", message=str(err))
        except UpdateUnsendable as err:  # the same update would fail again: the task is waited out
            self.outbox.refused_tasks.add(err.task_id)
            self.metrics.unsent()
            return Outcome("bad_update", message=str(err))
        except PolicyStop as stop:  # something about to leave was outside the policy: nothing was sent
            return self._leave_for(stop.refusal)
        except SiloLeft as left:
            self.left = left
            return Outcome("left", message=str(left))
        except HubTlsRefused as err:
            self.metrics.hub_error("UNAUTHENTICATED")
            return Outcome("tls_refused", message=str(err))
        except HubCertificateUnchecked as err:
            self.metrics.hub_error("UNAVAILABLE")
            return Outcome("hub_unchecked", message=str(err))

    def _leave_for(self, refusal: Refusal) -> Outcome:
        """Leave the run for a refusal found outside a step that could (the Outbox's check of a message)."""
        try:
            self._leave(refusal)
        except SiloLeft as left:
            self.left = left
        return Outcome("left", message=str(self.left))

    def close(self) -> None:
        self.channel.close()
