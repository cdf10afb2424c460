"""The serving engine stays in small parts over public names: no class in kvjax/serve over
400 lines, no private name of kvjax.cache used outside it, and no module of kvjax/serve
imports a private name of another kvjax package. Parses the source; imports nothing."""

import ast
from pathlib import Path

KVJAX = Path(__file__).resolve().parents[2] / "kvjax"
# Every other package and module of kvjax (what kvjax/serve may use only by public names).
OTHERS = sorted(f"kvjax.{p.stem}" for p in KVJAX.iterdir()
                if p.stem not in ("serve", "__init__", "__main__", "__pycache__")
                and (p.is_dir() or p.suffix == ".py"))
MAX_CLASS_LINES = 400


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, package: str) -> list[str]:
    """Private names of `package` (or its modules) that `path` imports or reaches as an
    attribute of a name bound to one of them."""
    tree = ast.parse(path.read_text())
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if node.module == package or node.module.startswith(package + "."):
                    if _private(alias.name):
                        found.append(f"line {node.lineno}: from {node.module} import "
                                     f"{alias.name}")
                    bound.add(alias.asname or alias.name)
                elif full == package or full.startswith(package + "."):
                    bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute) and not _private(base.attr):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_class_in_kvjax_serve_is_over_400_lines():
    long = [f"{path.name}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((KVJAX / "serve").glob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, long


def test_private_names_stay_in_their_package():
    outside = {str(path.relative_to(KVJAX)): uses for path in sorted(KVJAX.rglob("*.py"))
               if "cache" not in path.relative_to(KVJAX).parts[:1]
               and (uses := _private_uses(path, "kvjax.cache"))}
    assert not outside, outside
    serve = {}
    for path in sorted((KVJAX / "serve").glob("*.py")):
        for package in OTHERS:
            if uses := _private_uses(path, package):
                serve[f"{path.name} ({package})"] = uses
    assert not serve, serve
