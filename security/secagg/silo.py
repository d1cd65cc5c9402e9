"""The silo's half of SecAgg+: five stages, each a method that consumes the hub's message and returns bytes.

    s = SiloSession(session_id, silo_id, identity=..., verifier=..., run_id=...)
    keys   = s.advertise_keys()                   # stage 0: fresh X25519 key pairs (c, s), signed
    shares = s.share_keys(roster)                 # stage 1: check neighbours' signed keys; shares of b and s_sk
    masked = s.masked_input(inbox, tensors)       # stage 2: y = Q(x) + PRG(b) + sum_j +-PRG(s_ij)  (mod 2^m)
    sig    = s.consistency(request)               # stage 3: sign the survivor set U3 the hub announces
    reply  = s.unmask(request)                    # stage 4: b-shares of survivors, s_sk-shares of dropped ones

With silos ordered by their roster index, silo i's masked input is

    y_i = Q(x_i) + PRG(K_self(b_i)) + sum_{j in N_i, j > i} PRG(K_ij) - sum_{j in N_i, j < i} PRG(K_ij)   (mod 2^m)

where K_ij = HKDF(X25519(s_sk_i, s_pk_j)) = K_ji, and N_i are the neighbours whose shares reached i. Over any set
of silos that all survived, the pairwise masks cancel; the hub removes the self masks with the seeds b_i it
reconstructs from t shares, and the masks shared with a dropped silo j with the key s_sk_j it reconstructs instead.
An honest silo reveals, for each neighbour, a share of b_j OR of s_sk_j, never both: that is what keeps a single
y_i hidden.

Against a hub that deviates (Bonawitz et al. 2017, the malicious-server variant), a *signed* session (identity
and verifier given) adds two checks, so the hub can neither substitute keys nor tell neighbours different stories:

- share_keys: every neighbour's (c_pk, s_pk) must carry that neighbour's signature, by a live certificate of the
  federation CA with CN = its id, over advertise_statement(run, session, id, c_pk, s_pk). Keys the hub made up
  cannot be signed, and keys replayed from another run or session are signed over other bytes.
- consistency / unmask: the silo signs the survivor set U3 it is shown, once. It then reveals only if the unmask
  request agrees with that set (survivors = its neighbours in U3, dropped = the rest) and the hub forwards valid
  signatures over the very same set from at least t of its own neighbours (and max(min_cohort, t) silos in all).
  A hub that showed v as alive to one group of v's neighbours and as dropped to another would need t signatures
  on each of two sets; an honest silo signs only one, and t > k/2, so (short of a coalition of corrupt silos of
  size about 2t + 2 - k, in a complete neighbourhood) one of the groups refuses and the hub never holds t shares
  of both b_v and s_sk_v.

Signed or not, every share carries its sender's session parameters (messages.session_parameters: quantization
rules, ring, k, t) and its recipient refuses one made under other parameters than its own roster's, before masking;
signed survivor sets cover them too. Otherwise a hub could give one silo a fine encoding and every other silo a
one-bit encoding of a huge range, and read that silo's input out of the sum.

Unsigned sessions run the same stages (the consistency reply carries no signature) and still refuse an unmask
request that contradicts the set they acknowledged, but cannot tell which silos saw which set.

Any failed check aborts the session (state ABORTED, SecAggError raised); the hub then treats the silo as dropped.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping

import numpy as np
import torch

from security.secagg import messages as msg
from security.secagg import primitives as pr
from security.secagg import shamir
from security.secagg.identity import (
    IdentityError,
    PeerVerifier,
    SiloIdentity,
    advertise_statement,
    survivors_statement,
)
from security.secagg.quantize import MODULUS_BITS, UINT, Rule, encode, rounding_generator, rule_for


class SecAggError(RuntimeError):
    """This silo refuses to continue the session (bad parameters, tampered share, inconsistent request)."""


class Stage(enum.Enum):
    NEW = "new"
    ADVERTISED = "advertised"
    SHARED = "shared"
    MASKED = "masked"
    CONSISTENT = "consistent"  # acknowledged (signed) the survivor set
    DONE = "done"
    ABORTED = "aborted"


class SiloSession:
    """One silo's side of one session. Signed when `identity` is given (then `verifier` is required): its keys
    and its view of the survivor set are signed, and the neighbours' are verified. `min_cohort`: the fewest silos
    whose inputs the sum may hold (checked on the survivor set); `min_threshold`: the fewest shares (t) that must
    be needed to recover any secret of this silo (checked on the roster)."""

    def __init__(self, session_id: str, silo_id: str, rounding_seed: int | None = None, keep_levels: bool = False,
                 *, identity: SiloIdentity | None = None, verifier: PeerVerifier | None = None, run_id: str = "",
                 min_cohort: int = 0, min_threshold: int = 0):
        if identity is not None:
            if verifier is None:
                raise ValueError("a signed session needs a verifier for its neighbours' certificates")
            if identity.silo_id != silo_id:
                raise ValueError(f"the identity is silo {identity.silo_id!r}'s, not {silo_id!r}'s")
        self.session = session_id
        self.silo_id = silo_id
        self.identity = identity
        self.verifier = verifier
        self.run_id = run_id
        self.min_cohort = min_cohort
        self.min_threshold = min_threshold
        self.stage = Stage.NEW
        self._rounding = rounding_generator(rounding_seed)
        self._c_key = pr.new_keypair()  # share encryption
        self._s_key = pr.new_keypair()  # pairwise masks
        self.roster: msg.Roster | None = None
        self._neighbour_certs: dict[str, bytes] = {}  # neighbour -> the certificate its signed keys came with
        self._seed: bytes | None = None
        self._received: dict[str, msg.SharePlaintext] = {}
        self.survivors: frozenset[str] | None = None  # the survivor set this silo acknowledged (signed)
        self.clipped_values = 0  # how many values fell outside their rule's clip range (local statistic)
        self.keep_levels = keep_levels
        self.levels: np.ndarray | None = None  # the encoded input, kept (keep_levels) for inspection by its owner

    @property
    def signed(self) -> bool:
        return self.identity is not None

    def _enter(self, expected: Stage) -> None:
        if self.stage is not expected:
            raise SecAggError(f"session {self.session}: stage {self.stage.value}, cannot run a {expected.value} step")

    def _abort(self, reason: str) -> SecAggError:
        self.stage = Stage.ABORTED
        self._seed, self._s_key, self._received = None, None, {}
        return SecAggError(f"session {self.session}, silo {self.silo_id}: {reason}")

    # ------------------------------------------------------------------ stage 0
    def advertise_keys(self) -> bytes:
        self._enter(Stage.NEW)
        c_pk, s_pk = pr.public_bytes(self._c_key), pr.public_bytes(self._s_key)
        cert = signature = ""
        if self.identity is not None:
            cert = msg.b64(self.identity.cert_der)
            signature = msg.b64(self.identity.sign(advertise_statement(self.run_id, self.session, self.silo_id,
                                                                       c_pk, s_pk)))
        self.stage = Stage.ADVERTISED
        return msg.dump(msg.AdvertiseKeys(session=self.session, c_pk=msg.b64(c_pk), s_pk=msg.b64(s_pk), cert=cert,
                                          signature=signature))

    # ------------------------------------------------------------------ stage 1
    def share_keys(self, roster_bytes: bytes) -> bytes:
        self._enter(Stage.ADVERTISED)
        try:
            roster = msg.parse(msg.Roster, roster_bytes, self.session)
            self._check_roster(roster)
        except (msg.ProtocolError, ValueError) as err:
            raise self._abort(f"refusing the roster: {err}") from None
        self.roster = roster
        self._seed = os.urandom(shamir.SECRET_BYTES)
        try:
            sealed = self._seal_shares(roster)
        except ValueError as err:
            raise self._abort(f"cannot share keys: {err}") from None
        self.stage = Stage.SHARED
        return msg.dump(msg.SharedKeys(
            session=self.session, commitment=msg.b64(pr.commitment(self.session, self.silo_id, self._seed)),
            shares=sealed,
        ))

    def _seal_shares(self, roster: msg.Roster) -> dict[str, str]:
        """Shamir-share b and s_sk among the neighbours (point x = neighbour's index); seal each pair of shares
        for its recipient with AES-GCM under HKDF(X25519(c_sk_i, c_pk_j))."""
        points = {n.index: n for n in roster.neighbours}
        b_shares = shamir.split(self._seed, points, roster.threshold)
        sk_shares = shamir.split(pr.private_bytes(self._s_key), points, roster.threshold)
        sealed = {}
        for x, n in points.items():
            plain = msg.SharePlaintext(
                session=self.session, sender=self.silo_id, recipient=n.silo_id, x=x,
                self_mask=msg.b64(shamir.to_bytes(b_shares[x])), masking_key=msg.b64(shamir.to_bytes(sk_shares[x])),
                parameters=roster.parameters(),
            )
            key = pr.agree(self._c_key, msg.unb64(n.c_pk, pr.KEY_BYTES), self.session, pr.SHARE_KEY,
                           self.silo_id, n.silo_id)
            aad = share_aad(self.session, self.silo_id, n.silo_id)
            sealed[n.silo_id] = msg.b64(pr.seal(key, msg.dump(plain), aad))
        return sealed

    def _check_roster(self, r: msg.Roster) -> None:
        if r.silo_id != self.silo_id:
            raise ValueError(f"roster is addressed to {r.silo_id!r}")
        ids = [n.silo_id for n in r.neighbours]
        indices = [n.index for n in r.neighbours]
        if len(set(ids)) != len(ids) or self.silo_id in ids:
            raise ValueError("neighbour ids repeat or include this silo")
        if len(set(indices)) != len(indices) or r.index in indices:
            raise ValueError("neighbour indices repeat or collide with ours")
        if not (r.threshold >= 2 and 2 * r.threshold > r.degree):
            raise ValueError(f"threshold {r.threshold} is not a strict majority of the neighbourhood {r.degree}")
        if r.threshold < self.min_threshold:
            raise ValueError(f"threshold {r.threshold} is below this silo's minimum of {self.min_threshold} shares "
                             "(the run's pinned terms or the branch's policy)")
        if not r.threshold <= len(r.neighbours) <= r.degree:
            raise ValueError(f"{len(r.neighbours)} neighbours for a threshold of {r.threshold} and degree {r.degree}")
        if r.modulus_bits not in MODULUS_BITS or not r.rules:
            raise ValueError("bad modulus or no quantization rules")
        for rule in r.rules:
            Rule(rule.pattern, rule.clip, rule.bits)
            if rule.bits >= r.modulus_bits:
                raise ValueError(f"rule {rule.pattern!r} has more bits than the modulus")
        for n in r.neighbours:
            pr.load_public(msg.unb64(n.c_pk, pr.KEY_BYTES))
            pr.load_public(msg.unb64(n.s_pk, pr.KEY_BYTES))
        if self.signed:
            for n in r.neighbours:
                self._verify_neighbour_keys(n)

    def _verify_neighbour_keys(self, n: msg.NeighbourKeys) -> None:
        """The neighbour's keys must be signed by the neighbour itself, for this run and session (see module
        docstring): a key the hub substituted or replayed makes the whole roster unusable."""
        if not n.cert or not n.signature:
            raise ValueError(f"neighbour {n.silo_id}'s keys are not signed (no certificate or signature)")
        cert = msg.unb64(n.cert)
        statement = advertise_statement(self.run_id, self.session, n.silo_id, msg.unb64(n.c_pk, pr.KEY_BYTES),
                                        msg.unb64(n.s_pk, pr.KEY_BYTES))
        try:
            self.verifier.verify(n.silo_id, cert, statement, msg.unb64(n.signature))
        except IdentityError as err:
            raise ValueError(f"neighbour {n.silo_id}'s keys are not signed by its certificate ({err})") from None
        self._neighbour_certs[n.silo_id] = cert

    # ------------------------------------------------------------------ stage 2
    def masked_input(self, inbox_bytes: bytes, tensors: Mapping[str, torch.Tensor]) -> bytes:
        self._enter(Stage.SHARED)
        r = self.roster
        neighbours = {n.silo_id: n for n in r.neighbours}
        try:
            inbox = msg.parse(msg.Inbox, inbox_bytes, self.session)
            unknown = set(inbox.shares) - set(neighbours)
            if unknown:
                raise ValueError(f"shares from non-neighbours {sorted(unknown)[:3]}")
            if len(inbox.shares) < r.threshold:
                raise ValueError(f"only {len(inbox.shares)} neighbours shared keys, threshold {r.threshold}")
            for sender, sealed in inbox.shares.items():
                self._received[sender] = self._open_share(neighbours[sender], msg.unb64(sealed))
        except pr.TamperedShare as err:
            raise self._abort(f"a share failed authentication: {err}") from None
        except (msg.ProtocolError, ValueError) as err:
            raise self._abort(f"refusing the inbox: {err}") from None

        try:
            arrays = self._mask(tensors, neighbours, sorted(inbox.shares))
        except (ValueError, KeyError) as err:
            raise self._abort(f"cannot mask the input: {err}") from None
        self.stage = Stage.MASKED
        return msg.dump_masked(self.session, self.silo_id, arrays)

    def _mask(self, tensors: Mapping[str, torch.Tensor], neighbours: dict[str, msg.NeighbourKeys],
              senders: list[str]) -> dict[str, np.ndarray]:
        r = self.roster
        bits = r.modulus_bits
        rules = [Rule(x.pattern, x.clip, x.bits) for x in r.rules]
        names = sorted(tensors)
        flat, shapes = [], {}
        for name in names:
            q, clipped = encode(tensors[name], rule_for(rules, name), bits, self._rounding)
            flat.append(q)
            shapes[name] = tuple(tensors[name].shape)
            self.clipped_values += clipped
        y = np.concatenate(flat) if flat else np.zeros(0, UINT[bits])
        if self.keep_levels:
            self.levels = y.copy()
        # y = Q(x) + PRG(K_self) + sum_{j > i} PRG(K_ij) - sum_{j < i} PRG(K_ij)   (mod 2^m; numpy wraps)
        np.add(y, pr.prg_words(self_mask_key(self.session, self.silo_id, self._seed), y.size, bits), out=y)
        for sender in senders:
            n = neighbours[sender]
            key = pr.agree(self._s_key, msg.unb64(n.s_pk, pr.KEY_BYTES), self.session, pr.PAIR_MASK,
                           self.silo_id, n.silo_id)
            mask = pr.prg_words(key, y.size, bits)
            if r.index < n.index:
                np.add(y, mask, out=y)
            else:
                np.subtract(y, mask, out=y)
        arrays, offset = {}, 0
        for name in names:
            size = int(np.prod(shapes[name], dtype=np.int64))
            arrays[name] = y[offset : offset + size].reshape(shapes[name])
            offset += size
        return arrays

    def _open_share(self, sender: msg.NeighbourKeys, sealed: bytes) -> msg.SharePlaintext:
        key = pr.agree(self._c_key, msg.unb64(sender.c_pk, pr.KEY_BYTES), self.session, pr.SHARE_KEY,
                       self.silo_id, sender.silo_id)
        plain = msg.parse(msg.SharePlaintext, pr.open_sealed(key, sealed, share_aad(self.session, sender.silo_id,
                                                                              self.silo_id)), self.session)
        if plain.sender != sender.silo_id or plain.recipient != self.silo_id or plain.x != self.roster.index:
            raise ValueError(f"share from {sender.silo_id} is labelled for someone else")
        if plain.parameters != self.roster.parameters():
            raise ValueError(f"neighbour {sender.silo_id} was shown other session parameters (quantization rules, "
                             f"modulus, k or t) than this silo: a hub that encodes silos differently can read one "
                             f"silo's input out of the sum")
        shamir.from_bytes(msg.unb64(plain.self_mask))
        shamir.from_bytes(msg.unb64(plain.masking_key))
        return plain

    # ------------------------------------------------------------------ stage 3
    def consistency(self, request_bytes: bytes) -> bytes:
        """Acknowledge the survivor set U3 the hub announces, signing it in a signed session. Refused unless this
        silo is in it, every neighbour in it is one whose shares reached this silo, it has at least min_cohort
        silos (a sum over fewer, less the inputs of silos colluding with the hub, could be one silo's input), and
        at least t of this silo's neighbours are in it (or the unmask to come could not go ahead anyway). One
        set, once: the stage leaves MASKED."""
        self._enter(Stage.MASKED)
        try:
            req = msg.parse(msg.ConsistencyRequest, request_bytes, self.session)
            survivors = frozenset(req.survivors)
            if len(survivors) != len(req.survivors):
                raise ValueError("the survivor set names a silo twice")
            if self.silo_id not in survivors:
                raise ValueError("the survivor set leaves out this silo, which sent its masked input")
            neighbours = {n.silo_id for n in self.roster.neighbours}
            unknown = (survivors & neighbours) - set(self._received)
            if unknown:
                raise ValueError(f"neighbour(s) {', '.join(sorted(unknown)[:5])} are listed as survivors but never "
                                 f"shared keys with this silo")
            if len(survivors) < self.min_cohort:
                raise ValueError(f"the hub's survivor set has {len(survivors)} silos; this silo's policy requires a "
                                 f"cohort of at least {self.min_cohort}")
            alive = len(survivors & set(self._received))
            if alive < self.roster.threshold:
                raise ValueError(f"only {alive} neighbours survived, threshold {self.roster.threshold}")
        except (msg.ProtocolError, ValueError) as err:
            raise self._abort(f"refusing the survivor set: {err}") from None
        signature = ""
        if self.identity is not None:
            signature = msg.b64(self.identity.sign(survivors_statement(self.run_id, self.session, survivors,
                                                                       self.roster.parameters())))
        self.survivors = survivors
        self.stage = Stage.CONSISTENT
        return msg.dump(msg.ConsistencySignature(session=self.session, signature=signature))

    # ------------------------------------------------------------------ stage 4
    def unmask(self, request_bytes: bytes) -> bytes:
        """Reveal, per neighbour that shared keys, a share of its self-mask seed (it survived) or of its masking
        key (it dropped), never both: the request must agree with the survivor set this silo acknowledged, and in
        a signed session come with enough valid signatures over that same set. Afterwards the session is DONE."""
        self._enter(Stage.CONSISTENT)
        try:
            req = msg.parse(msg.UnmaskRequest, request_bytes, self.session)
            survivors, dropped = set(req.survivors), set(req.dropped)
            if survivors & dropped:
                raise ValueError("a neighbour is listed as both survived and dropped")
            if survivors | dropped != set(self._received):
                raise ValueError("the request does not account for exactly the neighbours that shared keys")
            if len(survivors) < self.roster.threshold:
                raise ValueError(f"only {len(survivors)} neighbours survived, threshold {self.roster.threshold}")
            acknowledged = set(self._received) & self.survivors
            if survivors != acknowledged:
                flipped = sorted(survivors ^ acknowledged)
                raise ValueError(f"the request disagrees with the survivor set this silo signed about "
                                 f"{', '.join(flipped[:5])}")
            if self.signed:
                self._check_survivor_signatures(req.signatures)
        except (msg.ProtocolError, ValueError) as err:
            raise self._abort(f"refusing to unmask: {err}") from None
        shares = {}
        for owner, plain in sorted(self._received.items()):
            if owner in survivors:
                shares[owner] = msg.RevealedShare(kind="self_mask", y=plain.self_mask)
            else:
                shares[owner] = msg.RevealedShare(kind="masking_key", y=plain.masking_key)
        self.stage = Stage.DONE
        self._seed, self._s_key, self._received = None, None, {}
        return msg.dump(msg.UnmaskReply(session=self.session, x=self.roster.index, shares=shares))

    def _check_survivor_signatures(self, signatures: list[msg.SignedSurvivors]) -> None:
        """Every forwarded signature must verify over the set this silo signed (one that does not means the hub
        is showing sets around that differ: refuse). Count distinct signers in the set: at least t of them among
        this silo's roster neighbours (under the certificate their keys came with), and max(min_cohort, t) in
        all, before anything is revealed."""
        statement = survivors_statement(self.run_id, self.session, self.survivors, self.roster.parameters())
        valid: set[str] = set()
        for entry in signatures:
            roster_cert = self._neighbour_certs.get(entry.silo_id)
            # A neighbour's certificate came with its roster entry: the hub may leave it out here.
            cert = msg.unb64(entry.cert) if entry.cert or roster_cert is None else roster_cert
            if roster_cert is not None and cert != roster_cert:
                raise ValueError(f"the survivor-set signature of neighbour {entry.silo_id} comes with a certificate "
                                 f"other than the one its keys were signed with")
            try:
                self.verifier.verify(entry.silo_id, cert, statement, msg.unb64(entry.signature))
            except IdentityError as err:
                raise ValueError(f"the signature of {entry.silo_id} does not verify over the survivor set and "
                                 f"session parameters this silo signed: the hub showed silos different sets or "
                                 f"parameters ({err})") from None
            if entry.silo_id in self.survivors:
                valid.add(entry.silo_id)
        from_neighbours = len(valid & set(self._neighbour_certs))
        if from_neighbours < self.roster.threshold:
            raise ValueError(f"only {from_neighbours} of this silo's neighbours signed the survivor set, threshold "
                             f"{self.roster.threshold}")
        need = max(self.min_cohort, self.roster.threshold)
        if len(valid) < need:
            raise ValueError(f"only {len(valid)} silos signed the survivor set, {need} required")


def self_mask_key(session: str, silo_id: str, seed: bytes) -> bytes:
    """The PRG key of a silo's self mask: HKDF over its 256-bit seed b, bound to the session and the silo."""
    return pr.hkdf(seed, session, pr.SELF_MASK, silo_id)


def share_aad(session: str, sender: str, recipient: str) -> bytes:
    """AES-GCM associated data of a share: it only opens for this session, this sender and this recipient."""
    return json.dumps([pr.PROTOCOL.decode(), "share", session, sender, recipient]).encode()
