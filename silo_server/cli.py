"""silo-server --config hub.yaml: run the hub of a federation."""

from __future__ import annotations

import argparse
import ctypes
import io
import logging
import sys

from security.grpc_logs import quiet_grpc_core
from silo_core.data import DataError
from silo_core.rounds import Scores, nan_if_none
from silo_server.config import ConfigError, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silo-server", description="Run the hub of a silokit federation.")
    p.add_argument("--config", required=True, help="path to hub.yaml (see examples/hub.yaml)")
    p.add_argument("--port", type=int, help="override server.port (0 picks a free port)")
    p.add_argument("--metrics-port", type=int, help="override metrics.port (0 picks a free port)")
    p.add_argument("--check", action="store_true",
                   help="validate the config, data, certificates and CRL, print the plan, exit")
    p.add_argument("--lift-quarantine", metavar="SILO",
                   help="let a silo quarantined for breaking the securely aggregated sum be sampled again (the running "
                        "hub notices at its next round), then exit")
    p.add_argument("--insecure-dev-only", action="store_true",
                   help="DEVELOPMENT ONLY: serve plaintext on 127.0.0.1 without certificates; silos declare their "
                        "id (silo-client --insecure-dev-only --silo-id NAME). Never with real data")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logs and full tracebacks on errors")
    return p


def share_malloc_arenas() -> None:
    """glibc gives each thread that allocates its own heap ("arena") and keeps what is freed there for that thread.
    Every gRPC thread that ever received a multi-MB upload then keeps about one upload's worth of memory: the hub's
    RSS grew by 548 MB from 10 to 100 silos with WRN-28-2 (bench/systems). Two shared arenas let freed upload
    buffers be reused by whichever thread receives next (bench/README.md, hub memory, has the current numbers).
    (Forcing large buffers to mmap instead, tried first, gives them back to the OS but page-faults every large
    tensor: evaluation ran 1.8x slower.)
    No-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The plan and results go to stdout, logs and errors to stderr. Piped (2>&1, tee, the systemd journal) stdout
    # is block-buffered while stderr writes each line at once, so an error came out before the plan lines printed
    # ahead of it: each stdout line goes out when printed instead.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    quiet_grpc_core(args.verbose)  # before anything imports grpc
    from security.tls import TlsError
    share_malloc_arenas()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(args.config)
        if args.port is not None:
            config.server.port = args.port
        if args.metrics_port is not None:
            config.metrics.port = args.metrics_port
        if args.lift_quarantine is not None:
            from silo_server.rounds.breaker import QuarantineList

            if not QuarantineList(config.run.state_dir).lift(args.lift_quarantine):
                print(f"error: silo {args.lift_quarantine} is not quarantined in {config.run.state_dir}",
                      file=sys.stderr)
                return 2
            print(f"silo {args.lift_quarantine} may be sampled again (the hub notices at its next round)")
            return 0
        from silo_server.app import HubApp  # heavy imports (torch) only after the config is known good
        from silo_server.rounds.privacy import plan_lines
        from silo_server.state.checkpoint import BEST_MODEL

        app = HubApp(config, insecure_dev_only=args.insecure_dev_only)
        if args.check:
            app.check_security()
            print(f"config OK: {len(app.labeled)} labeled images in {len(app.labeled.classes)} classes, "
                  f"algorithm {config.algorithm.name}, {config.rounds.total} rounds, model {app.spec.name}")
            print(f"model selection: {len(app.validation)} validation images score every round; the best round is "
                  f"kept as {BEST_MODEL}" if app.validation is not None else
                  "model selection: none (no data.validation); the final round's model is exported")
            weights = app.initial_weights_report  # the summary, then what was missing or unexpected, if anything
            for line in weights.lines() if weights else ["initial weights: random (no model.init_weights or "
                                                         "model.init_from_run)"]:
                print(line)
            for line in plan_lines(config.privacy, config.security.max_update_norm,
                                   getattr(config.rounds, "silos_per_round_count", None), config.rounds.min_silos):
                print(line)
            from security.terms import describe as describe_terms
            from security.terms import terms_sha256

            print(f"privacy terms stated to every silo (sha256 {terms_sha256(app.hub.terms)[:16]}), pinned for the run:")
            for line in describe_terms(app.hub.terms):
                print(f"  {line}")
            quarantined = app.hub.registry.quarantine.entries()
            for silo, q in sorted(quarantined.items()):
                print(f"quarantined: {silo} since round {q.round} ({q.reason}); lift with --lift-quarantine {silo}")
            departed = app.departures()
            if departed:
                print(f"silos that refused or left run {app.hub.run_id[:8]} (the hub's audit):")
                for silo, d in sorted(departed.items()):
                    print(f"  {silo}: {d['departure']} ({d['clause']}): {d['message']}")
            resumed = app.hub.rounds.load_state()  # verified as a real start would, without training anything
            print(f"checkpoint: resumes after round {resumed.round}" if resumed is not None else
                  f"checkpoint: none in {config.run.state_dir}; the run starts with the hub's initial training")
            return 0
        state = app.run()
        ended_early = app.hub.rounds.stopped_reason  # e.g. the privacy budget: a restart would stop again
        if state.round < config.rounds.total and not ended_early:
            print(f"hub stopped after round {state.round}; start it again to resume from the checkpoint")
            return 0
        last = app.hub.records.history[-1].scores if app.hub.records.history else Scores()
        ended = (f"run ended after round {state.round} of {config.rounds.total} ({ended_early}; the card says so "
                 "as stopped_early)") if ended_early else f"run finished after {state.round} rounds"
        print(f"{ended}; test accuracy {nan_if_none(last.test_accuracy):.4f}; "
              f"model in {config.run.state_dir}/model.safetensors")
        if app.best.found:
            which = "" if app.best.round else ", the initial model: no round beat the hub's labels alone"
            print(f"best round on the validation split: {app.best.round} ({app.best.accuracy:.4f}){which}; "
                  f"its model in {config.run.state_dir}/{BEST_MODEL}")
        return 0
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is kept and the next start resumes from it", file=sys.stderr)
        return 130
    except (ConfigError, DataError, TlsError, ValueError, OSError, RuntimeError) as err:
        if args.verbose:
            raise
        first = str(err).strip().splitlines() or [type(err).__name__]
        print(f"error: {first[0]}", file=sys.stderr)
        for line in first[1:]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except Exception as err:  # anything unexpected still gets one line unless --verbose
        if args.verbose:
            raise
        print(f"error: {type(err).__name__}: {err} (run with --verbose for details)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
