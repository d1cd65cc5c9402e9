"""A silo whose folder holds DICOM files trains in a real federation (hub + silo processes over mutual TLS), and
the patient name and ID written in every file appear in no log, no process output and no file the run writes."""

import json

import pytest

from silo_sim.stage import stage_federation
from tests.conftest import free_port
from tests.dicom_files import SECRET_ID, SECRET_NAME, png_to_dicom

pytest.importorskip("pydicom", reason="needs pydicom: pip install 'silokit[dicom]'")

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}


def test_a_silo_with_dicom_files_trains_and_no_header_value_leaves_it(tmp_path, processes):
    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=1, labels_per_class=1, unlabeled_limit=24, test_per_class=2, seed=3,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 2.0, "linger_s": 5.0},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 2, "min_silos": 1, "quorum": 1.0, "deadline_s": 120},
        },
    )
    silo = staged.silos[0]
    converted = [png_to_dicom(png) for png in sorted(silo.data.iterdir())]
    # One file the silo cannot read, so that a skip reason is logged too: a header cut off before the image.
    (silo.data / "zz-damaged.dcm").write_bytes(converted[0].read_bytes()[:300])
    assert sorted(p.suffix for p in silo.data.iterdir()) == [".dcm"] * 25

    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    client = processes.start_silo(silo, port, "--sim-labels", str(silo.labels), connect_timeout=60)
    assert hub.wait(timeout=180) == 0, processes.log("hub")
    assert client.wait(timeout=60) == 0, processes.log(silo.name)

    rounds = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["silos_reported"] == 1 for r in rounds)
    card = json.loads((staged.hub_state_dir / "model_card.json").read_text())
    assert card["silos"][silo.name]["rounds_contributed"] == 2
    assert card["silos"][silo.name]["skipped_images"] == 1
    silo_log = processes.log(silo.name)
    assert "loaded 24 images" in silo_log and "zz-damaged.dcm: a DICOM file without an image" in silo_log

    # Everything the run wrote (logs with the processes' output, state folders, certificates, configs), but not
    # the DICOM files themselves, which do hold the name and ID.
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".dcm"]
    assert {"hub.log", f"{silo.name}.log", "model_card.json", "history.json"} <= {p.name for p in written}
    secrets = [s.encode() for s in (SECRET_NAME, SECRET_ID, "SECRET")]
    for path in written:
        data = path.read_bytes()
        assert not any(secret in data for secret in secrets), path
