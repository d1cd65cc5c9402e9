"""What holding SecAgg+ against a deviating hub costs: signed keys and the consistency round, signed vs unsigned.

    python bench/privacy/signed_secagg.py                          # 10 and 100 silos, 5 repetitions each
    python bench/privacy/signed_secagg.py --silos 10 --repeat 3

The deployment's SecAgg+ objects (security/secagg) driven in one process by security/secagg/inprocess.py: every
byte that would cross the wire is produced and consumed, only transport is skipped. Each silo's tensors are the
demo model's update (small_cnn on 28x28x1 images, 10 classes: one delta per parameter, plus a `weight` scalar).
Times are CPU seconds (time.process_time, torch on one thread) of each party's own steps; silos run one after
another, so they are per-party costs, not a round's wall-clock time. Bytes are the messages as serialized.

Three modes per federation size:
- unsigned: the honest-but-curious protocol (the consistency stage still runs, with empty signatures);
- signed, cold: every silo and the hub start with an empty certificate cache (a silo's first round: each peer's
  certificate is parsed and its CA signature checked once, then the signatures over keys and survivor set);
- signed, warm: the verifiers are kept from a previous round (a long-running silo that has seen its peers'
  certificates before: only the signatures are checked).
Each figure is the median over the repetitions; "+" columns are signed minus unsigned.

Writes bench/privacy/results/signed_secagg.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cryptography
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402
from security import pki  # noqa: E402
from security.secagg import PeerVerifier, SecAggParams, SiloIdentity  # noqa: E402
from security.secagg.inprocess import STAGE_ORDER, Costs, aggregate  # noqa: E402
from silo_core.models import ModelSpec  # noqa: E402

OUT = ROOT / "bench" / "privacy" / "results"
MODES = ("unsigned", "signed, cold", "signed, warm")
RUN_ID = "bench-run"


def demo_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """A silo result shaped like the demo's: delta/<param> for every parameter of small_cnn, and weight."""
    model = ModelSpec(name="small_cnn", num_classes=10, in_channels=1, image_size=28, mean=[0.5], std=[0.5]).build()
    g = torch.Generator().manual_seed(seed)
    out = {f"delta/{n}": torch.randn(p.shape, generator=g) * 1e-3 for n, p in model.named_parameters()}
    out["weight"] = torch.ones(1)
    return out


def federation(root: Path, ids: list[str]) -> tuple[bytes, dict[str, SiloIdentity]]:
    """A federation CA and one certificate per silo (security.pki, as `silo-certs` makes them)."""
    ca = pki.init_ca(root / "ca")
    pki.issue_silos(ca, [(i, root / i) for i in ids])
    return (ca / pki.CA_CERT).read_bytes(), {i: SiloIdentity.from_bundle(root / i) for i in ids}


