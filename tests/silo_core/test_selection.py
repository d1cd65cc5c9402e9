"""Model selection on the hub's validation split: which round counts as the best one."""

import math

from silo_core.selection import BestRound


def test_the_best_round_is_the_highest_validation_accuracy_and_a_tie_goes_to_the_later_round():
    best = BestRound()
    assert best.as_dict() == {"best_round": 0, "best_validation_accuracy": -math.inf}
    verdicts = [best.offer(r, acc) for r, acc in [(1, 0.60), (2, 0.72), (3, 0.70), (4, 0.72), (5, 0.71)]]
    assert verdicts == [True, True, False, True, False]
    assert (best.round, best.accuracy) == (4, 0.72)


def test_a_nan_accuracy_never_becomes_the_best_round():
    best = BestRound()
    assert not best.offer(1, math.nan)
    assert best.round == 0
    assert best.offer(2, 0.0)  # a real score, however poor, is a round the hub can serve
    assert not best.offer(3, math.nan)
    assert (best.round, best.accuracy) == (2, 0.0)
