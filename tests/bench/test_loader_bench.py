"""The loader benchmark runs end to end on tiny folders (the real numbers come from `python bench/systems/loader.py`,
not from the suite): the silo child reports every phase, the memory sampler sees its process tree, the report
renders."""

import numpy as np
from PIL import Image

from tests.bench import load_script


def write(folder, count, size, mode):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        shape = (size, size) if mode == "L" else (size, size, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(folder / f"{i:03d}.{'png' if mode == 'L' else 'jpg'}")
    return folder


def test_the_silo_data_path_and_throughput_run_on_tiny_folders(tmp_path):
    bench = load_script("bench/systems/loader.py", "loader_bench")
    folder = write(tmp_path / "rgb", 24, 224, "RGB")
    lazy = bench.measure_silo(folder, 0.0, workers=1)
    assert lazy["lazy"] and lazy["images"] == 24
    assert [p["phase"] for p in lazy["phases"]] == ["start", "load", "read every image", "pseudo-label 1,000",
                                                     "SemiFL update, 100 steps"]
    assert lazy["phases"][2]["images"] == 24 and lazy["phases"][4]["steps"] == 3  # 24 images in batches of 8
    assert lazy["peak_rss_mb"] >= lazy["phases"][0]["rss_mb"] > 0 and lazy["peak_tree_pss_mb"] > 0
    rows = bench.throughput(write(tmp_path / "gray", 40, 28, "L"), 28, 1, model_images=40)
    assert [r["mode"] for r in rows] == ["in memory", "lazy, 0 workers", "lazy, 2 workers"]
    assert all(r["images"] == 40 and r["loader_images_per_s"] > 0 for r in rows)
    report = bench.markdown({"machine": {"platform": "test", "cpu_count": 2, "note": ""},
                             "memory": [{**lazy, "cache_mb": "0"}], "throughput": rows})
    assert "| 24 | 0 | files (lazy) |" in report and "| 28 px | lazy, 2 workers |" in report
