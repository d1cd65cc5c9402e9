"""silo-sim's staging process: check the options, read the images, stage the federation (image files, certificates,
hub.yaml). It is the only silo-sim process that imports torch for staging; silo-sim's own process starts it, starts
the hub and the silo hosts, and follows the run without torch, so the memory staging took (a torch import and the
data set, about 370 MB) is given back before the first round instead of held to the end.

It tells silo-sim two things as they happen, each one line on stdout starting with STAGING_EVENT, then JSON:
`hub_staged` once the hub's files and hub.yaml are written (silo-sim starts the hub and the silo hosts then, while
the silos' files are still being linked), and `staged` once everything is. Every other line is for the user.

    python -m silo_sim.prepare [silo-sim's options]     (run by silo-sim; --export-demo stages and explains)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silo_sim.cli import (
    DEMO_OPTIONS,
    apply_hub_settings,
    build_parser,
    check_secure_aggregation_fits,
    option_overrides,
    parse_options,
    rounds_sampling,
    silo_policies,
    validation_per_class,
)
from silo_sim.report import console
from silo_sim.staged import STAGING_EVENT


@dataclass
class Plan:
    """What the options come to once checked: the algorithm's options, the hub.yaml to stage, what to stage."""

    options: dict[str, Any]
    needs_silos: bool
    policies: dict[str, str]
    hub_config: dict[str, Any]
    stage_options: dict[str, Any]
    data: str  # --data: loaded only when staging (a kept federation needs no image read)
    image_size: int | None


def check(args) -> Plan:
    """Every option checked (the engine's already, by silo-sim) before anything is staged or started; a bad one is a
    ValueError naming it (bad --data: a DataError when staging reads it, still before the hub starts)."""
    from silo_core.algorithms import get_algorithm
    from silo_sim.attacks import check_attack

    entry = get_algorithm(args.algorithm)
    if args.silos < 1:
        raise ValueError("--silos must be at least 1")
    if args.attackers < 0 or args.attackers > args.silos:
        raise ValueError(f"--attackers must be between 0 and --silos ({args.silos}), got {args.attackers}")
    if args.attackers and not entry.hub.needs_silos:
        raise ValueError(f"--attackers needs silos, and {args.algorithm} runs at the hub alone")
    check_attack(args.attack, "--attack")
    policies = silo_policies(args.silo_policy, args.silos)  # a bad policy file fails here, naming the file and key
    if args.labeled_silos < 0 or args.labeled_silos > args.silos:
        raise ValueError("--labeled-silos must be between 0 and --silos")
    given = parse_options(args.option)
    options = {**DEMO_OPTIONS.get(args.algorithm, {}), **given}
    for line in option_overrides(args.algorithm, given):
        console.print(line, highlight=False)
    entry.options.model_validate(options)  # a bad --option fails here, with its name
    hub_config = {
        "run": {"seed": args.seed, "device": args.device, "threads": os.cpu_count() or 2},
        "algorithm": {"name": args.algorithm, "options": options},
        "model": {"name": args.model},  # its input size and channels: the data's (stage.write_hub_yaml)
        "wire": {"half_precision": args.half_precision},
        # With a Prometheus watching, stay up long enough for it to discover and scrape a short run.
        **({"server": {"linger_s": 30.0, "min_linger_s": 30.0}} if getattr(args, "prometheus_targets", None)
           else {}),
        "rounds": {"total": args.rounds, "min_silos": args.silos, "deadline_s": 900, **rounds_sampling(args)},
    }
    apply_hub_settings(hub_config, args.hub_set)
    check_secure_aggregation_fits(hub_config, args.silos)
    stage_options = {
        "num_silos": args.silos, "labels_per_class": args.labels_per_class, "partition": args.partition,
        "alpha": args.alpha, "classes_per_silo": args.classes_per_silo, "unlabeled_limit": args.unlabeled,
        "seed": args.seed, "hub_config": hub_config, "test_per_class": args.test_per_class,
        "validation_per_class": validation_per_class(args, entry.hub.needs_validation),
        "labeled_silos": args.labeled_silos, "silo_labels_per_class": args.silo_labels_per_class,
        "hub_host": args.hub_host,
    }
    return Plan(options, entry.hub.needs_silos, policies, hub_config, stage_options, args.data, args.image_size)


