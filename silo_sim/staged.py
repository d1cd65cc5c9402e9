"""A staged federation as plain data: where the hub's and each silo's files are. No torch here, so that silo-sim's
own process can follow a run from what its staging process reports (silo_sim/prepare.py) without importing what
staging needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from silo_core.data import ImageSet

DATA_HELP = ("demo (the bundled 6,000 Fashion-MNIST images), fashion-mnist:ROOT, mnist:ROOT, cifar10:ROOT or "
             "svhn:ROOT (torchvision's layout under ROOT, e.g. ROOT/FashionMNIST/raw: the whole training split; "
             "the test set is the dataset's own), or the path of any folder of class sub-folders (e.g. CIFAR-10 "
             "as JPEG folders; the test set is held out from it)")


# Written under a staged federation's root: where its hub's and silos' files are (they may be in a federation kept
# by an earlier run, silo_sim/staging_cache.py), for whatever reads the federation afterwards.
STAGED_FILE = "staged.json"

# A line the staging process (silo_sim/prepare.py) writes to tell silo-sim something, followed by JSON.
STAGING_EVENT = "silo-sim-staging "


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


@dataclass
class SiloSpec:
    name: str
    certs: Path
    data: Path | None  # None when every image of the silo is labeled
    state_dir: Path
    labels: Path
    num_images: int
    labeled: Path | None = None
    num_labeled: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "certs": str(self.certs), "data": str(self.data) if self.data else None,
                "state_dir": str(self.state_dir), "labels": str(self.labels), "num_images": self.num_images,
                "labeled": str(self.labeled) if self.labeled else None, "num_labeled": self.num_labeled}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SiloSpec:
        return cls(d["name"], Path(d["certs"]), _path(d["data"]), Path(d["state_dir"]), Path(d["labels"]),
                   int(d["num_images"]), _path(d["labeled"]), int(d["num_labeled"]))


@dataclass
class StagedFederation:
    root: Path
    hub_config: Path
    hub_state_dir: Path
    ca_dir: Path
    silos: list[SiloSpec] = field(default_factory=list)
    hub_labeled: ImageSet | None = None  # in the staging process only (not in to_json)
    test: ImageSet | None = None

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "hub_config": str(self.hub_config), "hub_state_dir": str(self.hub_state_dir),
                "ca_dir": str(self.ca_dir), "silos": [s.to_json() for s in self.silos]}

    def write(self) -> None:
        """Record where this federation's files are, as its STAGED_FILE under its root (read back by `read`)."""
        (self.root / STAGED_FILE).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, root: Path) -> StagedFederation:
        """The federation staged under `root` (its STAGED_FILE)."""
        return cls.from_json(json.loads((Path(root) / STAGED_FILE).read_text()))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StagedFederation:
        return cls(Path(d["root"]), Path(d["hub_config"]), Path(d["hub_state_dir"]), Path(d["ca_dir"]),
                   [SiloSpec.from_json(s) for s in d["silos"]])
