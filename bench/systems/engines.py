"""silo-sim's two silo engines side by side: worker processes against Ray actors (`--engine ray`).

One federation per engine, the same seeds and settings (by default 100 silos, 10 sampled per round, 3 rounds,
small_cnn, on the bundled demo data); while each runs, the memory of its processes is sampled every second from
/proc: the silo hosts (worker processes, or the Ray actors named in logs/ray-actors.json), Ray's own processes
(raylet, GCS, its other daemons and idle workers: everything under Ray's temp dir that is not an actor) and the hub.

    python bench/systems/engines.py                        # writes results/engines.json and engines.md
    python bench/systems/engines.py --silos 20 --rounds 2  # a smaller comparison

RSS sums count shared pages (torch's libraries) once per process; PSS shares them out, so the PSS sum is what the
processes take from the machine together.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402

RESULTS = ROOT / "bench" / "systems" / "results"


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in kB; zeros when it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:] if line.split()[1:2]}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, command line followed by " [name]"). The name tells silo-sim's
    processes apart: forked from its launcher, they all have the fork server's command line (silo_sim/launcher.py
    names them silokit-hub, silokit-hostN, silokit-staging)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), f"{cmdline} [{name}]")
    return found


def descendants(roots: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    out, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - out
        out |= frontier
    return out


def groups(engine: str, sim_pid: int, work: Path) -> dict[str, set[int]]:
    """The pids of the hub, the silo hosts and (Ray) Ray's own processes of the sim run now."""
    table = processes()
    tree = descendants({sim_pid}, table)
    tree = {p for p in tree if "multiprocessing.forkserver" not in table[p][1]}  # it names modules it preloads
    hub = {p for p in tree if "silo_server.cli" in table[p][1] or "[silokit-hub]" in table[p][1]}
    if engine == "workers":
        return {"hub": hub, "silo_hosts": {p for p in tree if "silo_sim.worker" in table[p][1]
                                           or "[silokit-host" in table[p][1]}, "ray": set()}
    try:
        hosts = json.loads((work / "logs" / "ray-actors.json").read_text())
    except (OSError, ValueError):
        return {"hub": hub, "silo_hosts": set(), "ray": set()}
    actors = {a["pid"] for a in hosts["actors"]}
    temp_dir = hosts["ray_temp_dir"]
    ray_roots = {p for p, (_, cmd) in table.items() if temp_dir and temp_dir in cmd}
    ray_all = descendants(ray_roots, table) | (tree - hub - {sim_pid})
    return {"hub": hub, "silo_hosts": actors & set(table), "ray": ray_all - actors}


def run_engine(engine: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    work, out = workdir / engine / "work", workdir / engine / "out"
    command = [sys.executable, "-m", "silo_sim.cli", "--engine", engine, "--silos", str(args.silos),
               "--silos-per-round-count", str(args.per_round), "--rounds", str(args.rounds),
               "--model", "small_cnn", "--labels-per-class", "5", "--unlabeled", str(args.unlabeled),
               "--test-per-class", "50", "--option", "hub_epochs=1", "--option", "local_epochs=1",
               "--no-baseline", "--seed", "0", "--workdir", str(work), "--out", str(out)]
    if args.workers:
        command += ["--workers", str(args.workers)]
    peaks: dict[str, dict[str, int]] = {g: {"rss_kb": 0, "pss_kb": 0, "processes": 0}
                                        for g in ("hub", "silo_hosts", "ray")}
    started = time.time()
    sim = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(sim.stdout), daemon=True)
    reader.start()
    while sim.poll() is None:
        for name, pids in groups(engine, sim.pid, work).items():
            rss, pss = (sum(v) for v in zip(*(memory_kb(p) for p in pids), strict=True)) if pids else (0, 0)
            peak = peaks[name]
            if pss > peak["pss_kb"]:
                peak.update(rss_kb=rss, pss_kb=pss, processes=len(pids))
        time.sleep(1.0)
    reader.join(timeout=5)
    seconds = time.time() - started
    if sim.returncode != 0:
        raise SystemExit(f"silo-sim --engine {engine} failed:\n{''.join(output)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["rounds"]
    return {
        "engine": engine, "wall_seconds": seconds, "federated_seconds": summary["federated_seconds"],
        "round_seconds": [r["round_seconds"] for r in rounds],
        "silos_contributed": [r["silos_contributed"] for r in rounds],
        "test_accuracy": [r["test_accuracy"] for r in rounds],
        "hub_peak_rss_MB": max(r["hub_peak_rss_bytes"] for r in rounds) / 1e6,
        "peaks_MB": {name: {"rss": p["rss_kb"] / 1024, "pss": p["pss_kb"] / 1024, "processes": p["processes"]}
                     for name, p in peaks.items()},
        "command": " ".join(command[1:]).replace(str(workdir), "$WORK"),
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"# silo-sim engines: worker processes against Ray actors ({s['silos']} silos, {s['per_round']} per round, "
             f"{s['rounds']} rounds, small_cnn)", "",
             f"Machine: {cpus(result['machine'])}, {result['machine']['platform']}, Ray "
             f"{result['machine']['ray']}. Command: `{' '.join(['python bench/systems/engines.py', s['argv']]).strip()}`. "
             "One run of each engine, one after the other.", "",
             "| engine | silo hosts | round time (s), rounds 1..n | federated run | silo hosts PSS (RSS) | Ray's own "
             "processes PSS (RSS) | hub peak RSS | test accuracy, last round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        hosts, ray = r["peaks_MB"]["silo_hosts"], r["peaks_MB"]["ray"]
        lines.append(
            f"| {r['engine']} | {hosts['processes']} | {', '.join(f'{x:.2f}' for x in r['round_seconds'])} | "
            f"{r['federated_seconds']:.0f} s | {hosts['pss']:,.0f} MB ({hosts['rss']:,.0f} MB) | "
            + (f"{ray['pss']:,.0f} MB ({ray['rss']:,.0f} MB), {ray['processes']} processes" if ray["processes"]
               else "-")
            + f" | {r['hub_peak_rss_MB']:.0f} MB | {r['test_accuracy'][-1]:.4f} |")
    lines += ["", "Memory: the peak of the group's summed PSS over the run, sampled every second (RSS at that "
              "moment in brackets). The federated run is from the hub's start to its end, Ray's start included "
              "for the Ray engine.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--unlabeled", type=int, default=3000, help="unlabeled images over all the silos")
    p.add_argument("--workers", type=int, help="silo hosts for both engines (default: each engine's own)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import ray

    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        runs = [run_engine(engine, args, Path(tmp)) for engine in ("workers", "ray")]
    result = {"settings": {"silos": args.silos, "per_round": args.per_round, "rounds": args.rounds,
                           "unlabeled": args.unlabeled, "workers": args.workers,
                           "argv": " ".join(argv if argv is not None else sys.argv[1:])},
              "machine": {**machine(), "ray": ray.__version__},
              "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engines.json").write_text(json.dumps(result, indent=2))
    (args.out / "engines.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
