"""Notebooks: each `.ipynb` matches its jupytext `.py` source, and each `.py` runs end to end.

Each notebook ends with assertions of what it shows (a failed one fails its
cell, and so this test); figures go to a temporary folder.
"""

import os
import pathlib

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_ipynb_in_sync_with_py(src):
    ipynb = src.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `jupytext --sync {src}`"
    assert _cells(jupytext.read(ipynb)) == _cells(jupytext.read(src)), (
        f"{ipynb.name} is out of sync with {src.name}: run `jupytext --sync {src}`"
    )


# A rotation: a notebook's run takes 8-32 s of a 2-core machine (a kernel, jax and the
# notebook's programs), so the default run executes one, chosen by the commit's seed
# (tests/conftest.py); `--slow` runs all of them. Every notebook's sync with its source is
# checked on every run (above).
@pytest.mark.rotate(1)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_runs(src, tmp_path, monkeypatch, child_env):
    nb = jupytext.read(src)
    last = [c.source for c in nb.cells if c.cell_type == "code"][-1]
    assert "assert" in last, f"{src.name} must end with assertions of what it shows"
    figures = tmp_path / "figures"
    env = {
        "KVJAX_FIGURES": str(figures),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": child_env["XLA_FLAGS"] + " --xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # ipykernel's built-in "python3" kernel runs this interpreter
