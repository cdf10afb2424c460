"""`python -m kvjax info`: the environment report and its --help."""

import json

import jax
import pytest

from kvjax import __main__ as cli
from kvjax import info
from kvjax.backends import cpu


def test_collect_reports_versions_devices_kernels_and_each_ops_choice():
    report = info.collect()
    assert report["jax"] == jax.__version__ and report["backend"] == jax.default_backend()
    assert len(report["devices"]) == jax.device_count()
    assert all("device" in d["memory_kinds"] for d in report["devices"])
    k = report["cpu_kernels"]
    assert k["built"] == cpu.available() and k["reason"] == cpu.unavailable_reason()
    for op, c in report["cpu_ops"].items():
        choice = cpu.choose(op, **({"dtype": "bfloat16"} if op in ("write_rows", "copy_pages")
                                   else {}))
        assert c["impl"] == ("cpu" if choice.use_kernel else "xla") and c["reason"]
    assert report["cache_dir"] == str(cpu.get_options().cache_path)


def test_kernels_off_shows_the_reason_and_the_xla_path(capsys):
    with cpu.override(kernels=False):
        assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels: not available: disabled by CpuOptions.kernels=False" in out
    assert "kernels=False" in out  # the options that differ from the defaults
    for op in ("paged_decode", "matmul", "write_rows"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(op))
        assert " xla " in line


def test_json_and_help(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cpu_ops"]) == set(cpu.policy.OPS)
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--help"])
    assert e.value.code == 0
    assert "--no-build" in capsys.readouterr().out
