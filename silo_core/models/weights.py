"""Starting weights from a file the operator names (hub.yaml's model.init_weights and model.init_from_run): the
kit never downloads any. Read without unpickling (safetensors, or torch.load with weights_only=True)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn

if TYPE_CHECKING:
    from silo_core.models.spec import ModelSpec

RUN_WEIGHTS, RUN_CARD = "model.safetensors", "model_card.json"  # what a finished run leaves in its state folder
_WRAPPERS = ("state_dict", "model_state_dict", "model")  # where training scripts nest the weights in a checkpoint
_PREFIXES = ("module.", "_orig_mod.")  # added by DataParallel/DistributedDataParallel and by torch.compile
_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class WeightsReport:
    """What `load_weights` did to each of the model's tensors, for the hub's log and `silo-server --check`."""

    source: str
    loaded: list[str] = field(default_factory=list)
    summed_stem: list[str] = field(default_factory=list)  # 3-channel convolutions summed into a 1-channel one
    head: list[str] = field(default_factory=list)  # the classifier, left as initialised: another class count
    head_classes: tuple[int, int] = (0, 0)  # (in the file, here)
    missing: list[str] = field(default_factory=list)  # the model's tensors the file lacks: left as initialised
    unexpected: list[str] = field(default_factory=list)  # the file's tensors the model lacks: ignored

    @property
    def missing_weights(self) -> list[str]:
        """Missing tensors that matter: BN running statistics are recomputed from the hub's data (static BN)."""
        return [n for n in self.missing if n.rpartition(".")[2] not in _BN_STATS]

    @property
    def worrying(self) -> bool:
        """Missing weights or unexpected tensors: the file may be another architecture's, mostly left unused."""
        return bool(self.missing_weights or self.unexpected)

    def summary(self) -> str:
        total = len(self.loaded) + len(self.summed_stem) + len(self.head) + len(self.missing)
        parts = [f"initial weights from {self.source}: {len(self.loaded) + len(self.summed_stem)} of {total} "
                 "tensors loaded"]
        if self.summed_stem:
            parts.append(f"{', '.join(self.summed_stem)} summed over 3 colour channels for 1-channel images")
        if self.head:
            parts.append(f"classifier {', '.join(self.head)} re-initialised ({self.head_classes[0]} classes in the "
                         f"file, {self.head_classes[1]} here)")
        if self.missing:
            stats = len(self.missing) - len(self.missing_weights)
            parts.append(f"{len(self.missing)} missing" + (f" ({stats} BN statistics, recomputed)" if stats else ""))
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (ignored)")
        return "; ".join(parts)

    def lines(self) -> list[str]:
        """The summary, then the first few names of what was missing or unexpected."""
        def first(names: list[str]) -> str:
            return ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")

        lines = [self.summary()]
        if self.missing_weights:
            lines.append(f"missing from the file, left as initialised: {first(self.missing_weights)}")
        if self.unexpected:
            lines.append(f"in the file but not in the model, ignored: {first(self.unexpected)}")
        return lines


