"""What a silo raises to its operator: SiloError (a problem to fix, the message says how) and SiloLeft (this
branch's policy ended its part in a run)."""

from __future__ import annotations

from silo_client.policy import Refusal


class SiloError(RuntimeError):
    """A problem the operator of this silo must fix; the message says what and how."""


class SiloLeft(SiloError):
    """This silo refused the run or left it by its own policy (a typed refusal, told to the hub): nothing more of
    it leaves the branch in this run. silo-client exits with status 3."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal
