"""What a silo requires of each secure-aggregation session: the stricter of the run's pinned terms and its policy,
line by line, so that a hub is held to the floor it promised even where the branch's policy asks for less."""

from __future__ import annotations

from silo.v1 import silo_pb2
from silo_client.policy import BranchPolicy
from silo_client.privacy import SessionFloor


def terms(min_cohort: int, min_threshold: int) -> silo_pb2.PrivacyTerms:
    return silo_pb2.PrivacyTerms(secure_aggregation=silo_pb2.SecureAggregationTerms(
        enabled=True, min_cohort=min_cohort, min_threshold=min_threshold))


def policy(min_cohort: int, min_threshold: int) -> BranchPolicy:
    return BranchPolicy.model_validate({"secure_aggregation": {"required": True, "min_cohort": min_cohort,
                                                                "min_threshold": min_threshold}})


def test_without_a_policy_the_pinned_terms_are_the_floor():
    assert SessionFloor.of(terms(6, 5), None) == SessionFloor(min_cohort=6, min_threshold=5)


def test_each_line_takes_the_stricter_of_terms_and_policy():
    assert SessionFloor.of(terms(6, 5), policy(3, 2)) == SessionFloor(min_cohort=6, min_threshold=5)
    assert SessionFloor.of(terms(3, 2), policy(8, 4)) == SessionFloor(min_cohort=8, min_threshold=4)
    assert SessionFloor.of(terms(8, 2), policy(3, 4)) == SessionFloor(min_cohort=8, min_threshold=4)


def test_a_run_without_secure_aggregation_terms_leaves_only_the_policy():
    assert SessionFloor.of(silo_pb2.PrivacyTerms(), policy(4, 3)) == SessionFloor(min_cohort=4, min_threshold=3)
    assert SessionFloor.of(silo_pb2.PrivacyTerms(), None) == SessionFloor()
