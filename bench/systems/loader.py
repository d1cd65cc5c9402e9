"""Image folders read lazily: a silo's peak memory with 2,000 and 20,000 images at 224 px, and images per second of
the lazy loader against the in-memory path at 28 px and 224 px.

    python bench/systems/loader.py                    # about 20 minutes on 2 CPU cores
    python bench/systems/loader.py --sizes 2000       # the memory part for one folder size only

The images are Fashion-MNIST's (the raw files under --fashion-mnist; the product never reads them), written as
real files once under --workdir: 224 px RGB JPEGs (each upscaled and tinted by its class, quality 90) and 28 px
grayscale PNGs, as a branch would hold them.

Memory: a whole federated round at 224 px does not fit this benchmark's time on 2 CPU cores (one forward pass of
small_cnn over 20,000 images at 224 px alone takes 10 to 20 minutes here), so a child process runs a silo's data
path with the silo's own code, and its memory is measured from the outside:
  1. load the folder as silo-client does (load_unlabeled_folder with --cache-mb and --loader-workers),
  2. read every image once through the loader, batches of 250 in order (a whole-set pass, as pseudo-labelling
     does, without the model's time),
  3. pseudo-label the first 1,000 images with small_cnn (width 4) on the weak view (predict_logits, as SemiFL),
  4. one SemiFL silo update (SemiFLSilo.local_update: its own pseudo-labelling pass, then 100 training steps of
     L_fix + L_mix with RandAugment) on the first 800 images.
Peak RSS is the child's VmHWM (its own high-water mark); the loader workers are separate processes, so the tree's
peak is also sampled every 0.2 s as the sum of PSS (proportional set size: pages shared after fork counted once).
Each folder size runs with the default --cache-mb (512 MiB: 2,000 images at 224 px, 301 MB decoded, are held in
memory; 20,000, 3 GB, are read lazily) and with the other path forced.

Throughput: one epoch of shuffled batches of 64 through image_batches (the loader alone), and a pseudo-labelling
pass with small_cnn (predict_logits), in memory and lazily with 0 and 2 loader workers.

Writes results/loader.json and results/loader.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.processor import cpus, machine  # noqa: E402

# numpy, torch, Pillow and silokit are imported inside the functions: loader workers import the main module again
# (they start from a fork server), and a heavy top level here would be paid by every worker of every epoch.

RESULTS = Path(__file__).resolve().parent / "results"
IN_MEMORY = 1e9  # --cache-mb that holds any folder in memory


# ------------------------------------------------------------------------------------------------ image files


def fashion_mnist(raw: Path):
    import numpy as np

    def idx(name: str) -> np.ndarray:
        data = gzip.decompress((raw / f"{name}.gz").read_bytes())
        dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(data[3])]
        return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(dims)

    return idx("train-images-idx3-ubyte"), idx("train-labels-idx1-ubyte")


def write_images(folder: Path, count: int, size: int, raw: Path) -> Path:
    """``count`` image files in ``folder`` (kept between runs): 224 px RGB JPEGs or 28 px grayscale PNGs."""
    import numpy as np
    from PIL import Image

    done = folder / ".complete"
    if done.exists() and int(done.read_text()) == count:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = fashion_mnist(raw)
    tints = np.random.default_rng(0).uniform(0.4, 1.0, (10, 3))  # a colour per class: real RGB content
    started = time.time()
    for i in range(count):
        gray = images[i % len(images)]
        if size == 28:
            Image.fromarray(gray).save(folder / f"{i:05d}.png", compress_level=1)
            continue
        big = np.asarray(Image.fromarray(gray).resize((size, size), Image.Resampling.BILINEAR), dtype=np.float32)
        rgb = np.clip(big[:, :, None] * tints[labels[i % len(labels)]] + 20, 0, 255).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i:05d}.jpg", quality=90)
    done.write_text(str(count))
    print(f"wrote {count} images of {size} px to {folder} in {time.time() - started:.0f} s", flush=True)
    return folder


# ------------------------------------------------------------------------------------------------ memory


def status_kb(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def silo_child(folder: Path, cache_mb: float, workers: int) -> None:
    """The measured silo data path (see the module docstring); prints one JSON line per phase."""
    import torch

    from silo_core.algorithms.base import RoundPlan, SiloData, model_tensors
    from silo_core.algorithms.semifl import SemiFLOptions, SemiFLSilo
    from silo_core.data import ImageFiles, image_batches, load_unlabeled_folder
    from silo_core.models import ModelSpec
    from silo_core.training import predict_logits

    cpu = torch.device("cpu")
    torch.set_num_threads(2)

    def report(phase: str, started: float, **extra) -> None:
        print(json.dumps({"phase": phase, "seconds": time.time() - started, "rss_mb": status_kb("self", "VmRSS") / 1024,
                          "hwm_mb": status_kb("self", "VmHWM") / 1024, **extra}), flush=True)

    report("start", time.time())
    t = time.time()
    loaded = load_unlabeled_folder(folder, 224, 3, cache_mb=cache_mb, workers=workers)
    images = loaded.images
    report("load", t, images=len(images), lazy=isinstance(images, ImageFiles))
    t = time.time()
    seen = sum(len(idx) for idx, _ in image_batches(images, torch.arange(len(images)).split(250)))
    report("read every image", t, images=seen)
    spec = ModelSpec(num_classes=10, in_channels=3, image_size=224, mean=[0.5] * 3, std=[0.5] * 3,
                     options={"width": 4})
    torch.manual_seed(0)
    model = spec.build()
    t = time.time()
    predict_logits(model, images[:1000], spec.mean, spec.std, cpu, weak=True, generator=torch.Generator())
    report("pseudo-label 1,000", t)
    plan = RoundPlan(round=1, tensors=model_tensors(model), hyperparameters={"lr": 0.01, "seed": 0}, expected={})
    options = SemiFLOptions(tau=0.0, local_epochs=1, silo_batch_size=8)  # 800 images: 100 steps
    t = time.time()
    result = SemiFLSilo(options, spec, cpu).local_update(plan, SiloData(images=images[:800], silo_id="bench"))
    report("SemiFL update, 100 steps", t, steps=result.metrics["train_steps"])


def tree_pss_kb(pid: int) -> int:
    """PSS of ``pid`` and every descendant (shared pages divided among the processes sharing them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def measure_silo(folder: Path, cache_mb: float | None, workers: int) -> dict:
    args = [sys.executable, __file__, "--silo-child", str(folder), "--workers", str(workers)]
    if cache_mb is not None:
        args += ["--cache-mb", str(cache_mb)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    phases: list[dict] = []

    def read_phases() -> None:
        for line in proc.stdout:
            phases.append(json.loads(line))
            print(f"  {phases[-1]}", flush=True)

    reader = threading.Thread(target=read_phases, daemon=True)
    reader.start()
    peak_tree_kb = 0
    while proc.poll() is None:
        peak_tree_kb = max(peak_tree_kb, tree_pss_kb(proc.pid))
        time.sleep(0.2)
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"the silo child failed ({proc.returncode})")
    return {"phases": phases, "peak_rss_mb": max(p["hwm_mb"] for p in phases),
            "peak_tree_pss_mb": peak_tree_kb / 1024, "lazy": phases[1]["lazy"], "images": phases[1]["images"]}


# ------------------------------------------------------------------------------------------------ throughput


def throughput(folder: Path, size: int, channels: int, model_images: int) -> list[dict]:
    import torch

    from silo_core.data import image_batches, load_unlabeled_folder
    from silo_core.models import ModelSpec
    from silo_core.training import predict_logits, shuffled_batches

    torch.set_num_threads(2)
    spec = ModelSpec(num_classes=10, in_channels=channels, image_size=size, mean=[0.5] * channels,
                     std=[0.5] * channels, options={"width": 16 if size == 28 else 4})
    torch.manual_seed(0)
    model = spec.build()
    rows = []
    for mode, cache_mb, workers in (("in memory", IN_MEMORY, 0), ("lazy, 0 workers", 0, 0), ("lazy, 2 workers", 0, 2)):
        t = time.time()
        images = load_unlabeled_folder(folder, size, channels, cache_mb=cache_mb, workers=workers).images
        load_s = time.time() - t
        n = len(images)
        order = shuffled_batches(n, 64, torch.Generator().manual_seed(0))
        t = time.time()
        seen = sum(len(idx) for idx, _ in image_batches(images, order))
        epoch_s = time.time() - t
        t = time.time()
        predict_logits(model, images[:model_images], spec.mean, spec.std, torch.device("cpu"))
        predict_s = time.time() - t
        row = {"size": size, "mode": mode, "images": n, "load_seconds": load_s, "epoch_seconds": epoch_s,
               "loader_images_per_s": seen / epoch_s, "pseudo_label_images": model_images,
               "pseudo_label_images_per_s": model_images / predict_s}
        print(f"  {row}", flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ report


def markdown(results: dict) -> str:
    lines = ["# Image loader: memory and throughput (`bench/systems/loader.py`)", "",
             f"Machine: {results['machine']['platform']}, {cpus(results['machine'])}, no GPU; "
             f"{results['machine']['note']}", "",
             "## Peak memory of a silo's data path, 224 px RGB JPEGs", "",
             "| images | --cache-mb | held | peak RSS (silo process) | peak PSS (silo + loader workers) | load | "
             "read all | pseudo-label 1,000 | SemiFL update (100 steps) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["memory"]:
        ph = {p["phase"]: p for p in r["phases"]}
        lines.append(
            f"| {r['images']:,} | {r['cache_mb']} | {'files (lazy)' if r['lazy'] else 'memory'} | "
            f"**{r['peak_rss_mb']:,.0f} MB** | {r['peak_tree_pss_mb']:,.0f} MB | {ph['load']['seconds']:.1f} s | "
            f"{ph['read every image']['seconds']:.1f} s | {ph['pseudo-label 1,000']['seconds']:.1f} s | "
            f"{ph['SemiFL update, 100 steps']['seconds']:.1f} s |")
    lines += ["", "## Images per second", "",
              "| size | path | load (s) | loader alone, images/s | pseudo-labelling (small_cnn), images/s |",
              "|---|---|---|---|---|"]
    for r in results["throughput"]:
        lines.append(f"| {r['size']} px | {r['mode']} | {r['load_seconds']:.1f} | {r['loader_images_per_s']:,.0f} | "
                     f"{r['pseudo_label_images_per_s']:,.0f} ({r['pseudo_label_images']:,} images) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/silokit-bench-loader"),
                   help="where the image files are written (kept for later runs)")
    p.add_argument("--fashion-mnist", type=Path, default=Path("/work/shared/data/FashionMNIST/raw"))
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000], help="silo folder sizes at 224 px")
    p.add_argument("--workers", type=int, default=2, help="loader workers of the lazily read folders")
    p.add_argument("--note", default="", help="a line about the machine's state, for the report")
    p.add_argument("--silo-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cache-mb", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.silo_child is not None:
        from silo_core.data import DEFAULT_CACHE_MB

        silo_child(args.silo_child, DEFAULT_CACHE_MB if args.cache_mb is None else args.cache_mb, args.workers)
        return 0

    results = {"machine": {**machine(), "note": args.note},
               "memory": [], "throughput": []}
    big = max(args.sizes)
    folder224 = write_images(args.workdir / f"jpeg224-{big}", big, 224, args.fashion_mnist)
    for size in sorted(args.sizes):
        folder = folder224 if size == big else write_images(args.workdir / f"jpeg224-{size}", size, 224,
                                                              args.fashion_mnist)
        for cache_mb in (None, 0.0 if size * 3 * 224 * 224 <= 512 * 2**20 else IN_MEMORY):
            label = "512 (default)" if cache_mb is None else ("0" if cache_mb == 0 else "1e9")
            print(f"silo data path: {size} images at 224 px, --cache-mb {label}", flush=True)
            results["memory"].append({**measure_silo(folder, cache_mb, args.workers), "cache_mb": label})
    print("throughput, 28 px", flush=True)
    folder28 = write_images(args.workdir / "png28-5000", 5000, 28, args.fashion_mnist)
    results["throughput"] += throughput(folder28, 28, 1, model_images=5000)
    print("throughput, 224 px", flush=True)
    results["throughput"] += throughput(write_images(args.workdir / "jpeg224-2000", 2000, 224, args.fashion_mnist),
                                        224, 3, model_images=1000)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loader.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "loader.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
