"""The package uses only jax APIs that the installed jax has, undeprecated, and no private module.

pyproject declares a range of jax versions; CI installs the newest the package
index serves. This reads every `jax...` name the package's source refers to
(through any import alias: `jnp.`, `pl.`, `pltpu.`...) and resolves it in the
installed jax with deprecation warnings turned into errors, so a name that a
release removed or deprecated fails here, naming the file and line.
"""

import ast
import importlib
import warnings
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "kernels_pallas")


def _sources():
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _jax_references(tree):
    """(line, dotted name) of every jax module, imported name and attribute chain used."""
    alias = {}  # local name -> dotted jax path
    refs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jax":
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "jax"
                    refs.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.split(".")[0] == "jax"):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                refs.append((node.lineno, f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in alias:
                refs.append((node.lineno, ".".join([alias[inner.id], *reversed(chain)])))
    return refs


def _resolve(dotted: str):
    """Imports the longest module prefix of `dotted`, then getattr's the rest.

    Stops after the first attribute that is not a module: what follows may be
    an attribute of a runtime value (`x.shape` of an imported function's result
    is not written like this, but `jnp.float32.dtype` is).
    """
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            i -= 1
    if obj is None:
        raise ModuleNotFoundError(dotted)
    for name in parts[i:]:
        was_module = type(obj).__name__ == "module"
        obj = getattr(obj, name)
        if not was_module:
            break
    return obj


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


# Private names used on purpose, each behind a guarded import that fails loudly naming the
# jax version when it moves: Mosaic GPU's interpreter (its params class is public only from
# jax 0.11; its race detector's state has no public accessor). Interpret mode on a CPU only.
ALLOWED_PRIVATE = {
    ("kernels_pallas/_mosaic_gpu.py",
     "jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams"),
    ("kernels_pallas/_mosaic_gpu.py",
     "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call"),
}


def test_no_private_jax_modules():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}"
           for p in _sources() for line, name in _jax_references(ast.parse(p.read_text()))
           if _private(name) and (str(p.relative_to(ROOT)), name) not in ALLOWED_PRIVATE]
    assert not bad, "private jax modules (not covered by jax's API policy):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_jax_name_resolves_without_deprecation(package):
    seen, bad = set(), []
    for p in sorted((ROOT / package).rglob("*.py")):
        for line, name in _jax_references(ast.parse(p.read_text())):
            if name in seen:
                continue
            seen.add(name)
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                try:
                    _resolve(name)
                except (AttributeError, ImportError, DeprecationWarning) as e:
                    bad.append(f"{p.relative_to(ROOT)}:{line}: {name}: "
                               f"{type(e).__name__}: {e}")
    assert seen, "found no jax references: the scan is broken"
    assert not bad, f"with jax {jax.__version__}:\n" + "\n".join(bad)


def test_the_scan_finds_aliased_and_deprecated_names():
    # The scan itself must be able to fail: an aliased removed name and a deprecated one.
    src = ("import jax.numpy as jnp\nfrom jax.experimental import pallas as pl\n"
           "from jax._src.pallas.mosaic import tpu_info\n"
           "x = jnp.no_such_function\ny = pl.dot\n")
    refs = dict((n, line) for line, n in _jax_references(ast.parse(src)))
    assert "jax.numpy.no_such_function" in refs and "jax.experimental.pallas.dot" in refs
    assert _private("jax._src.pallas.mosaic.tpu_info") and not _private("jax.__version__")
    with pytest.raises(AttributeError):
        _resolve("jax.numpy.no_such_function")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        # Deprecated in jax 0.11, removed in 0.12: either way the scan refuses it.
        with pytest.raises((DeprecationWarning, AttributeError)):
            _resolve("jax.experimental.pallas.dot")
