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


def test_plan_lists_parts_and_limits_without_running_them(script, tmp_path, capsys):
    out_dir = tmp_path / "never"
    assert script.main(["--plan", "--parts", "kernels,host", "--budget", "200",
                        "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "kernels: up to 150 s, runs:" in out and "tests/kernels" in out
    assert "host: up to 120 s, runs if the parts before it leave it the time" in out
    assert not out_dir.exists()  # nothing ran, nothing written


def test_decode_target_plan_bytes_and_flops_match_hand_arithmetic(capsys):
    """The GPU decode targets' sizes as `--plan` prints them (no GPU needed): K+V or the
    latent at the true lengths in bf16, Q and O, and MLA's FLOPs per byte near 240."""
    from benchmarks import pallas_kernels

    assert pallas_kernels.main(["--targets", "--plan"]) == 0
    rows = {tuple(ln.split()[:3]): ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    gqa = rows[("gqa", "8", "32768")]
    assert float(gqa[6]) == 8 * 8 * 32768 * (128 + 128) * 2 / 2**20  # 1024 MiB of K and V
    q_o = 8 * 32 * (128 + 128) * 2 + 8 * 32 * 4  # bf16 Q and O, float32 log-sum-exp
    assert abs(float(gqa[7]) - q_o / 2**20) < 0.005
    mla = rows[("mla", "8", "32768")]
    assert float(mla[6]) == 8 * 32768 * (512 + 64) * 2 / 2**20  # 288 MiB of latents
    flops = 2 * 8 * 128 * 32768 * (576 + 512)
    assert abs(float(mla[8]) - flops / 1e9) < 0.05
    assert 235 < float(mla[9]) < 241  # compute-bound on Hopper (ridge near 206)
    assert {k[:1] for k in rows} == {("gqa",), ("mla",)} and len(rows) == 6


def test_prefill_plan_flops_match_hand_arithmetic(capsys):
    """8 prompts of 4096 tokens, causal: each row's queries see 4096 * 4097 / 2 keys in
    all, 32 heads x (128 + 128) multiply-adds each; the mixed step adds 56 decode rows."""
    from benchmarks import prefill_kernels

    assert prefill_kernels.main(["--plan"]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    prefill = 8 * (4096 * 4097 // 2) * 32 * 2 * 256
    assert abs(float(rows["prefill"][2]) - prefill / 1e9) < 0.01
    assert rows["kivi"][2] == rows["prefill"][2]
    chunks = 8 * (512 * 2048 + 512 * 513 // 2)  # chunks at mid-prompt
    mixed = (chunks + 56 * 4096) * 32 * 2 * 256
    assert rows["mixed"][1] == "64" and abs(float(rows["mixed"][2]) - mixed / 1e9) < 0.01


def test_long_context_plan_matches_hand_arithmetic(capsys):
    """The 4M-token run's sizes, without a GPU: Llama-3-8B's int2 KV (2-bit codes plus a
    16-bit scale and zero per 32 elements; the last 128 tokens in bf16) fits beside its bf16
    weights in an H200's 139 GiB, its bf16 KV (512 GiB) does not."""
    from benchmarks import long_context

    assert long_context.main(["--plan"]) == 0
    out = capsys.readouterr().out
    elements = 32 * 2 * 8 * 128  # per token: layers x (K, V) x KV heads x head_dim
    tokens = 4 * 1024 * 1024
    int2 = (tokens - 128) * elements * (2 + 32 / 32) / 8 + 128 * elements * 2
    line = " ".join(next(ln for ln in out.splitlines() if ln.strip().startswith("int2")).split())
    assert f"calculator KV {int2 / 2**30:.2f} GiB" in line and line.endswith("fits in 139 GiB")
    bf16 = next(ln for ln in out.splitlines() if ln.strip().startswith("bf16"))
    assert f"{tokens * elements * 2 / 2**30:.2f} GiB" in bf16 and "does not fit" in bf16


def test_kivi_target_plan_bytes_match_hand_arithmetic(capsys):
    """The KIVI rows' sizes as `--kivi-targets --plan` prints them (no GPU needed): per token
    and KV head, int4 K and V each 64 bytes of codes plus a float16 scale and zero per 32
    elements (16 bytes); MLA's int4 latent the same per 512 channels plus its bf16 rope."""
    from benchmarks import pallas_kernels

    assert pallas_kernels.main(["--kivi-targets", "--plan"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    tokens = 8 * 32768
    mib = {(r[0], r[3], r[-2] if r[-1].startswith("g") else "bf16"): float(r[6]) for r in rows}
    assert mib[("gqa", "32/8", "bf16")] == 8 * tokens * 256 * 2 / 2**20
    for bits in (8, 4, 2):
        per_head = 2 * (128 * bits // 8 + 2 * 2 * 128 // 32)
        assert mib[("qgqa", "32/8", f"int{bits}")] == 8 * tokens * per_head / 2**20
    latent = 512 // 2 + 2 * 2 * 512 // 32 + 64 * 2
    for heads in ("16/1", "128/1"):
        assert mib[("qmla", heads, "int4")] == tokens * latent / 2**20
        assert mib[("mla", heads, "bf16")] == tokens * 576 * 2 / 2**20
    assert len(rows) == 8


def test_kivi_verdicts_divide_by_the_bf16_kernel_of_the_same_size(rng):
    """Each KIVI row's step over the bf16 Mosaic kernel's at its op and heads (Mosaic even
    where Triton was faster), against its bound; MLA at 128 heads reported without one; a
    row that missed the reference fails its line; int2 must beat int4."""
    from benchmarks import pallas_kernels as pk

    def row(op, impl, ms, heads=32, bits=None, ok=True):
        return pk.Row(op=op, impl=impl, mode="native", batch=8, context=32768, q_heads=heads,
                      kv_heads=8, head_dim=128, page_size=64, dtype="bfloat16", kv_bytes=1,
                      bytes_moved=1, median_ms=ms, gbps=1.0, frac_copy=1.0, frac_nominal=None,
                      frac_ceiling=None, tflops=1.0, frac_matmul=None, max_abs_err=0.0, ok=ok,
                      bits=bits)

    gqa, mla16, mla128 = rng.uniform(0.5, 1.0, 3)
    i8, i4, i2, m16, m128 = rng.uniform(0.2, 0.4, 5)
    rows = [row("gqa", "triton", gqa / 2), row("gqa", "mosaic", gqa),
            row("qgqa", "pallas", i8 * gqa, bits=8), row("qgqa", "pallas", i4 * gqa, bits=4),
            row("qgqa", "pallas", i2 * gqa, bits=2, ok=False),
            row("mla", "mosaic", mla16, heads=16), row("mla", "mosaic", mla128, heads=128),
            row("qmla", "pallas", 1.8 * m16 * mla16, heads=16, bits=4),
            row("qmla", "pallas", m128 * mla128, heads=128, bits=4)]
    got = {v["row"]: v for v in pk.kivi_verdicts(rows)}
    for bits, r, bound in ((8, i8, 0.60), (4, i4, 0.40), (2, i2, 0.28)):
        v = got[f"qgqa int{bits} 32 heads vs gqa mosaic"]
        assert abs(v["ratio"] - r) < 1e-9 and v["bound"] == bound
        assert v["met"] == (r <= bound and bits != 2)
    v = got["qmla int4 16 heads vs mla mosaic"]
    assert abs(v["ratio"] - 1.8 * m16) < 1e-9 and v["bound"] == 0.5 and v["met"] == (
        1.8 * m16 <= 0.5)
    assert got["qmla int4 128 heads vs mla mosaic"]["bound"] is None
    assert not got["qgqa int2 faster than int4"]["met"]  # the int2 row failed its check
    assert len(got) == 6