def tell(kind: str, **fields: Any) -> None:
    print(STAGING_EVENT + json.dumps({"kind": kind, **fields}), flush=True)


def export_demo(args, plan: Plan) -> None:
    from silo_sim.stage import load_source, stage_federation

    staged = stage_federation(args.export_demo, **plan.stage_options, source=load_source(plan.data, plan.image_size))
    print(f"staged a demo federation in {staged.root}:")
    print(f"  hub:   silo-server --config {staged.hub_config}   (port 0 = a free port, written to "
          f"{staged.hub_state_dir}/port and bound again on a restart; set server.port to fix it)")
    for s in staged.silos[:3]:
        data = (f"--data {s.data} " if s.data else "") + (f"--labeled {s.labeled} " if s.labeled else "")
        print(f"  silo:  silo-client {data}--certs {s.certs} --hub {args.hub_host}:PORT")
    if len(staged.silos) > 3:
        print(f"  ... and {len(staged.silos) - 3} more silos under {staged.root / 'silos'}")


def clear_run_state(root: Path) -> list[Path]:
    """Remove an earlier run's hub and silo state from a reused --workdir (its run.json, checkpoints, history,
    port files, quarantine, the silos' ledgers): a run never resumes another, or reads its ports. Returns what went."""
    root = Path(root)
    gone = [d for d in [root / "hub" / "state", *sorted(root.glob("silos/*/state"))] if d.is_dir()]
    for d in gone:
        shutil.rmtree(d)
    return gone


def stage(args, plan: Plan) -> None:
    from silo_sim.stage import load_source, stage_federation
    from silo_sim.staging_cache import describe, evict, federation_key, kept_federation, restore

    cleared = clear_run_state(args.workdir)  # before hub.yaml is written: the hub starts as soon as it is
    if cleared:
        console.print(f"removed the state of an earlier run in {args.workdir} ({len(cleared)} folders)")

    def hub_staged(hub_part) -> None:  # `kept`: the kept federation the run reads from (staging_cache.in_use)
        tell("hub_staged", staged=hub_part.to_json(), needs_silos=plan.needs_silos, kept=key)

    t0 = time.time()
    what = f"{args.silos} silos, {args.labels_per_class} hub labels per class and certificates"
    key = None if args.restage else federation_key(plan.data, plan.image_size, plan.stage_options)
    if key is None:
        source = load_source(plan.data, plan.image_size)
        console.print(f"staging {what} in {args.workdir} from {source.description} ...")
        staged = stage_federation(args.workdir, **plan.stage_options, source=source, hub_staged=hub_staged)
        reused = False
    else:
        with kept_federation(key) as (files, reused):
            if reused:
                staged, description = restore(args.workdir, files, hub_config=plan.hub_config,
                                              hub_host=args.hub_host, seed=args.seed, hub_staged=hub_staged)
                console.print(f"reusing {what} from {description} staged by an earlier run in {files} (--restage: "
                              f"afresh in --workdir); state and logs in {args.workdir}")
            else:
                source = load_source(plan.data, plan.image_size)
                console.print(f"staging {what} from {source.description} in {files}, kept for later runs with "
                              f"the same data and options (--restage: in --workdir); state and logs in "
                              f"{args.workdir} ...")
                staged = stage_federation(args.workdir, **plan.stage_options, source=source, hub_staged=hub_staged,
                                          files=files)
                describe(files, source, staged)
    console.print(f"{'ready' if reused else 'staged'} in {time.time() - t0:.1f}s; the hub started meanwhile; "
                  f"{args.silos} silos join over mutual TLS")
    tell("staged", staged=staged.to_json(), options=plan.options, policies=plan.policies,
         needs_silos=plan.needs_silos)
    if key is not None and not reused:
        evict()  # after the run has what it needs: removing an old federation's links takes a second


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        plan = check(args)
        if args.export_demo:
            export_demo(args, plan)
        elif args.workdir is None:
            raise ValueError("the staging process needs --workdir (silo-sim passes it)")
        else:
            stage(args, plan)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
