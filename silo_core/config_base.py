"""The one base of every config section (hub.yaml, algorithm options, privacy): a value can be read only one way.

Strict types: YAML's `true` or `'10'` is not a count, `1.0` is not a whole number, and `.inf` or `.nan` is never a
setting (a float field still takes an int, as YAML writes `lr: 1`). Unknown keys are refused, so a typo is an error
rather than a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict


class StrictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# YAML has no path type: a path arrives as a string, which strict mode alone would refuse.
ConfigPath = Annotated[Path, Strict(False)]
