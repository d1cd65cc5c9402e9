"""silo-client --data /local/images [--labeled /local/labeled] --hub HOST:PORT --certs DIR: join a federation."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="silo-client", description="Join a silokit federation with local images.")
    p.add_argument("--data", type=Path, help="folder of unlabeled images (searched recursively)")
    p.add_argument("--labeled", type=Path, metavar="DIR",
                   help="optional folder of labeled images, one sub-folder per class named as the hub's classes "
                        "(HASSLE trains on them; a fully labeled site may omit --data)")
    p.add_argument("--hub", default="localhost:50051", help="HOST:PORT of the hub (default localhost:50051)")
    p.add_argument("--certs", type=Path, help="bundle from `silo-certs issue-silo`: ca.pem cert.pem key.pem (required)")
    p.add_argument("--crl", type=Path, metavar="FILE",
                   help="the federation CA's crl.pem: refuse a hub whose certificate it revokes (default: crl.pem in "
                        "--certs when there is one)")
    p.add_argument("--insecure-dev-only", action="store_true",
                   help="DEVELOPMENT ONLY: plaintext to a `silo-server --insecure-dev-only` hub on this machine, "
                        "without certificates; needs --silo-id. Never with real data")
    p.add_argument("--silo-id", help="with --insecure-dev-only: the silo id to declare (with TLS the id is the "
                                     "certificate's name)")
    p.add_argument("--policy", type=Path, metavar="FILE",
                   help="the branch's privacy policy (branch-policy.yaml, see docs/branch-operator.md): the silo "
                        "refuses, before reading any image, a run whose privacy terms fall short of it, leaves a run "
                        "whose tasks breach them, and stops at its epsilon ceilings. Without it the silo follows the "
                        "hub's terms")
    p.add_argument("--model-factory", action="append", default=[], metavar="PKG.MODULE:CALLABLE",
                   help="allow a run whose model this factory builds (repeat for several; also the policy's "
                        "model_factories). A silo imports no code because the hub names it: without this, a run "
                        "with model.factory is refused at join")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--state-dir", type=Path, help="where this silo keeps its own state (default beside --data)")
    p.add_argument("--connect-timeout", type=float, default=300.0,
                   help="give up when the hub stays unreachable this many seconds (0: never; default 300)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--cache-mb", type=float, default=None, metavar="MIB",
                   help="keep the images in memory when their decoded pixels fit in this many MiB (fastest for small "
                        "images); a bigger folder is read from disk batch by batch as training goes (default 512)")
    p.add_argument("--loader-workers", type=int, default=None, metavar="N",
                   help="processes decoding images while training, for a folder read from disk (0: decode in the "
                        "training process; default 2)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port (0 picks a free one; default: not served)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics endpoint (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")
    p.add_argument("--sim-labels", type=Path, help=argparse.SUPPRESS)  # simulation only
    p.add_argument("--verbose", "-v", action="store_true", help="debug logs and full tracebacks on errors")
    return p


def _check_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.insecure_dev_only:
        if not args.silo_id:
            parser.error("--insecure-dev-only needs --silo-id NAME (there is no certificate to name this silo)")
        if args.certs:
            parser.error("--certs and --insecure-dev-only exclude each other: drop --insecure-dev-only to use TLS")
        if args.crl:
            parser.error("--crl checks the hub's certificate; with --insecure-dev-only there is none")
    else:
        if args.silo_id:
            parser.error("--silo-id only applies with --insecure-dev-only; with TLS the id is the certificate's name")
        if not args.certs:
            parser.error("the following arguments are required: --certs (a bundle from `silo-certs issue-silo`)")


def silo_label(certs: Path) -> str:
    """The silo id for metric labels: the CN of the bundle's certificate (the identity the hub sees)."""
    from security.pki import cert_common_name

    try:
        return cert_common_name((certs / "cert.pem").read_bytes())
    except Exception:  # a broken bundle is reported by the TLS checks right after; label it by folder meanwhile
        return certs.name


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data is None and args.labeled is None:
        parser.error("give --data (a folder of unlabeled images) and/or --labeled (a folder of labeled images)")
    _check_mode(parser, args)
    if args.cache_mb is not None and not args.cache_mb >= 0:
        parser.error("--cache-mb must be a number of MiB >= 0 (0: always read images from disk)")
    if args.loader_workers is not None and args.loader_workers < 0:
        parser.error("--loader-workers must be >= 0 (0: decode in the training process)")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from security.grpc_logs import quiet_grpc_core

    quiet_grpc_core(args.verbose)  # before anything imports grpc
    from security.tls import TlsError
    from silo_client.client import SiloClient, SiloSettings
    from silo_client.errors import SiloError, SiloLeft
    from silo_client.policy import PolicyError, load_policy
    from silo_core.data import DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS, DataError

    try:
        policy = load_policy(args.policy) if args.policy is not None else None
    except PolicyError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    client = server = None
    try:
        metrics = None
        if args.metrics_port is not None:
            from silo_client.metrics import SiloMetricFamilies, SiloMetrics

            families = SiloMetricFamilies()
            label = args.silo_id if args.insecure_dev_only else silo_label(args.certs)
            metrics = SiloMetrics(families, label, certs=args.certs)
            server = families.serve(args.metrics_host, args.metrics_port)
            logging.getLogger("silo_client").info("metrics at %s", server.url)
        client = SiloClient(SiloSettings(
            hub=args.hub, certs=args.certs, data=args.data, device=args.device, state_dir=args.state_dir,
            connect_timeout_s=args.connect_timeout, sim_labels=args.sim_labels, labeled=args.labeled,
            insecure_dev_silo_id=args.silo_id if args.insecure_dev_only else None, crl=args.crl,
            model_factories=tuple(args.model_factory), policy=policy,
            cache_mb=DEFAULT_CACHE_MB if args.cache_mb is None else args.cache_mb,
            loader_workers=DEFAULT_LOADER_WORKERS if args.loader_workers is None else args.loader_workers,
        ), metrics=metrics)
        signal.signal(signal.SIGTERM, lambda *_: client.stop_event.set())
        rc = client.run_forever()
        if server is not None and not client.stop_event.is_set():
            server.wait_for_scrape(30.0)  # the run is over: let a watching Prometheus collect the final values
        return rc
    except KeyboardInterrupt:
        return 130
    except SiloLeft as left:  # this branch's policy: the reason is logged, recorded and told to the hub
        print(f"error: {left} (policy clause {left.refusal.clause})", file=sys.stderr)
        return 3
    except (DataError, TlsError, SiloError, ValueError, OSError) as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
