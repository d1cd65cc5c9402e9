"""Client-level DP: clipping, central and distributed noise, adaptive clipping, accounting, budgets, JSON state."""

import json
import math

import pytest
import torch

from security.dp import (
    UNCLIPPED,
    AdaptiveClipping,
    BudgetExhausted,
    DPConfig,
    DPController,
    PrivacyAccountant,
    SiloInstructions,
    clip_update,
    noise_generator,
    per_silo_std,
    privatize_update,
    update_noise_multiplier,
)


def test_rdp_accountant_pins_the_reference_epsilon():
    acc = PrivacyAccountant("rdp", delta=1e-5)
    acc.step(noise_multiplier=1.5, sample_rate=0.04, steps=2250)
    assert round(acc.epsilon(), 3) == 7.329
    assert acc.steps == 2250


def test_cached_rdp_equals_opacus_rdp_accountant_on_a_mixed_history():
    from opacus.accountants import RDPAccountant

    acc = PrivacyAccountant("rdp", delta=1e-5)
    for z, q, s in [(1.5, 0.04, 100), (1.1, 0.3, 20), (1.5, 0.04, 7)]:
        acc.step(z, q, steps=s)
    reference = RDPAccountant()
    reference.history = [(1.5, 0.04, 100), (1.1, 0.3, 20), (1.5, 0.04, 7)]
    assert acc.epsilon() == reference.get_epsilon(delta=1e-5)


def test_prv_accountant_is_available_and_tighter():
    rdp, prv = PrivacyAccountant("rdp"), PrivacyAccountant("prv")
    for acc in (rdp, prv):
        acc.step(1.5, 0.04, steps=2250)
    assert 6.0 < prv.epsilon() < rdp.epsilon()


def test_accountant_state_round_trips_through_json():
    acc = PrivacyAccountant("rdp", delta=1e-6)
    acc.step(1.1, 0.1, steps=30)
    acc.step(0.9, 0.2, steps=5)
    restored = PrivacyAccountant.from_json(json.loads(json.dumps(acc.to_json())))
    assert restored.epsilon() == acc.epsilon() and restored.steps == 35 and restored.delta == 1e-6
    with pytest.raises(ValueError, match="bad accountant history"):
        PrivacyAccountant.from_json({"mechanism": "rdp", "delta": 1e-5, "history": [[0.0, 0.1, 3]]})


def test_clipping_bounds_the_joint_norm_and_leaves_weights_alone():
    t = {"delta/a": torch.full((3,), 2.0), "delta/b": torch.full((1,), 2.0), "weight": torch.tensor([5.0])}
    clipped, norm = clip_update(t, 1.0, ["delta/"])
    assert norm == pytest.approx(4.0)
    joint = math.sqrt(sum(float(v.pow(2).sum()) for k, v in clipped.items() if k.startswith("delta/")))
    assert joint == pytest.approx(1.0) and float(clipped["weight"]) == 5.0
    small, norm = clip_update(t, 10.0, ["delta/"])
    assert norm == pytest.approx(4.0) and torch.equal(small["delta/a"], t["delta/a"])


def test_distributed_shares_sum_to_the_full_noise():
    z, c, m = 1.2, 0.5, 8
    instructions = SiloInstructions(clip_norm=c, noise_std=per_silo_std(z * c, m))
    g = noise_generator(0)
    zero = {"delta/w": torch.zeros(50_000)}
    total = sum(privatize_update(zero, instructions, g)[0]["delta/w"].double() for _ in range(m))
    assert float(total.std()) == pytest.approx(z * c, rel=0.02)
    assert abs(float(total.mean())) < 0.02


def test_central_noise_has_std_z_times_c_and_the_round_is_charged():
    ctl = DPController(DPConfig(enabled=True, noise_multiplier=2.0, clip_norm=0.25), secure_aggregation=False,
                       seed=0)
    plan = ctl.plan_round(expected_silos=4, enrolled=10, min_contributors=2)
    assert plan.noise_std == 0.0 and ctl.mode == "central"
    summed = {"delta/w": torch.zeros(50_000, dtype=torch.float64), "weight": torch.tensor([4.0])}
    out, dp = ctl.finish_round(summed, contributors=4, expected_silos=4, enrolled=10)
    assert float(out["delta/w"].std()) == pytest.approx(0.5, rel=0.02) and float(out["weight"]) == 4.0
    expected = PrivacyAccountant()
    expected.step(2.0, 0.4)
    assert dp.epsilon == pytest.approx(expected.epsilon()) and dp.sample_rate == 0.4
    assert (dp.clip_norm, dp.noise_multiplier, dp.epsilon_budget, dp.unclipped_fraction) == (0.25, 2.0, None, None)


def test_distributed_mode_needs_secure_aggregation_and_splits_the_noise():
    cfg = DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=2.0, noise="distributed")
    with pytest.raises(ValueError, match="needs secure aggregation"):
        DPController(cfg, secure_aggregation=False)
    ctl = DPController(cfg, secure_aggregation=True)
    plan = ctl.plan_round(expected_silos=9, enrolled=9, min_contributors=4)
    assert plan.noise_std == pytest.approx(2.0 / 2)  # z C / sqrt(m)
    summed = {"delta/w": torch.ones(10, dtype=torch.float64)}
    out, _ = ctl.finish_round(summed, contributors=5, expected_silos=9, enrolled=9)
    assert torch.equal(out["delta/w"], summed["delta/w"])  # the hub adds nothing: the silos did


