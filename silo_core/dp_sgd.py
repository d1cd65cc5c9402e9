"""Sample-level differential privacy at a silo: local training through Opacus' DP-SGD, with the silo's own ledger.

Client-level DP (security/dp.py) protects a whole silo in the hub's sums. Sample-level DP protects one image of
a silo's own data inside everything the silo sends: every local step clips each example's gradient to
`clip_norm`, adds Gaussian noise of std `noise_multiplier * clip_norm` to their sum, and draws its batch by
Poisson sampling (each example in with probability q = 1 / ceil(n / batch_size), about batch_size / n), which is
what the accountant assumes.

What each example contributes must depend on that example alone, so:
- the model must use group norm (batch norm mixes the examples of a batch): hub.yaml `model.options.norm: group`;
- an algorithm trains on one view per example with plain cross-entropy (SemiFL: L_fix on the strong view of the
  confident images; Mixup pairs two people's images, so L_mix is left out under sample-level DP).

The silo keeps its own accountant per run (a JSON file in its state folder, so a restarted silo goes on counting)
and reports epsilon at `delta` after every round. With `epsilon_budget` set, a silo whose next round would exceed
it trains no more and tells the hub it skipped.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from silo_core.accounting import PrivacyAccountant
from silo_core.config_base import StrictConfig
from silo_core.data import Images, image_batches
from silo_core.files import write_json_atomic

log = logging.getLogger("silo_core.dp_sgd")


class SampleDPConfig(StrictConfig):
    """hub.yaml `privacy.sample_dp`: DP-SGD in every silo's local training (off by default)."""

    enabled: bool = Field(False, description="train at every silo with DP-SGD (needs model.options.norm: group)")
    noise_multiplier: float = Field(1.0, gt=0, description="sigma: noise std on a batch's gradient sum is "
                                    "sigma * clip_norm")
    clip_norm: float = Field(1.0, gt=0, description="C: L2 bound on one example's gradient")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta at which each silo reports its epsilon")
    epsilon_budget: float | None = Field(None, gt=0, description="a silo stops training before its own epsilon "
                                         "would exceed this")

    def hyperparameters(self) -> dict[str, Any]:
        """What travels to the silos in the task's hyperparameters."""
        return {"noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm, "delta": self.delta,
                "epsilon_budget": self.epsilon_budget}


