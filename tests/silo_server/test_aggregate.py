import pytest
import torch

from silo_server.rounds.aggregate import RunningSum, UploadBudget


def test_running_sum_is_exact_and_keeps_one_copy_whatever_the_number_of_silos():
    sums = RunningSum()
    g = torch.Generator().manual_seed(0)
    expected = torch.zeros(100, dtype=torch.float64)
    for _ in range(200):
        delta = torch.randn(100, generator=g) * 1e-4  # small deltas: float64 sums must not lose them
        expected += delta.double()
        sums.add({"delta/w": delta, "weight": torch.ones(1)}, {"pl_total": 10.0, "pl_selected": 3.0})
        assert len(sums.tensors) == 2  # memory does not grow with the number of reports
    out = sums.result()
    assert torch.allclose(out["delta/w"].double(), expected, atol=1e-9)
    assert float(out["weight"]) == 200.0
    assert sums.metrics == {"pl_total": 2000.0, "pl_selected": 600.0}
    assert sums.contributors == 200


def test_a_skipped_report_adds_metrics_but_is_not_a_contributor():
    sums = RunningSum()
    sums.add({}, {"pl_total": 5.0})
    assert sums.contributors == 0 and sums.tensors == {} and sums.metrics == {"pl_total": 5.0}


def test_upload_budget_admits_an_upload_larger_than_itself_when_nothing_else_is_held():
    budget = UploadBudget(100)
    with budget.hold(250):  # alone: admitted, so no valid upload waits forever
        assert budget.held == 250
    with budget.hold(60):
        waited = []
        # Over the limit while 60 bytes are held; a closed round (still_wanted false) stops the wait at once.
        with budget.hold(60, still_wanted=lambda: waited.append(1) and False):
            assert budget.held == 120
        assert waited == [1]
    assert budget.held == 0 and budget.peak == 250
    with pytest.raises(ValueError, match="positive"):
        UploadBudget(0)
