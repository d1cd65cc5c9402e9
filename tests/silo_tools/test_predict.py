"""silo-predict: the CSV, top-k, labeled metrics, which weights are used, and refusals, on a state folder laid out
as the hub leaves it (tests/silo_tools/state.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from PIL import Image

from silo_core.augment import to_float
from silo_core.data import DataError, class_folder_name, load_image_file, load_labeled_folder
from silo_core.training import evaluate
from silo_tools.card import CardError, load_trained_model
from silo_tools.predict import labeled_files, labeled_metrics, main
from tests.conftest import ROOT
from tests.silo_tools.state import CLASSES, tiny_spec, write_images, write_state


def reference_probs(model, paths, spec=None):
    """Softmax outputs of the PyTorch model on the images, fed as the hub feeds them."""
    spec = spec or tiny_spec()
    x = torch.stack([load_image_file(p, spec.image_size, spec.in_channels) for p in paths])
    with torch.no_grad():
        return torch.softmax(model(to_float(x, spec.mean, spec.std)), 1)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_has_one_row_per_readable_image_with_top_k(tmp_path, capsys):
    models = write_state(tmp_path / "state")
    images = tmp_path / "images"
    paths = write_images(images, 4) + write_images(images / "nested" / "deeper", 3, seed=5)
    (images / "broken.png").write_bytes(b"not a png")
    (images / "notes.txt").write_text("not an image")
    out = tmp_path / "predictions.csv"
    assert main(["--model", str(tmp_path / "state"), str(images), "--out", str(out), "--quiet"]) == 0

    rows = read_csv(out)
    assert rows[0] == ["path", "class", "confidence", "class_2", "confidence_2", "class_3", "confidence_3"]
    rows = rows[1:]
    assert [r[0] for r in rows] == ["000.png", "001.png", "002.png", "003.png",
                                    "nested/deeper/000.png", "nested/deeper/001.png", "nested/deeper/002.png"]
    probs = reference_probs(models["final"], paths)
    for row, p in zip(rows, probs, strict=True):
        conf, idx = p.sort(descending=True)
        assert row[1::2] == [CLASSES[i] for i in idx.tolist()]  # every class, most likely first
        assert [float(v) for v in row[2::2]] == pytest.approx(conf.tolist(), abs=2e-6)
    err = capsys.readouterr().err
    assert "skipped " in err and "broken.png" in err and "notes.txt" not in err

    # --top-k 1: the class and its confidence only; a larger k than the classes is cut to the classes.
    assert main(["--model", str(tmp_path / "state"), str(images), "--out", str(out), "--force", "--quiet",
                 "--top-k", "1", "--batch-size", "3"]) == 0
    one = read_csv(out)
    assert one[0] == ["path", "class", "confidence"] and [r[1] for r in one[1:]] == [r[1] for r in rows]


def test_labeled_folder_gives_the_known_accuracy_recall_and_confusion_matrix(tmp_path, capsys):
    """Images are filed under the class the model predicts for them (right) or under the next class (wrong), so
    every number is known in advance; the accuracy equals the hub's evaluate() on the same folder."""
    models = write_state(tmp_path / "state")
    pool = write_images(tmp_path / "pool", 12, seed=3)
    predicted = reference_probs(models["final"], pool).argmax(1).tolist()
    labeled = tmp_path / "labeled"
    for name in CLASSES:  # every class folder, some maybe empty, as the hub's layout has
        (labeled / name).mkdir(parents=True)
    expected = torch.zeros(3, 3, dtype=torch.int64)
    for i, (path, pred) in enumerate(zip(pool, predicted, strict=True)):
        truth = pred if i % 3 else (pred + 1) % 3  # every third image is filed wrongly
        path.rename(labeled / CLASSES[truth] / f"{i:02d}.png")
        expected[truth, pred] += 1
    Image.new("L", (8, 8)).save(labeled / "loose.png")  # in no class folder: skipped, named
    out = tmp_path / "run" / "labeled.csv"
    assert main(["--model", str(tmp_path / "state"), "--labeled", str(labeled), "--out", str(out)]) == 0

    metrics = json.loads((tmp_path / "run" / "labeled_metrics.json").read_text())
    assert metrics["images"] == 12 and metrics["correct"] == 8
    assert metrics["accuracy"] == pytest.approx(8 / 12)
    assert metrics["confusion_matrix"]["counts"] == expected.tolist()
    for i, name in enumerate(CLASSES):
        n = int(expected[i].sum())
        assert metrics["per_class"][name]["images"] == n
        assert metrics["per_class"][name]["recall"] == (pytest.approx(int(expected[i, i]) / n) if n else None)
    assert [s["path"] for s in metrics["skipped"]] == [str(labeled / "loose.png")]
    assert metrics["model"]["weights_file"] == "model.safetensors" and metrics["model"]["round"] == 4

    hub = load_labeled_folder(labeled, 16, 1)  # how the hub scores a test folder
    spec = tiny_spec()
    assert evaluate(models["final"], hub.images, hub.labels, spec.mean, spec.std,
                    torch.device("cpu"))["accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-6)

    rows = read_csv(out)
    assert rows[0][:3] == ["path", "label", "class"] and len(rows) == 13
    assert sum(r[1] == r[2] for r in rows[1:]) == 8
    printed = capsys.readouterr().out
    assert "accuracy 66.67% (8 of 12 images)" in printed and "confusion matrix" in printed
    with Image.open(tmp_path / "run" / "labeled_confusion.png") as png:
        assert png.format == "PNG" and png.width > 3 * 40 and png.height > 3 * 40


def test_labeled_metrics_numbers():
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [2, 0, 4]])
    m = labeled_metrics(confusion, ["x", "y", "z"])
    assert m["images"] == 10 and m["correct"] == 7 and m["accuracy"] == pytest.approx(0.7)
    assert m["per_class"]["x"] == {"images": 4, "correct": 3, "recall": 0.75}
    assert m["per_class"]["y"]["recall"] is None  # no images of y: no recall, and not in the mean
    assert m["mean_recall"] == pytest.approx((0.75 + 4 / 6) / 2)


