"""A staged federation kept between silo-sim runs (silo_sim/staging_cache.py): the second run with the same data and
options links and issues nothing, each run keeps its own state, and other options, a folder source, a half-staged
folder or certificates near their end get a federation of their own."""

import fcntl
import json
import os
import time
from pathlib import Path

import yaml
from cryptography import x509
from PIL import Image

from security.pki.store import BUNDLE_CERT
from silo_core.data import list_image_files
from silo_sim import staging_cache
from silo_sim.prepare import main as prepare
from silo_sim.stage import load_source, stage_federation
from silo_sim.staged import STAGING_EVENT, StagedFederation
from silo_sim.staging_cache import COMPLETE, describe, evict, federation_key, federations_dir, kept_federation

SMALL = ["--silos", "3", "--labels-per-class", "1", "--unlabeled", "30", "--test-per-class", "2", "--rounds", "1",
         "--seed", "11"]  # a seed no other test stages with


def staged_by(capsys, workdir, *extra) -> tuple[StagedFederation, str]:
    assert prepare([*SMALL, *extra, "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    events = [json.loads(line[len(STAGING_EVENT):]) for line in out.splitlines() if line.startswith(STAGING_EVENT)]
    assert [e["kind"] for e in events] == ["hub_staged", "staged"]
    return StagedFederation.from_json(events[-1]["staged"]), " ".join(out.split())


def serial(bundle) -> int:
    return x509.load_pem_x509_certificate((bundle / BUNDLE_CERT).read_bytes()).serial_number


def test_a_second_run_reuses_the_files_and_keeps_its_own_state(tmp_path, capsys, monkeypatch) -> None:
    first, said = staged_by(capsys, tmp_path / "one")
    assert "staging 3 silos" in said and "kept for later runs" in said

    def no_images(*args, **kwargs):
        raise AssertionError("a run whose federation is kept reads no image before its hub starts")

    with monkeypatch.context() as m:
        m.setattr("silo_sim.stage.load_source", no_images)
        second, said = staged_by(capsys, tmp_path / "two")
    assert "reusing 3 silos" in said and "staged by an earlier run in" in said and "bundled demo" in said
    kept = federations_dir()
    for a, b in zip(first.silos, second.silos, strict=True):
        assert a.certs == b.certs and a.data == b.data and a.labels == b.labels  # the same files, in the cache
        assert kept in a.certs.parents and kept in a.data.parents
        assert a.state_dir == tmp_path / "one" / "silos" / a.name / "state"  # state: each run's own
        assert b.state_dir == tmp_path / "two" / "silos" / b.name / "state"
    images = list_image_files(first.silos[0].data)
    assert len(images) == first.silos[0].num_images == 10 and all(p.is_file() for p in images)
    for run, staged in ((tmp_path / "one", first), (tmp_path / "two", second)):
        assert StagedFederation.read(run) == staged  # what reads the federation later finds its files
        assert not (run / "pki").exists()  # nothing of the kept federation is copied into the workdir
        config = yaml.safe_load((run / "hub.yaml").read_text())
        hub_certs = config["server"]["certs"]
        assert os.path.isabs(hub_certs) and Path(hub_certs) == first.ca_dir.parent / "hub"
        assert config["data"]["labeled"]["path"].startswith(str(kept)) and config["run"]["state_dir"] == "hub/state"

    restaged, said = staged_by(capsys, tmp_path / "three", "--restage")
    assert "staging 3 silos" in said and "in " + str(tmp_path / "three") in said
    assert restaged.silos[0].certs == tmp_path / "three" / "pki" / "silos" / "silo-001"
    assert serial(restaged.silos[0].certs) != serial(first.silos[0].certs)  # a CA and certificates of its own
    assert len(list_image_files(restaged.silos[0].data)) == 10


def test_other_options_or_data_files_get_their_own_federation_and_a_folder_none(tmp_path) -> None:
    options = {"num_silos": 3, "labels_per_class": 1, "partition": "iid", "seed": 0, "hub_host": "127.0.0.1"}
    key = federation_key("demo", None, options)
    assert key is not None and key == federation_key("demo", None, dict(options))
    assert len({key, federation_key("demo", None, {**options, "seed": 1}),
                federation_key("demo", None, {**options, "partition": "noniid"}),
                federation_key("demo", None, {**options, "num_silos": 4}),
                federation_key("demo", None, {**options, "hub_host": "10.0.0.5"}),
                federation_key("demo", 32, options)}) == 6
    assert federation_key("demo", None, {**options, "hub_config": {"rounds": {"total": 9}}}) == key  # hub.yaml's
    raw = tmp_path / "tv" / "FashionMNIST" / "raw"  # a torchvision data set is named by its own files
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"x" * 100)
    tv = federation_key(f"fashion-mnist:{tmp_path / 'tv'}", None, options)
    assert tv is not None and tv != key
    (raw / "train-images-idx3-ubyte").write_bytes(b"y" * 101)  # replaced: another federation
    assert federation_key(f"fashion-mnist:{tmp_path / 'tv'}", None, options) not in (tv, None)
    assert federation_key(f"fashion-mnist:{tmp_path / 'missing'}", None, options) is None  # loading will say why
    for label in ("a", "b"):  # the user's own folder may change under the same paths: never kept
        (tmp_path / "own" / label).mkdir(parents=True)
        Image.new("L", (8, 8)).save(tmp_path / "own" / label / "1.png")
    assert federation_key(str(tmp_path / "own"), None, options) is None


def test_a_half_staged_or_expiring_federation_is_staged_again(tmp_path, monkeypatch) -> None:
    key = "k" * 24
    with kept_federation(key) as (folder, reuse):
        assert not reuse
        (folder / "pki" / "hub").mkdir(parents=True)
        (folder / "stale").write_text("")
    try:
        with kept_federation(key) as (folder, reuse):
            assert not reuse  # complete, but without a readable hub certificate
            raise RuntimeError("staging failed half-way")
    except RuntimeError:
        pass
    assert not (folder / COMPLETE).exists() and not (folder / "stale").exists()  # cleared, and not marked complete

    key = stage_kept(tmp_path / "a")
    with kept_federation(key) as (_, reuse):
        assert reuse
    monkeypatch.setattr(staging_cache, "MIN_DAYS_LEFT", 120)  # the certificates are issued for 90 days
    with kept_federation(key) as (folder, reuse):
        assert not reuse and not any(folder.iterdir())  # emptied for the caller to stage afresh


def stage_kept(workdir) -> str:
    source = load_source("demo")
    options = {"num_silos": 2, "labels_per_class": 1, "unlabeled_limit": 10, "test_per_class": 1, "seed": 5}
    key = federation_key("demo", None, options)
    with kept_federation(key) as (files, reuse):
        assert not reuse
        describe(files, source, stage_federation(workdir, **options, source=source, files=files))
    return key


def kept_folders(prefix: str, count: int, hours_ago: int) -> tuple[Path, set[str]]:
    """`count` complete kept federations PREFIX-k, last used hours_ago + k hours ago (the higher k, the older);
    returns the cache folder and the names of the other complete federations already there."""
    root = federations_dir()
    root.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        folder = root / f"{prefix}-{k}"
        (folder / "silos").mkdir(parents=True)
        (folder / COMPLETE).write_text("")
        at = time.time() - 3600 * (hours_ago + k)
        os.utime(folder / COMPLETE, (at, at))
    ours = {f"{prefix}-{k}" for k in range(count)}
    return root, {p.name for p in root.iterdir() if (p / COMPLETE).is_file()} - ours


def test_only_the_most_recently_used_federations_are_kept(tmp_path) -> None:
    root, others = kept_folders("evict-test", 5, hours_ago=10)  # evict-test-4 the least recently used
    with open(root / "evict-test-4.lock", "w") as busy:  # a run is checking it right now: left alone
        fcntl.flock(busy, fcntl.LOCK_EX)
        removed = evict(keep=len(others) + 2)
    assert sorted(p.name for p in removed) == ["evict-test-2", "evict-test-3"]
    assert (root / "evict-test-4").is_dir() and (root / "evict-test-1" / COMPLETE).is_file()
    assert sorted(p.name for p in evict(keep=len(others) + 2)) == ["evict-test-4"]


def test_a_federation_a_run_is_training_on_is_not_evicted_by_another_runs_staging(tmp_path) -> None:
    # The staging lock is let go once staged; the run's hub and silos read the folder for the whole run. A
    # benchmark's next cell, staging another federation, evicted the least recently used: a running cell's.
    root, others = kept_folders("inuse-test", 2, hours_ago=1000)  # older than any other kept federation
    with staging_cache.in_use("inuse-test-1"), staging_cache.in_use("inuse-test-1"):  # two runs share it
        removed = evict(keep=len(others))
        assert [p.name for p in removed if p.name.startswith("inuse-test")] == ["inuse-test-0"]
        assert (root / "inuse-test-1" / COMPLETE).is_file()
    assert [p.name for p in evict(keep=len(others))] == ["inuse-test-1"]  # the runs ended
