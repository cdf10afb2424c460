"""Host-memory tier: `host_tier_bytes` and `python -m kvjax memory --host-fraction`.

Every expected figure is worked out here from the model's dimensions.
"""

import dataclasses
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.__main__ import main
from kvjax.memory import HostTier, bytes_per_sequence, get_preset, host_tier_bytes, kv_format

REPO = Path(__file__).resolve().parents[2]

# Llama-3-8B: 32 layers, 8 KV heads, head_dim 128.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
ELEMS = 2 * KV_HEADS * HEAD_DIM  # K and V per token per layer
BF16_TOKEN = LAYERS * ELEMS * 2  # 131,072 bytes
# int4 codes + a 16-bit scale and a 16-bit zero per 32 elements = 5 bits per element.
INT4_G32_TOKEN = LAYERS * ELEMS * 5 // 8  # 40,960 bytes
LLAMA = get_preset("llama-3-8b")


def test_llama_dimensions():
    assert (LLAMA.num_layers, LLAMA.kv_heads, LLAMA.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    assert BF16_TOKEN == 131_072 and INT4_G32_TOKEN == 40_960


def _decimal(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _binary(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


# -- the function


def test_bf16_llama_128k_90_percent_batch_2():
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 131_072, host_fraction=0.9, page_size=16,
                           batch=2)
    assert isinstance(tier, HostTier)
    # floor(0.9 * 131,072 / 16) = floor(7,372.8) = 7,372 pages of 16 tokens.
    pages = 9 * 131_072 // (10 * 16)
    assert pages == 7_372
    assert tier.host_pages == pages and tier.host_tokens == 16 * pages == 117_952
    assert tier.device_tokens == 131_072 - 117_952 == 13_120
    assert tier.host_bytes == 117_952 * BF16_TOKEN
    assert tier.device_bytes == 13_120 * BF16_TOKEN
    assert tier.batch_host_bytes == 2 * 117_952 * BF16_TOKEN
    assert tier.batch_device_bytes == 2 * 13_120 * BF16_TOKEN
    # One decode step reads every host token of every layer once, for both sequences.
    assert tier.transfer_bytes_per_step == 2 * 117_952 * LAYERS * ELEMS * 2
    assert not tier.capped
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.host_pages = 0


def test_kivi_int4_ring_stays_on_device():
    fmt = kv_format("int4", group_size=32, residual=128)
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 131_072, host_fraction=Fraction(1, 2),
                           page_size=16, batch=2, fmt=fmt)
    # Half the context in host pages: 65,536 quantized tokens.
    assert tier.host_tokens == 65_536 and tier.movable_pages == (131_072 - 128) // 16
    assert tier.host_bytes == 65_536 * INT4_G32_TOKEN
    # On the device: the other quantized tokens, and the 128-token tail at bf16.
    assert tier.device_bytes == (131_072 - 128 - 65_536) * INT4_G32_TOKEN + 128 * BF16_TOKEN
    assert tier.transfer_bytes_per_step == 2 * 65_536 * INT4_G32_TOKEN


def test_kivi_residual_caps_the_host_pages():
    fmt = kv_format("int4", group_size=32, residual=128)
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 131_072, host_fraction=0.9995,
                           page_size=16, batch=2, fmt=fmt)
    # F alone would move floor(131,006.464 / 16) = 8,187 pages; only the
    # (131,072 - 128) / 16 = 8,184 quantized pages outside the ring can move.
    assert math.floor(Fraction(9995, 10_000) * 131_072 / 16) == 8_187
    assert tier.capped and tier.host_pages == 8_184 and tier.host_tokens == 130_944
    # What stays on the device is exactly the 128 bf16 residual tokens.
    assert tier.device_tokens == 128
    assert tier.device_bytes == 128 * BF16_TOKEN
    assert tier.host_bytes == 130_944 * INT4_G32_TOKEN


def test_partial_page_context_with_residual():
    fmt = kv_format("int4", group_size=32, residual=128)
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 1000, host_fraction=0.9, page_size=16,
                           fmt=fmt)
    # F: floor(900 / 16) = 56 pages; quantized pages: floor((1000 - 128) / 16) = 54.
    assert tier.host_pages == 54 and tier.host_tokens == 864 and tier.capped
    # Device: 8 quantized tokens and the 128-token tail (accounting's split).
    assert tier.device_bytes == 8 * INT4_G32_TOKEN + 128 * BF16_TOKEN


