"""The simulated attacks (silo_sim/attacks.py): what a poisoned result holds, number by number, and the silo-sim
flags that set them."""

import pytest
import torch

from silo_core.algorithms.base import RoundPlan, SiloAlgorithm, SiloData, SiloResult
from silo_sim import cli
from silo_sim.attacks import PoisonedSilo, attack_seed, poison


class Fixed(SiloAlgorithm):
    """A silo half whose honest result is known: two groups, a weight and a delta each, and a count."""

    name = "fixed"
    trains_on_labeled = True

    def __init__(self):
        super().__init__(None, None, torch.device("cpu"))

    def local_update(self, plan, data):
        return SiloResult({"a/delta/x": torch.tensor([2.0, -4.0]), "a/weight": torch.tensor([2.0]),
                           "b/delta/x": torch.tensor([1.0, 1.0, 1.0]), "b/weight": torch.tensor([1.0]),
                           "count": torch.tensor([7.0])}, metrics={"pl_selected": 3.0})

    def result_groups(self, expected):
        return {"a": ["a/delta/x", "a/weight"], "b": ["b/delta/x", "b/weight"]}


def plan(round_number=1):
    return RoundPlan(round=round_number, tensors={}, hyperparameters={}, expected={})


def data(silo_id):
    return SiloData(images=torch.zeros(0, 1, 2, 2, dtype=torch.uint8), silo_id=silo_id)


def test_sign_flip_reverses_and_scales_every_delta_and_keeps_weights_and_the_rest():
    result = PoisonedSilo(Fixed(), "sign_flip").local_update(plan(), data("s1"))
    assert result.tensors["a/delta/x"].tolist() == [-20.0, 40.0]
    assert result.tensors["b/delta/x"].tolist() == [-10.0, -10.0, -10.0]
    assert result.tensors["a/weight"].item() == 2.0 and result.tensors["b/weight"].item() == 1.0
    assert result.tensors["count"].item() == 7.0 and result.metrics == {"pl_selected": 3.0}
    assert poison({"delta/x": torch.tensor([1.0]), "weight": torch.tensor([1.0])}, "sign_flip", 0,
                  scale=3.0)["delta/x"].tolist() == [-3.0]


def test_noise_is_weighted_like_an_honest_delta_and_drawn_again_for_each_silo_and_round():
    big = {"delta/x": torch.zeros(200_000), "weight": torch.tensor([4.0])}
    noise = poison(big, "noise", seed=1)["delta/x"]
    assert noise.mean().abs() < 0.05 and (noise.std() - 4.0).abs() < 0.05  # weight 4 x N(0, 1)
    assert poison(big, "noise", 1, scale=0.5)["delta/x"].std() == pytest.approx(2.0, rel=0.01)
    silo = PoisonedSilo(Fixed(), "noise")
    first = silo.local_update(plan(1), data("s1")).tensors
    assert torch.equal(first["a/delta/x"], silo.local_update(plan(1), data("s1")).tensors["a/delta/x"])
    assert not torch.equal(first["a/delta/x"], silo.local_update(plan(2), data("s1")).tensors["a/delta/x"])
    assert not torch.equal(first["a/delta/x"], silo.local_update(plan(1), data("s2")).tensors["a/delta/x"])
    assert attack_seed("s1", 1) == attack_seed("s1", 1) != attack_seed("s1", 2)
    assert first["a/weight"].item() == 2.0 and first["count"].item() == 7.0


def test_only_the_named_silos_attack_and_the_wrapper_is_the_inner_silo_half_otherwise():
    inner = Fixed()
    silo = PoisonedSilo(inner, "sign_flip", only={"bad"})
    assert silo.local_update(plan(), data("good")).tensors["a/delta/x"].tolist() == [2.0, -4.0]
    assert silo.local_update(plan(), data("bad")).tensors["a/delta/x"].tolist() == [-20.0, 40.0]
    assert silo.result_groups({}) == inner.result_groups({})
    assert silo.name == "fixed" and silo.trains_on_labeled and silo.device == inner.device
    with pytest.raises(ValueError, match="'flip' is no attack; choose one of sign_flip, noise"):
        PoisonedSilo(inner, "flip")


@pytest.mark.parametrize(("argv", "message"), [
    (["--attackers", "5", "--silos", "4"], "--attackers must be between 0 and --silos (4), got 5"),
    (["--attackers", "1", "--attack", "flood"], "--attack 'flood' is no attack; choose one of sign_flip, noise"),
    (["--attackers", "1", "--algorithm", "server-only"], "--attackers needs silos"),
])
def test_silo_sim_refuses_attack_flags_it_cannot_run_with_one_line(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