def test_best_model_is_used_unless_final(tmp_path):
    models = write_state(tmp_path / "state", best_round=2)
    best = load_trained_model(tmp_path / "state")
    final = load_trained_model(tmp_path / "state", final=True)
    assert (best.weights.name, best.round, best.which) == ("best_model.safetensors", 2, "best")
    assert (final.weights.name, final.round, final.which) == ("model.safetensors", 4, "final")
    assert not best.model.training and not final.model.training

    paths = write_images(tmp_path / "images", 3)
    for flags, which in (([], "best"), (["--final"], "final")):
        out = tmp_path / f"{which}.csv"
        assert main(["--model", str(tmp_path / "state"), str(tmp_path / "images"), "--out", str(out), "-q",
                     *flags]) == 0
        got = [float(r[2]) for r in read_csv(out)[1:]]
        assert got == pytest.approx(reference_probs(models[which], paths).max(1).values.tolist(), abs=2e-6)

    # The card names a best model that is not there: refused, with the way out.
    (tmp_path / "state" / "best_model.safetensors").unlink()
    with pytest.raises(CardError, match="best_model.safetensors is missing.*pass --final"):
        load_trained_model(tmp_path / "state")
    assert load_trained_model(tmp_path / "state", final=True).which == "final"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "silo_tools.predict", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


@dataclass
class Result:
    returncode: int
    stderr: str


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_weights_that_do_not_match_the_card_are_refused(tmp_path):
    write_state(tmp_path / "state")
    write_images(tmp_path / "images", 2)
    weights = tmp_path / "state" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    line = one_line_error(run_cli("--model", tmp_path / "state", tmp_path / "images", "--out", tmp_path / "p.csv"))
    assert str(weights) in line and "does not match the model card" in line
    assert not (tmp_path / "p.csv").exists()


