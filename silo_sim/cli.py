"""silo-sim: a hub and N silos on this machine, over the real wire stack (gRPC, mutual TLS, real image files).

With no arguments it runs the demo: the bundled Fashion-MNIST subset, SemiFL, a few rounds tuned to finish in a few
minutes on two CPU cores, then a summary table beside the server-only baseline trained on the same labels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from silo_sim.federation import Launched, launch, read_history, run_federation, terminate
from silo_sim.launcher import Launcher
from silo_sim.report import console, server_only_baseline, summary_table
from silo_sim.staged import DATA_HELP, STAGING_EVENT, StagedFederation

# Demo defaults: tuned so the whole demo takes a few minutes on 2 CPU cores and shows what silos add. They differ
# from the paper's (which needs hundreds of rounds): tau 0.8 instead of 0.95 lets pseudo-labels cover more classes
# early, a constant LR keeps the hub's fine-tune effective to the last round, and fewer, larger local batches keep
# a round short on a CPU. hub.yaml defaults stay the paper's. Every algorithm gets the same budget: 5 hub epochs
# on the labels before round 1 and per round, 2 local epochs, lr 0.03, so the sim compares like with like.
_SEMIFL_DEMO: dict[str, Any] = {
    "tau": 0.8,
    "hub_epochs": 5,
    "local_epochs": 2,
    "silo_batch_size": 32,
    "hub_batch_size": 16,
    "lr": 0.03,
    "lr_schedule": "constant",
}
_FEDAVG_DEMO: dict[str, Any] = {"init_epochs": 5, "hub_epochs": 5, "local_epochs": 2, "silo_batch_size": 32,
                                "hub_batch_size": 16, "lr": 0.03, "lr_schedule": "constant"}
DEMO_OPTIONS: dict[str, dict[str, Any]] = {
    "semifl": _SEMIFL_DEMO,
    "server-only": _SEMIFL_DEMO,
    "fedseal": {**_FEDAVG_DEMO, "nesterov": True},
    "fedavg-fixmatch": {**_FEDAVG_DEMO, "tau": 0.8},
    "supervised": _FEDAVG_DEMO,
    "hassle": {"hub_warmup_epochs": 5, "hub_epochs": 5, "hub_batch_size": 16, "local_epochs": 2, "batch_size": 32,
               "lr": 0.03, "lr_schedule": "constant"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silo-sim", description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, default=4, help="number of simulated silos (default 4; up to 100+)")
    p.add_argument("--rounds", type=int, default=20, help="communication rounds (default 20)")
    p.add_argument("--algorithm", default="semifl",
                   help="semifl, fedseal, hassle, server-only, fedavg-fixmatch or supervised (the simulation-only "
                        "ceiling: silos train on their true labels)")
    p.add_argument("--labels-per-class", type=int, default=25, help="labeled images per class at the hub (default 25)")
    p.add_argument("--unlabeled", type=int, default=None,
                   help="unlabeled images spread over the silos (default: all 6000 bundled minus the hub's labels)")
    p.add_argument("--test-per-class", type=int, default=None, metavar="N",
                   help="evaluate on N test images per class (default: all 2000 bundled test images)")
    p.add_argument("--partition", choices=["iid", "classes", "dirichlet"], default="iid")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet alpha (with --partition dirichlet)")
    p.add_argument("--classes-per-silo", type=int, default=2, help="with --partition classes")
    per_round = p.add_mutually_exclusive_group()
    per_round.add_argument("--silos-per-round", type=float, metavar="FRACTION",
                           help="fraction of the silos sampled each round, in (0, 1] (default 1.0: all)")
    per_round.add_argument("--silos-per-round-count", type=int, metavar="N",
                           help="number of silos sampled each round (instead of a fraction)")
    p.add_argument("--labeled-silos", type=int, default=0, metavar="K",
                   help="the first K silos are partly labeled (HASSLE trains on their labels; default 0)")
    p.add_argument("--silo-labels-per-class", type=int, default=5, metavar="N",
                   help="labeled images per class kept by each partly labeled silo (default 5)")
    p.add_argument("--attackers", type=int, default=0, metavar="K",
                   help="simulation only: the first K silos poison their updates after honest training, to measure "
                        "hub.yaml aggregation.rule (default 0; see --attack)")
    p.add_argument("--attack", default="sign_flip", metavar="KIND",
                   help="with --attackers: sign_flip sends -10 x the honest model change, noise a Gaussian model "
                        "change of deviation 1 per weight, weight a weight of -30 x its own (refused in the clear; "
                        "under secure aggregation the hub finds and quarantines it) (silo_sim/attacks.py; default "
                        "sign_flip)")
    p.add_argument("--silo-policy", action="append", default=[], metavar="[N=]FILE",
                   help="a branch privacy policy (branch-policy.yaml, as silo-client --policy) for every silo, or "
                        "with N= for silo N only (1-based; repeatable, the specific one wins): the silo refuses a run "
                        "whose terms fall short of it before reading any image (the hub waits for every silo: add "
                        "--hub-set rounds.min_silos=N for the others to train without it)")
    p.add_argument("--validation-per-class", type=int, default=None, metavar="N",
                   help="held-out labeled validation images per class at the hub: the hub scores every round on "
                        "them and keeps the best round's model (best_model.safetensors); staged with 20 per class "
                        "for algorithms that need one (FedSEAL's thresholds) even when not given")
    p.add_argument("--workers", type=int,
                   help="silo hosts: worker processes, or Ray actors with --engine ray (default: one per CPU core, "
                        "with --engine ray as many as the cluster holds at --silo-cpus/--silo-gpus; at most --silos)")
    p.add_argument("--load-at-join", action="store_true",
                   help="each silo decodes its images before it joins, as silo-client does (default: a silo joins on "
                        "its file count and decodes them when first sampled, so silos a run never samples cost no "
                        "decoding and round 1 starts sooner)")
    p.add_argument("--engine", choices=["workers", "ray"], default="workers",
                   help="what hosts the silos: worker processes on this machine (default) or Ray actors (the ray "
                        'extra: pip install -e ".[ray]"); the hub is a local process either way')
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="with --engine ray: join this Ray cluster (e.g. 127.0.0.1:6379) instead of starting and "
                        "stopping a local Ray")
    p.add_argument("--silo-cpus", type=float, metavar="N",
                   help="with --engine ray: CPUs each silo host actor requests, the share of one silo at work "
                        "(fractions allowed; default 1)")
    p.add_argument("--silo-gpus", type=float, metavar="N",
                   help="with --engine ray: GPUs each silo host actor requests (fractions allowed; default 0)")
    p.add_argument("--ship-silo-files", action="store_true",
                   help="with --engine ray: send each actor its silos' certificates, images and branch policies "
                        "(one archive per actor, unpacked in a temporary folder on its node and removed after), for "
                        "a cluster whose nodes do not share this machine's file system")
    p.add_argument("--hub-host", default="127.0.0.1", metavar="HOST",
                   help="the address the hub listens on and the silos dial (default 127.0.0.1: this machine only); "
                        "for Ray actors on other machines, an address of this machine they can reach. The hub's "
                        "certificate names it")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="algorithm option (repeatable), e.g. --option tau=0.9 --option local_epochs=2")
    p.add_argument("--hub-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="set a hub.yaml key (YAML value), e.g. privacy.secure_aggregation.enabled=true; repeatable; "
                        "not those silo-sim's own flags set (run.state_dir, run.seed, rounds.total, algorithm.name, "
                        "data)")
    p.add_argument("--model", choices=["small_cnn", "wrn28_2"], default="small_cnn",
                   help="network (both take any image size, grayscale or colour)")
    p.add_argument("--data", default="demo", metavar="SOURCE", help=f"the images: {DATA_HELP}")
    p.add_argument("--image-size", type=int, metavar="PIXELS",
                   help="the side the model takes (default: the data's, e.g. 28 for Fashion-MNIST, 32 for CIFAR-10, "
                        "a folder's first image)")
    p.add_argument("--half-precision", action="store_true", help="send the model to silos as float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, help="write summary.json (every round's metrics, baseline, settings) here")
    p.add_argument("--workdir", type=Path,
                   help="the run's hub.yaml, state and logs, kept (default: a temp dir, removed); the silos' images "
                        "and the certificates come from a federation staged by an earlier run with the same data "
                        "and options when there is one (kept under the cache, see --restage)")
    p.add_argument("--restage", action="store_true",
                   help="stage every image folder and certificate into --workdir afresh instead of reusing a "
                        "federation kept by an earlier run (the demo and torchvision data sets are kept; a folder "
                        "of your own images is always staged afresh)")
    p.add_argument("--export-demo", type=Path, metavar="DIR",
                   help="only stage the demo federation (images, certificates, hub.yaml) in DIR and print how to run it")
    p.add_argument("--no-baseline", action="store_true", help="skip the server-only baseline")
    p.add_argument("--prometheus-targets", type=Path, metavar="DIR",
                   help="write Prometheus file_sd target files (hub.yml, silos.yml) for the hub's and the workers' "
                        "/metrics endpoints here, e.g. ops/prometheus/targets (see docs/operations.md)")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option {pair!r} must look like KEY=VALUE")
        key, raw = pair.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def option_overrides(algorithm: str, given: dict[str, Any]) -> list[str]:
    """One line per --option that replaces a value the demo sets for this algorithm (DEMO_OPTIONS), so that a
    user comparing runs knows which of their values took the place of the demo's tuning."""
    demo = DEMO_OPTIONS.get(algorithm, {})
    return [f"--option {key}={json.dumps(value)} overrides the demo's {key}={json.dumps(demo[key])} for {algorithm}"
            for key, value in given.items() if key in demo and demo[key] != value]


