"""A branch's policy against a real hub: a run that falls short is refused at Join before any image is read, the hub
is told why in a typed refusal it counts; a task that breaches the pinned terms makes the silo leave; the ledger
carries on across a silo's restart and a second run, where the lifetime budget stops the silo; the protocol
versions of hub and silo are checked both ways."""

from __future__ import annotations

import json
import re
import threading

import grpc
import pytest

from security.audit import AUDIT_FILE, read_records, verify_chain
from security.tls import DEV_IDENTITY_KEY
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.client import SiloClient, SiloSettings
from silo_client.errors import SiloError, SiloLeft
from silo_client.ledger import LEDGER_FILE, BranchLedger
from silo_client.policy import BranchPolicy
from silo_core.dp_sgd import ledger_for
from silo_server.app import HubApp
from silo_server.config import parse_config
from tests.silo_client.test_cli_errors import write_images

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 4, "hub_batch_size": 4, "tau": 0.0}


def hub_config(tmp_path, name="state", **sections):
    return parse_config({
        "run": {"state_dir": name, "device": "cpu", "threads": 1},
        "server": {"port": 0, "certs": "hub", "long_poll_s": 1.0, "linger_s": 0.5},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "algorithm": {"name": "semifl", "options": TINY},
        "rounds": {"total": 2, "min_silos": 1, "deadline_s": 60},
        "security": {"allowed_silos": ["dev-1"]},
        **sections,
    }, base=tmp_path)


def start_hub(tmp_path, **sections):
    app = HubApp(hub_config(tmp_path, **sections), insecure_dev_only=True)
    return app, app.start_server()


def silo(tmp_path, port, policy=None, state="silo-state"):
    if not (tmp_path / "images").exists():
        write_images(tmp_path / "images", n=6)
    return SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", device="cpu",
                                   state_dir=tmp_path / state, insecure_dev_silo_id="dev-1",
                                   policy=BranchPolicy.model_validate(policy) if policy is not None else None))


def audit_kinds(folder):
    return [r["kind"] for _, r in read_records(folder / AUDIT_FILE)]


@pytest.mark.parametrize("policy,clause,line", [
    ({"sample_dp": {"required": True}}, "sample_dp.required",
     "policy requires sample-level DP-SGD; this run trains without it"),
    ({"algorithms": ["fedseal", "hassle"]}, "algorithms",
     "policy allows algorithms fedseal, hassle; this run uses semifl"),
    ({"lifetime_epsilon": 10}, "lifetime_epsilon",
     "policy sets a lifetime epsilon budget of 10; this run has no differential privacy that holds against the hub, "
     "so its epsilon would be unbounded"),
])
def test_a_run_short_of_the_policy_is_refused_at_join_before_any_image_is_read(tmp_path, policy, clause, line):
    app, port = start_hub(tmp_path)
    joins = []
    real_join = app.hub.join
    app.hub.join = lambda *a, **k: joins.append((k.get("preparing"), a[1], a[2])) or real_join(*a, **k)
    client = silo(tmp_path, port, policy)
    client._load = lambda run: pytest.fail("an image was read before the run's terms were checked")
    try:
        with pytest.raises(SiloLeft) as left:
            client._join()
        assert (left.value.refusal.clause, str(left.value)) == (clause, line)
        assert joins == [(True, 0, 0)]  # one Join, preparing, telling the hub nothing of the branch's data
        assert app.hub.registry.departures == {("refused", clause): 1}
        assert app.hub.registry.live_silos() == [] and "dev-1" in app.departures()
        assert audit_kinds(client.state_dir) == ["join", "terms", "leave"]
        assert verify_chain(client.state_dir / AUDIT_FILE).ok
        ledger = json.loads((client.state_dir / LEDGER_FILE).read_text())
        assert ledger["runs"][app.hub.run_id]["leaves"][0]["clause"] == clause
    finally:
        client.close()
        app.stop()


