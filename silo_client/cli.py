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
                   help="optional folder of labeled images, one sub-folder per class in the hub's class order "
                        "(HASSLE trains on them; a fully labeled site may omit --data)")
    p.add_argument("--hub", default="localhost:50051", help="HOST:PORT of the hub (default localhost:50051)")
    p.add_argument("--certs", required=True, type=Path, help="bundle from `silo-certs issue-silo`: ca.pem cert.pem key.pem")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--state-dir", type=Path, help="where this silo keeps its own state (default beside --data)")
    p.add_argument("--connect-timeout", type=float, default=300.0,
                   help="give up when the hub stays unreachable this many seconds (0: never; default 300)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--sim-labels", type=Path, help=argparse.SUPPRESS)  # simulation only
    p.add_argument("--verbose", "-v", action="store_true", help="debug logs and full tracebacks on errors")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data is None and args.labeled is None:
        parser.error("give --data (a folder of unlabeled images) and/or --labeled (a folder of labeled images)")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from security.tls import TlsError
    from silo_client.client import SiloClient, SiloError, SiloSettings
    from silo_core.data import DataError

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    client = None
    try:
        client = SiloClient(SiloSettings(
            hub=args.hub, certs=args.certs, data=args.data, device=args.device, state_dir=args.state_dir,
            connect_timeout_s=args.connect_timeout, sim_labels=args.sim_labels, labeled=args.labeled,
        ))
        signal.signal(signal.SIGTERM, lambda *_: client.stop_event.set())
        return client.run_forever()
    except KeyboardInterrupt:
        return 130
    except (DataError, TlsError, SiloError, ValueError, OSError) as err:
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