def test_budget_stops_before_it_would_be_exceeded():
    z, q = 1.0, 0.5
    probe = PrivacyAccountant()
    probe.step(z, q, steps=10)
    budget = probe.epsilon() + 1e-9  # exactly 10 rounds fit
    ctl = DPController(DPConfig(enabled=True, noise_multiplier=z, epsilon_budget=budget), secure_aggregation=False)
    for _ in range(10):
        ctl.plan_round(expected_silos=2, enrolled=4, min_contributors=1)
        ctl.finish_round({"delta/w": torch.zeros(3)}, contributors=2, expected_silos=2, enrolled=4)
    with pytest.raises(BudgetExhausted, match="one more round would spend epsilon"):
        ctl.plan_round(expected_silos=2, enrolled=4, min_contributors=1)
    assert ctl.rounds == 10 and ctl.epsilon() <= budget


def test_controller_state_survives_a_restart_with_the_same_count():
    cfg = DPConfig(enabled=True, noise_multiplier=1.3, clip_norm=1.0,
                   adaptive_clipping=AdaptiveClipping(enabled=True))
    straight = DPController(cfg, secure_aggregation=False, seed=1)
    first = DPController(cfg, secure_aggregation=False, seed=1)
    summed = {"delta/w": torch.zeros(4), UNCLIPPED: torch.tensor([1.0])}
    for ctl, rounds in ((straight, 5), (first, 3)):
        for _ in range(rounds):
            ctl.plan_round(3, 12, 2)
            ctl.finish_round(dict(summed), contributors=3, expected_silos=3, enrolled=12)
    state = json.loads(json.dumps(first.state_dict()))
    second = DPController(cfg, secure_aggregation=False, seed=1)
    second.load_state_dict(state)
    assert second.rounds == 3 and second.epsilon() == first.epsilon() and second.clip_norm == first.clip_norm
    for _ in range(2):
        second.plan_round(3, 12, 2)
        second.finish_round(dict(summed), contributors=3, expected_silos=3, enrolled=12)
    assert second.epsilon() == pytest.approx(straight.epsilon()) and second.rounds == 5
    other = DPController(DPConfig(enabled=True, accountant="prv"), secure_aggregation=False)
    with pytest.raises(ValueError, match="differs from the config"):
        other.load_state_dict(state)


def test_adaptive_noise_split_composes_to_z():
    z, sigma_b = 1.0, 2.0
    z_delta = update_noise_multiplier(z, sigma_b)
    assert (z_delta ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)
    assert update_noise_multiplier(z, None) == z
    with pytest.raises(ValueError):
        update_noise_multiplier(1.0, 0.5)


def test_adaptive_clipping_tracks_the_target_quantile():
    """Silo update norms are spread around 3.0; the clip follows their median, from far below and far above."""
    g = torch.Generator().manual_seed(0)
    for start in (0.1, 30.0):
        cfg = DPConfig(enabled=True, noise_multiplier=0.5, clip_norm=start,
                       adaptive_clipping=AdaptiveClipping(enabled=True, target_quantile=0.5, learning_rate=0.3,
                                                          count_noise_multiplier=1.0))
        ctl = DPController(cfg, secure_aggregation=True, seed=2)
        for _ in range(120):
            plan = ctl.plan_round(expected_silos=20, enrolled=40, min_contributors=16)
            indicator = torch.zeros(1, dtype=torch.float64)
            for _ in range(20):
                norm = 3.0 * math.exp(0.3 * float(torch.randn((), generator=g)))
                out, _ = privatize_update({"delta/w": torch.tensor([norm])}, plan, g)
                indicator += out[UNCLIPPED].double()
            ctl.finish_round({"delta/w": torch.zeros(1), UNCLIPPED: indicator}, 20, 20, 40)
        assert ctl.clip_norm == pytest.approx(3.0, rel=0.15), start
        assert 0.3 < ctl.last.unclipped_fraction < 0.7


def test_silo_instructions_round_trip_and_refuse_nonsense():
    s = SiloInstructions(clip_norm=0.5, noise_std=0.1, indicator_noise_std=0.2, adaptive=True)
    assert SiloInstructions.from_json(json.loads(json.dumps(s.to_json()))) == s
    with pytest.raises(ValueError):
        SiloInstructions.from_json({"clip_norm": -1, "noise_std": 0})


@pytest.mark.parametrize("mechanism", ["rdp", "prv"])
def test_the_accountant_keeps_its_own_ledger_and_agrees_with_opacus_public_api(mechanism):
    from opacus.accountants import PRVAccountant, RDPAccountant

    ours = PrivacyAccountant(mechanism, delta=1e-5)
    theirs = {"rdp": RDPAccountant, "prv": PRVAccountant}[mechanism]()
    for z, q, steps in ((1.1, 0.1, 3), (1.1, 0.1, 2), (0.9, 0.2, 4)):
        ours.step(z, q, steps)
        for _ in range(steps):
            theirs.step(noise_multiplier=z, sample_rate=q)
    assert ours.history == [(1.1, 0.1, 5), (0.9, 0.2, 4)]  # consecutive equal (z, q) merged
    assert ours.epsilon() == pytest.approx(theirs.get_epsilon(delta=1e-5), rel=1e-6)
    restored = PrivacyAccountant.from_json(json.loads(json.dumps(ours.to_json())))
    assert restored.history == ours.history and restored.epsilon() == pytest.approx(ours.epsilon(), rel=1e-9)
    assert not hasattr(restored, "_impl")  # nothing of Opacus' private state is written or read back
