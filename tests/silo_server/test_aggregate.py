import torch

from silo_server.aggregate import RunningSum


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
