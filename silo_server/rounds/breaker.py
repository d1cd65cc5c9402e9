"""Finding the silo that breaks a securely aggregated sum, and keeping it out of the run.

Under secure aggregation the hub sees only the sum of a cohort's inputs. A silo that sends an input no honest silo
could (a weight outside its cap: security.validation.check_aggregate) makes that sum fail its check. The model is
safe (the sum is refused), but every attempt the silo is in fails, and the hub cannot see who broke it.

Group testing finds it when there are spare silos: after a failed sum, each retry draws a cohort that holds only
part of the suspects (about half of them, a binary split) and fills the rest with silos not suspected. A cohort
whose sum fails narrows the suspects to its own contributors; one whose sum passes clears its contributors, and
its sum is applied, so the run goes on while the search does. A silo present in every failed attempt and in no
passing one is the breaker once it is the only suspect left: about log2(cohort) attempts. It is quarantined for
the run (QuarantineList: kept in the hub's state folder across restarts), not sampled again until the operator
lifts it (`silo-server --config hub.yaml --lift-quarantine NAME`).

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
    """The suspects of the current search (empty: none under way) and the silos a passing sum cleared."""

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
        suspect left (the search then ends)."""
        members = set(contributors)
        narrowed = (self.suspects & members) if self.suspects else members - self.cleared
        # Nobody left (two breakers in turn, or one that behaved in a passing cohort): start over from this cohort.
        self.suspects = narrowed or members
        self.failed_attempts += 1
        if len(self.suspects) == 1:
            (breaker,) = self.suspects
            self.suspects, self.cleared = set(), set()
            return breaker
        return None

    def passed(self, contributors: Iterable[str]) -> str | None:
        """A cohort's sum passed its check: its contributors are cleared for the search under way. Returns the
        breaker when one suspect is left (it was in every failed cohort and in no passing one)."""
        if not self.suspects:
            return None
        members = set(contributors)
        self.suspects -= members
        self.cleared |= members
        if not self.suspects:
            # Every suspect behaved in this sum: the search ends with no one found, and a later failure starts a
            # new one (silos cleared here may break then, and silos that joined since are not the only suspects).
            self.cleared = set()
            return None
        if len(self.suspects) == 1:
            (breaker,) = self.suspects
            self.suspects, self.cleared = set(), set()
            return breaker
        return None

    def cohort(self, live: Sequence[str], size: int, rng: random.Random) -> list[str] | None:
        """A cohort of `size` live silos holding about half of the live suspects and no more than all but one of
        them, the rest cleared or unsuspected silos; None when no such cohort exists (no spare silos)."""
        suspects = sorted(s for s in live if s in self.suspects)
        others = sorted(s for s in live if s not in self.suspects)
        if len(suspects) < 2:
            return None  # one suspect is not a split, and none live cannot be tested now
        take = min(len(suspects) - 1, max(1, math.ceil(len(suspects) / 2)), size)
        take = max(take, size - len(others))  # fill from suspects only where too few others are live
        if take >= len(suspects) or take < 1:
            return None
        fillers = sorted(others, key=lambda s: (s not in self.cleared, s))  # cleared ones first
        return sorted(rng.sample(suspects, take) + fillers[: size - take])


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

    def cohort(self, live: list[str], sampled: set[str], size: int, r: int, attempt: int) -> set[str]:
        """A cohort of `size` silos (the fewest a round may have: it splits the suspects fastest) holding about
        half of the live suspects; the usual sample when no such cohort exists (no spare silos)."""
        rng = random.Random(self.seed * 1_000_003 + r * 101 + attempt + 7)
        cohort = self.hunt.cohort(live, size, rng) if size < len(live) else None
        if cohort is None:
            if not self.said_no_spare:
                self.said_no_spare = True
                log.error("round %d: a silo keeps breaking the securely aggregated sum, and with %d live silos and "
                          "rounds of at least %d none can be left out to find it (no spare silos): the round keeps "
                          "failing until more silos connect or the breaker is revoked (suspects: %s)", r, len(live),
                          size, ", ".join(sorted(self.hunt.suspects)[:10]))
            return sampled
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
        """A sum that passed its check: its silos are not the breaker."""
        breaker = self.hunt.passed(contributors) if self.hunt.active else None
        if breaker is not None:
            self._found(breaker, r)

    def _found(self, breaker: str, round_number: int) -> None:
        attempts = self.hunt.failed_attempts
        self.hunt.restore({})  # the search is over (the same object the checkpoint holds)
        self.quarantine(Quarantine(
            silo=breaker, round=round_number, attempts=attempts, at=now_iso(),
            reason=f"in every cohort whose securely aggregated sum failed its check ({attempts} failed attempts) and "
                   f"in none whose sum passed"))


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