def test_errors_are_one_line_naming_the_fault(tmp_path, capsys):
    def run(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        return Result(rc, capsys.readouterr().err)

    state, images, out = tmp_path / "state", tmp_path / "images", tmp_path / "p.csv"
    write_images(images, 2)
    assert "does not exist" in one_line_error(run("--model", state, images, "--out", out))
    state.mkdir()
    assert "model_card.json is missing" in one_line_error(run("--model", state, images, "--out", out))
    write_state(state)
    (state / "model.safetensors").unlink()
    assert "model.safetensors is missing" in one_line_error(run("--model", state, images, "--out", out))

    write_state(state)
    card = json.loads((state / "model_card.json").read_text())
    (state / "model_card.json").write_text(json.dumps({**card, "format": "silokit model card v9"}))
    assert "upgrade silokit" in one_line_error(run("--model", state, images, "--out", out))
    (state / "model_card.json").write_text(json.dumps({**card, "weights_file": "../elsewhere.safetensors"}))
    assert "weights_file must be a file name in the state folder" in one_line_error(
        run("--model", state, images, "--out", out))
    (state / "model_card.json").write_text(json.dumps({**card, "classes": ["only", "two"]}))
    assert "names 2 classes but model.num_classes is 3" in one_line_error(
        run("--model", state, images, "--out", out))
    (state / "model_card.json").write_text("{not json")
    assert "cannot be read as JSON" in one_line_error(run("--model", state, images, "--out", out))
    write_state(state)

    assert "no images found" in one_line_error(run("--model", state, tmp_path / "state", "--out", out))
    assert "is not a folder" in one_line_error(run("--model", state, tmp_path / "nowhere", "--out", out))
    out.write_text("mine")
    assert "pass --force" in one_line_error(run("--model", state, images, "--out", out))
    assert out.read_text() == "mine"
    (tmp_path / "labeled" / "z_zebra").mkdir(parents=True)
    assert "not one of the model's classes" in one_line_error(
        run("--model", state, "--labeled", tmp_path / "labeled", "--out", tmp_path / "q.csv"))
    # When no image can be read, the error names an unreadable file and why, not a loose image or a hidden file.
    unreadable = tmp_path / "unreadable"
    (unreadable / CLASSES[0]).mkdir(parents=True)
    (unreadable / CLASSES[0] / "broken.png").write_bytes(b"not a png")
    write_images(unreadable, 1)
    (unreadable / "._0.png").write_bytes(b"macOS metadata")
    result = run("--model", state, "--labeled", unreadable, "--out", tmp_path / "r.csv")
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and "broken.png" in line and "not inside a class sub-folder" not in line
    assert [p.name for p, _ in labeled_files(unreadable, CLASSES)[1]] == ["000.png"]  # the hidden file is no image


def test_class_folders_may_be_named_as_silokit_writes_them_when_a_class_name_holds_a_slash(tmp_path):
    """Fashion-MNIST's "T-shirt/top" (the demo data's and a torchvision hub's first class) can name no folder:
    a folder named as silokit writes it ("0_T-shirt_top") scores as that class, one named as the class as that."""
    classes = ["T-shirt/top", "Trouser", "Pullover"]
    write_images(tmp_path / class_folder_name(0, classes[0], 3), 2)
    write_images(tmp_path / "Pullover", 1)
    files, loose = labeled_files(tmp_path, classes)
    assert [(p.parent.name, k) for p, k in files] == [("0_T-shirt_top", 0), ("0_T-shirt_top", 0), ("Pullover", 2)]
    assert loose == []
    write_images(tmp_path / "T-shirt_top", 1)  # neither the class nor silokit's name for it
    with pytest.raises(DataError, match=r"T-shirt_top is not one of the model's classes .* silokit writes them "
                                        r"\(0_T-shirt_top, 1_Trouser, 2_Pullover\)"):
        labeled_files(tmp_path, classes)


FACTORY = "tests.model_factories:tiny_net"


def test_a_card_naming_a_user_factory_is_built_only_when_the_user_names_it(tmp_path, monkeypatch):
    # A factory whose import would leave a mark: naming it in a card must not import it.
    (tmp_path / "their_pkg.py").write_text("import pathlib\n"
                                            f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
                                            "def build(**kw): raise AssertionError('never called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_state(tmp_path / "state")
    card_path = tmp_path / "state" / "model_card.json"
    card = json.loads(card_path.read_text())
    card["model"]["factory"] = card["model"]["name"] = "their_pkg:build"
    card_path.write_text(json.dumps(card))
    with pytest.raises(CardError, match="pass --model-factory their_pkg:build if you trust"):
        load_trained_model(tmp_path / "state")
    with pytest.raises(CardError, match=r"names the user model factory their_pkg:build \(--model-factory names "
                                        r"other.mod:fn\)"):
        load_trained_model(tmp_path / "state", model_factory="other.mod:fn")
    assert not (tmp_path / "imported").exists()

    write_state(tmp_path / "plain")
    with pytest.raises(CardError, match="names no user factory.*leave --model-factory out"):
        load_trained_model(tmp_path / "plain", model_factory=FACTORY)

    # Named by the user: built through the registry, and it must be the network the hub trained.
    spec = tiny_spec(name=FACTORY, factory=FACTORY)
    models = write_state(tmp_path / "factory", spec)
    trained = load_trained_model(tmp_path / "factory", model_factory=FACTORY)
    paths = write_images(tmp_path / "images", 3)
    assert torch.equal(reference_probs(trained.model, paths, spec), reference_probs(models["final"], paths, spec))
    import tests.model_factories as factories

    monkeypatch.setattr(factories, "HIDDEN_WIDTH", factories.HIDDEN_WIDTH * 2)  # another release of the package
    with pytest.raises(CardError, match="not the network the hub trained"):
        load_trained_model(tmp_path / "factory", model_factory=FACTORY)


# What silo-predict and silo-export must never import: they run where only `pip install silokit` was done, and
# read nothing but the state folder.
FORBIDDEN = ("grpc", "silo_server", "silo_client", "silo_sim", "security", "opacus")

HYGIENE = """
import sys
from silo_tools import {module}
rc = {module}.main(sys.argv[1:])
bad = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
print("FORBIDDEN:", bad)
sys.exit(rc if not bad else 99)
"""


@pytest.mark.parametrize("module", ["predict", "export"])
def test_the_tools_import_no_hub_silo_or_transport_code(tmp_path, module):
    write_state(tmp_path / "state")
    write_images(tmp_path / "images", 2)
    args = ([tmp_path / "images", "--out", tmp_path / "p.csv"] if module == "predict"
            else ["--format", "onnx", "--out", tmp_path / "m.onnx"])
    code = HYGIENE.format(module=module, forbidden=FORBIDDEN)
    result = subprocess.run([sys.executable, "-c", code, "--model", str(tmp_path / "state"), *map(str, args)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FORBIDDEN: []" in result.stdout
