"""The one base of every config section (hub.yaml, algorithm options, privacy): a value can be read only one way.

Strict types: YAML's `true` or `'10'` is not a count, `1.0` is not a whole number, and `.inf` or `.nan` is never a
setting (a float field still takes an int, as YAML writes `lr: 1`). Unknown keys are refused, so a typo is an error
rather than a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict, ValidationError


class StrictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# YAML has no path type: a path arrives as a string, which strict mode alone would refuse.
ConfigPath = Annotated[Path, Strict(False)]


_TYPE_HINTS = {
    "int_type": "write a whole number without quotes, e.g. 10",
    "float_type": "write a number without quotes, e.g. 0.5",
    "bool_type": "write true or false without quotes",
    "string_type": "write text, quoted if YAML would read it as something else",
    "finite_number": ".inf and .nan are not settings; write a finite number",
}


def format_validation_error(err: ValidationError, source: str, reference: str = "the config reference in README.md"
                            ) -> str:
    """One line per problem, naming the file, the key and what to write instead."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key '{key}' (check the spelling; see {reference})")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
        elif e["type"] in _TYPE_HINTS:
            given = repr(e["input"])[:60]
            lines.append(f"{source}: bad value for '{key}': {e['msg']}, got {given}; {_TYPE_HINTS[e['type']]}")
        else:
            lines.append(f"{source}: bad value for '{key}': {e['msg']}")
    return "\n".join(lines)
