"""The README's config reference must cover every hub.yaml key and every option of every algorithm."""

import re
from pathlib import Path

import yaml

from security.secagg.params import SecAggParams
from silo_core.algorithms import ALGORITHMS
from silo_core.algorithms.base import SGDOptions, StrongAugmentOptions
from silo_core.algorithms.semifl import SemiFLOptions
from silo_server.config import DataSource, HubConfig

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_hub_config_key_is_documented():
    missing = []
    for section, field in HubConfig.model_fields.items():
        model = field.annotation
        for key in getattr(model, "model_fields", {}):
            if f"`{section}.{key}" not in README:
                missing.append(f"{section}.{key}")
    assert not missing, f"undocumented hub.yaml keys: {missing}"


def test_every_data_source_key_and_semifl_option_is_documented():
    for key in DataSource.model_fields:
        assert key in README, key
    missing = [k for k in SemiFLOptions.model_fields if f"`{k}`" not in README]
    assert not missing, f"undocumented SemiFL options: {missing}"


def readme_section(name: str) -> str:
    """The README text from `<!-- options:NAME -->` to the next options marker."""
    start = README.index(f"<!-- options:{name} -->")
    end = README.index("<!-- options:", start + 1)
    return README[start:end]


# server-only takes SemiFL's options; options shared through base.py are documented once, in the shared table.
SECTION = {"server-only": "semifl"}
SHARED = set(SGDOptions.model_fields) | set(StrongAugmentOptions.model_fields)


def test_every_option_of_every_algorithm_is_documented_in_its_section():
    missing = []
    for name, entry in ALGORITHMS.items():
        own = readme_section(SECTION.get(name, name))
        shared = readme_section("shared")
        for key in entry.options.model_fields:
            in_shared = key in SHARED and name not in ("semifl", "server-only")
            if f"`{key}`" not in own and not (in_shared and f"`{key}`" in shared):
                missing.append(f"{name}.{key}")
    assert not missing, f"undocumented algorithm options: {missing}"
    assert all(f"`{name}`" in README for name in ALGORITHMS)


def test_quickstart_gives_the_two_commands_and_ci_runs_the_second_verbatim():
    assert 'pip install -e . && silo-sim' in README
    test_command = 'pip install -e ".[dev]" && pytest'
    assert test_command in README
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()


def test_every_algorithm_block_in_docs_algorithms_is_a_valid_config_section():
    import re

    import yaml

    from silo_server.config import parse_config

    text = (Path(__file__).resolve().parent.parent / "docs" / "algorithms.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    names = []
    for block in blocks:
        data = block.get("data", {"labeled": {"kind": "demo"}})
        config = parse_config({"data": data, "algorithm": block["algorithm"]})
        config.algorithm.parsed_options()
        names.append(config.algorithm.name)
    assert sorted(names) == sorted(ALGORITHMS)


def test_the_bring_your_own_model_examples_work(tmp_path, monkeypatch):
    """docs/byo-model.md: the hub.yaml parses, and its factory example, installed as written, builds a network the
    registry accepts with the options the page gives."""
    import re
    import sys

    import torch
    import yaml

    from silo_core.models import ModelSpec
    from silo_server.config import ModelSection, parse_config

    text = (Path(__file__).resolve().parent.parent / "docs" / "byo-model.md").read_text()
    hub, factory_model = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "resnet18.safetensors").write_bytes(b"")  # only its existence is checked here
    config = parse_config(hub, base=tmp_path)
    assert (config.model.name, config.model.in_channels, config.model.image_size) == ("torchvision/resnet18", 1, 224)
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    package = tmp_path / "site" / "their_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "their_pkg", raising=False)
    section = ModelSection.model_validate(factory_model["model"])
    spec = ModelSpec(section.factory, num_classes=3, in_channels=section.in_channels, image_size=section.image_size,
                     options=section.options, factory=section.factory)
    model = spec.build()
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == 5  # depth 5 from options


def test_the_example_hub_config_says_how_many_silos_secure_aggregation_needs():
    """Turning secure aggregation on in examples/hub.yaml must not leave the hub waiting for a silo the comment
    never asked for: the number it names is the one the hub plans with."""
    text = (Path(__file__).resolve().parent.parent / "examples" / "hub.yaml").read_text()
    (named,) = re.findall(r"needs >= (\d+) silos per round", text)
    section = yaml.safe_load(text)["privacy"]["secure_aggregation"]
    assert int(named) == SecAggParams.model_validate({**section, "enabled": True}).fewest_sampled() == 4