class SampleDPLedger:
    """One silo's sample-level privacy spending in one run, kept on disk when the silo has a state folder."""

    def __init__(self, delta: float, path: Path | None = None):
        self.path = path
        self.accountant = PrivacyAccountant("rdp", delta)
        if path is not None and path.is_file():
            try:
                self.accountant = PrivacyAccountant.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError) as err:
                # Never guess at privacy spent: a damaged ledger stops the silo with the file named.
                raise ValueError(f"sample-level DP ledger {path} is damaged ({err}); restore it from a backup. "
                                 "Deleting it would forget the privacy this silo has already spent") from None
            self.accountant.delta = delta

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def allows(self, budget: float | None, noise_multiplier: float, sample_rate: float, steps: int) -> bool:
        return budget is None or self.accountant.epsilon_after(noise_multiplier, sample_rate, steps) <= budget

    def charge(self, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        self.accountant.step(noise_multiplier, sample_rate, steps)
        if self.path is not None:
            write_json_atomic(self.path, self.accountant.to_json())
        return self.epsilon()


def ledger_for(ledgers: dict[str, SampleDPLedger], silo_id: str, run_id: str, state_dir: Path | None,
               delta: float) -> SampleDPLedger:
    """The ledger of (silo, run), loaded once per process from the silo's state folder."""
    key = f"{silo_id}/{run_id}"
    if key not in ledgers:
        path = None
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            path = state_dir / f"sample_dp_ledger-{run_id or 'default'}.json"
        ledgers[key] = SampleDPLedger(delta, path)
    return ledgers[key]


def sample_dp_unfit(algorithm: str, supports_sample_dp: bool, algorithm_options: Mapping[str, Any],
                    model_options: Mapping[str, Any]) -> str | None:
    """Why DP-SGD would not run as sample-level DP promises with this algorithm, these options and this model (None:
    it would). The hub refuses such a hub.yaml; a silo refuses a run whose terms state sample-level DP that its own
    training would not carry out, rather than take the hub's word (its updates would leave without DP-SGD)."""
    if not supports_sample_dp:
        return f"privacy.sample_dp is not available for algorithm {algorithm!r} yet"
    if model_options.get("norm", "batch") != "group":
        return ("privacy.sample_dp needs model.options.norm: group (batch norm mixes the images of a batch, so one "
                "image's gradient cannot be clipped on its own)")
    rule = algorithm_options.get("threshold_rule", "fixed")
    if rule != "fixed":
        return (f"privacy.sample_dp needs algorithm.options.threshold_rule: fixed (not {rule}): per-class thresholds "
                "learnt from all of a silo's images let one image move many others in or out of the pseudo-labeled "
                "set, which DP-SGD's per-image accounting does not cover")
    if algorithm_options.get("local_steps") is not None:
        return ("privacy.sample_dp counts local work in epochs (its accountant schedules whole passes): remove "
                "algorithm.options.local_steps and set local_epochs")
    return None


def dp_schedule(num_examples: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(sampling rate q, steps) of `epochs` passes over `num_examples` in expected batches of `batch_size`, as
    Opacus' Poisson loader draws them: ceil(n / B) draws a pass, each example in with probability one over that
    (B / n only when B divides n; charging B / n over-stated epsilon, e.g. 21.3 for 16.6 at n 150, B 100)."""
    draws = math.ceil(max(num_examples, 1) / batch_size)
    return 1.0 / draws, epochs * draws


def dp_sgd_train(
    model: nn.Module,
    images: Images,
    targets: torch.Tensor,
    view: Callable[[torch.Tensor], torch.Tensor],
    *,
    epochs: int,
    batch_size: int,
    optimizer: torch.optim.Optimizer,
    noise_multiplier: float,
    clip_norm: float,
    device: torch.device,
) -> tuple[float, int]:
    """`epochs` of DP-SGD on cross-entropy(model(view(images[i])), targets[i]) through Opacus' PrivacyEngine.
    `view` maps a uint8 batch to the model's float input (the augmentation). Returns (mean loss, steps taken);
    the caller charges its ledger with dp_schedule(), which counts every scheduled step."""
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    model.train()
    problems = ModuleValidator.validate(model, strict=False)
    if problems:
        raise ValueError(f"this model cannot be trained with per-sample gradients: {problems[0]}; set hub.yaml "
                         "model.options.norm: group for privacy.sample_dp")
    # The batch draws and the noise must be secret from everyone, the hub included: both come from generators
    # seeded by the OS's CSPRNG, never from the run's seed (which the hub chose and knows).
    sampling = torch.Generator().manual_seed(secrets.randbits(63))
    noise = torch.Generator(device=device).manual_seed(secrets.randbits(63))
    indices = TensorDataset(torch.arange(len(images)))
    loader = DataLoader(indices, batch_size=batch_size, generator=sampling)
    with warnings.catch_warnings():  # "Secure RNG turned off": our generators are seeded from the OS CSPRNG
        warnings.simplefilter("ignore", UserWarning)
        engine = PrivacyEngine(accountant="rdp")
    private_model, private_optimizer, private_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=clip_norm, poisson_sampling=True, noise_generator=noise,
    )
    private_model.train()
    # Opacus' hooks on the first layer fire with no input gradient (images need none): harmless, and said each step.
    warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
    total, steps = 0.0, 0
    for _ in range(epochs):
        # The epoch's Poisson draws first, then their pixels (read from disk for a big folder); the draws are the
        # same either way. An image whose file turns out unreadable is left out of its batch. Always float32.
        draws = [idx for (idx,) in private_loader]
        for idx, pixels in image_batches(images, draws):
            if len(idx) == 0:  # an empty Poisson draw: nothing to step on (the ledger still counts it)
                continue
            x = view(pixels).to(device)
            loss = F.cross_entropy(private_model(x), targets[idx].to(device))
            private_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            private_optimizer.step()
            total, steps = total + loss.item(), steps + 1
    private_model.remove_hooks()
    return total / max(steps, 1), steps
