"""What a silo requires of each secure-aggregation session: the stricter of the run's pinned terms and its policy,
line by line, so that a hub is held to the floor it promised even where the branch's policy asks for less."""

from __future__ import annotations

from security.secagg import SecAggParams
from silo.v1 import silo_pb2
from silo_client.policy import BranchPolicy
from silo_client.privacy import SessionFloor


def terms(min_cohort: int, min_threshold: int, neighbours: int = 0) -> silo_pb2.PrivacyTerms:
    return silo_pb2.PrivacyTerms(secure_aggregation=silo_pb2.SecureAggregationTerms(
        enabled=True, min_cohort=min_cohort, min_threshold=min_threshold, threshold=2 / 3, neighbours=neighbours))


def policy(min_cohort: int, min_threshold: int) -> BranchPolicy:
    return BranchPolicy.model_validate({"secure_aggregation": {"required": True, "min_cohort": min_cohort,
                                                                "min_threshold": min_threshold}})


def test_without_a_policy_the_pinned_terms_are_the_floor():
    assert SessionFloor.of(terms(6, 5), None) == SessionFloor(min_cohort=6, min_threshold=5, threshold=2 / 3)


def test_each_line_takes_the_stricter_of_terms_and_policy():
    shape = {"threshold": 2 / 3}
    assert SessionFloor.of(terms(6, 5), policy(3, 2)) == SessionFloor(min_cohort=6, min_threshold=5, **shape)
    assert SessionFloor.of(terms(3, 2), policy(8, 4)) == SessionFloor(min_cohort=8, min_threshold=4, **shape)
    assert SessionFloor.of(terms(8, 2), policy(3, 4)) == SessionFloor(min_cohort=8, min_threshold=4, **shape)


def test_a_run_without_secure_aggregation_terms_leaves_only_the_policy():
    assert SessionFloor.of(silo_pb2.PrivacyTerms(), policy(4, 3)) == SessionFloor(min_cohort=4, min_threshold=3)
    assert SessionFloor.of(silo_pb2.PrivacyTerms(), None) == SessionFloor()


def test_a_rounds_threshold_floor_grows_with_the_cohort_the_task_states():
    # Pinned: t = 2/3 of k, k = 3 ceil(log2 n). A round whose sum holds at least 40 silos samples at least 40, so
    # its k is at least degree_for(40) = 18 and t at least 12: a two-neighbour roster with t = 2 is refused there.
    floor = SessionFloor.of(terms(2, 2), None)
    assert floor.threshold_at(2) == 2 and floor.threshold_at(40) == 12
    assert floor.threshold_at(40) == SecAggParams().plan(40).threshold
    fixed = SessionFloor.of(terms(3, 2, neighbours=4), None)
    assert fixed.threshold_at(50) == 3  # k = 4 fixed by the hub: t = 3
    assert SessionFloor(min_threshold=5).threshold_at(100) == 5  # no pinned shape: the floor alone
