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


class UpdateUnsendable(Exception):
    """This silo's own update for a task failed the checks the hub makes of it (its shapes, dtypes, finite values:
    a float16 overflow under wire.half_precision, say), so nothing was sent. Training again would give the same
    update, so the task is waited out, not retried."""

    def __init__(self, task_id: str, round_number: int, reason: str):
        super().__init__(f"round {round_number}: this silo's update failed its own check before sending ({reason}); "
                         f"nothing was sent, and the round goes on without it")
        self.task_id = task_id

