"""Server-only: the hub trains on its own labels alone. The lower bound every semi-supervised method must beat.

It runs the same ServerUpdate schedule as SemiFL (one fine-tune before round 1 and one per round, cosine LR), so
"server-only" and "SemiFL" differ only in what the silos add.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from silo_core.algorithms.base import HubState, RoundPlan, load_model, model_tensors
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions


class ServerOnlyOptions(SemiFLOptions):
    """The hub-side SemiFL knobs apply; silo-side ones are ignored."""


class ServerOnlyHub(SemiFLHub):
    name = "server-only"
    needs_silos = False

    def begin_round(self, state: HubState) -> RoundPlan:
        return RoundPlan(round=state.round + 1, tensors={}, hyperparameters={}, expected={})

    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        r = state.round + 1
        model = load_model(self.model_spec, state.tensors)
        hub_loss = self._server_update(model, r + 1, self.options.hub_epochs)  # as SemiFL's, batch for batch
        tensors = {**state.tensors, **model_tensors(model)}
        return HubState(round=r, tensors=tensors, meta=dict(state.meta)), {"hub_loss": hub_loss}

    def served_model(self, state: HubState) -> nn.Module:
        return load_model(self.model_spec, state.tensors).eval()