def test_mla_deepseek_v2_int2():
    ds = get_preset("deepseek-v2")
    fmt = kv_format("int2", group_size=32, residual=512)
    tier = host_tier_bytes(ds.attention, ds.num_layers, 1000, host_fraction=0.5, page_size=64,
                           batch=3, fmt=fmt)
    # 60 layers x (512 c_KV + 64 k_rope) x (2 + 2 * 16 / 32 = 3 bits) / 8 = 12,960 B per token.
    per_token = 60 * (512 + 64) * 3 // 8
    assert per_token == 12_960
    # min(floor(500 / 64), floor((1000 - 512) / 64)) = min(7, 7) pages of 64.
    assert tier.host_tokens == 7 * 64 and not tier.capped
    assert tier.batch_host_bytes == 3 * 448 * per_token
    bf16 = 60 * 576 * 2
    assert tier.device_bytes == (1000 - 512 - 448) * per_token + 512 * bf16


def test_fraction_is_read_as_decimal():
    # 0.3 of 160 tokens is 48 = 3 pages of 16, although the float 0.3 is a hair under 3/10.
    assert Fraction(0.3) * 160 < 48
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 160, host_fraction=0.3, page_size=16)
    assert tier.host_tokens == 48 and tier.host_fraction == Fraction(3, 10)


def test_zero_fraction_and_short_context_move_nothing():
    total = bytes_per_sequence(LLAMA.attention, LAYERS, 100)
    for f, ctx in [(0, 100), (0.1, 100)]:  # 0.1 * 100 = 10 tokens: less than a page
        tier = host_tier_bytes(LLAMA.attention, LAYERS, ctx, host_fraction=f, page_size=16)
        assert tier.host_tokens == 0 and tier.host_bytes == 0
        assert tier.device_bytes == total == 100 * BF16_TOKEN


@given(
    f=st.fractions(min_value=0, max_value=Fraction(999, 1000)),
    context=st.integers(1, 20_000),
    page_size=st.sampled_from([1, 16, 64, 256]),
    residual_pages=st.integers(0, 8),
    bits=st.sampled_from([None, 2, 4, 8]),
)
def test_invariants(f, context, page_size, residual_pages, bits):
    fmt = (kv_format("bf16") if bits is None
           else kv_format(f"int{bits}", group_size=32, residual=residual_pages * page_size))
    tier = host_tier_bytes(LLAMA.attention, LAYERS, context, host_fraction=f,
                           page_size=page_size, batch=3, fmt=fmt)
    assert tier.host_tokens % page_size == 0
    assert tier.host_tokens <= f * context
    assert tier.host_tokens <= max(context - fmt.residual, 0)
    if not tier.capped:
        assert tier.host_tokens > f * context - page_size
    assert tier.host_bytes + tier.device_bytes == bytes_per_sequence(
        LLAMA.attention, LAYERS, context, fmt)
    assert tier.transfer_bytes_per_step == 3 * tier.host_bytes


def test_step_seconds():
    tier = host_tier_bytes(LLAMA.attention, LAYERS, 131_072, host_fraction=0.9, page_size=16,
                           batch=2)
    t_host, t_hbm = tier.step_seconds(host_gbps=55, hbm_gbps=4800)
    assert t_host == pytest.approx(2 * 117_952 * BF16_TOKEN / 55e9, rel=1e-12)
    assert t_hbm == pytest.approx(2 * 13_120 * BF16_TOKEN / 4800e9, rel=1e-12)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="host_gbps must be a positive finite number"):
            tier.step_seconds(host_gbps=bad, hbm_gbps=4800)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(host_fraction=1), "host_fraction must be a number in [0, 1)"),
        (dict(host_fraction=-0.5), "got -0.5"),
        (dict(host_fraction="half"), "got 'half'"),
        (dict(host_fraction=math.nan), "got nan"),
        (dict(host_fraction=True), "got True"),
        (dict(host_fraction=0.5, page_size=0), "page_size must be a positive int, got 0"),
        (dict(host_fraction=0.5, batch=0), "batch must be a positive int, got 0"),
        (dict(host_fraction=0.5, context=0), "context must be a positive int, got 0"),
    ],
)
def test_function_errors(kwargs, message):
    kwargs = dict(context=4096) | kwargs
    context = kwargs.pop("context")
    with pytest.raises(ValueError) as e:
        host_tier_bytes(LLAMA.attention, LAYERS, context, **kwargs)
    assert message in str(e.value)


# -- the CLI


def _main(capsys, *args: str) -> str:
    assert main(["memory", *args]) == 0
    return capsys.readouterr().out


def _row(out: str, label: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith(label)]
    assert len(lines) == 1, (label, lines)
    return lines[0][len(label):].split("  ")


def _check_row(out: str, label: str, tokens: int, nbytes: int) -> None:
    cells = [c.strip() for c in _row(out, label) if c.strip()]
    assert cells == [f"{tokens:,}", f"{nbytes:,}", _decimal(nbytes), _binary(nbytes)]


