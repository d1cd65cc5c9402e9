"""The privacy benchmark's secure-aggregation harness runs and its numbers are consistent (the real table is
produced by `python bench/privacy/run.py secagg`, not by the suite)."""

import json

from tests.bench import load_script


def test_secagg_bench_tiny_profile():
    bench = load_script("bench/privacy/run.py", "privacy_bench")
    rows = bench.bench_secagg([4], dropout=0.25)
    assert [r["dropped_after_sharing"] for r in rows] == [0, 1]
    for r in rows:
        assert r["parameters"] > 1_400_000 and (r["neighbours_k"], r["threshold_t"]) == (3, 2)
        # a masked upload is 4 bytes per value plus small framing: within 1% of the plain float32 upload
        assert r["plain_upload_bytes"] < r["silo_bytes_up_mean"] < 1.01 * r["plain_upload_bytes"]
        assert r["max_abs_error_checked"] < r["contributors"] * 2 * 1024 / (2**20 - 1)
    assert rows[1]["contributors"] == 3
    assert bench.noise_for_epsilon(8.0, rounds=10, sample_rate=0.5) > 0.5


def test_sample_dp_bench_tiny_run(tmp_path):
    """One round, 2 silos: the harness trains with DP-SGD, reads each silo's ledger and writes its table."""
    bench = load_script("bench/privacy/run.py", "privacy_bench")
    assert bench.main(["sample-dp", "--rounds", "1", "--silos", "2", "--noise-multipliers", "1.0", "--tau", "0.0", "--silo-images", "200",
                       "--threads", "1",
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sample_dp.json").read_text())
    cells = {c["setting"]: c for c in data["cells"]}
    assert set(cells) == {"server-only", "none", "none-fix-only", "1.0"}
    assert cells["server-only"]["max_silo_epsilon"] is None and cells["none"]["max_silo_epsilon"] is None
    assert cells["1.0"]["max_silo_epsilon"] > 0
    assert all(0.1 < c["final_accuracy"] <= 1 for c in cells.values())
    assert "| SemiFL + DP-SGD at the silos | 1 |" in (tmp_path / "sample_dp.md").read_text()
