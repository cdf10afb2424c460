"""scripts/device_check.py: its command line, the time budget, and how a part's end is read.

On CPU the native kernel tests skip, so a run of the `kernels` part shows only that the
part runs, is timed and summarised; it asserts nothing about an accelerator.
"""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location(
        "device_check", os.path.join(ROOT, "scripts", "device_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_and_bad_parts(script, capsys):
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(f in out for f in ("--parts", "--budget", "--out", *script.PARTS))
    for argv, needle in ((["--parts", "kernels,gpu"], "gpu"), (["--budget", "0"], "0")):
        with pytest.raises(SystemExit) as refused:
            script.main(argv)
        assert refused.value.code == 2 and needle in capsys.readouterr().err


def test_parts_past_the_budget_are_skipped_and_listed(script, tmp_path, capsys):
    assert script.main(["--parts", "host,offload", "--budget", "5", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "device_check.json").read_text())["results"]
    assert [(r["part"], r["status"]) for r in got] == [("host", "skipped"),
                                                       ("offload", "skipped")]
    assert "| host | skipped |" in capsys.readouterr().out


def test_outcome_is_pytests_summary_or_the_last_line(script):
    log = "collected\n....\nFAILED x::y\n==== 1 failed, 4 passed, 2 skipped in 3.21s ====\n"
    assert script.outcome(log) == "1 failed, 4 passed, 2 skipped in 3.21s"
    assert script.outcome("a\nwrote out.json\n\n") == "wrote out.json"
    assert script.outcome("") == "(no output)"


def test_a_part_runs_and_is_summarised(script, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the part's pytest: native kernels skip
    assert script.main(["--parts", "kernels", "--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "device_check.json").read_text())["results"]
    assert r["status"] == "ok" and r["seconds"] > 0 and "skipped" in r["outcome"]
    assert "needs a GPU backend" in (tmp_path / "kernels.log").read_text()
