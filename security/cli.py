"""`silo-certs`: make the federation CA and issue the hub's and the silos' certificate bundles.

    silo-certs init --dir pki/ca                               # once, on an offline/admin machine
    silo-certs issue-hub --ca pki/ca --out pki/hub --dns hub.example.org --ip 10.0.0.5
    silo-certs issue-silo branch-01 --ca pki/ca                # -> pki/silos/branch-01 (next to the CA dir)
    silo-certs list --ca pki/ca

Each subcommand is a pair (``_add_<name>`` to declare its arguments, ``_cmd_<name>`` to run it) registered in
``_COMMANDS``; revoke/renew slot in the same way (the CA already keeps crl.pem and issued.json for them).
Errors print one line ``error: ...`` on stderr and exit with status 2; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from security import pki
from security.tls import TlsError

# What the operator runs next with a bundle; kept here so the wording follows the other CLIs in one place.
_HUB_NEXT = (
    "copy {out} to the hub machine and run silo-server with it as its certificate bundle (--certs {out})"
)
_SILO_NEXT = "copy {out} to the branch '{name}' and run silo-client --certs {out} ..."


class _UsageError(Exception):
    """Raised instead of argparse's sys.exit so usage errors follow the same one-line, exit-2 rule."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


def _read_passphrase(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise pki.PkiError(f"cannot read passphrase file {path}: {e.strerror}") from e
    # Files written by `echo` end in a newline that is not part of the passphrase.
    data = data.rstrip(b"\r\n")
    if not data:
        raise pki.PkiError(f"passphrase file {path} is empty")
    return data


def _add_passphrase(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--passphrase-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the passphrase that {what} the CA key (trailing newline ignored)",
    )


# --------------------------------------------------------------------------------------------------------------
# init


def _add_init(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="create the federation CA", description="Create the federation CA.")
    p.add_argument("--dir", required=True, type=Path, help="CA directory to create (must not hold a CA yet)")
    p.add_argument("--name", default="silokit CA", help="CA common name (default: %(default)s)")
    p.add_argument("--days", type=int, default=3650, help="CA validity in days (default: %(default)s)")
    _add_passphrase(p, "encrypts")


def _cmd_init(args: argparse.Namespace) -> None:
    passphrase = _read_passphrase(args.passphrase_file)
    d = pki.init_ca(args.dir, name=args.name, days=args.days, passphrase=passphrase)
    enc = "encrypted" if passphrase else "NOT encrypted"
    print(f"created CA '{args.name}' in {d} (valid {args.days} days)")
    print(f"  {d / pki.CA_CERT}      CA certificate (public; goes into every bundle)")
    print(f"  {d / pki.CA_KEY}      CA private key, mode 0600, {enc}: keep it off the hub, back it up")
    print(f"  {d / pki.CRL}     revocation list")
    print(f"  {d / pki.INVENTORY} inventory of issued certificates")
    print(f"next: silo-certs issue-hub --ca {d} --out HUB_BUNDLE_DIR --dns HUB_HOSTNAME [--ip HUB_IP]")


# --------------------------------------------------------------------------------------------------------------
# issue-hub


def _add_issue_hub(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "issue-hub",
        help="issue the hub's server certificate bundle",
        description="Issue the hub's server certificate. List every name/address silos will dial; "
        "with no --dns/--ip the certificate is for localhost and 127.0.0.1 only.",
    )
    p.add_argument("--ca", required=True, type=Path, help="CA directory")
    p.add_argument(
        "--out", required=True, type=Path, help="bundle directory to write (ca.pem, cert.pem, key.pem)"
    )
    p.add_argument(
        "--dns", action="append", default=[], metavar="NAME", help="DNS name of the hub (repeatable)"
    )
    p.add_argument(
        "--ip", action="append", default=[], metavar="ADDR", help="IP address of the hub (repeatable)"
    )
    p.add_argument("--days", type=int, default=90, help="validity in days (default: %(default)s)")
    _add_passphrase(p, "unlocks")


def _cmd_issue_hub(args: argparse.Namespace) -> None:
    out = pki.issue_hub(
        args.ca,
        args.out,
        dns=args.dns,
        ips=args.ip,
        days=args.days,
        passphrase=_read_passphrase(args.passphrase_file),
    )
    cert = (out / pki.BUNDLE_CERT).read_bytes()
    sans = ", ".join(args.dns + args.ip) or ", ".join(pki.DEFAULT_HUB_DNS + pki.DEFAULT_HUB_IPS)
    print(f"issued hub certificate for {sans} (expires in {pki.cert_days_left(cert):.0f} days)")
    _print_bundle(out)
    print("next: " + _HUB_NEXT.format(out=out))


# --------------------------------------------------------------------------------------------------------------
# issue-silo


def _default_silo_out(ca: Path, name: str) -> Path:
    """Bundles sit next to the CA directory: pki/ca -> pki/silos/NAME."""
    return ca.resolve().parent / "silos" / name


def _add_issue_silo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "issue-silo",
        help="issue a silo's client certificate bundle",
        description="Issue the client certificate of one silo; its name is the silo's identity at the hub.",
    )
    p.add_argument("name", help="silo id: 1-64 characters from A-Z a-z 0-9 . _ -")
    p.add_argument("--ca", required=True, type=Path, help="CA directory")
    p.add_argument(
        "--out",
        type=Path,
        help="bundle directory to write (default: CA_DIR/../silos/NAME, next to the CA dir)",
    )
    p.add_argument("--days", type=int, default=90, help="validity in days (default: %(default)s)")
    _add_passphrase(p, "unlocks")