def test_cli_bf16_llama_128k(capsys):
    out = _main(capsys, "--model", "llama-3-8b", "--context", "131072", "--batch", "2",
                "--host-fraction", "0.9", "--host-bandwidth", "55", "--hbm-bandwidth", "4800")
    host, device = 16 * (9 * 131_072 // (10 * 16)), 131_072 - 16 * (9 * 131_072 // (10 * 16))
    _check_row(out, "device per sequence", device, device * BF16_TOKEN)
    _check_row(out, "host per sequence", host, host * BF16_TOKEN)
    _check_row(out, "device per batch (2 seqs)", 2 * device, 2 * device * BF16_TOKEN)
    _check_row(out, "host per batch (2 seqs)", 2 * host, 2 * host * BF16_TOKEN)
    _check_row(out, "host->device per decode step", 2 * host, 2 * host * BF16_TOKEN)
    # By hand: 15,460,204,544 B = 15.46 GB = 14.40 GiB of host memory per sequence.
    assert "15,460,204,544" in out and "15.46 GB" in out and "14.40 GiB" in out
    # device + host = the summary's KV per sequence.
    assert f"{131_072 * BF16_TOKEN:,}" in "".join(_row(out, "KV per sequence"))
    t_host, t_hbm = 2 * host * BF16_TOKEN / 55e9, 2 * device * BF16_TOKEN / 4800e9
    assert f"= {t_host * 1e3:.3f} ms" in out and f"= {t_hbm * 1e6:.3f} us" in out
    assert f"sum (transfer, then device reads): {(t_host + t_hbm) * 1e3:.3f} ms" in out
    assert f"fully overlapped with device reads): {t_host * 1e3:.3f} ms" in out
    assert "KV cache only" in out


def test_cli_kivi_int4_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "kvjax", "memory", "--model", "llama-3-8b", "--context", "131072",
         "--batch", "2", "--kv-dtype", "int4", "--group-size", "32", "--residual", "128",
         "--host-fraction", "0.9995"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    host = 131_072 - 128  # capped: every quantized page moves, the 128-token ring stays
    _check_row(out, "device per sequence", 128, 128 * BF16_TOKEN)
    _check_row(out, "host per sequence", host, host * INT4_G32_TOKEN)
    _check_row(out, "device per batch (2 seqs)", 256, 256 * BF16_TOKEN)
    _check_row(out, "host->device per decode step", 2 * host, 2 * host * INT4_G32_TOKEN)
    assert "bf16 ring of residual 128 + 16 tokens" in out and "caps the host pages" in out
    assert "Decode step time" not in out


def test_cli_no_host_tier_by_default(capsys):
    assert "Host tier" not in _main(capsys, "--model", "llama-3-8b")
    assert "Host tier" not in _main(capsys, "--model", "llama-3-8b", "--host-fraction", "0")


def test_help_documents_host_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--host-fraction F", "--host-bandwidth GBPS", "--hbm-bandwidth GBPS"):
        assert flag in text
    assert "0 <= F < 1" in text and "floor(F * context / page_size)" in text
    assert "reading the KV cache only" in text and "GB/s" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host-fraction", "1"], "argument --host-fraction: must be a number in [0, 1)"),
        (["--host-fraction", "-0.1"], "got '-0.1'"),
        (["--host-fraction", "abc"], "got 'abc'"),
        (["--host-fraction", "nan"], "got 'nan'"),
        (["--host-fraction", "0.5", "--host-bandwidth", "-3", "--hbm-bandwidth", "4800"],
         "argument --host-bandwidth: must be a positive number, got '-3'"),
        (["--host-fraction", "0.5", "--host-bandwidth", "55", "--hbm-bandwidth", "0"],
         "argument --hbm-bandwidth: must be a positive number, got '0'"),
        (["--host-bandwidth", "55", "--hbm-bandwidth", "4800"],
         "argument --host-bandwidth: needs --host-fraction F with 0 < F < 1"),
        (["--host-fraction", "0.5", "--hbm-bandwidth", "4800"],
         "argument --hbm-bandwidth: the step time bound adds both terms; give --host-bandwidth"),
        (["--host-fraction", "0.5", "--lengths", "100,200"],
         "argument --host-fraction: 0.5 is not allowed with --lengths"),
        (["--host-fraction", "0.5", "--length-spread", "4"],
         "argument --host-fraction: 0.5 is not allowed with --length-spread"),
        (["--host-fraction", "0.5", "--budget", "16"],
         "argument --host-fraction: 0.5 is not allowed with --budget"),
        (["--host-fraction", "0.5", "--kv-dtype", "int4", "--residual", "100"],
         "argument --residual: 100 must be a multiple of --page-size 16 with --host-fraction"),
    ],
)
def test_cli_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--model", "llama-3-8b", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
