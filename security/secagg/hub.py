"""The hub's half of SecAgg+: collect each stage's messages, close the stage, relay, and finally unmask the sum.

    h = HubSession(session_id, silo_ids, params, shapes, verifier=..., run_id=..., signed=True)
    h.receive_keys(silo, payload)*        ; rosters  = h.close_advertise()    # U1: silos that advertised keys
    h.receive_shares(silo, payload)*      ; inboxes  = h.close_share_keys()   # U2: silos that shared keys
    h.receive_masked_input(silo, payload)*; requests = h.close_masked_input() # U3: silos whose masked input arrived
    h.receive_consistency(silo, payload)* ; requests = h.close_consistency()  # U4: silos that signed U3
    h.receive_unmask(silo, payload)*      ; result   = h.finish()             # U5: silos that revealed shares

U1 >= U2 >= U3 >= U4 >= U5 (the stats keep their names: "u4" counts the silos that revealed shares, U5 here, and
"consistency" those that signed U3). The masked inputs are added into one running sum mod 2^m as they arrive
(memory does not grow with the number of silos). At the end, with N_j the neighbours of j,

    sum_{i in U3} Q(x_i) = sum_{i in U3} y_i - sum_{i in U3} PRG(K_self(b_i))
                           - sum_{j in U2 \\ U3} sum_{i in N_j & U3} sign(i, j) PRG(K_ij)       (mod 2^m)

where sign(i, j) = +1 if i's index is below j's, else -1 (the sign with which i added the mask it shares with j),
b_i is reconstructed from t shares of survivors' neighbours and checked against i's commitment, and s_sk_j (hence
K_ij = HKDF(X25519(s_sk_j, s_pk_i))) from t shares and checked against j's advertised public key.

Dropouts are tolerated at every stage while the threshold holds: when a stage closes, a silo with fewer than t live
neighbours is left out (it cannot be unmasked later); once masked inputs have been summed nobody can be left out,
so if some silo in U2 then lacks t neighbours to reveal its secret (after the masked input or after the
consistency round), the round is abandoned (RoundAbandoned). The result is always exact or nothing: never a
wrong sum.

In a signed session (silo.py's docstring has the threat model) the hub checks what it can before relaying: each
silo's advertised keys against its certificate (a bad signature drops that silo before any honest silo sees its
keys) and each consistency signature against the survivor set. The silos do not rely on these checks; they
verify every neighbour's signature themselves, because the hub is the party they guard against.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from security.secagg import messages as msg
from security.secagg import primitives as pr
from security.secagg import shamir
from security.secagg.graph import degree_for, neighbour_graph, threshold_for
from security.secagg.identity import IdentityError, PeerVerifier, advertise_statement, survivors_statement
from security.secagg.params import SecAggParams
from security.secagg.quantize import UINT, Rule, check_capacity, decode_sum, rule_for
from security.secagg.silo import self_mask_key

STAGES = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask", "done", "abandoned")


class RoundAbandoned(RuntimeError):
    """Too few silos remain to finish the protocol; the round must be rerun. No sum is produced."""


@dataclass
class SecAggResult:
    sums: dict[str, torch.Tensor]  # float64 sums over the contributors, dequantized
    contributors: list[str]  # U3: whose inputs are in the sum
    integer_sums: dict[str, np.ndarray] = field(default_factory=dict)  # the exact sums of levels, mod 2^m
    suspects: list[str] = field(default_factory=list)  # silos that revealed a share not on the polynomial
    stats: dict[str, int] = field(default_factory=dict)


class HubSession:
    def __init__(self, session_id: str, silo_ids: Sequence[str], params: SecAggParams,
                 shapes: Mapping[str, tuple[int, ...]], rng: random.Random | None = None,
                 min_survivors: int | None = 1, *, verifier: PeerVerifier | None = None, run_id: str = "",
                 signed: bool = False):
        ids = sorted(set(silo_ids))
        if len(ids) != len(silo_ids):
            raise ValueError("silo ids repeat")
        if signed and verifier is None:
            raise ValueError("a signed session needs a verifier for the silos' certificates")
        self.session = session_id
        self.verifier = verifier
        self.run_id = run_id
        self.signed = signed
        self.params = params
        self.rules: list[Rule] = params.rules()
        self.bits = params.modulus_bits
        self.dtype = np.dtype(UINT[self.bits])
        check_capacity(self.rules, self.bits, len(ids))
        self.names = sorted(shapes)
        self.shapes = {n: tuple(int(d) for d in shapes[n]) for n in self.names}
        for name in self.names:
            rule_for(self.rules, name)  # every tensor must have a rule
        self.size = sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes.values())

        self.ids = ids
        self.index = {s: i + 1 for i, s in enumerate(ids)}  # Shamir points and mask signs
        self.degree = degree_for(len(ids), params.neighbours)
        self.threshold = threshold_for(self.degree, params.threshold)
        self.min_survivors = max(self.threshold, min_survivors or 0)
        self.graph = neighbour_graph(ids, self.degree, rng or random.Random(secrets.randbits(64)))

        self.stage = "advertise_keys"
        self.keys: dict[str, tuple[bytes, bytes]] = {}  # silo -> (c_pk, s_pk)
        self.identities: dict[str, tuple[str, str]] = {}  # silo -> (certificate, signature over its keys), base64
        self.u1: set[str] = set()
        self.sealed: dict[str, dict[str, str]] = {}  # sender -> recipient -> ciphertext (base64)
        self.commitments: dict[str, bytes] = {}
        self.u2: set[str] = set()
        self.total = np.zeros(self.size, self.dtype)
        self.masked_from: set[str] = set()
        self.u3: set[str] = set()
        self.consistency_signatures: dict[str, str] = {}  # silo in U3 -> its signature over U3 (base64)
        self.u4: set[str] = set()  # the silos that signed U3 (Bonawitz et al.'s U4)
        self.revealed: dict[str, dict[str, int]] = {}  # owner -> {x: y}
        self.unmasked_from: set[str] = set()
        self.gone: set[str] = set()  # silos that said they cannot continue (the wire layer stops waiting for them)
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------------ bookkeeping
    def _expect(self, stage: str, silo_id: str, allowed: set[str], done: set[str] | dict) -> None:
        if self.stage != stage:
            raise msg.ProtocolError(f"session {self.session} is at stage {self.stage}, not {stage}")
        if silo_id not in allowed:
            raise msg.ProtocolError(f"silo {silo_id} is not part of stage {stage} of session {self.session}")
        if silo_id in done:
            raise msg.DuplicateMessage(f"silo {silo_id} already sent its {stage} message")
        if silo_id in self.gone:
            raise msg.ProtocolError(f"silo {silo_id} gave up on session {self.session}")

    def _abandon(self, reason: str) -> RoundAbandoned:
        self.stage = "abandoned"
        self.total = np.zeros(0, self.dtype)
        return RoundAbandoned(f"secure aggregation session {self.session} abandoned: {reason}")

    def _stages(self) -> dict[str, tuple[set[str], set[str]]]:
        """Each stage: the silos asked for its message, and those that sent it."""
        return {"advertise_keys": (set(self.ids), set(self.keys)), "share_keys": (self.u1, set(self.sealed)),
                "masked_input": (self.u2, set(self.masked_from)),
                "consistency": (self.u3, set(self.consistency_signatures)), "unmask": (self.u4, set(self.unmasked_from))}

    def waiting_for(self) -> set[str]:
        """Silos whose message the current stage still lacks (the wire layer waits for these or a deadline)."""
        asked, sent = self._stages().get(self.stage, (set(), set()))
        return asked - sent - self.gone

    def answered(self) -> int:
        """How many silos have sent the current stage's message and are still in the session."""
        return len(self._stages().get(self.stage, (set(), set()))[1] - self.gone)

    def closable(self) -> bool:
        """Whether closing share_keys, masked_input or consistency now would let the session go on, as its close
        method would judge the silos that answered (a stage closed on a quorum alone could abandon a round that
        waiting would have finished)."""
        if self.stage not in ("share_keys", "masked_input", "consistency"):
            return False
        sent = self._stages()[self.stage][1]
        if self.stage == "share_keys":
            return len(self._pruned(sent)) >= self.min_survivors
        return len(sent) >= self.min_survivors and all(len(self.graph[j] & sent) >= self.threshold for j in self.u2)

    def dropouts(self) -> set[str]:
        """Silos that left the protocol so far: gave up, or did not answer a stage they were part of."""
        out = set(self.gone)
        for asked, answered in self._stages().values():
            out |= asked - answered
        return out

    def drop(self, silo_id: str) -> None:
        """A silo gave up (its session aborted): nothing more is accepted from it; it counts as a dropout."""
        self.gone.add(silo_id)

    def _pruned(self, alive: set[str]) -> set[str]:
        """`alive` less, until none is left, every silo with fewer than t live neighbours: its secrets could not be
        recovered, so it must not enter the sum."""
        alive = set(alive)
        while True:
            weak = {i for i in alive if len(self.graph[i] & alive) < self.threshold}
            if not weak:
                return alive
            alive -= weak

    def _prune(self, alive: set[str], stage: str) -> set[str]:
        """_pruned; abandon below min_survivors."""
        alive = self._pruned(alive)
        if len(alive) < self.min_survivors:
            raise self._abandon(f"{len(alive)} silos left after {stage}, {self.min_survivors} needed "
                                f"(threshold t = {self.threshold} of {self.degree} neighbours)")
        return alive

    # ------------------------------------------------------------------ stage 0: advertise keys
    def receive_keys(self, silo_id: str, payload: bytes) -> None:
        self._expect("advertise_keys", silo_id, set(self.ids), self.keys)
        m = msg.parse(msg.AdvertiseKeys, payload, self.session)
        c_pk, s_pk = msg.unb64(m.c_pk, pr.KEY_BYTES), msg.unb64(m.s_pk, pr.KEY_BYTES)
        if c_pk == s_pk:
            raise msg.ProtocolError("the two public keys must differ")
        try:
            for pk in (c_pk, s_pk):  # X25519 with a low-order point fails: refuse such keys up front
                pr.new_keypair().exchange(pr.load_public(pk))
        except ValueError as err:
            raise msg.ProtocolError(f"unusable public key: {err}") from None
        if self.signed:
            if not m.cert or not m.signature:
                raise msg.ProtocolError(f"silo {silo_id}'s keys are not signed (no certificate or signature)")
            try:
                self.verifier.verify(silo_id, msg.unb64(m.cert), advertise_statement(
                    self.run_id, self.session, silo_id, c_pk, s_pk), msg.unb64(m.signature))
            except IdentityError as err:
                raise msg.ProtocolError(f"silo {silo_id}'s keys are not signed by its certificate: {err}") from None
        self.keys[silo_id] = (c_pk, s_pk)
        self.identities[silo_id] = (m.cert, m.signature)
        self.bytes_in += len(payload)

    def close_advertise(self) -> dict[str, bytes]:
        """U1, and each member's roster: parameters plus the public keys of its neighbours in U1."""
        if self.stage != "advertise_keys":
            raise msg.ProtocolError(f"cannot close advertise_keys at stage {self.stage}")
        self.u1 = self._prune(set(self.keys) - self.gone, "advertise_keys")  # no roster names a silo that left
        rules = [msg.RuleMsg(pattern=r.pattern, clip=r.clip, bits=r.bits) for r in self.rules]
        rosters = {}
        for i in sorted(self.u1):
            neighbours = [
                msg.NeighbourKeys(silo_id=j, index=self.index[j], c_pk=msg.b64(self.keys[j][0]),
                                  s_pk=msg.b64(self.keys[j][1]), cert=self.identities[j][0],
                                  signature=self.identities[j][1])
                for j in sorted(self.graph[i] & self.u1)
            ]
            rosters[i] = msg.dump(msg.Roster(
                session=self.session, silo_id=i, index=self.index[i], degree=self.degree, threshold=self.threshold,
                modulus_bits=self.bits, rules=rules, neighbours=neighbours,
            ))
        self.stage = "share_keys"
        self.bytes_out += sum(map(len, rosters.values()))
        return rosters

    # ------------------------------------------------------------------ stage 1: share keys
    def receive_shares(self, silo_id: str, payload: bytes) -> None:
        self._expect("share_keys", silo_id, self.u1, self.sealed)
        m = msg.parse(msg.SharedKeys, payload, self.session)
        if set(m.shares) != self.graph[silo_id] & self.u1:
            raise msg.ProtocolError(f"silo {silo_id} must send one share to each of its neighbours, exactly")
        for sealed in m.shares.values():
            msg.unb64(sealed)
        self.commitments[silo_id] = msg.unb64(m.commitment, 32)
        self.sealed[silo_id] = dict(m.shares)
        self.bytes_in += len(payload)

    def close_share_keys(self) -> dict[str, bytes]:
        """U2, and each member's inbox: the ciphertexts its neighbours in U2 addressed to it."""
        if self.stage != "share_keys":
            raise msg.ProtocolError(f"cannot close share_keys at stage {self.stage}")
        self.u2 = self._prune(set(self.sealed), "share_keys")
        inboxes = {
            i: msg.dump(msg.Inbox(session=self.session,
                                  shares={j: self.sealed[j][i] for j in sorted(self.graph[i] & self.u2)}))
            for i in sorted(self.u2)
        }
        self.stage = "masked_input"
        self.bytes_out += sum(map(len, inboxes.values()))
        return inboxes

    # ------------------------------------------------------------------ stage 2: masked input
    def masked_input_bytes(self) -> int:
        """The most a masked input may take: its tensors in the ring's dtype plus a safetensors header (names,
        shapes, offsets, the session and silo labels), and never more than params.max_masked_bytes."""
        header = 8 + 1024 + 256 * len(self.shapes)
        return min(self.params.max_masked_bytes, header + self.size * self.dtype.itemsize)

    def receive_masked_input(self, silo_id: str, payload: bytes) -> None:
        """Check and add y_i into the running sum at once (mod 2^m); the input itself is not kept."""
        self._expect("masked_input", silo_id, self.u2, self.masked_from)
        arrays = msg.parse_masked(payload, self.session, silo_id, self.shapes, self.dtype, self.masked_input_bytes())
        y = np.concatenate([arrays[n].reshape(-1) for n in self.names]) if self.names else self.total[:0]
        np.add(self.total, y, out=self.total)
        self.masked_from.add(silo_id)
        self.bytes_in += len(payload)

    def close_masked_input(self) -> dict[str, bytes]:
        """U3, and for each member the same consistency request: the survivor set U3 to acknowledge (sign)."""
        if self.stage != "masked_input":
            raise msg.ProtocolError(f"cannot close masked_input at stage {self.stage}")
        self.u3 = set(self.masked_from)
        if len(self.u3) < self.min_survivors:
            raise self._abandon(f"{len(self.u3)} masked inputs, {self.min_survivors} needed")
        self._check_recoverable(self.u3, "the masked input")
        request = msg.dump(msg.ConsistencyRequest(session=self.session, survivors=sorted(self.u3)))
        requests = {i: request for i in sorted(self.u3)}
        self.stage = "consistency"
        self.bytes_out += sum(map(len, requests.values()))
        return requests

    def _check_recoverable(self, revealers: set[str], stage: str) -> None:
        """Every silo in U2 needs t neighbours among those who may still reveal its shares, or its mask stays in
        the sum for good: abandon."""
        short = sorted(j for j in self.u2 if len(self.graph[j] & revealers) < self.threshold)
        if short:
            raise self._abandon(f"silo(s) {', '.join(short[:5])} have fewer than t = {self.threshold} neighbours "
                                f"left to reveal their secrets after {stage}")

    def parameters(self) -> str:
        """The fingerprint of the parameters every roster of this session shows (messages.session_parameters)."""
        return msg.session_parameters(self.bits, self.degree, self.threshold, self.rules)

    # ------------------------------------------------------------------ stage 3: consistency
    def receive_consistency(self, silo_id: str, payload: bytes) -> None:
        """A member of U3 acknowledges U3; in a signed session its signature must verify over exactly U3."""
        self._expect("consistency", silo_id, self.u3, self.consistency_signatures)
        m = msg.parse(msg.ConsistencySignature, payload, self.session)
        if self.signed:
            if not m.signature:
                raise msg.ProtocolError(f"silo {silo_id} did not sign the survivor set")
            try:
                self.verifier.verify(silo_id, msg.unb64(self.identities[silo_id][0]),
                                     survivors_statement(self.run_id, self.session, self.u3, self.parameters()),
                                     msg.unb64(m.signature))
            except IdentityError as err:
                raise msg.ProtocolError(f"silo {silo_id}'s signature over the survivor set does not verify: "
                                        f"{err}") from None
        self.consistency_signatures[silo_id] = m.signature
        self.bytes_in += len(payload)

    def close_consistency(self) -> dict[str, bytes]:
        """U4, and for each member its unmask request: the fate of its neighbours in U2 (survived: in U3, or
        dropped) and the signatures of U4 over U3, its own neighbours' first."""
        if self.stage != "consistency":
            raise msg.ProtocolError(f"cannot close consistency at stage {self.stage}")
        self.u4 = set(self.consistency_signatures)
        if len(self.u4) < self.min_survivors:
            raise self._abandon(f"{len(self.u4)} silos signed the survivor set, {self.min_survivors} needed")
        self._check_recoverable(self.u4, "the consistency round")
        signed = {j: msg.SignedSurvivors(silo_id=j, cert=self.identities[j][0],
                                         signature=self.consistency_signatures[j]) for j in sorted(self.u4)}
        requests = {}
        for i in sorted(self.u4):
            requests[i] = msg.dump(msg.UnmaskRequest(
                session=self.session, survivors=sorted(self.graph[i] & self.u3),
                dropped=sorted(self.graph[i] & (self.u2 - self.u3)), signatures=self._signatures_for(i, signed)))
        self.stage = "unmask"
        self.bytes_out += sum(map(len, requests.values()))
        return requests

    def _signatures_for(self, i: str, signed: dict[str, msg.SignedSurvivors]) -> list[msg.SignedSurvivors]:
        """The signatures over U3 that silo i needs, its neighbours' first and without their certificates (it has
        them from its roster), then others' with theirs until there are max(min_survivors, t): a silo that
        accepted the run's terms needs no more (its policy's cohort is at most the terms' minimum, which
        min_survivors holds). Never past one message (MAX_JSON_BYTES)."""
        first = [signed[j].model_copy(update={"cert": ""}) for j in sorted(self.graph[i] & self.u4)]
        others = max(0, max(self.min_survivors, self.threshold) - len(first))
        rest = [signed[j] for j in sorted(self.u4 - self.graph[i])][:others]
        budget = msg.MAX_JSON_BYTES - 1024 - sum(len(j) + 4 for j in self.graph[i])  # room for the id lists
        out = []
        for entry in first + rest:
            budget -= len(entry.silo_id) + len(entry.cert) + len(entry.signature) + 48
            if budget < 0:
                break
            out.append(entry)
        return out

    # ------------------------------------------------------------------ stage 4: unmask
    def receive_unmask(self, silo_id: str, payload: bytes) -> None:
        self._expect("unmask", silo_id, self.u4, self.unmasked_from)
        m = msg.parse(msg.UnmaskReply, payload, self.session)
        if m.x != self.index[silo_id]:
            raise msg.ProtocolError(f"silo {silo_id} quotes share point {m.x}, its index is {self.index[silo_id]}")
        expected = self.graph[silo_id] & self.u2
        if set(m.shares) != expected:
            raise msg.ProtocolError(f"silo {silo_id} must reveal one share per neighbour in the round, exactly")
        for owner, share in m.shares.items():
            want = "self_mask" if owner in self.u3 else "masking_key"
            if share.kind != want:
                raise msg.ProtocolError(f"silo {silo_id} revealed a {share.kind} share of {owner}, expected {want}")
        for owner, share in m.shares.items():
            try:
                y = shamir.from_bytes(msg.unb64(share.y))
            except ValueError as err:
                raise msg.ProtocolError(str(err)) from None
            self.revealed.setdefault(owner, {})[m.x] = y
        self.unmasked_from.add(silo_id)
        self.bytes_in += len(payload)

    def can_finish(self) -> bool:
        """True once every silo in U2 has at least t revealed shares (further replies only add spares)."""
        return self.stage == "unmask" and all(len(self.revealed.get(j, {})) >= self.threshold for j in self.u2)

    def finish(self) -> SecAggResult:
        if self.stage != "unmask":
            raise msg.ProtocolError(f"cannot finish at stage {self.stage}")
        if not self.can_finish():
            short = sorted(j for j in self.u2 if len(self.revealed.get(j, {})) < self.threshold)
            raise self._abandon(f"fewer than t = {self.threshold} shares revealed for {', '.join(short[:5])}")
        total = self.total.copy()
        suspects: set[str] = set()
        x_to_silo = {x: s for s, x in self.index.items()}
        for j in sorted(self.u3):  # survivors: remove the self mask PRG(K_self(b_j))
            commitment = self.commitments[j]
            try:
                seed, off = shamir.reconstruct(
                    self.revealed[j], self.threshold,
                    check=lambda b, j=j, c=commitment: pr.commitment(self.session, j, b) == c,
                )
            except shamir.ReconstructionError as err:
                raise self._abandon(f"self-mask seed of {j}: {err}") from None
            suspects.update(x_to_silo[x] for x in off)
            np.subtract(total, pr.prg_words(self_mask_key(self.session, j, seed), self.size, self.bits), out=total)
        for j in sorted(self.u2 - self.u3):  # dropped after sharing: remove the masks survivors shared with j
            s_pk = self.keys[j][1]
            try:
                raw, off = shamir.reconstruct(
                    self.revealed[j], self.threshold,
                    check=lambda sk, pk=s_pk: pr.public_bytes(pr.load_private(sk)) == pk,
                )
            except shamir.ReconstructionError as err:
                raise self._abandon(f"masking key of dropped silo {j}: {err}") from None
            suspects.update(x_to_silo[x] for x in off)
            sk_j = pr.load_private(raw)
            for i in sorted(self.graph[j] & self.u3):
                key = pr.agree(sk_j, self.keys[i][1], self.session, pr.PAIR_MASK, j, i)
                mask = pr.prg_words(key, self.size, self.bits)
                # i added +PRG(K_ij) if index(i) < index(j), else subtracted it: undo that.
                if self.index[i] < self.index[j]:
                    np.subtract(total, mask, out=total)
                else:
                    np.add(total, mask, out=total)
        sums, integer_sums, offset = {}, {}, 0
        count = len(self.u3)
        for name in self.names:
            size = int(np.prod(self.shapes[name], dtype=np.int64))
            q = total[offset : offset + size].reshape(self.shapes[name])
            integer_sums[name] = q
            sums[name] = decode_sum(q, rule_for(self.rules, name), count)
            offset += size
        self.stage = "done"
        self.revealed = {}
        return SecAggResult(
            sums=sums, contributors=sorted(self.u3), integer_sums=integer_sums, suspects=sorted(suspects),
            stats={"sampled": len(self.ids), "advertised": len(self.keys), "u1": len(self.u1),
                   "u2": len(self.u2), "u3": len(self.u3), "u4": len(self.unmasked_from),
                   "consistency": len(self.u4),
                   "degree": self.degree, "threshold": self.threshold,
                   "bytes_in": self.bytes_in, "bytes_out": self.bytes_out},
        )