def silo_policies(values: list[str], silos: int) -> dict[str, str]:
    """--silo-policy [N=]FILE values as silo name -> policy file; each file is loaded once here, so a bad one fails
    before anything starts, naming the file and the key."""
    from silo_client.policy import load_policy
    from silo_sim.stage import silo_name

    every, one = None, {}
    for value in values:
        index, sep, path = value.partition("=")
        if not sep:
            index, path = "", value
        elif not index.isdigit() or not 1 <= int(index) <= silos:
            raise ValueError(f"--silo-policy {value!r}: N must be a silo number from 1 to --silos ({silos})")
        load_policy(Path(path))
        if index:
            one[silo_name(int(index))] = str(Path(path).resolve())
        else:
            every = str(Path(path).resolve())
    return {silo_name(i): one.get(silo_name(i), every) for i in range(1, silos + 1)
            if one.get(silo_name(i), every) is not None}


def rounds_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The hub.yaml key for --silos-per-round or --silos-per-round-count (none: the hub's default, every silo).
    Only the given one is set, so --hub-set can still choose the other."""
    if args.silos_per_round is not None:
        if not 0 < args.silos_per_round <= 1:
            raise ValueError(f"--silos-per-round is a fraction in (0, 1], got {args.silos_per_round:g}; for a "
                             f"number of silos use --silos-per-round-count")
        return {"silos_per_round": args.silos_per_round}
    if args.silos_per_round_count is not None:
        if args.silos_per_round_count < 1:
            raise ValueError("--silos-per-round-count must be at least 1")
        return {"silos_per_round_count": args.silos_per_round_count}
    return {}


def validation_per_class(args: argparse.Namespace, needed: bool) -> int | None:
    """Images per class of the hub's validation split: as given, else 20 where the algorithm needs one."""
    if args.validation_per_class is not None:
        if args.validation_per_class < 0:
            raise SystemExit("--validation-per-class must be 0 or more")
        return args.validation_per_class or None
    return 20 if needed else None


# hub.yaml keys silo-sim sets from its own flags and reads back itself (where the hub's state is, how many rounds
# its progress and baseline cover, which seed and algorithm its baseline uses, the data it staged): --hub-set on
# one of them would change the hub alone, and the simulator would wait on, or compare against, the wrong thing.
OWNED_HUB_KEYS = {"run.state_dir": "--workdir (the hub's state is WORKDIR/hub/state)", "run.seed": "--seed",
                  "rounds.total": "--rounds", "algorithm.name": "--algorithm", "data": "the staging flags "
                  "(--data, --labels-per-class, --test-per-class, ...)"}


def apply_hub_settings(config: dict[str, Any], pairs: list[str]) -> dict[str, Any]:
    """--hub-set privacy.dp.enabled=true: set one hub.yaml key (a dotted path) to a YAML value, in place.
    The result is checked like a hub.yaml, so a typo fails here with the key named."""
    from silo_server.config import parse_config

    for pair in pairs:
        path, sep, raw = pair.partition("=")
        keys = path.split(".")
        if not sep or len(keys) < 2 or not all(keys):
            raise ValueError(f"--hub-set {pair!r} must look like SECTION.KEY=VALUE, e.g. "
                             "privacy.secure_aggregation.enabled=true")
        owner = next((flag for key, flag in OWNED_HUB_KEYS.items() if path == key or path.startswith(key + ".")),
                     None)
        if owner is not None:
            raise ValueError(f"--hub-set {path}: silo-sim sets this key itself; use {owner}")
        node = config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"--hub-set {path}: {key} is a value, not a section")
        node[keys[-1]] = yaml.safe_load(raw)
    parse_config({**config, "data": {"labeled": {"kind": "demo"}}}, source="--hub-set")
    return config


