"""hub.yaml: read with yaml.safe_load into pydantic models that refuse unknown keys and name the bad one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from security.pki import PkiError, validate_silo_name
from silo_core.algorithms import ALGORITHMS, get_algorithm
from silo_core.config_base import ConfigPath, StrictConfig, format_validation_error
from silo_core.data import DEFAULT_CACHE_MB, DEFAULT_LOADER_WORKERS
from silo_core.dp_sgd import sample_dp_unfit
from silo_core.models import RUN_WEIGHTS, ModelSpec
from silo_core.tensors import CHUNK_BYTES
from silo_server.rounds.privacy import PrivacySection
from silo_server.rounds.robust import AggregationSection


class ConfigError(ValueError):
    """A config file problem, phrased for the operator: which file, which key, what to do."""


# Upper bounds: far above any real federation, low enough that a typo (an extra zero or three) is caught here
# rather than as a hub that hangs, exhausts memory or never ends.
MAX_SILOS = 100_000
DAY_S = 86_400.0
Seed = Annotated[int, Field(ge=0, le=2**32 - 1, description="numpy's generators take seeds in [0, 2^32)")]


def _fraction(value: Any, count_key: str, what: str) -> Any:
    """A fraction key takes a fraction written as one (0.5, 1.0). A bare integer is refused: `1` used to mean
    100% here, while many read it as one silo, so the count lives in its own key."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = f"; for a number of silos use {count_key}: {value} instead" if value >= 1 else ""
        raise ValueError(f"must be a fraction of {what} in (0, 1], written with a decimal point (e.g. 0.5, or 1.0 "
                         f"for all){count}")
    if isinstance(value, float) and value > 1:
        raise ValueError(f"must be a fraction of {what} in (0, 1]; for a number of silos use "
                         f"{count_key}: {value:g} instead")
    return value


class DataSource(StrictConfig):
    """Where a set of images comes from."""

    kind: Literal["imagefolder", "torchvision", "demo"] = Field(
        description="imagefolder: one sub-folder per class; torchvision: local dataset files; demo: bundled set"
    )
    path: ConfigPath | None = Field(None, description="imagefolder: the folder")
    name: str | None = Field(None, description="torchvision: dataset name, e.g. FashionMNIST")
    root: ConfigPath | None = Field(None, description="torchvision: folder holding <name>/raw (never downloads)")
    split: Literal["train", "test"] = "train"
    labels_per_class: int | None = Field(None, ge=1, le=10_000_000,
                                         description="keep a stratified subset of this many per class")
    seed: Seed = 0

    @model_validator(mode="after")
    def _needs(self) -> DataSource:
        if self.kind == "imagefolder" and self.path is None:
            raise ValueError("kind 'imagefolder' needs 'path'")
        if self.kind == "torchvision" and (self.name is None or self.root is None):
            raise ValueError("kind 'torchvision' needs 'name' and 'root'")
        return self


