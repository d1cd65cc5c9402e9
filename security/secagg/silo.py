"""The silo's half of SecAgg+: four stages, each a method that consumes the hub's message and returns bytes.

    s = SiloSession(session_id, silo_id)
    keys   = s.advertise_keys()                   # stage 0: fresh X25519 key pairs (c, s)
    shares = s.share_keys(roster)                 # stage 1: self-mask seed b, Shamir shares of b and s_sk
    masked = s.masked_input(inbox, tensors)       # stage 2: y = Q(x) + PRG(b) + sum_j +-PRG(s_ij)  (mod 2^m)
    reply  = s.unmask(request)                    # stage 3: b-shares of survivors, s_sk-shares of dropped ones

With silos ordered by their roster index, silo i's masked input is

    y_i = Q(x_i) + PRG(K_self(b_i)) + sum_{j in N_i, j > i} PRG(K_ij) - sum_{j in N_i, j < i} PRG(K_ij)   (mod 2^m)

where K_ij = HKDF(X25519(s_sk_i, s_pk_j)) = K_ji, and N_i are the neighbours whose shares reached i. Over any set
of silos that all survived, the pairwise masks cancel; the hub removes the self masks with the seeds b_i it
reconstructs from t shares, and the masks shared with a dropped silo j with the key s_sk_j it reconstructs instead.
An honest silo reveals, for each neighbour, a share of b_j OR of s_sk_j, never both: that is what keeps a single
y_i hidden.

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
from security.secagg.quantize import MODULUS_BITS, UINT, Rule, encode, rounding_generator, rule_for


class SecAggError(RuntimeError):
    """This silo refuses to continue the session (bad parameters, tampered share, inconsistent request)."""


class Stage(enum.Enum):
    NEW = "new"
    ADVERTISED = "advertised"
    SHARED = "shared"
    MASKED = "masked"
    DONE = "done"
    ABORTED = "aborted"


class SiloSession:
    def __init__(self, session_id: str, silo_id: str, rounding_seed: int | None = None, keep_levels: bool = False):
        self.session = session_id
        self.silo_id = silo_id
        self.stage = Stage.NEW
        self._rounding = rounding_generator(rounding_seed)
        self._c_key = pr.new_keypair()  # share encryption
        self._s_key = pr.new_keypair()  # pairwise masks
        self.roster: msg.Roster | None = None
        self._seed: bytes | None = None
        self._received: dict[str, msg.SharePlaintext] = {}
        self.clipped_values = 0  # how many values fell outside their rule's clip range (local statistic)
        self.keep_levels = keep_levels
        self.levels: np.ndarray | None = None  # the encoded input, kept (keep_levels) for inspection by its owner

    def _enter(self, expected: Stage) -> None:
        if self.stage is not expected:
            raise SecAggError(f"session {self.session}: stage {self.stage.value}, cannot run a {expected.value} step")

    def _abort(self, reason: str) -> SecAggError:
        self.stage = Stage.ABORTED
        self._seed, self._s_key = None, None
        return SecAggError(f"session {self.session}, silo {self.silo_id}: {reason}")

    # ------------------------------------------------------------------ stage 0
    def advertise_keys(self) -> bytes:
        self._enter(Stage.NEW)
        self.stage = Stage.ADVERTISED
        return msg.dump(msg.AdvertiseKeys(session=self.session, c_pk=msg.b64(pr.public_bytes(self._c_key)),
                                          s_pk=msg.b64(pr.public_bytes(self._s_key))))

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
        shamir.from_bytes(msg.unb64(plain.self_mask))
        shamir.from_bytes(msg.unb64(plain.masking_key))
        return plain

    # ------------------------------------------------------------------ stage 3
    def unmask(self, request_bytes: bytes) -> bytes:
        self._enter(Stage.MASKED)
        try:
            req = msg.parse(msg.UnmaskRequest, request_bytes, self.session)
            survivors, dropped = set(req.survivors), set(req.dropped)
            if survivors & dropped:
                raise ValueError("a neighbour is listed as both survived and dropped")
            if survivors | dropped != set(self._received):
                raise ValueError("the request does not account for exactly the neighbours that shared keys")
            if len(survivors) < self.roster.threshold:
                raise ValueError(f"only {len(survivors)} neighbours survived, threshold {self.roster.threshold}")
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


def self_mask_key(session: str, silo_id: str, seed: bytes) -> bytes:
    """The PRG key of a silo's self mask: HKDF over its 256-bit seed b, bound to the session and the silo."""
    return pr.hkdf(seed, session, pr.SELF_MASK, silo_id)


def share_aad(session: str, sender: str, recipient: str) -> bytes:
    """AES-GCM associated data of a share: it only opens for this session, this sender and this recipient."""
    return json.dumps([pr.PROTOCOL.decode(), "share", session, sender, recipient]).encode()
