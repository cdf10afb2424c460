"""Script names must not shadow importable modules.

A script run as `python benchmarks/X.py` (or `scripts/X.py`) has its folder first on
sys.path, so `X` shadows any module of that name for everything the script imports:
transformers probes optional packages with `find_spec` and imported a script named
`kernels.py` as the HuggingFace `kernels` package, which broke every benchmark that loads
transformers.
"""

import importlib.metadata
import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("benchmarks", "scripts")


def _script_names() -> dict[str, str]:
    out = {}
    for folder in FOLDERS:
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py") and not f.startswith("__"):
                out[f[:-3]] = f"{folder}/{f}"
    return out


def _transformers_probes() -> set[str]:
    """Top-level names transformers looks up to decide which optional packages it has
    (read from its source: importing transformers takes seconds)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return set()
    path = os.path.join(spec.submodule_search_locations[0], "utils", "import_utils.py")
    with open(path, encoding="utf-8") as f:
        src = f.read()
    return {n.split(".")[0] for n in re.findall(r'_is_package_available\(\s*"([\w.\-]+)"', src)}


def test_the_transformers_probe_list_is_read():
    """The probe list this check relies on is found (it would pass vacuously otherwise)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    assert {"kernels", "accelerate", "flash_attn"} <= _transformers_probes()


def test_no_script_shadows_a_module():
    taken = (set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
             | _transformers_probes() | {"kvjax", "kernels_pallas", "tests"})
    clashes = {path: name for name, path in _script_names().items() if name in taken}
    assert not clashes, (
        f"these scripts shadow modules of the same name when run as scripts (their folder "
        f"is first on sys.path): {clashes}; rename them")