def test_a_silo_says_nothing_of_its_data_to_a_new_run_before_it_has_checked_that_runs_terms(tmp_path):
    app, port = start_hub(tmp_path)
    joins = []
    real_join = app.hub.join
    app.hub.join = lambda *a, **k: joins.append((k.get("preparing"), a[1], a[2])) or real_join(*a, **k)
    client = silo(tmp_path, port, {"algorithms": ["semifl"]})
    try:
        client._join()
        assert joins[0] == (True, 0, 0) and joins[-1][0] is False and joins[-1][1] > 0  # terms checked, then counts
        # The hub comes back on another state folder: a new run, under terms this branch's policy refuses.
        app.hub.run_description = {**app.hub.run_description, "run_id": "f" * 32, "algorithm": "fedseal"}
        joins.clear()
        with pytest.raises(SiloLeft) as left:
            client._join()
        assert left.value.refusal.clause == "algorithms"
        assert joins == [(True, 0, 0)]  # the new run heard no image count before its terms were checked
    finally:
        client.close()
        app.stop()


@pytest.mark.parametrize("privacy", [{"clear_metrics": False}, {"dp": {"enabled": True, "noise": "central"}}])
def test_a_run_whose_terms_want_no_clear_metrics_is_not_told_the_device_or_the_unreadable_files(tmp_path, privacy):
    # README: with secure aggregation or DP, silos send no clear per-silo metrics. Every Join still told the hub
    # this branch's device and how many of its files were unreadable, unless a policy said clear_metrics: false.
    write_images(tmp_path / "images", n=6)
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    app, port = start_hub(tmp_path, privacy=privacy)
    joins = []
    real_join = app.hub.join
    app.hub.join = lambda *a, **k: joins.append((a[3], k.get("skipped_images", a[4] if len(a) > 4 else 0))) \
        or real_join(*a, **k)
    client = silo(tmp_path, port)  # no policy: the terms alone decide
    try:
        client._join()
        assert client.skipped_images == 1 and len(joins) == 2
        assert joins[-1] == ("", 0)  # after the terms were pinned: neither fact
        assert app.hub.registry.silos["dev-1"].skipped_images == 0
    finally:
        client.close()
        app.stop()


def test_a_hub_restarted_with_another_chunk_size_gets_chunks_of_that_size(tmp_path):
    app, port = start_hub(tmp_path)
    client = silo(tmp_path, port)
    try:
        client._join()
        assert client.outbox.chunk_bytes == app.config.wire.chunk_bytes
        # The same run (same state folder) after a restart with a smaller wire.chunk_bytes: the terms stay pinned.
        app.hub.run_description = {**app.hub.run_description, "chunk_bytes": 65536}
        client._join()
        assert client.outbox.chunk_bytes == 65536 and client.pinned_for == app.hub.run_id
    finally:
        client.close()
        app.stop()


@pytest.mark.parametrize("policy,change,refused", [
    ({"algorithms": ["semifl"]}, {"algorithm": "fedseal"}, "policy allows algorithms semifl; this run uses fedseal"),
    (None, {"model_factory": "evil.models:build"}, "the hub's run builds its model with the factory evil.models:build"),
])
def test_the_same_run_described_otherwise_at_a_later_join_is_checked_again(tmp_path, policy, change, refused):
    # Only the terms were compared at a later join of the same run: a hub (restarted, or answering the next Join)
    # could name another algorithm or a model factory under the same run id and terms, unchecked.
    app, port = start_hub(tmp_path)
    client = silo(tmp_path, port, policy=policy)
    try:
        client._join()
        assert client.pinned_for == app.hub.run_id
        app.hub.run_description = {**app.hub.run_description, **change}
        with pytest.raises((SiloLeft, SiloError), match=re.escape(refused)):
            client._join()
    finally:
        client.close()
        app.stop()


def test_a_restarted_silo_holds_a_run_to_the_terms_its_ledger_pinned(tmp_path):
    # The pinned terms lived in the silo process only: a silo restarted (systemd, a reboot) pinned whatever a hub
    # restarted under the same run id stated now.
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "run.json").write_text(json.dumps({"run_id": "run-r", "created": 0}))
    earlier = BranchLedger(tmp_path / "silo-state")  # an earlier process pinned other terms and released a round
    earlier.begin_run("run-r", hub_serial="1", hub_fingerprint="f", terms_sha256="0" * 64, client_dp_noise=None,
                      sample_dp=False)
    earlier.record_round("run-r", 1, client_dp_noise=None, sample_epsilon=None)
    app, port = start_hub(tmp_path)
    client = silo(tmp_path, port)
    try:
        with pytest.raises(SiloLeft) as left:
            client._join()
        assert (left.value.refusal.kind, left.value.refusal.clause) == ("breach", "terms")
        assert left.value.refusal.required == "0" * 16
        assert "other privacy terms than those this silo pinned when it first joined the run" in str(left.value)
        assert app.hub.registry.departures == {("breach", "terms"): 1}
    finally:
        client.close()
        app.stop()


