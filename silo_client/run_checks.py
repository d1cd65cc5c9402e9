"""What a silo checks about a run before it takes part, on what the run description says and what this silo holds:
its data fits the algorithm, its model is one this branch allows and builds the same as the hub's, the device runs
it (a rehearsal), an update's least size on the wire. Raises SiloError with what to do."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from silo.v1 import silo_pb2
from silo_client.errors import SiloError
from silo_client.policy import Refusal
from silo_core.algorithms.base import SiloAlgorithm, SiloData
from silo_core.augment import to_float
from silo_core.data import DataError, count_labeled_files, describe_classes, image_batches, same_classes
from silo_core.data import count_image_files as count_listed_images
from silo_core.dp_sgd import sample_dp_unfit
from silo_core.models import ModelSpec, TensorShape, architecture, architecture_difference
from silo_core.training import autocast, on_device


def described(run: silo_pb2.RunDescription) -> bytes:
    """The run description less the hub's wire setting (chunk_bytes, which a restarted hub may change): what a
    silo's checks of a run (its policy, the model it may build) were made on."""
    copy = silo_pb2.RunDescription()
    copy.CopyFrom(run)
    copy.chunk_bytes = 0
    return copy.SerializeToString(deterministic=True)


def guards_against_hub(dp: silo_pb2.ClientDPTerms) -> bool:
    """Client-level DP protects this silo from the hub only when the silos add the noise themselves (distributed);
    central noise is added by the hub after it has seen the sum, so against the hub it guarantees nothing."""
    return dp.enabled and dp.noise == "distributed"


def tells_clear_facts(terms: silo_pb2.PrivacyTerms) -> bool:
    """Whether a Join may tell the run this branch's device and count of unreadable files: clear facts about the
    branch that no aggregation needs, kept from a run whose pinned terms ask for no clear metrics or protect its
    rounds (secure aggregation, DP), as every clear per-silo metric is (a policy's clear_metrics: false blanks them
    too, in the Outbox)."""
    private = terms.secure_aggregation.enabled or terms.client_dp.enabled or terms.sample_dp.enabled
    return bool(terms.clear_metrics) and not private


def sample_dp_unkept(run: silo_pb2.RunDescription, silo: type[SiloAlgorithm]) -> Refusal | None:
    """A run whose terms state sample-level DP that this silo's own training would not carry out (an algorithm
    without DP-SGD, learnt class thresholds, ...): its updates would leave without it, so the silo refuses the run
    rather than take the hub's word (silo_core.dp_sgd.sample_dp_unfit, the check the hub's config makes too)."""
    if not run.terms.sample_dp.enabled:
        return None
    unfit = sample_dp_unfit(run.algorithm, silo.supports_sample_dp, json.loads(run.algorithm_options_json or "{}"),
                            json.loads(run.model_options_json or "{}"))
    if unfit is None:
        return None
    return Refusal("refused", "terms", "sample-level DP as the terms state", "training without it",
                   f"the run's terms state sample-level DP (DP-SGD), which this silo's training would not carry "
                   f"out, so its updates would leave without it: {unfit}")


def least_update_bytes(run: silo_pb2.RunDescription) -> int:
    """The fewest bytes one update of the run's model can take on the wire: every floating-point parameter of its
    architecture (batch-norm statistics left out) in float16, the most compact the wire allows. A policy's
    max_upload_bytes below it refuses the run at join; each real upload is checked exactly at the Outbox."""
    sizes = {"float32": 2, "float16": 2, "bfloat16": 2, "float64": 2}
    total = 0
    for t in run.architecture:
        if t.dtype in sizes and not t.name.endswith(("running_mean", "running_var")):
            n = 1
            for d in t.shape:
                n *= d
            total += n * sizes[t.dtype]
    return total


def check_upload_fits(run: silo_pb2.RunDescription) -> None:
    """An update of the run's model must fit the hub's own cap on one upload (run.max_upload_bytes): else every
    upload would be refused as oversized after the silo trained. Refused at join instead, naming both sizes."""
    least = least_update_bytes(run)
    if run.max_upload_bytes and least > run.max_upload_bytes:
        raise SiloError(f"one update of the run's model takes at least {least:,} bytes on the wire, above the hub's "
                        f"cap of {run.max_upload_bytes:,} bytes per upload (wire.max_upload_bytes): no update from "
                        f"this silo could be accepted; ask the hub's operator to raise it")


def count_image_files(root: Path, flag: str = "--data") -> int:
    """The images in the folder given with `flag` (--data or --labeled), whose name the error gives: for
    --labeled, those inside its class folders (the ones it trains on)."""
    if not root.is_dir():
        what = "the folder of this silo's images" if flag == "--data" else "a folder of labeled images"
        raise DataError(f"{flag} folder {root} does not exist; pass {flag} with {what}")
    return count_listed_images(root) if flag == "--data" else count_labeled_files(root)


def check_labeled_classes(folder: Path, classes: list[str], run: silo_pb2.RunDescription) -> None:
    """A silo's own labeled folder (--labeled) must name the run's classes in the hub's order: its labels are
    positions in its sorted class folders, so other names (or another order, such as "Malignant" sorting before
    "benign") would train the run on labels that mean other classes. A hub that predates run.classes: the count."""
    if run.classes:
        if not same_classes(classes, list(run.classes)):
            raise SiloError(f"labeled folder {folder} has classes {describe_classes(classes)} but the run has "
                            f"{describe_classes(list(run.classes))}; name one sub-folder per class exactly as the hub "
                            f"does (an empty folder for a class this site has no images of)")
    elif len(classes) != run.num_classes:
        raise SiloError(f"labeled folder {folder} has {len(classes)} class folders but the run has {run.num_classes} "
                        f"classes; give it one sub-folder per class, in the hub's order (an empty folder for a class "
                        f"this site has no images of)")


