"""The model card: read it, check it, and build the model it describes with the weights it names.

A hub's state folder is the hand-off of a run (silo_server/app.py, `HubApp.export`): `model_card.json` says which
network was trained (a model spec that `silo_core.models.ModelSpec` builds), how its inputs are made (image size,
channels, mean/std), the class names, and which weights files hold which round's model with their sha256:
`model.safetensors` (the last round) and, when the hub had a validation split, `best_model.safetensors` (the round
that scored best on it). This module is the only reader of that hand-off for silo-predict and silo-export.

Nothing here runs code named by a file: weights are read with safetensors (never pickle), and a card naming a user
model factory (`pkg.module:callable`) is built only when the user names that same callable on the command line,
as a silo does (its operator names the factory, never the hub)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from silo_core.algorithms import ALGORITHMS
from silo_core.augment import to_float
from silo_core.models import RUN_CARD, ModelSpec, architecture, architecture_sha256

KNOWN_FORMATS = ("silokit model card v1",)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CardError(Exception):
    """A problem with the state folder that the user can fix; the message is one line naming the file and what
    to do."""


@dataclass
class TrainedModel:
    """A run's model in eval mode on the CPU, with what is needed to feed it and read its output."""

    model: nn.Module
    spec: ModelSpec
    classes: list[str]
    weights: Path  # the file the weights came from
    weights_sha256: str
    round: int | None  # the round whose model the weights are
    which: str  # "best" (best_model.safetensors, by validation accuracy) or "final" (the last round's)
    card: dict[str, Any]

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 N x C x H x W (as silo_core.data loads them) -> the normalised float32 batch the model takes."""
        return to_float(images, self.spec.mean, self.spec.std)

    def describe(self) -> str:
        when = f"round {self.round}" if self.round is not None else "round unknown"
        why = ", best on the validation split" if self.which == "best" else ", the last round"
        return f"{self.spec.label} ({len(self.classes)} classes) from {self.weights} ({when}{why})"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every tool that reads a state folder takes."""
    parser.add_argument("--model", required=True, metavar="STATE_DIR",
                        help=f"the hub's state folder (run.state_dir): {RUN_CARD} and the weights it names")
    parser.add_argument("--final", action="store_true",
                        help="use the last round's model.safetensors even when the card names a best_model."
                             "safetensors (the round that scored best on the hub's validation split; the default)")
    parser.add_argument("--model-factory", metavar="PKG.MODULE:CALLABLE",
                        help="import and run this user model factory to build the network; needed (and only "
                             "allowed) when the model card names one, and it must name the same callable")


def error(message: str) -> int:
    """Print the one-line error and return the exit status for a user error."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def read_card(state_dir: Path | str) -> dict[str, Any]:
    """The state folder's model card, checked: every field predict and export need is there and well-formed."""
    folder = Path(state_dir)
    if not folder.exists():
        raise CardError(f"state folder {folder} does not exist; pass the hub's run.state_dir to --model")
    if not folder.is_dir():
        raise CardError(f"{folder} is not a folder; pass the hub's state folder (run.state_dir) to --model, "
                        f"not a file in it")
    path = folder / RUN_CARD
    if not path.is_file():
        raise CardError(f"{path} is missing: the hub writes it when a run finishes; pass the state folder of a "
                        f"finished run")
    try:
        card = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CardError(f"{path} cannot be read as JSON ({err}); restore it from the hub's state folder") from None
    if not isinstance(card, dict):
        raise CardError(f"{path} is not a silokit model card (a JSON object is expected)")
    fmt = card.get("format")
    if fmt not in KNOWN_FORMATS:
        if isinstance(fmt, str) and fmt.startswith("silokit model card"):
            raise CardError(f"{path} is a {fmt!r}, which this silokit does not know (it reads "
                            f"{', '.join(KNOWN_FORMATS)}); upgrade silokit: pip install -U silokit")
        raise CardError(f"{path} is not a silokit model card (format {fmt!r}); pass the state folder of a "
                        f"silokit hub")
    _check_card(card, path)
    return card


