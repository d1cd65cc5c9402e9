"""The README's config reference must cover every hub.yaml key and every SemiFL option the code accepts."""

from pathlib import Path

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


def test_quickstart_gives_the_two_commands_and_ci_runs_the_second_verbatim():
    assert 'pip install -e . && silo-sim' in README
    test_command = 'pip install -e ".[dev]" && pytest'
    assert test_command in README
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