def check_secure_aggregation_fits(config: dict[str, Any], silos: int) -> None:
    """A federation too small for secure aggregation's dropout tolerance would wait for silos that never come."""
    from security.secagg import SecAggParams

    section = config.get("privacy", {}).get("secure_aggregation", {})
    if not section.get("enabled"):
        return
    params = SecAggParams.model_validate(section)
    fewest = params.fewest_sampled()
    if silos < fewest:
        raise ValueError(f"secure aggregation needs at least {fewest} silos in a round to survive {params.dropouts} "
                         f"dropout(s) and hold min_cohort {params.min_cohort}; run --silos {fewest} or more, or "
                         "accept no dropout tolerance with --hub-set privacy.secure_aggregation.dropouts=0 (and a "
                         "smaller privacy.secure_aggregation.min_cohort)")


class Staging:
    """The staging process (silo_sim/prepare.py, `python -m silo_sim.prepare` with this command's options), forked
    from the launcher: what it says to the user is passed on as it comes, its events (STAGING_EVENT lines) are
    handed to the caller."""

    def __init__(self, launcher: Launcher, argv: list[str]):
        self.proc = launcher.start_piped("silo_sim.prepare", argv, "silokit-staging")
        self.errors = threading.Thread(target=self._pass_errors_on, daemon=True)
        self.errors.start()

    def _pass_errors_on(self) -> None:
        for line in self.proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()

    def events(self) -> Iterator[dict[str, Any]]:
        for line in self.proc.stdout:
            if line.startswith(STAGING_EVENT):
                yield json.loads(line[len(STAGING_EVENT):])
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    def wait(self) -> int:
        rc = self.proc.wait()
        self.errors.join(timeout=5)
        return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    # SIGTERM unwinds like Ctrl-C would, so the hub and the workers this process started are stopped too.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = None
    launched: list[Launched] = []
    staging = None
    using = contextlib.ExitStack()
    try:
        # Checking the options and staging run in a process of their own (they import torch and hold the data set);
        # this one starts the hub and the silo hosts when it is told the hub's part is staged, then follows the run.
        from silo_sim.ray_engine import check_engine_args  # imports Ray only for --engine ray

        check_engine_args(args)
        if not args.export_demo:
            workdir = args.workdir or Path(tempfile.mkdtemp(prefix="silo-sim-"))
        launcher = Launcher()  # imports torch and silokit once, for the staging process, the hub and the hosts
        staging = Staging(launcher, argv + ([] if args.export_demo else ["--workdir", str(workdir)]))
        done = None
        for event in staging.events():
            if event["kind"] == "hub_staged":
                if event.get("kept"):  # held until this run ends: no other run's eviction removes its files
                    from silo_sim.staging_cache import in_use

                    using.enter_context(in_use(event["kept"]))
                args.needs_silos = event["needs_silos"]
                launched.append(launch(StagedFederation.from_json(event["staged"]), args, launcher))
            elif event["kind"] == "staged":
                done = event
                break  # the staging process is done; round 1 need not wait for it to exit
        if done is None:  # it failed (and said why), or it only exported the demo
            return staging.wait()
        staged, options, cores = StagedFederation.from_json(done["staged"]), done["options"], os.cpu_count() or 2
        _, history, seconds = run_federation(staged, args, args.rounds, launched[0], done["policies"])
        staging.wait()
        baseline = None
        if not args.no_baseline and args.algorithm != "server-only":  # server-only IS the baseline
            console.print("training the server-only baseline on the same labels ...")
            baseline = server_only_baseline(staged, options, args.rounds, args.seed, args.device,
                                            rounds_run=history[-1].round if history else 0)
        _, initial = read_history(staged.hub_state_dir / "history.json")
        console.print(summary_table(history, baseline, args.algorithm, initial))
        final = history[-1] if history else None
        if baseline and final:
            accuracy = final.scores.test_accuracy or 0.0
            gain = 100 * (accuracy - baseline["test_accuracy"])
            verdict = "above" if gain > 0 else "NOT above"
            early = (f" after the same {baseline['rounds']} of {args.rounds} rounds (the run ended early)"
                     if baseline["rounds"] < args.rounds else "")
            console.print(f"{args.algorithm} final test accuracy {accuracy:.4f} is "
                          f"{verdict} server-only {baseline['test_accuracy']:.4f}{early} ({gain:+.1f} points); "
                          f"federated run took {seconds:.0f}s")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            summary = {
                "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                             "algorithm_options": options, "cores": cores},
                "initial": initial.to_json(),
                "rounds": [r.to_json() for r in history],
                "baseline": baseline,
                "final": final.to_json() if final else {},
                "federated_seconds": seconds,
            }
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
            console.print(f"summary written to {args.out / 'summary.json'}")
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if staging is not None and staging.proc.poll() is None:
            terminate([staging.proc])
        for early in launched:  # stopped already unless staging failed after they started
            terminate(early.procs)
        if workdir is not None and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        using.close()


if __name__ == "__main__":
    sys.exit(main())
