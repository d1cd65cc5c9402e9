"""The suite only checks that the quality benchmark's tiny profile runs end to end; numbers live in bench/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from silo_core.models import ModelSpec, count_parameters
from tests.bench import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_tiny_profile_writes_results_table_and_curves(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
               "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("seed 0:") == 2
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {c["method"]: c for c in results["cells"]}
    assert set(cells) == {"server-only", "semifl"}
    for cell in cells.values():
        assert 0.1 < cell["final_accuracy"] <= 1.0  # better than chance on 10 classes
        assert [h["round"] for h in cell["history"]] == [1, 2]
        # The hub's model selection on its validation split: every round scored, the best one tested at the end.
        validation = [h["validation_accuracy"] for h in cell["history"]]
        best = max(range(2), key=lambda i: (validation[i], i))
        assert cell["best_round"] == best + 1 and cell["best_validation_accuracy"] == validation[best]
        assert cell["best_round_test_accuracy"] == pytest.approx(cell["history"][best]["test_accuracy"], abs=1e-6)
    assert all(h["silos_contributed"] > 0 for h in cells["semifl"]["history"])
    for h in cells["semifl"]["history"]:  # timed phase by phase, as the deployment's hub times its rounds
        parts = h["silo_train_seconds"] * h["silos_sampled"] + h["aggregation_seconds"] + h["evaluation_seconds"]
        assert 0 < parts <= h["round_seconds"]
    table = (tmp_path / "table.md").read_text()
    assert "| semifl |" in table and "| server-only |" in table
    assert "Options that differ" not in table  # the profile's own cells
    kept = table.split("The model the hub keeps")[1]
    semifl = cells["semifl"]
    assert f"| semifl | {100 * semifl['best_round_test_accuracy']:.1f} (n=1) [{semifl['best_round']}] |" in kept
    assert (tmp_path / "curves.png").stat().st_size > 5000

    # A rerun with the same settings keeps the finished cells instead of training them again.
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "seed 0:" not in again.stdout, again.stderr[-3000:]
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == results["cells"]


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_two_runs_sharing_an_output_folder_split_the_cells_between_them(tmp_path):
    """`--threads 1` runs side by side on one folder (the way to fill the full table on a small CPU): every cell
    is trained by exactly one of them and results.json ends up with both."""
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
               "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "1"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-3000:] for _, err in outputs]
    trained = [line.split()[1] for out, _ in outputs for line in out.splitlines() if "seed 0:" in line]
    assert sorted(trained) == ["semifl", "server-only"]  # each cell once, by one run or the other
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(c["method"] for c in results["cells"]) == ["semifl", "server-only"]
    assert list((tmp_path / "running").iterdir()) == []  # claims are released once a cell is saved


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_jobs_share_the_cells_of_one_command_out_among_processes(tmp_path):
    """`--jobs 2` is the two runs above as one command: it starts a helper on the same folder and queue, waits
    for it and writes the table of both; --fresh is done once, before the helper starts."""
    (tmp_path / "results.json").write_text("{}")  # a stale file that --fresh must drop, not the helper trip on
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
               "--data-root", str(DATA), "--out", str(tmp_path), "--jobs", "2", "--fresh"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = [line.split()[1] for line in proc.stdout.splitlines() if "seed 0:" in line]
    assert sorted(trained) == ["semifl", "server-only"]  # each cell once, by this run or its helper
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(c["method"] for c in results["cells"]) == ["semifl", "server-only"]
    assert "| semifl |" in (tmp_path / "table.md").read_text()
    assert list((tmp_path / "running").iterdir()) == []


def test_helper_jobs_are_single_jobs_without_fresh(monkeypatch):
    """A profile may default to several jobs (medium: 2): a helper that kept that default would start helpers of
    its own, without end."""
    quality = load_script("bench/quality/run.py", "quality_run")
    started = []
    monkeypatch.setattr(quality.subprocess, "Popen", lambda command: started.append(command) or command)
    quality.start_helper_jobs(["--profile", "medium", "--jobs", "3", "--fresh", "--jobs=3", "--out", "x"], 2, 1)
    assert len(started) == 2
    for command in started:
        assert command[2:] == ["--profile", "medium", "--out", "x", "--jobs", "1", "--threads", "1"]
    assert quality.DEFAULT_JOBS["medium"] == 2


def test_option_overrides_parse_to_json_values_and_refuse_unknown_names():
    quality = load_script("bench/quality/run.py", "quality_run")
    assert quality.parse_option_overrides(["semifl.hub_epochs=2", "semifl.lr_schedule=constant",
                                           "fedseal.theta=0.1"]) == {
        "semifl": {"hub_epochs": 2, "lr_schedule": "constant"}, "fedseal": {"theta": 0.1}}
    with pytest.raises(SystemExit, match="semifl has no option 'hub_epoch'.*hub_epochs"):
        quality.parse_option_overrides(["semifl.hub_epoch=2"])
    with pytest.raises(SystemExit, match="unknown method 'semifll'"):
        quality.parse_option_overrides(["semifll.tau=0.5"])
    with pytest.raises(SystemExit, match="expected METHOD.OPTION=VALUE"):
        quality.parse_option_overrides(["tau=0.5"])
    with pytest.raises(SystemExit, match="--option for semifl: tau: Input should be a valid number"):
        quality.parse_option_overrides(["semifl.tau=x"])


def test_a_saved_cell_survives_an_option_added_later_at_its_default():
    quality = load_script("bench/quality/run.py", "quality_run")
    profile = quality.PROFILES["full"]
    current = quality.cell_options("semifl", profile)
    older = {k: v for k, v in current.items() if k != "init_epochs"}  # saved before init_epochs existed
    assert quality.saved_options({"method": "semifl", "options": older}) == current
    assert quality.saved_options({"method": "semifl", "options": {**current, "hub_epochs": 1}}) != current
    assert quality.saved_options({"method": "semifl", "options": {**current, "removed_knob": 1}}) is None


def test_option_width_or_head_override_needs_its_own_output_folder(capsys):
    quality = load_script("bench/quality/run.py", "quality_run")  # its main(), in this process: eight refusals
    refused = [(["--option", "semifl.tau=0.5"], "give --out DIR"), (["--width", "32"], "give --out DIR"),
               (["--head", "flatten"], "give --out DIR"),
               (["--head", "flatten", "--model", "wrn28_2", "--out", "x"], "--head flatten: for --model small_cnn only"),
               (["--model", "wrn28_2", "--width", "32", "--out", "unused"], "for --model small_cnn only"),
               (["--wire-check", "--width", "32", "--out", "unused"], "leave out --model, --width and --head"),
               (["--jobs", "0"], "--jobs 0: a whole number of at least 1"),
               (["--jobs", "2", "--ray"], "--jobs 2: a whole number of at least 1, without --ray")]
    for change, message in refused:
        with pytest.raises(SystemExit) as exited:
            quality.main(["--profile", "tiny", *change])
        assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_option_override_reaches_the_cell_and_is_recorded(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny", "--methods", "semifl",
               "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "2",
               "--option", "semifl.hub_epochs=1", "--option", "semifl.init_epochs=4", "--width", "8", "--head", "flatten",
               "--option", "semifl.threshold_rule=freematch"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert (cell["options"]["hub_epochs"], cell["options"]["init_epochs"]) == (1, 4)
    assert cell["options"]["local_epochs"] == 1  # the profile's other choices stay
    # The narrower model with the flatten head is the one that trained: 8 channels instead of 16, and a classifier
    # over 32 x 7 x 7 positions instead of 64 averages.
    assert cell["model_options"] == {"width": 8, "head": "flatten"}
    trained = count_parameters(ModelSpec(options={"width": 8, "head": "flatten"}).build())
    assert cell["parameters"] == trained == count_parameters(ModelSpec(options={"width": 8}).build()) - 330 + 15690
    table = (tmp_path / "table.md").read_text()
    assert f"Model: small_cnn head flatten width 8, {trained:,} parameters." in table
    # The table names what the folder changed, so an ablation's table says what it measured.
    assert ("Options that differ from the profile's: semifl hub_epochs 1, init_epochs 4, threshold_rule freematch."
            in table)


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_wire_check_gets_the_same_accuracy_in_process_and_through_silo_sim(tmp_path):
    """The table's cells skip only transport: one small cell through hub and silo processes over gRPC + mutual TLS
    and the same cell in one process, from the same PNG files, end on the same numbers in every round."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
                           "--wire-check", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = json.loads((tmp_path / "wire_check.json").read_text())
    assert check["method"] == "semifl" and check["options"]["tau"] == 0.5  # the tiny profile's options
    # ... all of them, defaults included, on both sides (silo-sim would fill gaps with its demo values, such as a
    # constant learning rate where the table's cells use the cosine schedule)
    quality = load_script("bench/quality/run.py", "quality_run")
    assert check["options"] == quality.cell_options("semifl", quality.PROFILES["tiny"])
    assert check["options"]["lr_schedule"] == "cosine"
    assert len(check["wire_accuracy"]) == len(check["inprocess_accuracy"]) == check["rounds"] == 3
    assert 0.1 < check["wire_accuracy"][-1] <= 1.0
    # Same kernels, same thread count, float64 sums at the hub: not close, equal.
    assert check["wire_accuracy"] == check["inprocess_accuracy"] and check["max_abs_difference"] == 0.0
    assert "Wire check (semifl, 4 silos, 3 rounds" in proc.stdout
