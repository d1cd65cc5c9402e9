"""What silo-sim shows: its console, the server-only baseline trained on the same labels, and the summary table of
a run's rounds."""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from silo_core.rounds import RoundRecord, Scores, nan_if_none
from silo_core.selection import BestRound

console = Console(stderr=False)
if not console.is_terminal:  # logs and pipes: wide enough that the summary table is never truncated
    console = Console(stderr=False, width=120)


def server_only_baseline(staged, options: dict[str, Any], rounds: int, seed: int, device: str,
                         rounds_run: int | None = None) -> dict[str, Any]:
    """The hub alone on the same labels, same model, same hub-side schedule: what the silos must beat. A run that
    ended before its last round (its privacy budget spent) is compared after as many rounds (`rounds_run`), on the
    schedule of all `rounds`, as its hub ran them: a baseline trained to the end had more hub epochs than the run."""
    import torch

    from silo_core.algorithms.base import HubData
    from silo_core.algorithms.server_only import ServerOnlyHub
    from silo_core.data import load_labeled_folder
    from silo_core.models import ModelSpec, starting_weights
    from silo_core.training import evaluate, resolve_device
    from silo_server.config import load_config

    torch.set_num_threads(os.cpu_count() or 2)
    # The staged hub.yaml's model, built as the hub builds it (the staged data's size, channels, normalisation).
    config = load_config(staged.hub_config)
    size, channels = config.model.image_size, config.model.in_channels
    # The folders hub.yaml names: under the workdir, or in a federation kept by an earlier run (staging_cache).
    labeled = load_labeled_folder(config.data.labeled.path, size, channels)
    test = load_labeled_folder(config.data.test.path, size, channels)
    spec = ModelSpec.from_config(config.model, len(labeled.classes))
    opts, left_out = baseline_options(options)
    if left_out:
        console.print(f"server-only baseline: {', '.join(left_out)} of the run's options cannot apply to it; "
                      f"its default used ({', '.join(f'{k}={getattr(opts, k)}' for k in left_out)})")
    dev = resolve_device(device)
    algo = ServerOnlyHub(opts, spec, HubData(labeled.images, labeled.labels), dev, seed, rounds)
    start = starting_weights(config.model.init_from_run, config.model.init_weights, spec)
    if start is not None:  # from the run's own starting model, as its hub trained
        algo.initial_weights = start[0]
    state = algo.init_state()
    started = time.time()
    ran = rounds if rounds_run is None else min(rounds_run, rounds)
    for _ in range(ran):
        state, _ = algo.finish_round(state, {}, {})
    result = evaluate(algo.served_model(state), test.images, test.labels, spec.mean, spec.std, dev)
    return {"algorithm": "server-only", "test_accuracy": result["accuracy"], "test_loss": result["loss"],
            "seconds": time.time() - started, "rounds": ran}


def baseline_options(options: dict[str, Any]):
    """ServerOnlyOptions from the hub-side knobs the run's algorithm shares with server-only (epochs, lr, ...),
    and the shared names whose value server-only cannot take (FedSEAL's lr_schedule exponential, say): those keep
    server-only's default, so a run that trained every round still gets its baseline and summary."""
    from pydantic import ValidationError

    from silo_core.algorithms.server_only import ServerOnlyOptions

    shared = {k: v for k, v in options.items() if k in ServerOnlyOptions.model_fields}
    try:
        return ServerOnlyOptions.model_validate(shared), []
    except ValidationError as err:
        left_out = sorted({str(e["loc"][0]) for e in err.errors() if e["loc"]})
        return ServerOnlyOptions.model_validate({k: v for k, v in shared.items() if k not in left_out}), left_out


def summary_table(history: list[RoundRecord], baseline: dict[str, Any] | None, algorithm: str,
                  initial: Scores | None = None) -> Table:
    table = Table(title=f"silo-sim: {algorithm}")
    table.add_column("round", justify="right", no_wrap=True, min_width=11)
    best = BestRound.from_history(history, initial)  # the round the hub kept as best_model.safetensors
    if best.found and best.round:
        table.caption = f"* best round on the hub's validation split: {best.round} (kept as best_model.safetensors)"
    elif best.found:
        table.caption = ("* best on the hub's validation split: the initial model (no round beat the hub's labels "
                         "alone; best_model.safetensors holds it)")
    private = any(h.dp is not None for h in history)  # the privacy spent, beside what it cost in accuracy
    # Silos left out of the sample that were handed the round's model (FedSEAL's ensemble_every_round)
    broadcast = any(h.silos_received for h in history)
    for col in ("test acc", *(("val acc",) if best.found else ()), "PL ratio", "PL acc", "silos",
                *(("received",) if broadcast else ()), "round time", "bytes up", "bytes down",
                *(("epsilon",) if private else ())):
        table.add_column(col, justify="right", no_wrap=True)
    if initial is not None and initial != Scores():  # the hub's model before any silo took part
        table.add_row("0 (initial)", f"{nan_if_none(initial.test_accuracy):.4f}",
                      *((f"{nan_if_none(initial.validation_accuracy):.4f}{'*' if best.round == 0 else ' '}",)
                        if best.found else ()),
                      "-", "-", "-", *(("-",) if broadcast else ()), "-", "-", "-",
                      *(("-",) if private else ()), style="dim")
    for h in history:
        validation = ((f"{nan_if_none(h.scores.validation_accuracy):.4f}{'*' if h.round == best.round else ' '}",)
                      if best.found else ())
        table.add_row(
            str(h.round), f"{nan_if_none(h.scores.test_accuracy):.4f}", *validation,
            f"{h.pseudo_label_ratio:.3f}" if h.pseudo_label_ratio is not None else "-",
            f"{h.pseudo_label_accuracy:.3f}" if h.pseudo_label_accuracy is not None else "-",
            f"{h.silos_reported or 0}/{h.silos_sampled or 0}",
            *((f"{h.silos_received or 0} ({_human(h.bytes_down_received or 0)})",) if broadcast else ()),
            f"{h.round_seconds or 0:.1f}s",
            _human(h.bytes_up or 0), _human(h.bytes_down or 0), *((_epsilon(h),) if private else ()),
        )
    if baseline:
        table.add_row("server-only", f"{baseline['test_accuracy']:.4f}", *(("-",) if best.found else ()), "-", "-",
                      "-", *(("-",) if broadcast else ()), f"{baseline['seconds']:.1f}s", "-", "-",
                      *(("-",) if private else ()), style="dim")
    return table


def _epsilon(record: RoundRecord) -> str:
    """Epsilon spent after the round, and the budget when there is one."""
    dp = record.dp
    if dp is None:
        return "-"
    return f"{dp.epsilon:.2f}" + (f" / {dp.epsilon_budget:g}" if dp.epsilon_budget is not None else "")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"
