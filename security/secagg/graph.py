"""The sparse neighbour graph of SecAgg+ (Bell et al. 2020) and the threshold on it.

In Bonawitz et al. (2017) every silo masks with every other one: O(n) keys, shares and masks per silo. SecAgg+
replaces the complete graph by a random k-regular graph with k of order log n: each silo agrees masks with, and
shares its secrets among, its k neighbours only, and still no coalition short of a neighbourhood learns anything
about an honest silo's input beyond the sum.

The graph here is a Harary graph on a random ring: silos are placed on a ring in a random order and each is
joined to the k/2 nearest on either side (k even, or k = n - 1: the complete graph). The threshold t counts shares
within one neighbourhood: a silo's secrets are recovered from any t of its k neighbours. We insist on t > k/2
(so a hub cannot collect t shares of a silo's self-mask seed AND t of its masking key from honest neighbours by
telling halves of them different stories) and t >= 2 (a sum of one input is that input).
"""

from __future__ import annotations

import math
import random


def auto_degree(n: int) -> int:
    """Default neighbourhood size: 3 * ceil(log2 n) rounded up to even, capped at n - 1 (complete graph)."""
    if n <= 1:
        return 0
    k = 3 * math.ceil(math.log2(n))
    k += k % 2
    return min(n - 1, k)


def degree_for(n: int, neighbours: int | None) -> int:
    k = auto_degree(n) if neighbours is None else min(n - 1, neighbours)
    if k < n - 1 and k % 2:
        k += 1  # a ring-lattice needs an even degree
    return min(k, n - 1)


def threshold_for(k: int, fraction: float) -> int:
    """t = max(2, floor(k/2) + 1, ceil(fraction * k)): a strict majority of the neighbourhood, at least 2."""
    t = max(2, k // 2 + 1, math.ceil(fraction * k - 1e-9))
    if t > k:
        raise ValueError(f"a neighbourhood of {k} cannot meet a threshold of {t}: secure aggregation needs at least "
                         f"3 silos in a round")
    return t


def neighbour_graph(ids: list[str], k: int, rng: random.Random) -> dict[str, set[str]]:
    """Each id's k neighbours on a random ring (the complete graph when k = n - 1). Symmetric, no self-loops."""
    n = len(ids)
    if not 0 <= k <= n - 1:
        raise ValueError(f"degree {k} impossible for {n} silos")
    if k == n - 1:
        return {i: set(ids) - {i} for i in ids}
    if k % 2:
        raise ValueError("a ring-lattice degree below n - 1 must be even")
    ring = list(ids)
    rng.shuffle(ring)
    graph: dict[str, set[str]] = {i: set() for i in ids}
    for p, i in enumerate(ring):
        for step in range(1, k // 2 + 1):
            j = ring[(p + step) % n]
            graph[i].add(j)
            graph[j].add(i)
    return graph
