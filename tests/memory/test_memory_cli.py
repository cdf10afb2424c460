"""`python -m kvjax memory`: a few runs as a real subprocess, the rest in-process."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.__main__ import main

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvjax", *args], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )


def _main(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_memory_table_subprocess():
    r = _run("memory", "--model", "llama-2-70b", "--context", "8192", "--batch", "8",
             "--kv-dtype", "bf16")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # Per layer: 2 * 8 KV heads * 128 * 2 bytes = 4,096; per token: * 80 layers = 327,680.
    assert "4,096" in out and "327,680" in out
    # Per sequence: 327,680 * 8,192 = 2,684,354,560 = 2.5 GiB; per batch: * 8 = 20 GiB.
    assert "2,684,354,560" in out and "2.50 GiB" in out
    assert "21,474,836,480" in out and "21.47 GB" in out and "20.00 GiB" in out
    # Weights: 68,976,648,192 params * 2 bytes; KV / weights = 21.47 / 137.95 = 0.156.
    assert "137,953,296,384" in out and "0.156" in out
    # Both unit systems are named.
    assert "decimal kB/MB/GB/TB = 10^3/10^6/10^9/10^12 bytes" in out
    assert "binary KiB/MiB/GiB/TiB = 2^10/2^20/2^30/2^40 bytes" in out


@pytest.mark.parametrize("args", [["--help"], ["memory", "--help"]])
def test_help_subprocess(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert "memory" in r.stdout


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--list", "--context", "--batch", "--kv-dtype", "--kv-bits",
                 "--group-size", "--scale-bits", "--weight-dtype", "--compare", "--lengths",
                 "--length-spread", "--page-size"):
        assert flag in out


def test_unknown_model_subprocess():
    r = _run("memory", "--model", "gpt-17")
    assert r.returncode == 2
    assert "argument --model: Unknown model 'gpt-17'" in r.stderr
    assert "llama-2-70b" in r.stderr and "deepseek-v3" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama-2-7b", "--context", "-5"],
         "argument --context: must be a positive integer, got '-5'"),
        (["--model", "llama-2-7b", "--kv-dtype", "int3"],
         "argument --kv-dtype: unknown dtype 'int3'; allowed: fp32, bf16, fp16, fp8, int8, "
         "int4, int2"),
        (["--model", "llama-2-7b", "--weight-dtype", "fp64"], "unknown dtype 'fp64'"),
        (["--model", "llama-2-7b", "--batch", "0"], "argument --batch"),
        (["--context", "10"], "--model argument is required"),
        (["--model", "llama-2-7b", "--lengths", "5,x"], "got 'x' in '5,x'"),
        (["--model", "llama-2-7b", "--lengths", "100,9000", "--context", "8192"],
         "longest length 9000 exceeds --context 8192"),
        (["--model", "llama-2-7b", "--lengths", "1", "--length-spread", "2"],
         "not allowed with argument"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["memory", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_compare_gqa_model(capsys):
    out = _main(capsys, "memory", "--model", "llama-2-70b", "--compare")
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    # MHA bf16: 2 * 64 * 128 * 2 bytes * 80 layers = 2,621,440 per token, the baseline.
    assert "2,621,440" in rows["MHA (64 KV heads)"] and "0.00%" in rows["MHA (64 KV heads)"]
    # The model's own GQA-8 at bf16: 1/8 of it = 327,680, an 87.50% reduction.
    gqa = rows["GQA-8 (actual)"]
    assert "327,680" in gqa and "87.50%" in gqa
    # MQA: 2 * 128 * 2 * 80 = 40,960 bytes, 1/64 of MHA: 98.44%.
    assert "40,960" in rows["MQA (1 KV head)"]
    # MLA with d_c = 512, d_rope = 64: 576 * 2 * 80 = 92,160 bytes: 96.48%.
    mla = rows["MLA (d_c 512, d_rope 64)"]
    assert "92,160" in mla and "96.48%" in mla
    # int2 MQA: 256 elements * 2 bits / 8 * 80 = 5,120 bytes: 1 - 5,120 / 2,621,440 = 99.80%.
    assert any("int2" in line and "5,120" in line and "99.80%" in line
               for line in out.splitlines())
    assert "d_c = 4 * head_dim = 512 and d_rope = head_dim / 2 = 64" in out


def test_compare_marks_mla_as_actual_and_counts_group_overhead(capsys):
    out = _main(capsys, "memory", "--model", "deepseek-v2", "--compare", "--group-size", "32")
    assert "MLA (d_c 512, d_rope 64) (actual)" in out
    assert "GQA" not in out.split("Cache variants")[1]
    # int2 + 16-bit scale/zero per 32 = 3 bits: 60 layers * 576 * 3 / 8 = 12,960 bytes.
    assert any("int2" in line and " 3 " in line and "12,960" in line
               for line in out.splitlines())


def test_compare_mha_model_has_no_gqa_row(capsys):
    out = _main(capsys, "memory", "--model", "llama-2-7b", "--compare")
    assert "MHA (32 KV heads) (actual)" in out
    assert "GQA" not in out.split("Cache variants")[1]


def test_kv_bits_and_group_size(capsys):
    out = _main(capsys, "memory", "--model", "deepseek-v2", "--kv-bits", "6", "--context", "1")
    # 60 * (512 + 64) * 6 bits / 8 = 25,920 bytes per token.
    assert "25,920" in out and "6 bits/element" in out


def test_lengths(capsys):
    out = _main(capsys, "memory", "--model", "llama-3-8b", "--lengths", "1,16,17,40")
    # 131,072 B/token. Contiguous: 4 x 40 = 160 tokens; paged: 7 x 16 = 112; used 74.
    lines = out.splitlines()
    contiguous = next(line for line in lines if line.startswith("contiguous"))
    paged = next(line for line in lines if line.startswith("paged ("))
    used = next(line for line in lines if line.startswith("used"))
    assert " 160 " in contiguous and f"{160 * 131_072:,}" in contiguous
    assert " 112 " in paged and f"{112 * 131_072:,}" in paged and "33.93%" in paged
    assert " 74 " in used and f"{74 * 131_072:,}" in used
    assert "paged / contiguous reservation: 0.700" in out


def test_length_spread(capsys):
    out = _main(capsys, "memory", "--model", "mistral-7b", "--length-spread", "4",
                "--context", "1000", "--page-size", "256")
    # Lengths 250, 500, 750, 1,000; contiguous 4 x 1,000 tokens, paged 1 + 2 + 3 + 4 pages.
    assert "lengths 250, 500, 750, 1,000" in out
    assert "4,000" in out and f"{10 * 256:,}" in out and "2,500" in out


def test_list(capsys):
    out = _main(capsys, "memory", "--list")
    assert "deepseek-v2-lite" in out and "llama-3.1-405b" in out
    # DeepSeek-V3: 61 * 576 * 2 = 70,272 bytes per token at bf16.
    assert "70,272" in out
