"""Shamir t-of-k secret sharing over the prime field GF(p), p = 2^521 - 1 (a Mersenne prime).

A secret s (here a 256-bit seed or X25519 private key, read as an integer, so s < 2^256 < p) is hidden as the
constant term of a random polynomial of degree t - 1:

    f(x) = s + a_1 x + ... + a_{t-1} x^{t-1}   (mod p),   a_i uniform in GF(p)

and share number x (x = 1, 2, ...: never 0) is the point (x, f(x)). Any t shares determine f and so s by Lagrange
interpolation at 0:

    s = f(0) = sum_j y_j * prod_{m != j} x_m / (x_m - x_j)   (mod p)

while any t - 1 shares are consistent with every secret (they reveal nothing). Extra shares beyond t are checked
against f: a share that is not on the polynomial is reported, never silently used.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from itertools import combinations

P = (1 << 521) - 1
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


class ReconstructionError(ValueError):
    """Fewer than t shares, or no t of them reconstruct a secret that passes the caller's check."""


def split(secret: bytes, xs: Iterable[int], t: int) -> dict[int, int]:
    """Shares (x -> f(x)) of a 32-byte secret for the distinct nonzero points xs; any t of them recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secrets are {SECRET_BYTES} bytes")
    xs = list(xs)
    if len(set(xs)) != len(xs) or any(not 0 < x < P for x in xs):
        raise ValueError("share points must be distinct and nonzero")
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold {t} must be between 1 and the number of shares {len(xs)}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(P) for _ in range(t - 1)]
    return {x: _evaluate(coefficients, x) for x in xs}


def _evaluate(coefficients: list[int], x: int) -> int:
    """Horner's rule: f(x) mod p."""
    y = 0
    for c in reversed(coefficients):
        y = (y * x + c) % P
    return y


def interpolate(points: dict[int, int], at: int = 0) -> int:
    """Lagrange interpolation of the polynomial through `points`, evaluated at `at` (mod p)."""
    return lagrange(points)(at)


def lagrange(points: dict[int, int]) -> Callable[[int], int]:
    """The polynomial through `points` as an evaluator, in barycentric form:

        f(x) = sum_j y_j w_j prod_{m != j} (x - x_m),      w_j = 1 / prod_{m != j} (x_j - x_m)

    The weights cost O(t^2) once; each evaluation then costs O(t) (prefix and suffix products), so checking
    every spare share against a reconstruction stays cheap even for large neighbourhoods.
    """
    xs = list(points)
    ys = [points[x] for x in xs]
    weights = []
    for j, xj in enumerate(xs):
        den = 1
        for m, xm in enumerate(xs):
            if m != j:
                den = den * (xj - xm) % P
        weights.append(ys[j] * pow(den, -1, P) % P)

    def evaluate(x: int) -> int:
        n = len(xs)
        prefix, suffix = [1] * (n + 1), [1] * (n + 1)
        for i in range(n):
            prefix[i + 1] = prefix[i] * (x - xs[i]) % P
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] * (x - xs[i]) % P
        return sum(weights[j] * prefix[j] % P * suffix[j + 1] for j in range(n)) % P

    return evaluate


def reconstruct(shares: dict[int, int], t: int, check: Callable[[bytes], bool] | None = None,
                max_tries: int = 256) -> tuple[bytes, list[int]]:
    """Recover the secret from at least t shares; return it and the points of shares that are not on its polynomial.

    The first t shares are tried first; if the result fails `check` (e.g. a commitment or a public key), other
    t-subsets are tried (at most max_tries) so one lying share-holder cannot stop the recovery when spare shares
    exist. A result is only ever returned if it passes `check` and at least t shares agree with it.
    """
    if len(shares) < t:
        raise ReconstructionError(f"{len(shares)} shares, {t} needed")
    if any(not 0 <= y < P for y in shares.values()):
        raise ReconstructionError("a share is outside the field")
    points = sorted(shares)
    for tries, subset in enumerate(combinations(points, t)):
        if tries >= max_tries:
            break
        chosen = {x: shares[x] for x in subset}
        f = lagrange(chosen)
        value = f(0)
        if value >> (8 * SECRET_BYTES):
            continue  # not a 256-bit secret: some share in this subset is wrong
        secret = value.to_bytes(SECRET_BYTES, "big")
        if check is not None and not check(secret):
            continue
        off = [x for x in points if x not in chosen and f(x) != shares[x]]
        if len(points) - len(off) >= t:
            return secret, off
    raise ReconstructionError("no t shares reconstruct a secret that passes verification")


def to_bytes(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def from_bytes(raw: bytes) -> int:
    if len(raw) != SHARE_BYTES:
        raise ValueError(f"a share value is {SHARE_BYTES} bytes, got {len(raw)}")
    y = int.from_bytes(raw, "big")
    if y >= P:
        raise ValueError("share value outside the field")
    return y