def check_data_for(algorithm: str, silo: type[SiloAlgorithm], data: SiloData) -> None:
    """Refuse, with what to do, a run this silo's data cannot take part in."""
    check_counts_for(algorithm, silo, len(data.images), data.num_labeled, data.true_labels is not None)


def check_counts_for(algorithm: str, silo: type[SiloAlgorithm], num_unlabeled: int, num_labeled: int,
                     has_true_labels: bool) -> None:
    """check_data_for on counts: also what a silo that loads when sampled can tell from its files at join."""
    if silo.needs_true_labels and not has_true_labels:
        raise SiloError(f"algorithm {algorithm} is the fully supervised ceiling: it trains on the silos' TRUE labels, "
                        f"which only a simulation has (silo-sim passes them); a real silo cannot take part")
    has_unlabeled = num_unlabeled > 0 and silo.trains_on_unlabeled
    has_labeled = num_labeled > 0 and silo.trains_on_labeled
    if not (has_unlabeled or has_labeled):
        need = "--data (unlabeled images)" + (" or --labeled" if silo.trains_on_labeled else "")
        raise SiloError(f"algorithm {algorithm} has nothing to train on at this silo; pass {need}")


def check_model_allowed(run: silo_pb2.RunDescription, allowed: tuple[str, ...]) -> None:
    """A run built by a model factory is joined only when this silo's own operator named that factory: a silo
    never imports code because the hub named it."""
    if run.model_factory and run.model_factory not in allowed:
        named = f" (this silo allows only {', '.join(allowed)})" if allowed else ""
        raise SiloError(f"the hub's run builds its model with the factory {run.model_factory}, and this silo imports "
                        f"no code because the hub names it{named}. If you trust that code and have its package "
                        f"installed here, restart with --model-factory {run.model_factory}")


def check_architecture(run: silo_pb2.RunDescription, spec: ModelSpec) -> None:
    """This silo's build of the run's model must be the hub's, tensor for tensor (another torchvision or timm
    version, or another copy of a factory, can change it): refuse before training, naming the first difference."""
    if not run.architecture:
        return
    expected = [TensorShape(t.name, tuple(t.shape), t.dtype) for t in run.architecture]
    difference = architecture_difference(expected, architecture(spec.build()))
    if difference:
        raise SiloError(f"this silo builds a different {spec.label} than the hub: {difference}. Install the same "
                        f"versions of torch/torchvision/timm and of the model's package as the hub")


def model_spec_of(run: silo_pb2.RunDescription) -> ModelSpec:
    return ModelSpec.from_run(run)


def data_key(run: silo_pb2.RunDescription) -> tuple[int, int]:
    """What the loaded images depend on: a run with another image size or channel count needs them loaded again."""
    return (run.image_size, run.in_channels)


def rehearse(spec: ModelSpec, data: SiloData, device: torch.device, batch_size: int = 32) -> None:
    """One throwaway training step and one inference batch of the run's network on a few of this silo's images,
    before it reports ready: a device that cannot run the model fails at start-up with a clear error rather than
    in round 1, and a fresh process's one-off costs (CUDA context, kernel choice, first memory) are paid before the
    hub starts timing rounds. Runs on a fork of the random state, so it changes nothing that training draws."""
    images = data.images if len(data.images) else data.labeled_images
    if images is None or len(images) == 0:
        return
    # Read in this process: one batch is not worth starting loader workers for.
    _, pixels = next(image_batches(images, [torch.arange(min(batch_size, len(images)))], workers=0))
    if len(pixels) == 0:
        return  # the first files turned out unreadable (counted); the first round will try the device
    try:
        with torch.random.fork_rng(devices=[]):
            model = on_device(spec.build(), device).train()  # as training runs it (autocast, memory format)
            x = to_float(pixels, spec.mean, spec.std).to(device)
            x = x if len(x) > 1 else x.repeat(2, 1, 1, 1)  # batch norm trains on two images at least
            with autocast(device):
                loss = model(x).logsumexp(1).mean()
            loss.backward()
            with torch.no_grad(), autocast(device):
                model.eval()(x)
    except (RuntimeError, ValueError) as err:
        raise SiloError(f"could not run the run's model ({spec.name}) on device {device}: {err}; check the device, "
                        f"or pass --device cpu") from None


class ProcessChecks:
    """Start-up checks whose outcome depends on the run and on this process (its libraries, its device), not on
    which silo asks: the architecture fingerprint and the rehearsal. One silo-client process pays them once, as
    before; a silo-sim host with hundreds of silos pays them once instead of once a silo (at 1,000 silos they were
    a third of the time to round 1). A failed check is not remembered: every silo that tries it fails alike."""

    def __init__(self) -> None:
        self._passed: set[tuple] = set()
        self._lock = threading.Lock()

    def once(self, key: tuple, check: Callable[[], None]) -> None:
        with self._lock:
            if key in self._passed:
                return
        check()
        with self._lock:
            self._passed.add(key)


PROCESS_CHECKS = ProcessChecks()
