"""Bad input at the hub: one clear line naming the key or file, exit code 2, no traceback."""

import subprocess
import sys

import yaml

from security.pki import init_ca, issue_hub


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
