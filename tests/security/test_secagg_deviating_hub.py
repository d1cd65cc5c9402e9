"""SecAgg+ against a hub that deviates (Bonawitz et al. 2017's malicious-server variant): every deviation below is
refused by the honest silos it is tried on, and the test then plays the hub to the end and shows, numerically, that
it cannot take one silo's update out of its masks. Where the attack works without the defence, the unsigned (or
policy-free) run shows it working, so the defence is what stops it.

The test plays the hub by hand: the honest HubSession keeps the books, the test rewrites what is relayed and keeps
what a hub sees (every masked input, every revealed share), and corrupt silos hand the hub their shares."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from security import pki
from security.crl import RevocationList
from security.secagg import (
    HubSession,
    IdentityError,
    PeerVerifier,
    ProtocolError,
    QuantizationRule,
    RoundAbandoned,
    Rule,
    SecAggError,
    SecAggParams,
    SiloIdentity,
    SiloSession,
    advertise_statement,
    shamir,
    survivors_statement,
)
from security.secagg import messages as msg
from security.secagg import primitives as pr
from security.secagg.inprocess import STAGE_ORDER, Costs, aggregate
from security.secagg.silo import Stage, self_mask_key, share_aad

PARAMS = SecAggParams(enabled=True, quantization=[QuantizationRule(pattern="*", clip=1.0, bits=16)])
RUN = "run-1"
BITS = 32


# ------------------------------------------------------------------------------------------------ a federation
@dataclass
class Federation:
    ca_dir: Path
    ca_pem: bytes
    identities: dict[str, SiloIdentity]  # silo id -> its certificate and key
    mallory: SiloIdentity  # a genuine silo certificate of another name, held by the hub
    hub: SiloIdentity  # the hub's own serverAuth certificate, issued by the same CA

    def verifier(self, crl: bool = False) -> PeerVerifier:
        revoked = RevocationList(self.ca_dir / pki.CRL, self.ca_dir / pki.CA_CERT).is_revoked if crl else None
        return PeerVerifier(self.ca_pem, revoked)


def make_federation(root: Path, n: int) -> Federation:
    names = [f"silo-{i:02d}" for i in range(n)]
    ca = pki.init_ca(root / "ca")
    pki.issue_silos(ca, [(name, root / name) for name in [*names, "mallory"]])
    pki.issue_hub(ca, root / "hub")
    return Federation(ca, (ca / pki.CA_CERT).read_bytes(),
                      {name: SiloIdentity.from_bundle(root / name) for name in names},
                      SiloIdentity.from_bundle(root / "mallory"), SiloIdentity.from_bundle(root / "hub"))


@pytest.fixture(scope="module")
def fed(tmp_path_factory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("federation"), 8)


def make_inputs(ids: Iterable[str], size: int = 200, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {i: {"delta/w": (torch.rand(size, generator=g) * 2 - 1) * 0.9, "weight": torch.ones(1)} for i in ids}


# ------------------------------------------------------------------------------------------------ the hub, by hand
class Driver:
    """One session between an honest HubSession (the books) and real silo sessions; the test decides what each
    silo is sent. Masked inputs are kept as they arrive (flattened in the silos' order of names)."""

    def __init__(self, fed: Federation, n: int, *, session: str = "s-1", signed: bool = True, run_id: str = RUN,
                 min_cohort: int = 0, seed: int = 0):
        self.fed, self.session, self.run_id, self.signed = fed, session, run_id, signed
        self.ids = [f"silo-{i:02d}" for i in range(n)]
        self.inputs = make_inputs(self.ids, seed=seed)
        self.shapes = {k: tuple(v.shape) for k, v in self.inputs[self.ids[0]].items()}
        self.hub = HubSession(session, self.ids, PARAMS, self.shapes, rng=random.Random(seed),
                              verifier=fed.verifier() if signed else None, run_id=run_id, signed=signed)
        self.silos = {i: SiloSession(session, i, keep_levels=True, identity=fed.identities[i] if signed else None,
                                     verifier=fed.verifier() if signed else None, run_id=run_id,
                                     min_cohort=min_cohort) for i in self.ids}
        self.advertised: dict[str, msg.AdvertiseKeys] = {}
        self.masked: dict[str, np.ndarray] = {}
        self.aborted: dict[str, str] = {}

    def _step(self, i: str, fn: Callable[[], bytes]) -> bytes | None:
        try:
            return fn()
        except SecAggError as err:
            self.aborted[i] = str(err)
            return None

    def advertise(self) -> dict[str, bytes]:
        for i in self.ids:
            payload = self.silos[i].advertise_keys()
            self.advertised[i] = msg.AdvertiseKeys.model_validate_json(payload)
            self.hub.receive_keys(i, payload)
        return self.hub.close_advertise()

    def share(self, rosters: dict[str, bytes]) -> None:
        for i, roster in rosters.items():
            out = self._step(i, lambda i=i, r=roster: self.silos[i].share_keys(r))
            if out is not None:
                self.hub.receive_shares(i, out)

    def keep_masked(self, i: str, payload: bytes) -> None:
        arrays = msg.parse_masked(payload, self.session, i, self.shapes, np.dtype(np.uint32), 1 << 30)
        self.masked[i] = np.concatenate([arrays[k].reshape(-1) for k in sorted(arrays)])

    def mask(self, inboxes: dict[str, bytes]) -> None:
        for i, inbox in inboxes.items():
            out = self._step(i, lambda i=i, b=inbox: self.silos[i].masked_input(b, self.inputs[i]))
            if out is not None:
                self.keep_masked(i, out)
                self.hub.receive_masked_input(i, out)

    def to_masked(self) -> dict[str, bytes]:
        """Honest until every masked input is in; returns the honest consistency requests."""
        self.share(self.advertise())
        self.mask(self.hub.close_share_keys())
        return self.hub.close_masked_input()

    def consistency(self, requests: dict[str, bytes]) -> dict[str, str]:
        """Each silo's answer to the survivor set it is shown: its signature (base64), for the silos that sign."""
        out = {}
        for i, request in requests.items():
            reply = self._step(i, lambda i=i, r=request: self.silos[i].consistency(r))
            if reply is not None:
                out[i] = msg.ConsistencySignature.model_validate_json(reply).signature
        return out

    def unmask(self, requests: dict[str, bytes]) -> dict[str, msg.UnmaskReply]:
        out = {}
        for i, request in requests.items():
            reply = self._step(i, lambda i=i, r=request: self.silos[i].unmask(r))
            if reply is not None:
                out[i] = msg.UnmaskReply.model_validate_json(reply)
        return out

    def signed_list(self, signatures: dict[str, str]) -> list[msg.SignedSurvivors]:
        return [msg.SignedSurvivors(silo_id=j, cert=self.advertised[j].cert, signature=s)
                for j, s in sorted(signatures.items())]

    def unmask_request(self, i: str, survivors: Iterable[str], signatures: dict[str, str]) -> bytes:
        """What a hub tells i: its neighbours that survived (the rest of its neighbours dropped)."""
        alive = set(survivors)
        neighbours = self.hub.graph[i]
        return msg.dump(msg.UnmaskRequest(session=self.session, survivors=sorted(neighbours & alive),
                                          dropped=sorted(neighbours - alive), signatures=self.signed_list(signatures)))


def revealed(replies: dict[str, msg.UnmaskReply], owner: str, kind: str) -> dict[int, int]:
    """The shares of `owner`'s secret of `kind` the hub was sent: Shamir point -> value."""
    return {r.x: shamir.from_bytes(msg.unb64(r.shares[owner].y)) for r in replies.values()
            if owner in r.shares and r.shares[owner].kind == kind}


def stolen(plains: Iterable[msg.SharePlaintext], kind: str) -> dict[int, int]:
    """What corrupt silos hand the hub: their shares of a silo's secrets, both kinds."""
    field = {"self_mask": "self_mask", "masking_key": "masking_key"}[kind]
    return {p.x: shamir.from_bytes(msg.unb64(getattr(p, field))) for p in plains}


def prg(key: bytes, size: int) -> np.ndarray:
    return pr.prg_words(key, size, BITS)


def strip_masks(session: str, silo: str, y: np.ndarray, seed: bytes | None,
                pair_keys: Iterable[tuple[bytes, bool]]) -> np.ndarray:
    """What the hub computes from one masked input y: y - PRG(K_self(b)) - sum sign * PRG(K_pair)  (mod 2^32),
    where `pair_keys` holds (K, silo added it) for each pairwise mask it knows."""
    x = y.copy()
    if seed is not None:
        np.subtract(x, prg(self_mask_key(session, silo, seed), x.size), out=x)
    for key, added in pair_keys:
        (np.subtract if added else np.add)(x, prg(key, x.size), out=x)
    return x


def agreeing(x: np.ndarray, truth: np.ndarray) -> float:
    """Fraction of coordinates where the hub's result equals the silo's encoded input (2^-32 by chance)."""
    return float(np.mean(x == truth))


# ------------------------------------------------------------------------------------------------ identity
def test_identity_signs_and_verifies_and_names_each_cause(fed, tmp_path):
    alice = fed.identities["silo-01"]
    v = fed.verifier()
    data = advertise_statement(RUN, "s", "silo-01", bytes(32), bytes(range(32)))
    v.verify("silo-01", alice.cert_der, data, alice.sign(data))
    with pytest.raises(IdentityError, match="silo silo-01: the signature does not verify"):
        v.verify("silo-01", alice.cert_der, data + b" ", alice.sign(data))
    with pytest.raises(IdentityError, match="silo silo-02: the certificate is silo 'silo-01''s"):
        v.verify("silo-02", alice.cert_der, data, alice.sign(data))
    with pytest.raises(IdentityError, match="no clientAuth"):
        v.verify("hub", fed.hub.cert_der, data, fed.hub.sign(data))
    with pytest.raises(IdentityError, match="does not parse"):
        v.verify("silo-01", b"\x30\x03junk", data, alice.sign(data))
    other_ca = pki.init_ca(tmp_path / "other-ca")
    pki.issue_silo(other_ca, "silo-01", tmp_path / "impostor")
    impostor = SiloIdentity.from_bundle(tmp_path / "impostor")
    with pytest.raises(IdentityError, match="not signed by the federation CA"):
        v.verify("silo-01", impostor.cert_der, data, impostor.sign(data))
    pki.issue_silo(fed.ca_dir, "expired", tmp_path / "expired", days=1,
                   not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    expired = SiloIdentity.from_bundle(tmp_path / "expired")
    with pytest.raises(IdentityError, match="outside its validity window"):
        v.verify("expired", expired.cert_der, data, expired.sign(data))
    # the signed bytes: canonical, domain-separated, bound to run and session; a set in any order is one set
    p = msg.session_parameters(32, 3, 2, PARAMS.rules())
    assert survivors_statement(RUN, "s", ["b", "a", "b"], p) == survivors_statement(RUN, "s", ["a", "b"], p)
    assert len({survivors_statement(RUN, "s", ["a"], p), survivors_statement("run-2", "s", ["a"], p),
                survivors_statement(RUN, "t", ["a"], p), advertise_statement(RUN, "s", "a", bytes(32), bytes(32)),
                survivors_statement(RUN, "s", ["a"], msg.session_parameters(32, 3, 2, [Rule("*", 1.0, 15)]))}) == 5
    # every part of the parameters counts: the ring, k, t, and each rule's pattern, range and width, in order
    two = [Rule("weight", 1024.0, 20), Rule("*", 1.0, 20)]
    variants = [(32, 3, 2, two), (64, 3, 2, two), (32, 4, 3, two), (32, 3, 3, two), (32, 3, 2, two[::-1]),
                (32, 3, 2, [two[0], Rule("*", 2.0, 20)]), (32, 3, 2, [two[0], Rule("*", 1.0, 19)]),
                (32, 3, 2, [two[0], Rule("delta/*", 1.0, 20)])]
    assert len({msg.session_parameters(*v) for v in variants}) == len(variants)
    with pytest.raises(ValueError, match="needs a verifier"):
        SiloSession("s", "silo-01", identity=alice)
    with pytest.raises(ValueError, match="needs a verifier"):
        HubSession("s", ["a", "b", "c"], PARAMS, {"x": (2,)}, signed=True)


def test_the_hub_drops_a_silo_whose_signatures_do_not_verify_before_anyone_sees_them(fed):
    d = Driver(fed, 5, session="h")
    keys = json.loads(d.silos["silo-00"].advertise_keys())
    with pytest.raises(ProtocolError, match="not signed \\(no certificate"):
        d.hub.receive_keys("silo-00", json.dumps({**keys, "cert": "", "signature": ""}).encode())
    forged = fed.mallory.sign(advertise_statement(RUN, "h", "silo-00", msg.unb64(keys["c_pk"]),
                                                  msg.unb64(keys["s_pk"])))
    with pytest.raises(ProtocolError, match="is silo 'mallory''s"):
        d.hub.receive_keys("silo-00", json.dumps({**keys, "cert": msg.b64(fed.mallory.cert_der),
                                                  "signature": msg.b64(forged)}).encode())
    d.hub.receive_keys("silo-00", json.dumps(keys).encode())
    assert "silo-00" in d.hub.keys
    # and a consistency signature over another set than U3
    d = Driver(fed, 5, session="h2")
    d.to_masked()
    other = fed.identities["silo-01"].sign(survivors_statement(RUN, "h2", d.ids[1:], d.hub.parameters()))
    with pytest.raises(ProtocolError, match="survivor set does not verify"):
        d.hub.receive_consistency("silo-01", msg.dump(msg.ConsistencySignature(session="h2",
                                                                               signature=msg.b64(other))))


# ------------------------------------------------------------------------------------------------ 1. substituted keys
def forged_entry(fed: Federation, d: Driver, v: str, how: str) -> dict[str, str]:
    """v's roster entry as a deviating hub would write it: public keys it generated, 'signed' as it can."""
    c_pk, s_pk = pr.public_bytes(pr.new_keypair()), pr.public_bytes(pr.new_keypair())
    statement = advertise_statement(d.run_id, d.session, v, c_pk, s_pk)
    cert, signature = {
        "unsigned": ("", ""),
        "another silo's certificate": (msg.b64(fed.mallory.cert_der), msg.b64(fed.mallory.sign(statement))),
        "the hub's own certificate": (msg.b64(fed.hub.cert_der), msg.b64(fed.hub.sign(statement))),
        "v's certificate over other keys": (d.advertised[v].cert, d.advertised[v].signature),
    }[how]
    return {"c_pk": msg.b64(c_pk), "s_pk": msg.b64(s_pk), "cert": cert, "signature": signature}


CAUSES = {"unsigned": "are not signed \\(no certificate or signature\\)",
          "another silo's certificate": "the certificate is silo 'mallory''s",
          "the hub's own certificate": "not a silo's \\(no clientAuth",
          "v's certificate over other keys": "the signature does not verify"}


@pytest.mark.parametrize("how", list(CAUSES))
def test_keys_substituted_for_a_silos_are_refused_by_every_neighbour(fed, how):
    d = Driver(fed, 7, session="subst")
    v = "silo-02"
    rosters = d.advertise()
    for j in d.hub.graph[v]:
        roster = json.loads(rosters[j])
        entry = next(n for n in roster["neighbours"] if n["silo_id"] == v)
        entry.update(forged_entry(fed, d, v, how))
        rosters[j] = json.dumps(roster).encode()
    d.share(rosters)
    assert set(d.aborted) == d.hub.graph[v]  # every neighbour of v refused; v itself saw honest keys
    for reason in d.aborted.values():
        assert f"refusing the roster: neighbour {v}'s keys" in reason
        assert re.search(CAUSES[how], reason), reason
    # nobody sealed a share under the hub's keys: of every honest silo the hub holds 0 < t shares; the round ends
    assert set(d.hub.sealed) == {v}
    with pytest.raises(RoundAbandoned):
        d.hub.close_share_keys()


@pytest.mark.parametrize("signed", [False, True])
def test_a_hub_that_surrounds_a_silo_with_keys_of_its_own(fed, signed):
    """The full attack: x's roster lists the hub's keys for every neighbour. Unsigned, x seals every share of b_x
    and s_sk_x to the hub, masks with keys the hub can compute, and the hub reads Q(x_x) exactly."""
    d = Driver(fed, 7, session="mitm", signed=signed)
    x = "silo-03"
    rosters = d.advertise()
    roster = json.loads(rosters[x])
    fake_c, fake_s = {}, {}
    for n in roster["neighbours"]:
        j = n["silo_id"]
        fake_c[j], fake_s[j] = pr.new_keypair(), pr.new_keypair()
        n["c_pk"], n["s_pk"] = msg.b64(pr.public_bytes(fake_c[j])), msg.b64(pr.public_bytes(fake_s[j]))
        # the best the hub has: the neighbour's real certificate and signature (over its real keys)
    shared = d._step(x, lambda: d.silos[x].share_keys(json.dumps(roster).encode()))
    c_pk_x, s_pk_x = msg.unb64(d.advertised[x].c_pk), msg.unb64(d.advertised[x].s_pk)
    if signed:
        assert shared is None and "refusing the roster: neighbour silo-00's keys are not signed by its certificate" \
            in d.aborted[x] and "signature does not verify" in d.aborted[x]
        assert d.silos[x].stage is Stage.ABORTED  # nothing sealed: the hub holds 0 < t shares of x's secrets
        return
    sk = msg.SharedKeys.model_validate_json(shared)
    plains = []
    for j, sealed in sk.shares.items():
        key = pr.agree(fake_c[j], c_pk_x, d.session, pr.SHARE_KEY, x, j)
        plains.append(msg.SharePlaintext.model_validate_json(
            pr.open_sealed(key, msg.unb64(sealed), share_aad(d.session, x, j))))
    seed, _ = shamir.reconstruct(stolen(plains, "self_mask"), roster["threshold"],
                                 check=lambda b: pr.commitment(d.session, x, b) == msg.unb64(sk.commitment))
    # an inbox of shares the hub made up, sealed under its keys: x opens them and masks its input
    inbox = {}
    for j in fake_c:
        plain = msg.SharePlaintext(session=d.session, sender=j, recipient=x, x=roster["index"],
                                   self_mask=msg.b64(shamir.to_bytes(7)), masking_key=msg.b64(shamir.to_bytes(9)),
                                   parameters=d.hub.parameters())
        key = pr.agree(fake_c[j], c_pk_x, d.session, pr.SHARE_KEY, j, x)
        inbox[j] = msg.b64(pr.seal(key, msg.dump(plain), share_aad(d.session, j, x)))
    d.keep_masked(x, d.silos[x].masked_input(msg.dump(msg.Inbox(session=d.session, shares=inbox)), d.inputs[x]))
    pair_keys = [(pr.agree(fake_s[j], s_pk_x, d.session, pr.PAIR_MASK, x, j), d.hub.index[x] < d.hub.index[j])
                 for j in fake_s]
    assert np.array_equal(strip_masks(d.session, x, d.masked[x], seed, pair_keys), d.silos[x].levels)


# ------------------------------------------------------------------------------------------------ 2. split survivors
V, GROUP_A, GROUP_B, COLLUDERS = "silo-00", ["silo-01", "silo-02"], ["silo-03", "silo-04"], ["silo-05", "silo-06"]


def split_views(d: Driver) -> tuple[dict[str, str], dict[str, str], dict]:
    """Honest until the masked inputs; then the hub shows V alive to V, group A and the colluders (set S1) and
    dropped to group B (S2); the colluders sign S2 as well and hand the hub their shares and keys."""
    d.to_masked()
    everyone, without_v = list(d.ids), [i for i in d.ids if i != V]
    request = {i: msg.dump(msg.ConsistencyRequest(session=d.session, survivors=without_v if i in GROUP_B
                                                  else everyone)) for i in d.ids}
    signatures = d.consistency(request)
    on_s1 = {j: signatures[j] for j in [V, *GROUP_A, *COLLUDERS]}
    on_s2 = {j: signatures[j] for j in GROUP_B}
    for c in COLLUDERS:
        on_s2[c] = msg.b64(d.fed.identities[c].sign(survivors_statement(d.run_id, d.session, without_v,
                                                                         d.hub.parameters()))) \
            if d.signed else ""
    corrupt = {c: (d.silos[c]._received[V], d.silos[c]._s_key) for c in COLLUDERS}
    return on_s1, on_s2, corrupt


@pytest.mark.parametrize("signed", [False, True])
def test_a_survivor_reported_dropped_to_some_silos_and_alive_to_others(fed, signed):
    d = Driver(fed, 7, session="split", signed=signed)
    assert (d.hub.degree, d.hub.threshold) == (6, 4)
    t = d.hub.threshold
    on_s1, on_s2, corrupt = split_views(d)
    requests = {i: d.unmask_request(i, d.ids, on_s1) for i in GROUP_A}
    requests |= {i: d.unmask_request(i, set(d.ids) - {V}, on_s2) for i in GROUP_B}
    replies = d.unmask(requests)
    b_shares = revealed(replies, V, "self_mask") | stolen([p for p, _ in corrupt.values()], "self_mask")
    sk_shares = revealed(replies, V, "masking_key") | stolen([p for p, _ in corrupt.values()], "masking_key")
    seed, _ = shamir.reconstruct(b_shares, t, check=lambda b: pr.commitment(d.session, V, b) == d.hub.commitments[V])
    truth = d.silos[V].levels
    s_pk = {j: d.hub.keys[j][1] for j in d.ids}
    if not signed:
        # 2 honest + 2 colluders revealed each kind: the hub holds t = 4 shares of b_V AND of s_sk_V
        assert not d.aborted and len(b_shares) == len(sk_shares) == t
        raw, _ = shamir.reconstruct(sk_shares, t, check=lambda sk: pr.public_bytes(pr.load_private(sk)) == s_pk[V])
        sk_v = pr.load_private(raw)
        pair_keys = [(pr.agree(sk_v, s_pk[j], d.session, pr.PAIR_MASK, V, j), d.hub.index[V] < d.hub.index[j])
                     for j in d.hub.graph[V]]
        assert np.array_equal(strip_masks(d.session, V, d.masked[V], seed, pair_keys), truth)
        return
    # group B sees only 3 of its neighbours' signatures on its set (the other B silo and the 2 colluders)
    assert set(d.aborted) == set(GROUP_B)
    for i in GROUP_B:
        assert "refusing to unmask: only 3 of this silo's neighbours signed the survivor set, threshold 4" \
            in d.aborted[i]
    assert len(sk_shares) == 2 < t
    with pytest.raises(shamir.ReconstructionError, match="2 shares, 4 needed"):
        shamir.reconstruct(sk_shares, t)
    # the hub's best: the self mask and the masks shared with the colluders off; the honest pair masks stay on
    pair_keys = [(pr.agree(s_key, s_pk[V], d.session, pr.PAIR_MASK, V, c), d.hub.index[V] < d.hub.index[c])
                 for c, (_, s_key) in corrupt.items()]
    assert agreeing(strip_masks(d.session, V, d.masked[V], seed, pair_keys), truth) < 0.01


def test_signatures_over_another_survivor_set_are_refused_naming_the_signer(fed):
    """A hub that forwards every signature it has (both sets) is caught by every silo it sends them to."""
    d = Driver(fed, 7, session="split-all")
    on_s1, on_s2, corrupt = split_views(d)
    both = {**{j: s for j, s in on_s1.items() if j not in COLLUDERS}, **on_s2}
    requests = {i: d.unmask_request(i, d.ids, both) for i in GROUP_A}
    requests |= {i: d.unmask_request(i, set(d.ids) - {V}, both) for i in GROUP_B}
    replies = d.unmask(requests)
    assert not replies and set(d.aborted) == set(GROUP_A + GROUP_B)
    for i in GROUP_A:  # shown S1: the B silos' signatures are over S2
        assert "the signature of silo-03 does not verify over the survivor set and session parameters this silo " \
               "signed" in d.aborted[i]
    for i in GROUP_B:  # shown S2: V's signature is over S1
        assert f"the signature of {V} does not verify over the survivor set and session parameters this silo " \
               "signed" in d.aborted[i]
    assert len(stolen([p for p, _ in corrupt.values()], "masking_key")) == 2 < d.hub.threshold


# ------------------------------------------------------------------------------------------------ 3. replayed roster
@pytest.mark.parametrize("signed", [False, True])
def test_a_roster_replayed_from_an_earlier_round_is_refused(fed, signed):
    first = Driver(fed, 5, session="round-1", signed=signed)
    old = first.advertise()
    d = Driver(fed, 5, session="round-2", signed=signed)
    d.advertise()
    # (a) as it was: the session field gives it away, signed or not
    d.share({"silo-00": old["silo-00"]})
    assert "refusing the roster: Roster is for session 'round-1', not 'round-2'" in d.aborted["silo-00"]
    # (b) relabelled for this session, round 1's keys and signatures inside
    relabelled = {i: json.dumps({**json.loads(old[i]), "session": "round-2"}).encode() for i in ["silo-01", "silo-02"]}
    # (c) this session's name, but from another run of the federation
    other_run = Driver(fed, 5, session="round-2", signed=signed, run_id="run-0")
    cross_run = other_run.advertise()
    d.share({**relabelled, "silo-03": cross_run["silo-03"]})
    if not signed:  # nothing tells an unsigned silo that these keys are stale: it seals its shares under them
        assert set(d.aborted) == {"silo-00"} and {"silo-01", "silo-02", "silo-03"} <= set(d.hub.sealed)
        return
    assert set(d.aborted) == {"silo-00", "silo-01", "silo-02", "silo-03"}
    for i in ["silo-01", "silo-02", "silo-03"]:
        assert "keys are not signed by its certificate" in d.aborted[i]
        assert "the signature does not verify" in d.aborted[i]
    assert set(d.hub.sealed) == set()  # of every silo that refused, the hub holds no share at all (0 < t)


# ------------------------------------------------------------------------------------------------ 4. small cohort
def test_a_survivor_set_below_the_silos_cohort_policy_is_refused(fed):
    d = Driver(fed, 7, session="cohort", min_cohort=5)
    d.to_masked()
    small = ["silo-00", "silo-01", "silo-02"]
    request = msg.dump(msg.ConsistencyRequest(session="cohort", survivors=small))
    assert d.consistency({i: request for i in small}) == {}
    for i in small:
        assert "refusing the survivor set: the hub's survivor set has 3 silos; this silo's policy requires a " \
               "cohort of at least 5" in d.aborted[i]
        with pytest.raises(SecAggError, match="stage aborted"):  # and it reveals nothing afterwards
            d.silos[i].unmask(d.unmask_request(i, small, {}))


@pytest.mark.parametrize("min_cohort", [0, 5])
def test_why_the_cohort_matters_a_sum_of_three_with_two_colluders_is_the_third(fed, min_cohort):
    """Four silos (k = 3, t = 2): the hub throws away silo-03's masked input and calls it dropped, so the round's
    sum holds V and two colluders; without the policy, the hub subtracts the colluders' inputs and has V's."""
    d = Driver(fed, 4, session="three", min_cohort=min_cohort)
    assert (d.hub.degree, d.hub.threshold) == (3, 2)
    d.share(d.advertise())
    inboxes = d.hub.close_share_keys()
    d.mask({i: inboxes[i] for i in ["silo-00", "silo-01", "silo-02"]})
    signatures = d.consistency(d.hub.close_masked_input())
    for i, s in signatures.items():
        d.hub.receive_consistency(i, msg.dump(msg.ConsistencySignature(session="three", signature=s)))
    if min_cohort:
        assert signatures == {} and len(d.aborted) == 3
        assert all("cohort of at least 5" in reason for reason in d.aborted.values())
        with pytest.raises(RoundAbandoned):
            d.hub.close_consistency()
        assert d.hub.revealed == {}
        return
    for i, reply in d.unmask(d.hub.close_consistency()).items():
        d.hub.receive_unmask(i, msg.dump(reply))
    result = d.hub.finish()
    total = np.concatenate([result.integer_sums[k].reshape(-1) for k in sorted(result.integer_sums)])
    x_v = total - d.silos["silo-01"].levels - d.silos["silo-02"].levels
    assert result.contributors == ["silo-00", "silo-01", "silo-02"]
    assert np.array_equal(x_v, d.silos["silo-00"].levels)


# ------------------------------------------------------------------------------------------------ 5. revoked silo
def test_a_roster_naming_a_revoked_silo_is_refused(tmp_path):
    fed5 = make_federation(tmp_path, 7)
    ids = sorted(fed5.identities)
    revoked = "silo-03"
    crl_verifier = fed5.verifier(crl=True)
    # the CRL can change mid-run: a verifier that cached the certificate still asks about revocation every time
    data = b"anything"
    me = fed5.identities[revoked]
    crl_verifier.verify(revoked, me.cert_der, data, me.sign(data))
    pki.revoke(fed5.ca_dir, revoked)
    with pytest.raises(IdentityError, match=f"silo {revoked}: the certificate \\(serial [0-9a-f]+\\) is revoked"):
        crl_verifier.verify(revoked, me.cert_der, data, me.sign(data))

    inputs = make_inputs(ids)
    # a hub with a stale view (no CRL) lets the revoked silo in; every silo that checks the CRL refuses
    costs = Costs()
    with pytest.raises(RoundAbandoned):
        aggregate(inputs, PARAMS, identities=fed5.identities, verifier=fed5.verifier(), costs=costs,
                  silo_verifiers={i: fed5.verifier(crl=True) for i in ids}, run_id=RUN)
    assert set(costs.aborted) == set(ids) - {revoked}
    for reason in costs.aborted.values():
        assert f"neighbour {revoked}'s keys are not signed by its certificate" in reason and "is revoked" in reason
    assert set(costs.hub.sealed) == {revoked}  # no honest silo shared anything: the hub holds 0 < t shares
    # a hub that checks the CRL itself refuses the revoked silo's keys, and the round goes on without it
    costs = Costs()
    result = aggregate(inputs, PARAMS, identities=fed5.identities, verifier=fed5.verifier(crl=True), costs=costs,
                       run_id=RUN)
    assert "is revoked" in costs.refused[revoked] and not costs.aborted
    assert result.contributors == [i for i in ids if i != revoked]
    assert np.array_equal(np.concatenate([result.integer_sums[k].reshape(-1) for k in sorted(result.integer_sums)]),
                          sum(costs.silos[i].levels for i in result.contributors).astype(np.uint32))


# ------------------------------------------------------------------------------------------------ 6. never both shares
@pytest.mark.parametrize("signed", [False, True])
def test_a_silo_never_reveals_both_shares_of_a_neighbour(fed, signed):
    d = Driver(fed, 7, session="twice", signed=signed)
    signatures = d.consistency(d.to_masked())
    assert len(signatures) == 7
    honest = d.unmask_request("silo-01", d.ids, signatures)
    flipped = d.unmask_request("silo-01", set(d.ids) - {"silo-00"}, signatures)
    reply = msg.UnmaskReply.model_validate_json(d.silos["silo-01"].unmask(honest))
    with pytest.raises(SecAggError, match="stage done, cannot run a consistent step"):
        d.silos["silo-01"].unmask(flipped)
    assert sorted(reply.shares) == sorted(d.hub.graph["silo-01"])
    assert {s.kind for s in reply.shares.values()} == {"self_mask"}  # one share per neighbour, of one kind
    # asked first to treat silo-00 as dropped, against the set it signed: refused, and nothing after that
    with pytest.raises(SecAggError, match="disagrees with the survivor set this silo signed about silo-00"):
        d.silos["silo-02"].unmask(d.unmask_request("silo-02", set(d.ids) - {"silo-00"}, signatures))
    with pytest.raises(SecAggError, match="stage aborted"):
        d.silos["silo-02"].unmask(d.unmask_request("silo-02", d.ids, signatures))


# ------------------------------------------------------------------------------------------------ 7. one encoding
def coarse_for_all_but(d: Driver, victim: str) -> dict[str, bytes]:
    """The rosters of a hub that gives `victim` the run's rules and every other silo a one-bit encoding of a huge
    range: their levels (0 or 1 each) would add at most n - 1 to the unmasked sum, which would then read as the
    victim's input to within (n - 1) / 2 levels. On the code before this check, 8 silos' sum gave the hub the
    victim's input to within 1.2e-4 (values up to 0.9, 16 bits), with no silo colluding."""
    coarse = [msg.RuleMsg(pattern="*", clip=1e6, bits=1)]
    return {i: r if i == victim else msg.dump(msg.Roster.model_validate_json(r).model_copy(update={"rules": coarse}))
            for i, r in d.advertise().items()}


@pytest.mark.parametrize("signed", [False, True])
def test_a_hub_that_encodes_one_silo_differently_gets_no_masked_input_from_anyone(fed, signed):
    d = Driver(fed, 8, session="encoding", signed=signed)
    victim = "silo-00"
    d.share(coarse_for_all_but(d, victim))
    assert d.hub.degree == 7 and not d.aborted  # a complete graph: every silo holds a share of every other
    d.mask(d.hub.close_share_keys())
    assert d.masked == {} and set(d.aborted) == set(d.ids)
    for i, reason in d.aborted.items():
        assert "refusing the inbox" in reason and "was shown other session parameters (quantization rules, " \
               "modulus, k or t) than this silo" in reason
        assert ("neighbour silo-01 " if i == victim else f"neighbour {victim} ") in reason


def test_a_hub_that_also_withholds_the_shares_that_would_give_it_away_leaves_the_victim_out(fed):
    """The hub keeps the victim's shares from the others and theirs from the victim: the others' round goes on
    without it, and the victim, short of t shares, never masks its input."""
    d = Driver(fed, 8, session="withheld")
    victim = "silo-00"
    d.share(coarse_for_all_but(d, victim))
    inboxes = {}
    for i, inbox in d.hub.close_share_keys().items():
        shares = msg.Inbox.model_validate_json(inbox).shares
        kept = {} if i == victim else {j: c for j, c in shares.items() if j != victim}
        inboxes[i] = msg.dump(msg.Inbox(session=d.session, shares=kept))
    d.mask(inboxes)
    assert victim not in d.masked and set(d.aborted) == {victim}
    assert "only 0 neighbours shared keys, threshold 5" in d.aborted[victim]
    assert len(d.masked) == 7  # the others, under one encoding among themselves


def test_a_stage_is_closable_only_when_closing_it_would_not_abandon_the_session(fed):
    # The hub closes a stage early once its quorum answered: a quorum below what the session needs (t live
    # neighbours per silo, min_survivors) must not count, or the early close abandons a round waiting would finish.
    d = Driver(fed, 8, session="closable")
    rosters = d.advertise()
    assert (d.hub.degree, d.hub.threshold, d.hub.min_survivors) == (7, 5, 5) and not d.hub.closable()
    d.share({i: rosters[i] for i in d.ids[:5]})
    assert d.hub.answered() == 5 and not d.hub.closable()  # each has 4 sealed neighbours, t = 5: none survives
    d.share({i: rosters[i] for i in d.ids[5:6]})
    assert d.hub.closable()
    inboxes = d.hub.close_share_keys()
    d.mask({i: inboxes[i] for i in d.ids[:5]})
    assert not d.hub.closable()  # each of the six in U2 needs t = 5 revealers among the five that masked
    d.mask({i: inboxes[i] for i in d.ids[5:6]})
    assert d.hub.closable()


# ------------------------------------------------------------------------------------------------ honest rounds
@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_an_honest_signed_round_is_exact_with_a_dropout_at_each_stage(fed, stage):
    ids = [f"silo-{i:02d}" for i in range(6)]
    inputs = make_inputs(ids, seed=3)
    costs = Costs()
    result = aggregate(inputs, PARAMS, drop={"silo-02": stage}, costs=costs, identities=fed.identities,
                       verifier=fed.verifier(), run_id=RUN, min_cohort=5)
    in_sum = STAGE_ORDER.index(stage) >= STAGE_ORDER.index("consistency")
    assert ("silo-02" in result.contributors) == in_sum and not costs.aborted and not costs.refused
    assert result.stats["consistency"] == (6 if stage == "unmask" else 5)
    assert result.stats["u4"] == 5
    total = sum(costs.silos[i].levels for i in result.contributors).astype(np.uint32)
    assert np.array_equal(np.concatenate([result.integer_sums[k].reshape(-1) for k in sorted(result.integer_sums)]),
                          total)
    true = sum(inputs[i]["delta/w"].double() for i in result.contributors)
    assert float((result.sums["delta/w"] - true).abs().max()) <= Rule("*", 1.0, 16).error_bound(6)


def test_a_policy_threshold_above_the_rosters_is_refused(fed):
    d = Driver(fed, 7, session="floor")
    d.silos["silo-00"].min_threshold = 5
    d.share(d.advertise())
    assert "threshold 4 is below this silo's minimum of 5 shares" in d.aborted["silo-00"]
    assert set(d.aborted) == {"silo-00"}
