"""The CPU backend's options: one typed object, the environment only as an override."""

import ast
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.backends import cpu
from kvjax.backends.cpu import options as options_mod

BACKENDS = Path(cpu.__file__).resolve().parents[1]


def test_defaults_environment_and_code_in_that_order(monkeypatch):
    for _, (var, _) in options_mod.ENV.items():
        monkeypatch.delenv(var, raising=False)
    assert cpu.get_options() == cpu.CpuOptions()
    monkeypatch.setenv("KVJAX_CPU_INT_LOGITS", "0")
    monkeypatch.setenv("KVJAX_CPU_MATMUL", "1")
    monkeypatch.setenv("KVJAX_CPU_SPIN_US", "7")
    monkeypatch.setenv("KVJAX_CPU_MARCH", "haswell")
    got = cpu.get_options()
    assert (got.int_logits, got.matmul, got.spin_us, got.march) == (False, "on", 7, "haswell")
    with cpu.override(int_logits=True, spin_us=3):
        got = cpu.get_options()
        assert (got.int_logits, got.spin_us, got.matmul) == (True, 3, "on")
        with cpu.override(spin_us=None):  # None: back to the environment's value
            assert cpu.get_options().spin_us == 7
        assert cpu.get_options().spin_us == 3
    assert cpu.get_options().int_logits is False


def test_invalid_values_are_refused_with_the_field_named(monkeypatch):
    with pytest.raises(ValueError, match="matmul"):
        cpu.CpuOptions(matmul="sometimes")
    with pytest.raises(ValueError, match="prefetch"):
        cpu.CpuOptions(prefetch=-1)
    with pytest.raises(ValueError, match="march"):
        cpu.CpuOptions(march="haswell -O0")
    with pytest.raises(TypeError, match="unknown option"):
        cpu.set_options(no_such_field=1)
    before = cpu.get_options()
    with pytest.raises(ValueError):
        cpu.set_options(threads=-2)
    assert cpu.get_options() == before  # nothing changed
    monkeypatch.setenv("KVJAX_CPU_ROWS", "maybe")
    with pytest.raises(ValueError, match="KVJAX_CPU_ROWS"):
        cpu.get_options()


def test_options_are_hashable_static_arguments():
    a, b = cpu.CpuOptions(), cpu.CpuOptions(int_values=False)
    assert hash(a) != hash(b) and a.tuning != b.tuning
    assert dataclasses.replace(b, int_values=True) == a


def test_every_environment_variable_is_read_by_the_options_module_only():
    """No Python file under kvjax/backends but options.py reads os.environ / os.getenv,
    and the C++ sources call no getenv (their settings come as attributes or through
    KvjaxConfigure)."""
    for path in BACKENDS.rglob("*.py"):
        if path.name == "options.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                raise AssertionError(f"{path} reads the environment (line {node.lineno})")
    for path in BACKENDS.rglob("*.[ch]*"):
        if path.suffix in (".cc", ".h"):
            assert not re.search(r"\bgetenv\s*\(", path.read_text()), path
    # Every field is documented with its variable.
    doc = (BACKENDS.parents[1] / "docs" / "cpu-backend.md").read_text()
    for field, (var, _) in options_mod.ENV.items():
        assert f"`{field}`" in doc and f"`{var}`" in doc, field


@pytest.mark.cpu_kernels
def test_tuning_reaches_the_kernel_as_attributes_and_retraces(rng):
    """The per-call settings are attributes of the custom call: a function traced under
    other options is another program (the wrapper's inner jit is not reused stale), and
    its result is the same attention (the settings change speed, not the sums' values
    beyond rounding)."""
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 9, 16, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 9, 16, 64)), jnp.float32)
    lengths = jnp.asarray([70, 33], jnp.int32)
    tables = jnp.asarray(rng.permutation(9)[:8].reshape(2, 4), jnp.int32)
    texts, outs = [], []
    for rows, prefetch in ((True, 1), (False, 0)):
        with cpu.override(rows=rows, prefetch=prefetch):
            # A new function: jax caches traces per function, and options are read when
            # a function is traced (the kernel wrapper's own jit takes them as static).
            f = jax.jit(lambda *a: cpu.paged_decode_attention(*a))
            texts.append(f.lower(q, k, v, lengths, tables).as_text())
            outs.append(f(q, k, v, lengths, tables))
    assert "prefetch = 1 : i64, rows = 1 : i64" in texts[0]
    assert "prefetch = 0 : i64, rows = 0 : i64" in texts[1]
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)
