"""Finding the silo that breaks a securely aggregated sum, and keeping it out of the run.

Under secure aggregation the hub sees only the sum of a cohort's inputs. A silo that sends an input no honest silo
could (a weight outside its cap: security.validation.check_aggregate) makes that sum fail its check. The model is
safe (the sum is refused), but every attempt the silo is in fails, and the hub cannot see who broke it.

Group testing finds it when there are spare silos: after a failed sum, each retry draws a cohort that holds only
part of the suspects (about half of those no passing sum has held yet, a binary split) and fills the rest with
silos not suspected. The suspects are the silos present in every failed sum of the search, and only a failed sum
narrows them: a passing sum (whose sum is applied, so the run goes on while the search does) only steers which
suspects the next cohort tests. A breaker may behave whenever it likes, so having behaved once proves nothing:
were a passing sum to clear its silos for good, a breaker that behaved once could later fail a cohort in which
an honest silo was the only suspect left, and have that silo quarantined. A single breaker is in every failed
sum, so the one silo left in all of them is it: about log2(cohort) + 1 attempts when it never behaves. It is
quarantined for the run (QuarantineList: kept in the hub's state folder across restarts), not sampled again
until the operator lifts it (`silo-server --config hub.yaml --lift-quarantine NAME`). A breaker that behaves in
every cohort that would single it out is never found, but then those sums pass and the run goes on.

Without spare silos (every live silo is needed in every cohort) no cohort can leave a suspect out: the hub says so
once, as an ERROR, and `silo-server --check` warns of it beforehand.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from silo_core.files import write_json_atomic

log = logging.getLogger("silo_server")

QUARANTINE_FILE = "quarantine.json"


@dataclass
class BreakerHunt:
    """The suspects of the current search (empty: none under way: the silos in every failed sum of it) and the
    silos a passing sum of it held (tested: the next cohorts test the other suspects first)."""

    suspects: set[str] = field(default_factory=set)
    cleared: set[str] = field(default_factory=set)
    failed_attempts: int = 0

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def to_json(self) -> dict[str, Any]:
        return {"suspects": sorted(self.suspects), "cleared": sorted(self.cleared),
                "failed_attempts": self.failed_attempts}

    def restore(self, saved: dict[str, Any]) -> None:
        """The search as a checkpoint holds it (a restarted hub goes on with it instead of starting over from the
        cohort that already failed); nothing saved (an older checkpoint): no search under way."""
        def names(key: str) -> set[str]:
            value = saved.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"breaker_hunt.{key} in the checkpoint is not a list of silo names")
            return set(value)

        attempts = saved.get("failed_attempts", 0)
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
            raise ValueError("breaker_hunt.failed_attempts in the checkpoint is not a count")
        self.suspects, self.cleared, self.failed_attempts = names("suspects"), names("cleared"), attempts

    def failed(self, contributors: Iterable[str]) -> str | None:
        """A cohort's sum was refused: the breaker is among its contributors. Returns it once it is the only
        suspect left, the one silo in every failed sum of the search (the search then ends)."""
        members = set(contributors)
        narrowed = (self.suspects & members) if self.suspects else members
        if not narrowed:  # no silo in every failed sum: two breakers in turn; start over from this cohort
            narrowed, self.cleared = members, set()
        self.suspects = narrowed
        self.failed_attempts += 1
        if len(self.suspects) == 1:
            (breaker,) = self.suspects
            self.suspects, self.cleared = set(), set()
            return breaker
        return None

    def passed(self, contributors: Iterable[str]) -> None:
        """A cohort's sum passed its check: its contributors are tested, so the next cohorts test the other
        suspects. It names no one: a breaker may behave in one sum and break the next."""
        if not self.suspects:
            return
        self.cleared |= set(contributors)
        if self.suspects <= self.cleared:
            # Every suspect has behaved in a passing sum: the search ends with no one found, and a later failure
            # starts a new one (silos that joined since are not the only suspects of it).
            self.suspects, self.cleared = set(), set()

    def exhausted(self, gone: Iterable[str]) -> bool:
        """Whether the search can learn nothing more: every suspect has behaved in a passing sum or is `gone` for
        good (left by its policy, revoked, quarantined: in no sum again, it must not keep the search going). A
        suspect only offline for now, or one that dropped out of a round, keeps it waiting: a breaker that skipped
        the rounds that would single it out must not end the search and start the next one afresh."""
        return self.active and self.suspects <= self.cleared | set(gone)

    def cohort(self, live: Sequence[str], size: int, rng: random.Random) -> list[str] | None:
        """A cohort of `size` live silos holding about half of the live suspects that no passing sum has held yet
        and no more than all but one of the suspects, the rest unsuspected silos (those a passing sum held first);
        None when no such cohort exists (no spare silos)."""
        suspects = sorted(s for s in live if s in self.suspects)
        untested = [s for s in suspects if s not in self.cleared]
        if len(suspects) < 2 or not untested:
            return None  # one suspect is not a split, and none live cannot be tested now
        take = min(max(1, math.ceil(len(untested) / 2)), len(suspects) - 1, size)
        chosen = rng.sample(untested, take)
        # Fillers: unsuspected silos (those a passing sum held first), then tested suspects, then untested ones.
        others = sorted((s for s in live if s not in self.suspects), key=lambda s: (s not in self.cleared, s))
        rest = others + sorted(s for s in suspects if s in self.cleared) + sorted(set(untested) - set(chosen))
        cohort = chosen + rest[: size - take]
        if len(cohort) < size or set(suspects) <= set(cohort):
            return None
        return sorted(cohort)


@dataclass(frozen=True)
class Quarantine:
    """A silo kept out of the run: which, since when, after how many failed sums, and why."""

    silo: str
    round: int
    attempts: int
    reason: str
    at: str


class BreakerSearch:
    """The round loop's side of the search: the hunt (checkpointed with the round), the cohorts it draws while a
    search is under way, and the quarantine of the breaker it finds (`quarantine`: the registry's)."""

    def __init__(self, quarantine: Callable[[Quarantine], None], seed: int):
        self.hunt = BreakerHunt()
        self.quarantine = quarantine
        self.seed = seed
        self.said_no_spare = False  # the hub said once that it cannot search (no spare silos)

    def cohort(self, live: list[str], size: int, r: int, attempt: int, gone: Iterable[str] = ()) -> set[str] | None:
        """A cohort of `size` silos (the fewest a round may have: it splits the suspects fastest) holding about
        half of the live suspects; None for the usual random sample: no suspect is live (the search waits for
        them), the search ended (every suspect behaved or is `gone` for good), or no such cohort exists (no spare
        silos)."""
        rng = random.Random(self.seed * 1_000_003 + r * 101 + attempt + 7)
        if self.hunt.exhausted(gone):
            log.info("round %d: the search for the silo that breaks the secure sum ends with no one found: every "
                     "suspect has behaved in a passing sum or left the run (a later failure starts a new search)", r)
            self.hunt.restore({})
            return None
        if not any(s in self.hunt.suspects for s in live):
            return None
        cohort = self.hunt.cohort(live, size, rng) if size < len(live) else None
        if cohort is None:
            if not self.said_no_spare:
                self.said_no_spare = True
                log.error("round %d: a silo keeps breaking the securely aggregated sum, and with %d live silos and "
                          "rounds of at least %d none can be left out to find it (no spare silos): the round keeps "
                          "failing until more silos connect or the breaker is revoked (suspects: %s)", r, len(live),
                          size, ", ".join(sorted(self.hunt.suspects)[:10]))
            return None
        log.info("round %d attempt %d: looking for the silo that breaks the secure sum: %d suspects, this cohort of "
                 "%d holds %d of them", r, attempt, len(self.hunt.suspects), len(cohort),
                 len(set(cohort) & self.hunt.suspects))
        return set(cohort)

    def sum_refused(self, r: int, attempt: int, contributors: Iterable[str]) -> None:
        """A cohort's secure sum failed its check: narrow the suspects; quarantine the breaker once it is found."""
        breaker = self.hunt.failed(contributors)
        if breaker is None:
            log.warning("round %d attempt %d: the secure sum failed its check; %d suspects left (%s)", r, attempt,
                        len(self.hunt.suspects), ", ".join(sorted(self.hunt.suspects)[:10]))
            return
        self._found(breaker, r)

    def sum_passed(self, r: int, contributors: Iterable[str]) -> None:
        """A sum that passed its check: its silos are tested (the next cohorts test the other suspects)."""
        self.hunt.passed(contributors)

    def _found(self, breaker: str, round_number: int) -> None:
        attempts = self.hunt.failed_attempts
        self.hunt.restore({})  # the search is over (the same object the checkpoint holds)
        self.quarantine(Quarantine(
            silo=breaker, round=round_number, attempts=attempts, at=now_iso(),
            reason=f"the one silo in every cohort whose securely aggregated sum failed its check ({attempts} failed "
                   f"attempts)"))


class QuarantineList:
    """The hub's quarantined silos, in state_dir/quarantine.json (written atomically, re-read when the file
    changes, so the operator's `silo-server --lift-quarantine NAME` reaches a running hub at its next sampling)."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / QUARANTINE_FILE
        self._seen: tuple[int, int] | None = None
        self._entries: dict[str, Quarantine] = {}

    def entries(self) -> dict[str, Quarantine]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._entries = None, {}
            return {}
        if (st.st_mtime_ns, st.st_size) != self._seen:
            self._entries = read_quarantine(self.path)
            self._seen = (st.st_mtime_ns, st.st_size)
        return dict(self._entries)

    def names(self) -> set[str]:
        return set(self.entries())

    def add(self, entry: Quarantine) -> None:
        entries = self.entries()
        entries[entry.silo] = entry
        self._write(entries)

    def lift(self, silo: str) -> bool:
        entries = self.entries()
        if entries.pop(silo, None) is None:
            return False
        self._write(entries)
        return True

    def _write(self, entries: dict[str, Quarantine]) -> None:
        write_json_atomic(self.path, {"quarantined": [asdict(e) for e in sorted(entries.values(),
                                                                                  key=lambda e: e.silo)]})
        self._seen = None  # re-read (and so re-stat) next time


def read_quarantine(path: Path) -> dict[str, Quarantine]:
    """The quarantine file's entries; ValueError naming the file when it is not one this module wrote."""
    try:
        rows = json.loads(Path(path).read_text())["quarantined"]
        return {str(r["silo"]): Quarantine(str(r["silo"]), int(r["round"]), int(r["attempts"]), str(r["reason"]),
                                           str(r["at"])) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a quarantine list ({err}); restore it or remove it to lift every "
                         "quarantine") from None


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