def one_round(update: dict[str, torch.Tensor], ids: list[str], mode: str, ca_pem: bytes,
              identities: dict[str, SiloIdentity], verifiers: dict[str, PeerVerifier] | None, session: str
              ) -> dict[str, Any]:
    n = len(ids)
    signed = mode != "unsigned"
    if signed and verifiers is None:  # cold: fresh caches for every party
        verifiers = {i: PeerVerifier(ca_pem) for i in [*ids, "hub"]}
    costs = Costs()
    result = aggregate({i: update for i in ids}, SecAggParams(enabled=True), session=session, costs=costs,
                       keep_levels=False, identities=identities if signed else None,
                       verifier=verifiers["hub"] if signed else None,
                       silo_verifiers={i: verifiers[i] for i in ids} if signed else None, run_id=RUN_ID,
                       clock=time.process_time)
    if costs.aborted or costs.refused or len(result.contributors) != n:
        raise RuntimeError(f"{mode}, {n} silos: the round did not complete cleanly: {costs.aborted or costs.refused}")
    error = max(float((result.sums[k] - update[k].double() * n).abs().max()) for k in update)
    return {
        "silo_cpu_s": statistics.mean(costs.silo_seconds.values()),
        "silos_cpu_s_round": sum(costs.silo_seconds.values()),
        "hub_cpu_s_round": costs.hub_seconds,
        "silo_bytes_up": statistics.mean(costs.silo_bytes_up.values()),
        "silo_bytes_down": statistics.mean(costs.silo_bytes_down.values()),
        "silo_stage_cpu_s": {s: costs.silo_stage_seconds.get(s, 0.0) / n for s in STAGE_ORDER},
        "hub_stage_cpu_s": dict(costs.hub_stage_seconds),
        "silo_stage_bytes_up": {s: costs.silo_stage_bytes_up.get(s, 0) / n for s in STAGE_ORDER},
        "silo_stage_bytes_down": {s: costs.silo_stage_bytes_down.get(s, 0) / n for s in STAGE_ORDER},
        "degree": result.stats["degree"], "threshold": result.stats["threshold"],
        "consistency": result.stats["consistency"], "max_abs_error": error,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the repetitions (nested per-stage dicts too)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def bench(silo_counts: list[int], repeat: int, root: Path) -> list[dict[str, Any]]:
    update = demo_update()
    parameters = sum(t.numel() for k, t in update.items() if k.startswith("delta/"))
    rows = []
    for n in silo_counts:
        ids = [f"silo-{i:03d}" for i in range(n)]
        ca_pem, identities = federation(root / f"n{n}", ids)
        for mode in MODES:
            warm = None
            if mode == "signed, warm":
                warm = {i: PeerVerifier(ca_pem) for i in [*ids, "hub"]}
                one_round(update, ids, mode, ca_pem, identities, warm, f"warm-up-{n}")  # fills the caches
            runs = [one_round(update, ids, mode, ca_pem, identities, warm, f"s-{n}-{mode}-{r}")
                    for r in range(repeat)]
            row = {"silos": n, "mode": mode, "parameters": parameters, "repeat": repeat, **median_of(runs)}
            rows.append(row)
            print(f"n={n:3d} {mode:13s} k={row['degree']:.0f} t={row['threshold']:.0f}  silo "
                  f"{1e3 * row['silo_cpu_s']:.1f} ms, hub {row['hub_cpu_s_round']:.3f} s, up "
                  f"{row['silo_bytes_up'] / 1e3:.1f} kB, down {row['silo_bytes_down'] / 1e3:.1f} kB, "
                  f"err {row['max_abs_error']:.1e}", flush=True)
    base = {r["silos"]: r for r in rows if r["mode"] == "unsigned"}
    for r in rows:
        b = base[r["silos"]]
        r["added"] = {k: r[k] - b[k] for k in ("silo_cpu_s", "silos_cpu_s_round", "hub_cpu_s_round",
                                              "silo_bytes_up", "silo_bytes_down")}
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        f"Command: `{info['command']}`", "",
        f"Signed SecAgg+ (signed keys + consistency round) against unsigned, {rows[0]['parameters']:,} parameters "
        f"per silo (small_cnn deltas + weight), defaults (k = 3 ceil(log2 n), t = 2/3 k, Z_2^32, 20-bit fixed "
        f"point); median of {rows[0]['repeat']} rounds.",
        f"Machine: {cpus(info)} (shared), {info['platform']}, Python "
        f"{info['python']}, cryptography {info['cryptography']}. Date: {info['date']}.",
        "CPU seconds per party (time.process_time), silos one after another in one process.", "",
        "| silos | k / t | mode | CPU ms per silo | + ms per silo | all silos' CPU s per round | hub CPU s per "
        "round | + hub s | up kB per silo | + up B | down kB per silo | + down B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["added"]
        lines.append(
            f"| {r['silos']} | {r['degree']:.0f} / {r['threshold']:.0f} | {r['mode']} | {1e3 * r['silo_cpu_s']:.2f} "
            f"| {1e3 * a['silo_cpu_s']:+.2f} | {r['silos_cpu_s_round']:.2f} | {r['hub_cpu_s_round']:.3f} "
            f"| {a['hub_cpu_s_round']:+.3f} | {r['silo_bytes_up'] / 1e3:.1f} | {a['silo_bytes_up']:+,.0f} "
            f"| {r['silo_bytes_down'] / 1e3:.1f} | {a['silo_bytes_down']:+,.0f} |")
    lines += ["", "Where it lands, per stage: CPU ms per silo / hub CPU ms / bytes up + down per silo.", "",
              "| silos | mode | " + " | ".join(STAGE_ORDER) + " | hub finish |",
              "|---|---|" + "---|" * (len(STAGE_ORDER) + 1)]
    for r in rows:
        cells = [f"{1e3 * r['silo_stage_cpu_s'][s]:.2f} / {1e3 * r['hub_stage_cpu_s'].get(s, 0.0):.2f} / "
                 f"{r['silo_stage_bytes_up'][s]:,.0f} + {r['silo_stage_bytes_down'][s]:,.0f}" for s in STAGE_ORDER]
        lines.append(f"| {r['silos']} | {r['mode']} | " + " | ".join(cells)
                     + f" | {1e3 * r['hub_stage_cpu_s'].get('finish', 0.0):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, nargs="*", default=[10, 100])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    info = {**machine(), "cryptography": cryptography.__version__,
            "command": " ".join(["python", "bench/privacy/signed_secagg.py", *argv]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    with tempfile.TemporaryDirectory(prefix="signed-secagg-") as tmp:
        rows = bench(args.silos, args.repeat, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "signed_secagg.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    table = markdown(rows, info)
    (args.out / "signed_secagg.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
