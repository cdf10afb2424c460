"""Imports point down the layers of docs/architecture.md, never up.

Every `import` and `from ... import` in kvjax/ and kernels_pallas/ is parsed
(function-local imports included: a lazy import is still a dependency) and
mapped to the layer of the module it names. A module may import its own layer
and the layers below it; the applications at the top may import anything;
kernels_pallas imports nothing of kvjax. A new top-level module must be given
a layer in LAYERS before it can be imported.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Higher imports lower. The order of docs/architecture.md.
LAYERS = {
    "serve": 70,
    "nnx": 65,
    "generate": 60,
    "sharding": 55,
    "models": 50,
    "cache": 40,
    "attention": 30,
    "backends": 20,
    "kernels_pallas": 20,
    "memory": 10,
    "data": 5,
    "rope": 5,
    "specs": 5,
}
# Entry points and drivers on top of the engine: the CLI, the demo, evaluation,
# training, `kvjax info`, and the package's lazy export table.
APPLICATIONS = {"kvjax", "__main__", "demo", "eval", "train", "info"}


def _unit(module: str) -> str | None:
    """The layer name of a dotted module (None outside kvjax and kernels_pallas)."""
    parts = module.split(".")
    if parts[0] == "kernels_pallas":
        return "kernels_pallas"
    if parts[0] != "kvjax":
        return None
    return parts[1] if len(parts) > 1 else "kvjax"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, dotted module) of every import in the file, relative ones resolved."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module in ("kvjax", "kernels_pallas"):  # `from kvjax import cache`
                for a in node.names:
                    yield node.lineno, f"{module}.{a.name}"
            else:
                yield node.lineno, module


def _violations(paths):
    bad = []
    for path in paths:
        src = _unit(_module_name(path))
        for line, module in _imports(path):
            dst = _unit(module)
            if dst is None or dst == src or src in APPLICATIONS:
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {src} imports {module}"
            if src == "kernels_pallas":
                bad.append(f"{where} (kernels_pallas imports nothing of kvjax)")
            elif src not in LAYERS or dst not in LAYERS and dst not in APPLICATIONS:
                bad.append(f"{where} (give {src if src not in LAYERS else dst} a layer)")
            elif dst in APPLICATIONS or LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{where} (upward or sideways)")
    return bad


def _sources():
    return sorted([*ROOT.glob("kvjax/**/*.py"), *ROOT.glob("kernels_pallas/**/*.py")])


def test_imports_point_down():
    bad = _violations(_sources())
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("src,line,ok", [
    ("kvjax/cache/x.py", "from kvjax.attention import pages", True),
    ("kvjax/cache/x.py", "from kvjax import generate", False),
    ("kvjax/attention/x.py", "from ..cache import state", False),
    ("kvjax/models/x.py", "import kvjax.demo", False),
    ("kernels_pallas/op/x.py", "from kvjax.specs import CacheSpec", False),
    ("kvjax/eval.py", "from kvjax.generate import loop", True),
])
def test_the_check_catches_upward_imports(monkeypatch, src, line, ok):
    path = ROOT / src
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line + "\n")
    assert (_violations([path]) == []) == ok, _violations([path])
