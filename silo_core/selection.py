"""Model selection: remember the round whose served model scored best on the hub's labeled validation split.

The last round is not always the best one (at SemiFL's paper silo budget the benchmark's runs lose up to 2 points
over their last ten rounds), so the hub keeps the best round's model beside the final one, as NVIDIA FLARE's model
selector does. The validation images are the hub's own, so selecting costs the silos nothing and reveals nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from silo_core.rounds import RoundRecord, Scores


@dataclass
class BestRound:
    """The best round so far by validation accuracy (round 0: the initial model, before any silo took part);
    `found` is False until a round has been scored."""

    round: int = 0
    accuracy: float = -math.inf

    @property
    def found(self) -> bool:
        return self.accuracy != -math.inf

    def offer(self, round_number: int, accuracy: float) -> bool:
        """Record a round's validation accuracy; True when it is the new best. A tie goes to the later round, whose
        model has trained on more; a NaN accuracy (a broken model) never wins."""
        if math.isnan(accuracy) or accuracy < self.accuracy:
            return False
        self.round, self.accuracy = round_number, accuracy
        return True

    @classmethod
    def from_history(cls, history: Iterable[RoundRecord], initial: Scores | None = None) -> BestRound:
        """The best round among the rounds scored on the validation split, the initial model (round 0) included
        when its scores are given: the same record the hub keeps, so the metrics and silo-sim's table name the
        model that best_model.safetensors holds."""
        best = cls()
        if initial is not None and initial.validation_accuracy is not None:
            best.offer(0, initial.validation_accuracy)
        for record in history:
            if record.scores.validation_accuracy is not None:
                best.offer(record.round, record.scores.validation_accuracy)
        return best

    def as_dict(self) -> dict[str, float | int]:
        return {"best_round": self.round, "best_validation_accuracy": self.accuracy}