def _cmd_issue_silo(args: argparse.Namespace) -> None:
    pki.validate_silo_name(args.name)  # before building a default path out of it
    out = args.out if args.out is not None else _default_silo_out(args.ca, args.name)
    out = pki.issue_silo(
        args.ca, args.name, out, days=args.days, passphrase=_read_passphrase(args.passphrase_file)
    )
    cert = (out / pki.BUNDLE_CERT).read_bytes()
    print(f"issued silo certificate '{args.name}' (expires in {pki.cert_days_left(cert):.0f} days)")
    _print_bundle(out)
    print("next: " + _SILO_NEXT.format(out=out, name=args.name))


def _print_bundle(out: Path) -> None:
    print(f"  {out / pki.BUNDLE_CA}    CA certificate")
    print(f"  {out / pki.BUNDLE_CERT}  certificate")
    print(f"  {out / pki.BUNDLE_KEY}   private key, mode 0600")


# --------------------------------------------------------------------------------------------------------------
# list


def _add_list(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "list", help="list issued certificates", description="List the certificates this CA issued."
    )
    p.add_argument("--ca", required=True, type=Path, help="CA directory")


def _cmd_list(args: argparse.Namespace) -> None:
    entries = pki.load_inventory(args.ca)
    if not entries:
        print(f"no certificates issued by {args.ca} yet")
        return
    now = dt.datetime.now(dt.UTC)
    header = ("KIND", "NAME", "SERIAL", "EXPIRES", "DAYS LEFT", "STATUS")
    rows = []
    for e in entries:
        not_after = dt.datetime.fromisoformat(e.not_after)
        days_left = (not_after - now).total_seconds() / 86400.0
        # The inventory only records decisions (valid/revoked); expiry is a fact of the clock, shown here.
        status = "expired" if e.status == "valid" and days_left < 0 else e.status
        rows.append((e.kind, e.name, e.serial, f"{not_after:%Y-%m-%d}", f"{days_left:.0f}", status))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


# --------------------------------------------------------------------------------------------------------------

_COMMANDS: dict[
    str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], None]]
] = {
    "init": (_add_init, _cmd_init),
    "issue-hub": (_add_issue_hub, _cmd_issue_hub),
    "issue-silo": (_add_issue_silo, _cmd_issue_silo),
    "list": (_add_list, _cmd_list),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="silo-certs", description="Certificates for a silokit federation (mutual TLS).")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add, run in _COMMANDS.values():
        before = set(sub.choices)
        add(sub)
        for name in set(sub.choices) - before:
            # SUPPRESS keeps a top-level `-v` from being reset to False by the subcommand's default.
            sub.choices[name].add_argument(
                "-v",
                "--verbose",
                action="store_true",
                default=argparse.SUPPRESS,
                help="show tracebacks on errors",
            )
            sub.choices[name].set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        args.run(args)
    except (pki.PkiError, TlsError, OSError) as e:
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(e).split())  # one line, whatever the exception text looked like
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