class RunSection(StrictConfig):
    name: str = "silokit"
    seed: Seed = 0
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda, cuda:N")
    state_dir: ConfigPath = Field(Path("hub-state"), description="checkpoints, history, final model")
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads for the hub (default: torch's)")
    tensorboard: ConfigPath | None = Field(None, description="write the run's curves for TensorBoard here, one "
                                           "folder per run (the tensorboard extra)")


class ServerSection(StrictConfig):
    host: str = "0.0.0.0"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port on the first start (written to "
                      "state_dir/port); a restart binds that same port again, so running silos find the hub")
    certs: ConfigPath = Field(Path("certs/hub"),
                              description="bundle from `silo-certs issue-hub`: ca.pem cert.pem key.pem")
    long_poll_s: float = Field(300.0, gt=0, le=300, description="a silo's NextTask is held until there is work "
                               "for it, at most this long; a waiting silo holds no thread")
    max_workers: int = Field(256, ge=8, le=10_000, description="threads for the hub calls that may block (join, "
                             "download, upload); waiting silos hold none")
    upload_header_timeout_s: float = Field(10.0, gt=0, le=600, description="an upload that sends no header this "
                                           "long after it opens is refused (DEADLINE_EXCEEDED)")
    upload_idle_s: float = Field(60.0, gt=0, le=3600, description="an upload that sends no chunk for this long is "
                                 "refused (DEADLINE_EXCEEDED)")
    linger_s: float = Field(15.0, ge=0, le=DAY_S, description="after the run, keep answering until every live silo "
                            "has heard it is over, at most this long")
    min_linger_s: float = Field(0.0, ge=0, le=DAY_S, description="and at least this long (e.g. for a Prometheus "
                                "to scrape the final state of a short run)")

    @model_validator(mode="after")
    def _linger_order(self) -> ServerSection:
        if self.min_linger_s > self.linger_s:
            raise ValueError(f"min_linger_s ({self.min_linger_s:g}) is above linger_s ({self.linger_s:g}), the most "
                             f"the hub stays after the run: raise linger_s to at least {self.min_linger_s:g}")
        return self


class DataSection(StrictConfig):
    labeled: DataSource
    test: DataSource | None = None
    validation: DataSource | None = None
    cache_mb: float = Field(DEFAULT_CACHE_MB, ge=0, le=2**30, description="an imagefolder whose decoded images fit "
                            "in this many MiB is held in memory; a bigger one is read from disk batch by batch")
    loader_workers: int = Field(DEFAULT_LOADER_WORKERS, ge=0, le=64, description="processes decoding images "
                                "of a folder read from disk while the hub trains (0: in the hub's own process)")


class ModelSection(StrictConfig):
    name: str = Field("small_cnn", description="small_cnn, wrn28_2, torchvision/<name>, timm/<name> or "
                      "monai/<name>")
    image_size: int = Field(28, ge=8, le=512)
    in_channels: int = Field(1, description="1 (grayscale) or 3 (RGB)")
    mean: list[float] | None = None
    std: list[float] | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    factory: str | None = Field(
        None, description='your own network: "package.module:callable", called with num_classes, in_channels, '
        "image_size and model.options; installed at the hub and at every silo, and a silo builds it only when "
        "its operator passes the same name to silo-client --model-factory")
    init_weights: ConfigPath | None = Field(
        None, description="start from these weights: a safetensors file or a PyTorch checkpoint (read with "
        "weights_only); only the hub reads it, silos get the model over the wire")
    init_from_run: ConfigPath | None = Field(
        None, description=f"warm-start from an earlier run's state folder (its {RUN_WEIGHTS}); the same model")

    @field_validator("in_channels")
    @classmethod
    def _channels(cls, value: int) -> int:
        # An int checked by hand, not Literal[1, 3]: a Literal would take YAML's `true` as 1.
        if value not in (1, 3):
            raise ValueError(f"must be 1 (grayscale) or 3 (RGB), got {value}")
        return value

    @model_validator(mode="after")
    def _known(self) -> ModelSection:
        # The model's name and options first (ModelSpec knows both), then the normalisation's length.
        if self.factory is not None:
            if "name" in self.model_fields_set:
                raise ValueError(f"set model.name (a built-in or library network) or model.factory (your own), not "
                                 f"both; got name {self.name!r} and factory {self.factory!r}")
        # The class count comes from the data later; the default stands in for it here.
        ModelSpec.from_config(self, num_classes=ModelSpec.num_classes).check_options()
        for key in ("mean", "std"):
            value = getattr(self, key)
            if value is not None and len(value) != self.in_channels:
                raise ValueError(f"{key} needs {self.in_channels} value(s), one per input channel")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError("std values must be positive (images are divided by them)")
        if self.init_weights is not None and self.init_from_run is not None:
            raise ValueError("set model.init_weights (a weights file) or model.init_from_run (an earlier run's "
                             "state folder), not both")
        return self


class AlgorithmSection(StrictConfig):
    name: str = "semifl"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
        return name

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # Field validators (not one on the model), so that a bad option is reported as algorithm.options.<key>.
        if "name" in info.data:  # else the name was refused already
            ALGORITHMS[info.data["name"]].options.model_validate(options)  # raises with the bad option's name
        return options

    def parsed_options(self) -> BaseModel:
        return get_algorithm(self.name).options.model_validate(self.options)


class RoundsSection(StrictConfig):
    """How many silos train in a round and how many reports apply it: each as a fraction OR a count, in two keys,
    so that no value can be read both ways."""

    total: int = Field(10, ge=1, le=1_000_000)
    silos_per_round: float = Field(1.0, gt=0, description="fraction of the live silos sampled each round, in (0, 1]")
    silos_per_round_count: int | None = Field(
        None, ge=1, le=MAX_SILOS, description="number of live silos sampled each round (instead of the fraction)"
    )
    min_silos: int = Field(1, ge=1, le=MAX_SILOS,
                           description="wait for this many connected silos before a round starts")
    quorum: float = Field(0.5, gt=0, description="reports needed, as a fraction of the sampled silos, in (0, 1]")
    quorum_silos: int | None = Field(
        None, ge=1, le=MAX_SILOS, description="number of reports needed (instead of the fraction)"
    )
    deadline_s: float = Field(600.0, gt=0, le=DAY_S, description="a round's time limit; late silos are left out")
    wait_after_quorum_s: float | None = Field(
        None, gt=0, le=DAY_S, description="once a round's quorum has reported, wait at most this long for the other "
        "sampled silos, then aggregate without them (default: twice the round's median report time, at least 10 s)")
    max_attempts: int = Field(5, ge=1, le=1000,
                              description="a failed round is retried without end (1 s to 60 s apart); every this "
                              "many failures in a row the hub logs an ERROR")
    liveness_s: float = Field(60.0, gt=0, le=DAY_S, description="a silo unheard of for longer is not sampled")

    @field_validator("silos_per_round", mode="before")
    @classmethod
    def _sample_fraction(cls, value: Any) -> Any:
        return _fraction(value, "rounds.silos_per_round_count", "the live silos")

    @field_validator("quorum", mode="before")
    @classmethod
    def _quorum_fraction(cls, value: Any) -> Any:
        return _fraction(value, "rounds.quorum_silos", "the sampled silos")

    @model_validator(mode="after")
    def _one_of_each(self) -> RoundsSection:
        for fraction, count in (("silos_per_round", "silos_per_round_count"), ("quorum", "quorum_silos")):
            if fraction in self.model_fields_set and getattr(self, count) is not None:
                raise ValueError(f"set rounds.{fraction} (a fraction) or rounds.{count} (a number of silos), "
                                 "not both")
        if (self.quorum_silos is not None and self.silos_per_round_count is not None
                and self.quorum_silos > self.silos_per_round_count):
            raise ValueError(f"rounds.quorum_silos ({self.quorum_silos}) exceeds rounds.silos_per_round_count "
                             f"({self.silos_per_round_count}): no round could reach it; lower quorum_silos")
        return self


class WireSection(StrictConfig):
    chunk_bytes: int = Field(CHUNK_BYTES, ge=1024, le=4 << 20)
    max_upload_bytes: int = Field(512 << 20, ge=1024, le=64 << 30)
    max_inflight_upload_bytes: int = Field(
        64 << 20, ge=1 << 20, le=64 << 30,
        description="uploads held at once (being received and checked) stay under this many "
        "bytes; later ones wait their turn, so hub memory stays flat however many silos report together")
    half_precision: bool = Field(False, description="large float tensors travel as float16 (model and deltas)")


class SecuritySection(StrictConfig):
    """What the hub enforces beyond the TLS handshake (see docs/security.md)."""

    crl: ConfigPath | None = Field(
        None, description="the CA's crl.pem, checked on every call and reloaded when it changes "
        "(default: crl.pem in server.certs)"
    )
    allowed_silos: list[str] | None = Field(
        None, description="silo ids allowed in; others are refused even with a valid certificate (default: any)"
    )
    max_update_norm: float | None = Field(
        None, gt=0, description="refuse an update whose L2 norm (delta tensors / weight) exceeds this (default: no bound)"
    )
    max_weight_factor: float = Field(
        4.0, ge=1.0, le=1e6, description="with sample-count weighting, no silo's weight exceeds this many times the "
        "median images declared by the round's sampled silos (its weight and delta are scaled down to it)"
    )

    @field_validator("allowed_silos")
    @classmethod
    def _names(cls, names: list[str] | None) -> list[str] | None:
        for name in names or []:
            try:
                validate_silo_name(name)
            except PkiError as e:
                raise ValueError(str(e)) from None
        if names is not None and len(set(names)) != len(names):
            raise ValueError("lists a silo twice")
        return names


class MetricsSection(StrictConfig):
    enabled: bool = Field(True, description="serve Prometheus metrics at http://host:port/metrics")
    host: str = Field("127.0.0.1", description="address of the metrics endpoint; 0.0.0.0 for a remote Prometheus")
    port: int = Field(9400, ge=0, le=65535, description="0 picks a free port (written to state_dir/metrics_port)")
    final_scrape_s: float = Field(30.0, ge=0, le=DAY_S,
                                  description="at the end, wait this long for a last scrape (only "
                                  "when something has scraped the endpoint before)")


class HubConfig(StrictConfig):
    run: RunSection = Field(default_factory=RunSection)
    server: ServerSection = Field(default_factory=ServerSection)
    data: DataSection
    model: ModelSection = Field(default_factory=ModelSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    rounds: RoundsSection = Field(default_factory=RoundsSection)
    wire: WireSection = Field(default_factory=WireSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    privacy: PrivacySection = Field(default_factory=PrivacySection)
    aggregation: AggregationSection = Field(default_factory=AggregationSection)

    @model_validator(mode="after")
    def _sample_dp_fits(self) -> HubConfig:
        if not self.privacy.sample_dp.enabled:
            return self
        entry = get_algorithm(self.algorithm.name)
        supports = entry.silo is not None and entry.silo.supports_sample_dp
        unfit = sample_dp_unfit(self.algorithm.name, supports, self.algorithm.options, self.model.options)
        if unfit is not None:
            able = [n for n, e in ALGORITHMS.items() if e.silo is not None and e.silo.supports_sample_dp]
            raise ValueError(unfit if supports else f"{unfit}; it works with: {', '.join(able)}")
        return self


    @model_validator(mode="after")
    def _aggregation_fits(self) -> HubConfig:
        """The rule's own constraints (silo_server/rules/base.py AggregationRule.check), the round loop's too."""
        r = self.rounds
        self.aggregation.aggregator().check(
            self.aggregation, get_algorithm(self.algorithm.name).hub,
            secure_aggregation=self.privacy.secure_aggregation.enabled, dp=self.privacy.dp.enabled,
            min_silos=r.min_silos, silos_per_round_count=r.silos_per_round_count)
        return self


def _resolve_paths(node: Any, base: Path) -> None:
    """Make relative paths relative to the config file, not to wherever the hub was started."""
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            value = getattr(node, name)
            if isinstance(value, Path) and not value.is_absolute():
                setattr(node, name, (base / value).resolve())
            else:
                _resolve_paths(value, base)


# What to write instead, for the type errors that strict parsing raises (YAML's `true`, `'10'`, `.inf`, ...).
def parse_config(raw: Any, source: str = "hub.yaml", base: Path | None = None) -> HubConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (run, server, data, ...), got {type(raw).__name__}")
    try:
        config = HubConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    if base is not None:
        _resolve_paths(config, base)
    _check_initial_weights(config.model, source)
    return config


def _check_initial_weights(model: ModelSection, source: str) -> None:
    """The starting weights must be there when the hub starts (once the paths are relative to the config file);
    whether they fit the model is checked when the hub builds it (the class count comes from the data)."""
    if model.init_weights is not None and not model.init_weights.is_file():
        raise ConfigError(f"{source}: model.init_weights {model.init_weights} is not a file (relative paths are "
                          "relative to the config file)")
    if model.init_from_run is not None and not (model.init_from_run / RUN_WEIGHTS).is_file():
        raise ConfigError(f"{source}: model.init_from_run {model.init_from_run} holds no {RUN_WEIGHTS}: name the "
                          "run.state_dir of a finished run (relative paths are relative to the config file)")


def load_config(path: Path) -> HubConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass --config with the path to your hub.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_config(raw, source=str(path), base=path.parent.resolve())
