"""`silo-certs`: make the federation CA and issue the hub's and the silos' certificate bundles.

    silo-certs init --dir pki/ca                               # once, on an offline/admin machine
    silo-certs issue-hub --ca pki/ca --out pki/hub --dns hub.example.org --ip 10.0.0.5
    silo-certs issue-silo branch-01 --ca pki/ca                # -> pki/silos/branch-01 (next to the CA dir)
    silo-certs issue-silo branch-01 --ca pki/ca --replace --out DIR   # a live name: revoke its certificate too
    silo-certs list --ca pki/ca                                # status and expiry of everything issued
    silo-certs revoke branch-01 --ca pki/ca                    # or a serial; re-signs crl.pem
    silo-certs renew branch-01 --ca pki/ca                     # fresh key and certificate, same identity
    silo-certs crl --ca pki/ca                                 # re-sign crl.pem before it goes stale

Each subcommand is a pair (``_add_<name>`` to declare its arguments, ``_cmd_<name>`` to run it) registered in
``_COMMANDS``. Every command prints what it wrote and where to copy it; none overwrites a key. Commands that
change the CA directory hold its lock (:func:`security.pki.ca_lock`), so concurrent runs are safe.
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
    "copy {out} to the hub machine, name it in hub.yaml as the hub's certificate bundle (server.certs: {out}, or "
    "where you copied it) and run silo-server --config hub.yaml"
)
_SILO_NEXT = "copy {out} to the branch '{name}' and run silo-client --certs {out} ..."
_CRL_NEXT = (
    "copy {crl} to the hub, over crl.pem in its certificate bundle (server.certs) or the file security.crl "
    "names in hub.yaml; the running hub reloads it and checks it on every call, no restart. Copy it over crl.pem "
    "in every silo's bundle (--certs) too: a silo checks its secure-aggregation neighbours' signed keys against "
    "its own copy (a revoked silo stays out of its rosters even if the hub lets it in) and the hub before joining "
    "and before a round (at most once a minute)"
)


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
    _add_replace(p, "the hub")
    _add_passphrase(p, "unlocks")


def _cmd_issue_hub(args: argparse.Namespace) -> None:
    passphrase = _read_passphrase(args.passphrase_file)
    with pki.ca_lock(args.ca):  # the certificates listed as replaced are exactly those this run revokes
        replaced = pki.live_certificates(args.ca, pki.HUB_CN) if args.replace else []
        out = pki.issue_hub(
            args.ca, args.out, dns=args.dns, ips=args.ip, days=args.days, passphrase=passphrase,
            replace=args.replace,
        )
    cert = (out / pki.BUNDLE_CERT).read_bytes()
    sans = ", ".join(args.dns + args.ip) or ", ".join(pki.DEFAULT_HUB_DNS + pki.DEFAULT_HUB_IPS)
    print(f"issued hub certificate for {sans} (expires in {pki.cert_days_left(cert):.0f} days)")
    _print_bundle(out)
    print(f"  {out / pki.BUNDLE_CRL}    revocation list (replace it after each `silo-certs revoke`)")
    print("next: " + _HUB_NEXT.format(out=out))
    _print_replaced(args.ca, replaced, args.replace)


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
    _add_replace(p, "NAME")
    _add_passphrase(p, "unlocks")


def _cmd_issue_silo(args: argparse.Namespace) -> None:
    pki.validate_silo_name(args.name)  # before building a default path out of it
    out = args.out if args.out is not None else _default_silo_out(args.ca, args.name)
    passphrase = _read_passphrase(args.passphrase_file)
    with pki.ca_lock(args.ca):  # the certificates listed as replaced are exactly those this run revokes
        replaced = pki.live_certificates(args.ca, args.name) if args.replace else []
        out = pki.issue_silo(args.ca, args.name, out, days=args.days, passphrase=passphrase, replace=args.replace)
    cert = (out / pki.BUNDLE_CERT).read_bytes()
    print(f"issued silo certificate '{args.name}' (expires in {pki.cert_days_left(cert):.0f} days)")
    _print_bundle(out)
    print("next: " + _SILO_NEXT.format(out=out, name=args.name))
    _print_replaced(args.ca, replaced, args.replace)


def _add_replace(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument(
        "--replace",
        action="store_true",
        help=f"if {who} still holds a live certificate, revoke it (re-signing crl.pem) and issue anew; without "
        "it, issuing for a live name is refused (`silo-certs renew` keeps the identity instead)",
    )


def _print_replaced(ca: Path, replaced: list[pki.IssuedCert], asked: bool) -> None:
    if not asked:
        return
    if not replaced:
        print("--replace: there was no live certificate to revoke")
        return
    for e in replaced:
        print(f"revoked the replaced {e.kind} certificate '{e.name}' (serial {e.serial}, bundle {e.path})")
    _print_crl(ca)


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
        status = pki.display_status(e, entries, now)
        rows.append((e.kind, e.name, e.serial, f"{not_after:%Y-%m-%d}", f"{days_left:.0f}", status))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


# --------------------------------------------------------------------------------------------------------------
# revoke, crl


def _print_crl(ca: Path) -> None:
    crl = pki.load_crl(ca)
    count = sum(1 for _ in crl)
    until = crl.next_update_utc
    print(f"wrote {ca / pki.CRL}: {count} revoked certificate(s), valid until {until:%Y-%m-%d}")
    print(f"  re-sign it before then with `silo-certs crl --ca {ca}` (the hub warns once it is stale)")
    print("next: " + _CRL_NEXT.format(crl=ca / pki.CRL))


def _add_revoke(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "revoke",
        help="revoke a certificate (by silo name or serial) and re-sign the CRL",
        description="Revoke certificates and re-sign crl.pem. A NAME revokes every certificate of that identity; "
        "a SERIAL (as `list` prints it, or a unique prefix of 8+ digits) revokes just that one.",
    )
    p.add_argument("target", metavar="NAME|SERIAL", help="silo name (or 'hub'), or certificate serial")
    p.add_argument("--ca", required=True, type=Path, help="CA directory")
    _add_passphrase(p, "unlocks")


def _cmd_revoke(args: argparse.Namespace) -> None:
    revoked = pki.revoke(args.ca, args.target, passphrase=_read_passphrase(args.passphrase_file))
    for e in revoked:
        print(f"revoked {e.kind} certificate '{e.name}' (serial {e.serial}, bundle {e.path})")
    if any(e.kind == "hub" for e in revoked):
        print(f"note: issue a new hub certificate now (`silo-certs renew hub --ca {args.ca}`), and copy crl.pem "
              "over crl.pem in every silo's bundle: a silo refuses a hub whose certificate it lists "
              "(docs/security.md, a compromised hub key)")
    _print_crl(args.ca)


def _add_crl(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "crl",
        help="re-sign the CRL (refresh its validity)",
        description="Re-sign crl.pem from the inventory, e.g. monthly, before its next-update date passes.",
    )
    p.add_argument("--ca", required=True, type=Path, help="CA directory")
    _add_passphrase(p, "unlocks")


def _cmd_crl(args: argparse.Namespace) -> None:
    pki.write_crl(args.ca, passphrase=_read_passphrase(args.passphrase_file))
    _print_crl(args.ca)


# --------------------------------------------------------------------------------------------------------------
# renew


def _add_renew(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "renew",
        help="issue a fresh certificate for an existing identity",
        description="Issue a new key and certificate for NAME (a silo name, or 'hub') into a new bundle directory. "
        "The old certificate keeps working until it expires, unless --revoke-old.",
    )
    p.add_argument("name", help="silo name, or 'hub'")
    p.add_argument("--ca", required=True, type=Path, help="CA directory")
    p.add_argument(
        "--out", type=Path, help="bundle directory to write (default: NAME.renewed-DATE beside the old bundle)"
    )
    p.add_argument("--days", type=int, default=90, help="validity in days (default: %(default)s)")
    p.add_argument("--dns", action="append", default=[], metavar="NAME",
                   help="hub only: DNS names (default: those of the hub's current certificate)")
    p.add_argument("--ip", action="append", default=[], metavar="ADDR",
                   help="hub only: IP addresses (default: those of the hub's current certificate)")
    p.add_argument("--revoke-old", action="store_true",
                   help="revoke the identity's older certificates once the new one is written")
    _add_passphrase(p, "unlocks")


def _cmd_renew(args: argparse.Namespace) -> None:
    passphrase = _read_passphrase(args.passphrase_file)
    old = [e for e in pki.load_inventory(args.ca) if e.name == args.name]
    out = pki.renew(args.ca, args.name, out_dir=args.out, days=args.days, passphrase=passphrase,
                    dns=args.dns, ips=args.ip, revoke_old=args.revoke_old)
    cert = (out / pki.BUNDLE_CERT).read_bytes()
    kind = old[-1].kind if old else "silo"
    print(f"renewed {kind} certificate '{args.name}' (expires in {pki.cert_days_left(cert):.0f} days)")
    _print_bundle(out)
    if kind == "hub":
        print(f"  {out / pki.BUNDLE_CRL}    revocation list")
        print(f"next: copy {out / pki.BUNDLE_KEY} and {out / pki.BUNDLE_CERT} over those in the hub's bundle "
              "(server.certs); the running hub serves the new certificate to new connections, no restart")
    else:
        print(f"next: copy {out} to the branch '{args.name}' (e.g. over its old bundle directory) and restart "
              "silo-client there with --certs pointing at it")
    if args.revoke_old:
        print(f"revoked the older certificate(s) of '{args.name}'")
        _print_crl(args.ca)
    else:
        who = "the hub serves" if kind == "hub" else "the branch uses"
        print(f"the old certificate stays valid until it expires; once {who} the new one, revoke the old: "
              f"`silo-certs revoke SERIAL --ca {args.ca}` (serials: `silo-certs list --ca {args.ca}`)")


# --------------------------------------------------------------------------------------------------------------

_COMMANDS: dict[
    str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], None]]
] = {
    "init": (_add_init, _cmd_init),
    "issue-hub": (_add_issue_hub, _cmd_issue_hub),
    "issue-silo": (_add_issue_silo, _cmd_issue_silo),
    "list": (_add_list, _cmd_list),
    "revoke": (_add_revoke, _cmd_revoke),
    "renew": (_add_renew, _cmd_renew),
    "crl": (_add_crl, _cmd_crl),
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
