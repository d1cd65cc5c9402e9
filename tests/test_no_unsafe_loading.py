"""Fails if the source tree can unpickle anything: pickle and friends, torch.load without weights_only=True,
np.load(allow_pickle=True), yaml.load / unsafe_load / full_load.

An AST scan (not a text search, so comments and docs may name these calls): every .py file of the repository
outside virtual environments and caches. The checker is tested on snippets too, so a broken checker cannot pass
silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP_DIRS = {".venv", "venv", ".git", "__pycache__", "build", "dist", ".eggs", "node_modules", ".tox"}

# Modules whose loading functions execute code from the data (directly or through pickle).
_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "jsonpickle", "joblib",
                   "marshal"}
_YAML_UNSAFE = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}


def _dotted(node: ast.AST) -> str:
    """'np.load' for Attribute(Name('np'), 'load'); '' for anything not a plain dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_calls(source: str, filename: str = "<snippet>") -> list[str]:
    """Every unpickling risk in ``source``, as 'file:line: what'."""
    found = []
    tree = ast.parse(source, filename)
    # Names bound by `import numpy as np` / `from torch import load as tload` etc.
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in _PICKLE_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top in _PICKLE_MODULES:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if not name:
            continue
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        where = f"{filename}:{node.lineno}"
        if full in ("torch.load", "torch.serialization.load") and not _is_const(
                _keyword(node, "weights_only"), True):
            found.append(f"{where}: {name}() without weights_only=True")
        elif full in ("numpy.load", "np.load") and not (
                _keyword(node, "allow_pickle") is None or _is_const(_keyword(node, "allow_pickle"), False)):
            found.append(f"{where}: {name}(allow_pickle=...) other than False")
        elif full.startswith("yaml.") and full.split(".", 1)[1] in _YAML_UNSAFE:
            found.append(f"{where}: {name}() (use yaml.safe_load)")
        elif full.endswith("read_pickle") or full.endswith("from_pickle"):
            found.append(f"{where}: {name}()")
    return found


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(ROOT).parts))]


def test_the_source_tree_never_unpickles() -> None:
    files = _sources()
    assert len(files) > 30  # the scan really looked at the project
    problems = [hit for path in files for hit in unsafe_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert not problems, "unsafe loading (see DESIGN.md, never unpickle):\n" + "\n".join(problems)


# Spelled in two pieces so that text scanners of this repository do not mistake the fixtures for real calls.
TORCH_LOAD = "torch." + "load"


@pytest.mark.parametrize("snippet", [
    "import pickle",
    "import pickle as p",
    "from pickle import loads",
    "import dill",
    "import numpy as np\nx = np.load('f.npy', allow_pickle=True)",
    "import numpy\nnumpy.load(f, allow_pickle=flag)",
    f"import torch\n{TORCH_LOAD}('m.pt')",
    f"import torch\n{TORCH_LOAD}('m.pt', weights_only=False)",
    "from torch import load\nload('m.pt')",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.unsafe_load(text)",
    "from yaml import full_load\nfull_load(text)",
    "import pandas as pd\npd.read_pickle('x')",
])
def test_the_checker_catches(snippet: str) -> None:
    assert unsafe_calls(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('m.pt', weights_only=True)",
    "import numpy as np\nnp.load('f.npz')",
    "import numpy as np\nnp.load('f.npz', allow_pickle=False)",
    "import yaml\nyaml.safe_load(text)",
    f"# {TORCH_LOAD}(x) in a comment\nx = 'pickle.loads'",
    "from safetensors.torch import load\nload(b'')",
])
def test_the_checker_lets_safe_code_through(snippet: str) -> None:
    assert unsafe_calls(snippet) == [], snippet
