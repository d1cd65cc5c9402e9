"""silo-client --metrics-port: a real silo process serves its metrics, labelled with its certificate's name, and
counts what happens (here: a hub that is not there). A busy port is one clear error."""

import socket
import urllib.request

from security.pki import init_ca, issue_silo
from tests.conftest import free_port, wait_for
from tests.silo_client.test_cli_errors import assert_one_clear_line, run_client, write_images


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_a_silo_serves_its_metrics_while_it_waits_for_the_hub(tmp_path, processes):
    write_images(tmp_path / "images")
    init_ca(tmp_path / "ca")
    certs = issue_silo(tmp_path / "ca", "branch-07", tmp_path / "bundle", days=20)
    port = free_port()
    proc = processes.start("silo", "-m", "silo_client.cli", "--data", str(tmp_path / "images"), "--certs", str(certs),
                           "--hub", f"127.0.0.1:{free_port()}", "--connect-timeout", "60", "--metrics-port", str(port))

    def failed_calls_counted():
        if proc.poll() is not None:
            return "exited"
        text = scrape(port)
        return text if 'code="UNAVAILABLE"' in text else None

    text = wait_for(failed_calls_counted, 60, "metrics showing the failed calls")
    assert text != "exited", processes.log("silo")
    assert 'silokit_silo_hub_errors_total{code="UNAVAILABLE",silo="branch-07"}' in text
    assert 'silokit_silo_rounds_joined_total{silo="branch-07"} 0.0' in text  # labelled by the certificate's CN
    line = [ln for ln in text.splitlines() if ln.startswith("silokit_silo_certificate_remaining_seconds")][0]
    assert 19 * 86400 < float(line.split()[-1]) <= 20 * 86400


def test_a_busy_metrics_port_is_one_clear_line(tmp_path):
    write_images(tmp_path / "images")
    init_ca(tmp_path / "ca")
    certs = issue_silo(tmp_path / "ca", "silo-a", tmp_path / "silo-a")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, err = run_client("--data", str(tmp_path / "images"), "--certs", str(certs), "--metrics-port",
                             str(busy.getsockname()[1]))
    assert rc == 2
    assert_one_clear_line(err, "cannot serve metrics", "--metrics-port")
