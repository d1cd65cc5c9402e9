"""Bad input at a silo: one clear line that says what to do, exit code 2, no traceback (unless --verbose)."""

import subprocess
import sys

import numpy as np
from PIL import Image

from security.pki import init_ca, issue_hub, issue_silo
from tests.conftest import free_port


def run_client(*args, timeout=60):
    proc = subprocess.run([sys.executable, "-m", "silo_client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr


def write_images(folder, n=3):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((28, 28), i * 40, dtype=np.uint8)).save(folder / f"{i}.png")


def assert_one_clear_line(stderr, *words):
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_and_empty_data_folders(tmp_path):
    init_ca(tmp_path / "ca")
    certs = issue_silo(tmp_path / "ca", "silo-a", tmp_path / "silo-a")
    rc, err = run_client("--data", str(tmp_path / "nope"), "--certs", str(certs))
    assert rc == 2
    assert_one_clear_line(err, "does not exist", "--data")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images here")
    rc, err = run_client("--data", str(tmp_path / "empty"), "--certs", str(certs))
    assert rc == 2
    assert_one_clear_line(err, "holds no images")
    # A mistyped --labeled is named as such, not blamed on --data.
    rc, err = run_client("--data", str(tmp_path / "empty"), "--labeled", str(tmp_path / "typo"), "--certs", str(certs))
    assert rc == 2
    assert_one_clear_line(err, "--labeled folder", "typo", "does not exist")


def test_missing_certificates_name_the_file(tmp_path):
    write_images(tmp_path / "images")
    rc, err = run_client("--data", str(tmp_path / "images"), "--certs", str(tmp_path / "no-certs"))
    assert rc == 2
    assert_one_clear_line(err, "no-certs", "silo-certs issue-silo")


def test_a_hub_that_is_down_or_a_wrong_port_gives_up_with_a_clear_message(tmp_path):
    write_images(tmp_path / "images")
    init_ca(tmp_path / "ca")
    certs = issue_silo(tmp_path / "ca", "silo-a", tmp_path / "silo-a")
    issue_hub(tmp_path / "ca", tmp_path / "hub")
    rc, err = run_client("--data", str(tmp_path / "images"), "--certs", str(certs), "--hub",
                         f"127.0.0.1:{free_port()}", "--connect-timeout", "2")
    assert rc == 2
    assert_one_clear_line(err, "cannot reach the hub", "--hub HOST:PORT", "gave up")