def read_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """A file's tensors by name: safetensors, or a PyTorch checkpoint read with weights_only=True (a checkpoint can
    carry code to run; weights_only refuses anything but tensors and plain containers). The weights may be nested
    under `state_dict`, `model_state_dict` or `model`, with DataParallel's `module.` prefix: both undone here."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        # A safetensors file opens with its header's length (8 bytes) and the header's JSON '{'; torch writes a zip.
        if len(head) == 9 and head[8:] == b"{":
            raw: Any = load_file(str(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise ValueError(f"cannot read initial weights {path}: {err}") from None
    except Exception as err:  # safetensors' and unpickling's own errors, of several types
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path} is not a safetensors file or a PyTorch checkpoint that loads with "
                         f"weights_only=True: {why}") from None
    # A training checkpoint keeps other things beside the weights (epoch, optimizer, even a tensor best_acc1).
    while isinstance(raw, dict) and (inner := next((raw[k] for k in _WRAPPERS if isinstance(raw.get(k), dict)),
                                                   None)) is not None:
        raw = inner
    tensors = {str(k): v for k, v in raw.items() if isinstance(v, torch.Tensor)} if isinstance(raw, dict) else {}
    if not tensors:
        keys = ", ".join(map(str, list(raw)[:8])) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path} holds no tensors by name (found: {keys}); save model.state_dict()")
    for prefix in _PREFIXES:  # only when every name has it: a model may have a submodule called `module`
        if all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{path} holds NaN or infinite values in {name}")
    return tensors


def read_run_weights(directory: Path | str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """An earlier run's final model (its state folder's model.safetensors), to warm-start from. The model card,
    when there is one, must describe the same network: to start from another run's weights with another class
    count, name its model.safetensors in model.init_weights instead (the classifier is then re-initialised)."""
    directory = Path(directory)
    card_path = directory / RUN_CARD
    if card_path.is_file():
        try:
            whole = json.loads(card_path.read_text())
            card = whole["model"]
            theirs = {key: card.get(key) for key in ("name", "factory", "in_channels", "num_classes")}
            # Group and batch norm hold tensors of the same shapes: only the card tells them apart.
            theirs["options.norm"] = str((card.get("options") or {}).get("norm", "batch"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{card_path} is not a silokit model card ({type(err).__name__}: {err})") from None
        if whole.get("algorithm") == "hassle":  # its file holds S, U and their residuals under their own prefixes
            raise ValueError(f"model.init_from_run: the run in {directory} is a HASSLE run, whose {RUN_WEIGHTS} holds "
                             "a dual ensemble of four networks, not one network to start from: start from a "
                             "SemiFL, FedSEAL or server-only run, or from a weights file with model.init_weights")
        ours = {"name": spec.name, "factory": spec.factory, "in_channels": spec.in_channels,
                "num_classes": spec.num_classes, "options.norm": spec.norm}
        wrong = [key for key in ours if theirs[key] != ours[key]]
        if wrong:
            said = ", ".join(f"{k} {theirs[k]!r} there, {ours[k]!r} here" for k in wrong)
            raise ValueError(f"model.init_from_run: the run in {directory} trained another model ({said}); "
                             f"match model.name/in_channels/options.norm to it, or start from its weights with "
                             f"model.init_weights: {directory / RUN_WEIGHTS} (a different class count "
                             f"re-initialises the classifier)")
    return read_weights(directory / RUN_WEIGHTS)


def starting_weights(init_from_run: Path | None, init_weights: Path | None,
                     spec: ModelSpec) -> tuple[dict[str, torch.Tensor], str] | None:
    """hub.yaml's model.init_from_run or model.init_weights, read, and where from; None for a random start. Every
    hub half that trains for the run reads them so (the hub, silo-sim's baseline and replay): a baseline from
    random weights would overstate the lift of a run that started from a backbone."""
    if init_from_run is not None:
        return read_run_weights(init_from_run, spec), str(Path(init_from_run) / RUN_WEIGHTS)
    if init_weights is not None:
        return read_weights(init_weights), str(init_weights)
    return None


def head_names(model: nn.Module, num_classes: int) -> set[str]:
    """The classifier's tensors: those of the last Linear or Conv2d layers with num_classes outputs (resnet `fc`,
    vit `heads.head`, squeezenet's final convolution; both of a distilled DeiT's `head` and `head_dist`, the last
    layers in a row that give num_classes outputs), or of the last one with num_classes outputs, or of the last
    Linear when none has."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]

    def outputs(m: nn.Module) -> int:
        return m.out_features if isinstance(m, nn.Linear) else m.out_channels

    trailing = []
    for n, m in reversed(layers):
        if outputs(m) != num_classes:
            break
        trailing.append((n, m))
    classifiers = [(n, m) for n, m in layers if outputs(m) == num_classes]
    linear = [(n, m) for n, m in layers if isinstance(m, nn.Linear)]
    chosen = trailing or (classifiers or linear)[-1:]
    return {f"{n}.{p}" if n else p for n, m in chosen for p, _ in m.named_parameters(recurse=False)}


@torch.no_grad()
def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], num_classes: int,
                 source: str = "a file") -> WeightsReport:
    """Copy a file's weights (`read_weights`) into a freshly built model, in place, and say what happened.

    - A tensor of the same name and shape is copied (cast to the model's dtype).
    - A 3-channel stem (a 4-D convolution weight (out, 3, k, k)) going into a 1-channel model (out, 1, k, k) is
      summed over colour: grayscale images then give the first layer what the colour network saw for gray pixels.
    - The classifier (`head_names`) stays as initialised when its shape differs: another class count.
    - Any other shape difference is a ValueError naming the tensor and both shapes: a different architecture.
    - The model's tensors that the file lacks stay as initialised and are listed: BN running statistics are
      harmless (static BN recomputes them from the hub's data), missing weights are reported as a warning, not an
      error, since a file may leave out parts on purpose (an extra layer, a new block). A file of which nothing
      matches is a ValueError: it is surely another network's.
    - The file's tensors that the model lacks are listed and ignored."""
    report = WeightsReport(source)
    state = model.state_dict()
    head = head_names(model, num_classes)
    for name, target in state.items():
        if name not in weights:
            report.missing.append(name)
            continue
        value = weights[name]
        if value.shape == target.shape:
            report.loaded.append(name)
        elif value.dim() == 4 and value.shape[1] == 3 and target.shape == (value.shape[0], 1, *value.shape[2:]):
            value = value.sum(dim=1, keepdim=True)
            report.summed_stem.append(name)
        elif name in head and value.dim() == target.dim() and value.shape[1:] == target.shape[1:]:
            report.head.append(name)
            report.head_classes = (int(value.shape[0]), int(target.shape[0]))
            continue
        else:
            hint = (" (set model.in_channels to the file's channel count)" if value.dim() == 4
                    and value.shape[0] == target.shape[0] and value.shape[2:] == target.shape[2:] else "")
            raise ValueError(f"initial weights from {source}: {name} has shape {tuple(value.shape)} in the file but "
                             f"{tuple(target.shape)} in model{hint}; the file is another architecture's or built "
                             "with other options")
        target.copy_(value.to(target.dtype))
    report.unexpected = [name for name in weights if name not in state]
    if not report.loaded and not report.summed_stem:
        raise ValueError(f"initial weights from {source}: no tensor name matches the model's (the file has e.g. "
                         f"{', '.join(list(weights)[:3])}; the model {', '.join(list(state)[:3])})")
    return report
