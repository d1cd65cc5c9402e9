"""Bad input at the hub: one clear line naming the key or file, exit code 2, no traceback."""

import os
import subprocess
import sys

import yaml

from security.pki import init_ca, issue_hub
from tests.silo_client.test_cli_errors import write_images


def run_server(*args):
    proc = subprocess.run([sys.executable, "-m", "silo_server.cli", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_config_typo_names_the_key(tmp_path):
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "demo"}}, "rounds": {"totl": 3}}))
    rc, err = run_server("--config", str(cfg))
    assert rc == 2
    assert "unknown key 'rounds.totl'" in err and "Traceback" not in err


def test_missing_config_file(tmp_path):
    rc, err = run_server("--config", str(tmp_path / "hub.yaml"))
    assert rc == 2 and "not found" in err and "Traceback" not in err


def test_missing_labeled_folder_and_missing_certificates(tmp_path):
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "imagefolder", "path": "nowhere"}}}))
    rc, err = run_server("--config", str(cfg))
    assert rc == 2 and "nowhere" in err and "Traceback" not in err
    cfg.write_text(yaml.safe_dump({
        "data": {"labeled": {"kind": "demo", "labels_per_class": 2}},
        "server": {"certs": "missing-certs", "host": "127.0.0.1", "port": 0},
        "run": {"state_dir": "state"},
    }))
    rc, err = run_server("--config", str(cfg))
    assert rc == 2 and "missing-certs" in err and "silo-certs issue-hub" in err and "Traceback" not in err


def test_a_validation_folder_with_other_classes_than_the_labeled_one_is_refused_at_start(tmp_path):
    for split, names in (("labeled", ("benign", "malignant", "normal")), ("validation", ("malignant", "normal"))):
        for name in names:
            write_images(tmp_path / split / name, n=2)
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({
        "data": {"labeled": {"kind": "imagefolder", "path": "labeled"},
                 "validation": {"kind": "imagefolder", "path": "validation"}},
        "model": {"image_size": 28, "in_channels": 1},
        "run": {"state_dir": "state", "device": "cpu"}}))
    rc, err = run_server("--config", str(cfg), "--check")
    assert rc == 2 and "Traceback" not in err, err
    assert ("data.validation has classes [malignant, normal] but data.labeled has [benign, malignant, normal]"
            in err and "give a class the split lacks an empty folder" in err), err


def test_a_class_folder_named_in_another_encoding_is_refused_at_start(tmp_path):
    # Class names go to every silo in the run description: a Latin-1 folder name (surrogates in Python) once let
    # the hub start and then failed every Join on protobuf's UTF-8 encoding.
    labeled = os.fsencode(tmp_path / "labeled")
    for name in (b"R\xe9sum\xe9", b"other"):
        write_images(tmp_path / os.fsdecode(labeled + b"/" + name), n=2)
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "imagefolder", "path": "labeled"}},
                                   "model": {"image_size": 28, "in_channels": 1},
                                   "run": {"state_dir": "state", "device": "cpu"}}))
    rc, err = run_server("--config", str(cfg), "--check")
    assert rc == 2 and "Traceback" not in err, err
    assert "data.labeled has a class folder whose name is not UTF-8 text ('R\\udce9sum\\udce9'); rename it" in err


def test_check_mode_validates_without_serving(tmp_path):
    init_ca(tmp_path / "ca")
    issue_hub(tmp_path / "ca", tmp_path / "hub")
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "demo", "labels_per_class": 3}},
                                   "server": {"certs": "hub"}, "run": {"state_dir": "state"}}))
    proc = subprocess.run([sys.executable, "-m", "silo_server.cli", "--config", str(cfg), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "30 labeled images in 10 classes" in proc.stdout
    assert "model selection: none (no data.validation)" in proc.stdout
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "demo", "labels_per_class": 3},
                                            "validation": {"kind": "demo", "split": "test", "labels_per_class": 2}},
                                   "server": {"certs": "hub"}, "run": {"state_dir": "state"}}))
    proc = subprocess.run([sys.executable, "-m", "silo_server.cli", "--config", str(cfg), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "model selection: 20 validation images score every round" in proc.stdout


def late_error_federation(tmp_path):
    """A hub.yaml whose fault is found late: after the hub has logged (an unreadable labeled image) and, under
    --check, printed its plan: the newest checkpoint is damaged."""
    init_ca(tmp_path / "ca")
    issue_hub(tmp_path / "ca", tmp_path / "hub")
    for label in ("a", "b"):
        write_images(tmp_path / "labeled" / label)
    (tmp_path / "labeled" / "a" / "broken.png").write_bytes(b"not a png")
    damaged = tmp_path / "state" / "checkpoints" / "round-1"
    damaged.mkdir(parents=True)
    (damaged / "state.json").write_text("{}")  # and no tensors file
    (tmp_path / "state" / "checkpoints" / "LATEST").write_text("round-1")
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"labeled": {"kind": "imagefolder", "path": "labeled"}},
                                   "server": {"certs": "hub", "host": "127.0.0.1", "port": 0},
                                   "run": {"state_dir": "state", "device": "cpu"}}))
    return cfg


def merged_output(*args):
    """stdout and stderr into one pipe, as a terminal log, `2>&1 | tee` or the systemd journal takes them, with
    Python's default buffering (PYTHONUNBUFFERED unset: it would hide a stream that is written out of order)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-m", "silo_server.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, env=env)
    return proc.returncode, proc.stdout


def test_a_late_error_is_a_whole_last_line_after_everything_logged_and_printed_before_it(tmp_path):
    cfg = late_error_federation(tmp_path)
    for mode in (["--check"], []):
        rc, out = merged_output("--config", str(cfg), *mode)
        assert rc == 2 and out.endswith("\n"), out
        lines = out.splitlines()
        errors = [i for i, line in enumerate(lines) if "error:" in line]
        assert errors == [len(lines) - 1], out  # one error line, the last one ...
        assert lines[-1].startswith("error: no checkpoint in") and "state.safetensors is missing" in lines[-1]
        logged = [i for i, line in enumerate(lines) if "WARNING silo_server: 1 unreadable images skipped" in line]
        assert len(logged) == 1, out  # ... after the log line written before it was found
        if mode:  # and after the plan --check printed before it (on stdout)
            assert any(line.startswith("config OK: 6 labeled images in 2 classes") for line in lines), out