def _check_card(card: dict[str, Any], path: Path) -> None:
    def bad(key: str, what: str) -> CardError:
        return CardError(f"{path}: {key} {what}; the card is damaged or hand-edited, restore it from the hub's "
                         f"state folder")

    model = card.get("model")
    if not isinstance(model, dict):
        raise bad("model", "is missing")
    if not isinstance(model.get("name"), str) or not model["name"]:
        raise bad("model.name", "is missing")
    for key, low, high in (("num_classes", 1, 1_000_000), ("image_size", 1, 65_536)):
        value = model.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad(f"model.{key}", f"must be a whole number in {low}..{high}, got {value!r}")
    channels = model.get("in_channels")
    if channels not in (1, 3) or isinstance(channels, bool):
        raise bad("model.in_channels", f"must be 1 or 3, got {channels!r}")
    for key in ("normalize_mean", "normalize_std"):
        value = model.get(key)
        if (not isinstance(value, list) or len(value) != channels
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
            raise bad(f"model.{key}", f"must list {channels} number(s), one per channel, got {value!r}")
    if min(model["normalize_std"]) <= 0:
        raise bad("model.normalize_std", "must be positive")
    if not isinstance(model.get("options", {}), dict):
        raise bad("model.options", "must be a mapping")
    factory = model.get("factory")
    if factory is not None and (not isinstance(factory, str) or ":" not in factory):
        raise bad("model.factory", f"must be 'pkg.module:callable', got {factory!r}")
    classes = card.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise bad("classes", "must list the class names")
    if len(classes) != model["num_classes"]:
        raise bad("classes", f"names {len(classes)} classes but model.num_classes is {model['num_classes']}")
    _check_weights_entry(card, "", path)
    best = card.get("best_round")
    if best is not None:
        if not isinstance(best, dict):
            raise bad("best_round", "must be a mapping or null")
        _check_weights_entry(best, "best_round.", path)
        if isinstance(best.get("round"), bool) or not isinstance(best.get("round"), int):
            raise bad("best_round.round", "must be a round number")


def _check_weights_entry(entry: dict[str, Any], prefix: str, path: Path) -> None:
    name, sha = entry.get("weights_file"), entry.get("weights_sha256")
    # A plain file name in the state folder: a card cannot point the tools at a file anywhere else.
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise CardError(f"{path}: {prefix}weights_file must be a file name in the state folder, got {name!r}; "
                        f"restore the card from the hub's state folder")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise CardError(f"{path}: {prefix}weights_sha256 must be a sha256 in hex, got {sha!r}; restore the card "
                        f"from the hub's state folder")


def choose_weights(card: dict[str, Any], state_dir: Path | str, final: bool = False
                   ) -> tuple[Path, str, int | None, str]:
    """(file, its sha256 by the card, its round, "best" or "final"): the best round's model when the card names
    one, unless ``final``; else the last round's."""
    folder = Path(state_dir)
    best = card.get("best_round")
    if best is not None and not final:
        path = folder / best["weights_file"]
        if not path.is_file():
            raise CardError(f"{path} is missing, but the model card names it as round {best['round']}'s model (best "
                            f"on the validation split); copy the whole state folder, or pass --final to use "
                            f"{card['weights_file']}")
        return path, best["weights_sha256"], best["round"], "best"
    path = folder / card["weights_file"]
    if not path.is_file():
        raise CardError(f"{path} is missing, but the model card names it as the run's model; copy the whole state "
                        f"folder")
    round_number = card.get("weights_round", card.get("rounds"))
    return path, card["weights_sha256"], round_number if isinstance(round_number, int) else None, "final"


def model_spec(card: dict[str, Any], model_factory: str | None = None) -> ModelSpec:
    """The card's model spec. A user factory is built only when the user named the same callable."""
    model = card["model"]
    factory = model.get("factory")
    if factory is None and model_factory is not None:
        raise CardError(f"--model-factory {model_factory} was given, but the model card names no user factory (its "
                        f"model is {model['name']}); leave --model-factory out")
    if factory is not None and model_factory != factory:
        given = f" (--model-factory names {model_factory})" if model_factory else ""
        raise CardError(f"the model card names the user model factory {factory}{given}; silokit imports user code "
                        f"only when you name it: pass --model-factory {factory} if you trust that code")
    return ModelSpec(model["name"], num_classes=model["num_classes"], in_channels=model["in_channels"],
                     image_size=model["image_size"], mean=[float(v) for v in model["normalize_mean"]],
                     std=[float(v) for v in model["normalize_std"]], options=dict(model.get("options", {})),
                     factory=factory)


def served_network(card: dict[str, Any], spec: ModelSpec) -> nn.Module:
    """A fresh network of the structure the hub served: the spec's network, or the combination of several that
    the card's algorithm serves (HASSLE's dual ensemble), with the card's algorithm options. An algorithm this
    install does not know is built as one network; the architecture check then says whether that was right."""
    entry = ALGORITHMS.get(str(card.get("algorithm")))
    if entry is None:
        return spec.build()
    return entry.hub.served_network(spec, entry.options.model_validate(card.get("algorithm_options") or {}))


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_trained_model(state_dir: Path | str, final: bool = False,
                       model_factory: str | None = None) -> TrainedModel:
    """Read the card, check the chosen weights file against its sha256, build the network and load the weights
    (strictly: every tensor present, none extra, shapes equal). The model comes back in eval mode on the CPU."""
    card = read_card(state_dir)
    weights, sha, round_number, which = choose_weights(card, state_dir, final)
    actual = file_sha256(weights)
    if actual != sha:
        raise CardError(f"{weights} does not match the model card (sha256 {actual[:12]}... in the file, "
                        f"{sha[:12]}... in the card): the file was changed or belongs to another run; restore the "
                        f"state folder as the hub wrote it")
    spec = model_spec(card, model_factory)
    try:
        model = served_network(card, spec)
    except (ValueError, ImportError) as err:
        raise CardError(f"cannot build model {spec.label} from {Path(state_dir) / RUN_CARD}: {err}") from None
    recorded = card["model"].get("architecture_sha256")
    if recorded is not None and architecture_sha256(architecture(model)) != recorded:
        # e.g. another version of the factory's package, or of torchvision, builds other tensors under the name
        raise CardError(f"model {spec.label} as built here is not the network the hub trained (its tensors' names, "
                        f"shapes or dtypes differ from the card's architecture_sha256); install the versions the "
                        f"hub used")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise CardError(f"{weights} is not a readable safetensors file ({err}); restore the state folder") from None
    _check_fit(model, tensors, weights, spec)
    model.load_state_dict(tensors, strict=True)
    return TrainedModel(model.eval(), spec, list(card["classes"]), weights, actual, round_number, which, card)


def _check_fit(model: nn.Module, tensors: dict[str, torch.Tensor], weights: Path, spec: ModelSpec) -> None:
    """One line naming what does not fit, instead of load_state_dict's paragraph."""
    state = model.state_dict()
    missing = [k for k in state if k not in tensors]
    unexpected = [k for k in tensors if k not in state]
    shapes = [k for k in state if k in tensors and tensors[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if shapes:
            k = shapes[0]
            parts.append(f"{k} is {tuple(tensors[k].shape)} in the file, {tuple(state[k].shape)} in the model")
        raise CardError(f"{weights} does not fit model {spec.label} as the card describes it: {'; '.join(parts)}")