def test_a_silo_that_left_a_run_for_a_breach_does_not_rejoin_it_after_a_restart(tmp_path):
    app, port = start_hub(tmp_path)
    first = silo(tmp_path, port)
    try:
        first._join()
        first.ledger.record_leave(app.hub.run_id, "breach", "client_dp.noise", "round 3: a task lowered the noise")
    finally:
        first.close()
    again = silo(tmp_path, port)  # the same state folder: a restarted process
    try:
        with pytest.raises(SiloLeft) as left:
            again._join()
        assert (left.value.refusal.kind, left.value.refusal.clause) == ("breach", "client_dp.noise")
        assert "left run" in str(left.value) and "it does not join that run again" in str(left.value)
    finally:
        again.close()
        app.stop()


def test_a_silo_of_the_previous_protocol_is_refused_by_a_hub_whose_run_has_privacy_terms(tmp_path):
    app, port = start_hub(tmp_path, privacy={"dp": {"enabled": True, "noise": "central"}})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = silo_pb2_grpc.FederationStub(channel)
            metadata = ((DEV_IDENTITY_KEY, "dev-1"),)
            old = silo_pb2.JoinRequest(client_version="0.1.0", num_unlabeled=10, device="cpu")  # no version field
            with pytest.raises(grpc.RpcError) as err:
                stub.Join(old, timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == ("this run's privacy terms need silokit wire protocol 2 (typed_terms); silo "
                                       "dev-1 speaks protocol 1 (silokit before 0.2.0): install silokit 0.2.0 or "
                                       "newer at the branch")
        assert app.hub.registry.refusals == {"old_protocol": 1} and app.hub.registry.silos == {}
    finally:
        app.stop()


def test_a_silo_whose_shares_do_not_carry_the_session_parameters_is_refused_at_join_signed_or_not(tmp_path):
    # Shares now carry the session's parameters: a silo of the earlier form would join an unsigned secure run and
    # make every mixed neighbourhood abort mid-round. The hub asks for the feature whenever secure aggregation is on.
    app, port = start_hub(tmp_path, privacy={"secure_aggregation": {"enabled": True}})
    try:
        assert not app.hub.terms.secure_aggregation.signed  # --insecure-dev-only: an unsigned session
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = silo_pb2_grpc.FederationStub(channel)
            earlier = silo_pb2.JoinRequest(client_version="0.2.0", num_unlabeled=10, device="cpu", protocol_version=2,
                                           features=["typed_terms", "policy"])
            with pytest.raises(grpc.RpcError) as err:
                stub.Join(earlier, timeout=10, metadata=((DEV_IDENTITY_KEY, "dev-1"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "(typed_terms, secagg_2)" in err.value.details() and "without secagg_2" in err.value.details()
    finally:
        app.stop()


def test_a_silo_refuses_a_hub_too_old_to_state_terms(tmp_path):
    app, port = start_hub(tmp_path)
    app.hub.run_description = {**app.hub.run_description, "protocol_version": 0, "terms": None}  # protocol 1
    client = silo(tmp_path, port)
    try:
        with pytest.raises(SiloLeft) as left:
            client._join()
        assert left.value.refusal.clause == "protocol"
        assert "the hub must run silokit 0.2.0 or newer (upgrade the hub first" in str(left.value)
    finally:
        client.close()
        app.stop()


def run_in_thread(app):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("state", app.hub.run()), daemon=True)
    thread.start()
    return thread, out


def test_a_task_that_raises_the_pinned_clip_makes_the_silo_leave_and_the_hub_count_the_breach(tmp_path):
    app, port = start_hub(tmp_path, privacy={"dp": {"enabled": True, "noise": "central", "clip_norm": 1.0}})
    client = silo(tmp_path, port)

    def downgrade(record):  # a hub that changes its terms after round 1
        if record.round == 1:
            app.hub.privacy.dp.clip_norm = 3.0

    app.hub.rounds.on_round = downgrade
    thread, _ = run_in_thread(app)
    try:
        with pytest.raises(SiloLeft) as left:
            client.run_forever()
        refusal = left.value.refusal
        assert (refusal.kind, refusal.clause, refusal.round) == ("breach", "client_dp.max_clip_norm", 2)
        assert str(left.value) == ("round 2: a task raised the clip norm: the run's pinned terms say clip norm at "
                                   "most 1, this task asks clip norm 3")
        assert client.rounds_done == [1]
        assert app.hub.registry.departures == {("breach", "client_dp.max_clip_norm"): 1}
        kinds = audit_kinds(client.state_dir)
        assert kinds.count("upload") == 1 and kinds[-1] == "leave"  # round 2 sent nothing but the Leave
    finally:
        client.close()
        app.hub.stop()
        thread.join(30)
        app.stop()


SAMPLE_DP = {"privacy": {"sample_dp": {"enabled": True, "noise_multiplier": 1.5, "clip_norm": 1.0}},
             "model": {"options": {"width": 4, "norm": "group"}}}


def test_the_ledger_carries_on_across_a_restart_and_a_second_run_stops_at_the_lifetime_budget(tmp_path,
                                                                                              monkeypatch):
    import silo_core.algorithms.semifl as semifl

    deltas = []  # the delta each round's DP-SGD is accounted at
    monkeypatch.setattr(semifl, "ledger_for", lambda *a: (deltas.append(a[-1]), ledger_for(*a))[1])
    app, port = start_hub(tmp_path, **SAMPLE_DP)
    policy = {"sample_dp": {"required": True}, "lifetime_epsilon": 1000.0}
    first = silo(tmp_path, port, {**policy, "delta": 1e-6})
    train = first._train
    first._train = lambda task: (train(task), first.stop_event.set())  # its operator stops it after round 1
    thread, _ = run_in_thread(app)
    try:
        assert first.run_forever() == 0 and first.rounds_done == [1]
        first.close()
        # The same branch restarted (same state folder) with the default delta (1e-5): the run it began stays
        # accounted at 1e-6, in its ledger and in the DP-SGD epsilon its rounds compute.
        again = silo(tmp_path, port, policy)
        assert again.run_forever() == 0 and again.rounds_done == [2]
        again.close()
    finally:
        app.hub.stop()
        thread.join(60)
        app.stop()
    ledger = json.loads((tmp_path / "silo-state" / LEDGER_FILE).read_text())
    rounds = ledger["runs"][app.hub.run_id]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and 0 < rounds[0]["sample"] < rounds[1]["sample"]
    assert ledger["runs"][app.hub.run_id]["delta"] == 1e-6 and deltas == [1e-6, 1e-6]
    spent = rounds[1]["lifetime"]
    assert spent == rounds[1]["image"] == rounds[1]["sample"]  # the first run: lifetime is its own epsilon

    # A second run (another hub's state, so another run id) under a lifetime budget the first run nearly spent.
    second, port2 = (lambda a: (a, a.start_server()))(HubApp(hub_config(tmp_path, name="state2", **SAMPLE_DP),
                                                               insecure_dev_only=True))
    late = silo(tmp_path, port2, {**policy, "lifetime_epsilon": spent * 0.999})
    try:
        with pytest.raises(SiloLeft) as left:
            late._join()
        assert left.value.refusal.clause == "lifetime_epsilon"
        assert str(left.value) == (f"policy sets a lifetime epsilon budget of {spent * 0.999:g}; this branch has "
                                   f"spent {spent:.4g} in earlier runs")
        assert second.hub.registry.departures == {("refused", "lifetime_epsilon"): 1}
    finally:
        late.close()
        second.stop()


@pytest.mark.parametrize("tamper, words", [
    (lambda d: d.__setitem__("algorithm", "fedseal"), "not available for algorithm 'fedseal'"),
    (lambda d: d["algorithm_options"].__setitem__("threshold_rule", "flexmatch"), "threshold_rule: fixed"),
])
def test_a_silo_refuses_terms_of_dp_sgd_that_its_own_training_would_not_carry_out(tmp_path, tamper, words):
    # Only the hub's config checked that the algorithm trains with DP-SGD: a hub stating sample-level DP while
    # running FedSEAL (or SemiFL with learnt class thresholds) had every silo send updates without it.
    app, port = start_hub(tmp_path, **SAMPLE_DP)
    tamper(app.hub.run_description)  # a hub that says more than it runs
    client = silo(tmp_path, port)  # no policy of its own: the terms alone are the promise
    client._load = lambda run: pytest.fail("an image was read for a run this silo cannot take part in")
    try:
        with pytest.raises(SiloLeft) as left:
            client._join()
        assert left.value.refusal.clause == "terms" and words in str(left.value)
        assert "which this silo's training would not carry out" in str(left.value)
        assert app.hub.registry.departures == {("refused", "terms"): 1}
    finally:
        client.close()
        app.stop()


@pytest.mark.parametrize("hub_budget, per_run, leaves", [(None, 0.01, True), (0.01, 1000.0, False)])
def test_dp_sgd_stopped_by_the_branchs_own_ceiling_makes_it_leave_by_the_hubs_budget_it_stays(
        tmp_path, hub_budget, per_run, leaves):
    # One round of DP-SGD passes epsilon 0.01, so round 1 trains nothing: the tighter of the two limits stops it.
    sample_dp = {**SAMPLE_DP["privacy"]["sample_dp"], **({"epsilon_budget": hub_budget} if hub_budget else {})}
    app, port = start_hub(tmp_path, privacy={"sample_dp": sample_dp}, model=SAMPLE_DP["model"])
    client = silo(tmp_path, port, {"sample_dp": {"required": True, "max_epsilon_per_run": per_run}})
    thread, _ = run_in_thread(app)
    try:
        if leaves:
            with pytest.raises(SiloLeft) as left:
                client.run_forever()
            assert left.value.refusal.clause == "sample_dp.max_epsilon_per_run"
            assert "DP-SGD epsilon ceiling for the run" in str(left.value)
            assert app.hub.registry.departures == {("budget", "sample_dp.max_epsilon_per_run"): 1}
        else:  # the run's own terms end DP-SGD: the silo takes part to the end, skipping, as every branch does
            assert client.run_forever() == 0 and client.rounds_done == [1, 2]
            assert app.hub.registry.departures == {}
    finally:
        client.close()
        app.hub.stop()
        thread.join(60)
        app.stop()


def test_check_prints_the_terms_and_the_branches_that_refused(tmp_path, capsys):
    import yaml

    from silo_server.cli import main
    from silo_server.config import load_config

    (tmp_path / "hub.yaml").write_text(yaml.safe_dump({
        "run": {"state_dir": "state", "device": "cpu", "threads": 1},
        "server": {"port": 0, "certs": "hub", "long_poll_s": 1.0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "privacy": {"dp": {"enabled": True, "noise": "central", "noise_multiplier": 1.3}},
        "security": {"allowed_silos": ["dev-1"]}}))
    app = HubApp(load_config(tmp_path / "hub.yaml"), insecure_dev_only=True)
    client = silo(tmp_path, app.start_server(), {"client_dp": {"required": True}})
    try:
        with pytest.raises(SiloLeft):
            client._join()
    finally:
        client.close()
        app.stop()
    assert main(["--config", str(tmp_path / "hub.yaml"), "--check", "--insecure-dev-only"]) == 0
    out = capsys.readouterr().out
    assert "  client-level DP: central noise, multiplier 1.3, clip 1, delta 1e-05, 10 rounds" in out
    assert "  clear per-silo metrics asked: pl_total, pl_selected, pl_correct, train_loss, train_steps, train_seconds" in out
    assert (f"silos that refused or left run {app.hub.run_id[:8]} (the hub's audit):\n  dev-1: refused "
            "(client_dp.noise): policy requires client-level DP noise added by the silos themselves; this run adds "
            "it at the hub, which could leave it out") in out
