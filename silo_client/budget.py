"""A silo's privacy budget for one task, by its own ledger and its branch policy, never the hub's figures: how far
DP-SGD may go in this run, whether a round would pass a ceiling (checked before training), and the ledger's entry
for a round (charged before anything derived from it leaves).

The client-level figure counts only noise that guards against the hub (distributed noise the silos add
themselves); the lifetime budget sums the runs' image epsilons across runs and hubs (silo_client/ledger.py)."""

from __future__ import annotations

from silo.v1 import silo_pb2
from silo_client.ledger import BranchLedger
from silo_client.metrics import SiloMetrics
from silo_client.outbox import epsilon_fields
from silo_client.policy import BranchPolicy, Refusal
from silo_client.run_checks import guards_against_hub

# The policy clauses that can stop DP-SGD, in the words a refusal uses.
DP_SGD_LIMITS = {"sample_dp.max_epsilon_per_run": "DP-SGD epsilon ceiling for the run",
                 "lifetime_epsilon": "lifetime epsilon budget"}


class TaskBudget:
    """One task's budget questions, for a run whose terms were pinned (`pinned`) with id `run_id`."""

    def __init__(self, policy: BranchPolicy | None, ledger: BranchLedger, pinned: silo_pb2.PrivacyTerms | None,
                 run_id: str, task: silo_pb2.Task):
        self.policy, self.ledger, self.pinned, self.run_id, self.task = policy, ledger, pinned, run_id, task

    def client_epsilon_after(self) -> float | None:
        """This silo's client-level epsilon after this round by its own accounting (None: no guarantee of that
        kind against the hub in this run)."""
        dp = self.pinned.client_dp if self.pinned is not None else None
        if dp is None or not guards_against_hub(dp) or not self.task.privacy.client_dp.enabled:
            return None
        return self.ledger.client_epsilon_after(self.run_id, dp.noise_multiplier)

    def _client_covers_lifetime(self) -> bool:
        after, p = self.client_epsilon_after(), self.policy
        return (after is not None and p is not None and p.lifetime_epsilon is not None
                and self.ledger.lifetime_epsilon(exclude_run=self.run_id) + after <= p.lifetime_epsilon)

    def sample_dp_limits(self) -> dict[str, float]:
        """What bounds the DP-SGD epsilon this run may reach at this silo, by the clause that sets it: the hub's
        budget (`sample_dp.epsilon_budget` in the run's terms), the policy's ceiling per run, and what the policy's
        lifetime budget leaves after earlier runs (when client-level DP does not already bound every image this
        round)."""
        sd, p = self.task.privacy.sample_dp, self.policy
        limits = {"sample_dp.epsilon_budget": sd.epsilon_budget} if sd.epsilon_budget else {}
        if p is not None and p.sample_dp.max_epsilon_per_run is not None:
            limits["sample_dp.max_epsilon_per_run"] = p.sample_dp.max_epsilon_per_run
        if p is not None and p.lifetime_epsilon is not None and not self._client_covers_lifetime():
            limits["lifetime_epsilon"] = p.lifetime_epsilon - self.ledger.lifetime_epsilon(exclude_run=self.run_id)
        return limits

    def sample_dp_limit(self) -> float | None:
        """The tightest of sample_dp_limits; None: no limit."""
        limits = self.sample_dp_limits()
        return min(limits.values()) if limits else None

    def policy_clause_binding_dp_sgd(self) -> str | None:
        """The policy clause whose limit DP-SGD stops at, when one does: the silo then leaves the run, as its
        policy says. None when the hub's own budget is at least as tight (the run's terms end DP-SGD there, and
        the silo keeps taking part, skipping)."""
        limits = self.sample_dp_limits()
        if not limits:
            return None
        tightest = min(limits.values())
        hub = limits.get("sample_dp.epsilon_budget")
        if hub is not None and hub <= tightest:
            return None
        return next(clause for clause, limit in limits.items() if limit == tightest)

    def refusal_before_training(self) -> Refusal | None:
        """A round that would take this silo past its policy's client-level ceiling per run, or past its lifetime
        budget with nothing else to bound it, is refused before training (the silo then leaves the run)."""
        p, after, round_ = self.policy, self.client_epsilon_after(), self.task.round
        if p is None or after is None:
            return None
        ceiling = p.client_dp.max_epsilon_per_run
        if ceiling is not None and after > ceiling:
            return Refusal("budget", "client_dp.max_epsilon_per_run", f"{ceiling:g}", f"{after:.4g}",
                           f"round {round_} would take this silo's client-level epsilon in the run to {after:.4g}, "
                           f"past the policy's ceiling of {ceiling:g}", round_)
        spent = self.ledger.lifetime_epsilon(exclude_run=self.run_id)
        # The run's image epsilon after this round is at least the smaller of its client-level figure and its DP-SGD
        # total so far: a DP-SGD round's own limit (sample_dp_limit) keeps the lifetime budget as the total grows,
        # but a round that trains nothing (too few confident images) is still charged its client-level step, and
        # once that step no longer covers the budget, the DP-SGD total reached meanwhile may not either.
        least = min(after, self.ledger.sample_total(self.run_id)) if self.task.privacy.sample_dp.enabled else after
        if p.lifetime_epsilon is not None and spent + least > p.lifetime_epsilon:
            return Refusal("budget", "lifetime_epsilon", f"{p.lifetime_epsilon:g}", f"{spent + least:.4g}",
                           f"round {round_} would take this branch's lifetime epsilon to {spent + least:.4g}, "
                           f"past the policy's budget of {p.lifetime_epsilon:g}", round_)
        return None

    def charge(self, metrics: dict[str, float], silo_metrics: SiloMetrics, skipped: bool = False) -> dict:
        """The ledger's entry for this round, written before anything derived from it leaves: one client-level
        step when the round's noise guards against the hub, the DP-SGD total the algorithm reports. Returns the
        figures the audit records with every message of the round."""
        dp, privacy = self.pinned.client_dp, self.task.privacy
        charged = dp.noise_multiplier if (guards_against_hub(dp) and privacy.client_dp.enabled) else None
        sample = metrics.get("sample_dp_epsilon") if privacy.sample_dp.enabled else None
        if sample is None and skipped and privacy.sample_dp.enabled:
            # A round skipped before any DP-SGD step (too few confident images) still sends its zeros into a
            # secure sum; it spent nothing at the sample level, so it keeps the run's total. Recorded as a round
            # without DP-SGD, it made the run's sample-level epsilon infinite from then on.
            sample = self.ledger.sample_total(self.run_id)
        figures = self.ledger.record_round(self.run_id, self.task.round, client_dp_noise=charged,
                                           sample_epsilon=sample, task=self.task.task_id)
        lifetime = self.ledger.lifetime_epsilon()
        silo_metrics.epsilon(figures.client, figures.sample, figures.image, lifetime)
        return epsilon_fields(figures, lifetime, self.ledger.releases(self.run_id, self.task.round, self.task.task_id))
