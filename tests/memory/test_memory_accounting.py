"""Byte accounting against values worked out by hand in each test."""

import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from kvjax.memory import accounting as acc
from kvjax.memory.presets import get_preset
from kvjax.specs import AttentionSpec, MLASpec

REPO = Path(__file__).resolve().parents[2]

# Llama-2-70B shapes: 80 layers, 64 query heads, head_dim 128.
LAYERS = 80
MHA_70B = AttentionSpec(q_heads=64, kv_heads=64, head_dim=128)
GQA_70B = AttentionSpec(q_heads=64, kv_heads=8, head_dim=128)


def test_mha_llama2_70b_shape_at_8k_batch_4_is_tens_of_gb():
    # K and V, 64 heads x 128 wide, 2 bytes each, 80 layers:
    # 2 * 80 * 64 * 128 * 2 = 2,621,440 bytes per token.
    assert acc.elements_per_token_per_layer(MHA_70B) == 2 * 64 * 128 == 16_384
    assert acc.bytes_per_token_per_layer(MHA_70B, "bf16") == 2 * 64 * 128 * 2 == 32_768
    assert acc.bytes_per_token(MHA_70B, LAYERS, "bf16") == 2_621_440
    # 8,192 tokens per sequence: 2,621,440 * 8,192 = 21,474,836,480 = 20 GiB.
    assert acc.bytes_per_sequence(MHA_70B, LAYERS, 8192, "bf16") == 21_474_836_480
    # Batch 4: 85,899,345,920 bytes = 85.9 GB = 80 GiB.
    batch = acc.bytes_per_batch(MHA_70B, LAYERS, 8192, 4, "bf16")
    assert batch == 2_621_440 * 8192 * 4 == 85_899_345_920
    assert batch == 80 * acc.GiB
    assert 10 * acc.GB < batch < 100 * acc.GB


def test_gqa_8_is_exactly_one_eighth_of_mha():
    mha = acc.bytes_per_batch(MHA_70B, LAYERS, 8192, 4, "bf16")
    gqa = acc.bytes_per_batch(GQA_70B, LAYERS, 8192, 4, "bf16")
    assert gqa * 8 == mha
    # 2 * 80 * 8 * 128 * 2 = 327,680 bytes per token.
    assert acc.bytes_per_token(GQA_70B, LAYERS) == 327_680
    assert gqa == 10_737_418_240


def test_deepseek_v2_cuts_kv_cache_by_93_3_percent_vs_deepseek_67b():
    # DeepSeek-V2 paper (arXiv 2405.04434): "reduces the KV cache by 93.3%" against
    # DeepSeek 67B. 67B caches bf16 K and V of 8 KV heads x 128 in 95 layers:
    # 2 * 95 * 8 * 128 = 194,560 elements * 16 bits = 3,112,960 bits per token.
    # V2 caches 512 + 64 latent elements in 60 layers, deployed at ~6 bits each:
    # 60 * (512 + 64) = 34,560 elements * 6 bits = 207,360 bits per token.
    # 1 - 207,360 / 3,112,960 = 0.93339...
    dense, mla = get_preset("deepseek-67b"), get_preset("deepseek-v2")
    dense_bytes = acc.bytes_per_token(dense.attention, dense.num_layers, "bf16")
    mla_bytes = acc.bytes_per_token(mla.attention, mla.num_layers, acc.kv_format(bits=6))
    assert dense_bytes * 8 == 2 * 95 * 8 * 128 * 16 == 3_112_960
    assert mla_bytes * 8 == 60 * (512 + 64) * 6 == 207_360
    saved = acc.reduction(mla_bytes, dense_bytes)
    assert saved == pytest.approx(1 - 207_360 / 3_112_960)
    assert round(100 * saved, 1) == 93.3


def test_mla_elements_are_latent_plus_rope():
    spec = MLASpec(q_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                   v_head_dim=128)
    assert acc.elements_per_token_per_layer(spec) == 512 + 64
    # 576 elements * 2 bytes = 1,152 bytes per layer, whatever the 128 query heads.
    assert acc.bytes_per_token_per_layer(spec, "bf16") == 1_152


def test_int2_with_group_32_and_16_bit_scale_zero_is_3_bits():
    # 2 code bits + (16-bit scale + 16-bit zero) / 32 elements = 2 + 1 = 3 bits.
    fmt = acc.kv_format("int2", group_size=32, scale_bits=16)
    assert fmt.overhead_bits_per_element == 1
    assert fmt.bits_per_element == 3
    # GQA-8 Llama-2-70B: 2,048 elements * 3 bits / 8 = 768 bytes per layer;
    # * 80 layers = 61,440 bytes per token.
    assert acc.bytes_per_token_per_layer(GQA_70B, fmt) == 768
    assert acc.bytes_per_token(GQA_70B, LAYERS, fmt) == 61_440


def test_fractional_bits_stay_exact():
    # int4 with a 16-bit scale and zero per 128: 4 + 32/128 = 17/4 bits.
    fmt = acc.kv_format("int4", group_size=128)
    assert fmt.bits_per_element == Fraction(17, 4)
    mla = MLASpec(q_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128)
    # 576 * 17/4 = 2,448 bits = 306 bytes.
    assert acc.bytes_per_token_per_layer(mla, fmt) == 306
    # 2 * 1 head * 3 wide = 6 elements * 2 bits = 12 bits = 3/2 bytes: not a whole byte.
    tiny = AttentionSpec(q_heads=1, kv_heads=1, head_dim=3)
    per_layer = acc.bytes_per_token_per_layer(tiny, "int2")
    assert isinstance(per_layer, Fraction)
    assert per_layer == Fraction(3, 2)


@pytest.mark.parametrize(
    "name, bits",
    [("fp32", 32), ("bf16", 16), ("fp16", 16), ("fp8", 8), ("int8", 8), ("int4", 4),
     ("int2", 2), ("BF16", 16), ("bfloat16", 16), ("float32", 32)],
)
def test_dtype_bits(name, bits):
    assert acc.dtype_bits(name) == bits
    assert acc.kv_format(name).bits == bits


@pytest.mark.parametrize("bits", [2, 4, 6, 8, 16, 32, 3])
def test_bits_override_per_layer(bits):
    # Llama-2-70B GQA: 2,048 elements per layer * bits / 8.
    fmt = acc.kv_format("bf16", bits=bits)
    assert fmt.bits == bits
    assert acc.bytes_per_token_per_layer(GQA_70B, fmt) == Fraction(2048 * bits, 8)


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(ValueError, match=r"'int3'.*fp32, bf16, fp16, fp8, int8, int4, int2"):
        acc.dtype_bits("int3")


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(bits=0), "bits"), (dict(bits=True), "bits"), (dict(bits=4, group_size=0),
     "group_size"), (dict(bits=4, scale_bits=-1), "scale_bits"),
     (dict(bits=4, residual=-1), "residual")],
)
def test_kv_format_validates(kwargs, field):
    with pytest.raises(ValueError, match=f"KVFormat.{field}"):
        acc.KVFormat(**kwargs)


def test_formats_with_equal_numbers_are_equal_whatever_their_names():
    assert acc.kv_format("fp8") == acc.kv_format("int8")
    assert hash(acc.kv_format("fp8")) == hash(acc.kv_format("int8"))
    assert acc.kv_format("int4") != acc.kv_format("int4", group_size=32)


def test_residual_tail_is_counted_at_bf16():
    # GQA-8 Llama-2-70B: 2,048 elements per layer, 80 layers = 163,840 elements per token.
    fmt = acc.kv_format("int4", residual=128)
    elements = 2 * 8 * 128 * 80
    # 1,000 tokens: 872 at 4 bits, the last 128 at 16 bits.
    expected = elements * (872 * 4 + 128 * 16) // 8
    assert acc.bytes_per_sequence(GQA_70B, LAYERS, 1000, fmt) == expected
    # Shorter than the tail: everything is bf16.
    assert acc.bytes_per_sequence(GQA_70B, LAYERS, 100, fmt) == acc.bytes_per_sequence(
        GQA_70B, LAYERS, 100, "bf16"
    )
    # Per-token figures describe a quantized token.
    assert acc.bytes_per_token(GQA_70B, LAYERS, fmt) == elements * 4 // 8


def test_weight_bytes():
    # Llama-2-70B: 68,976,648,192 params * 2 bytes.
    assert acc.weight_bytes(68_976_648_192, "bf16") == 137_953_296_384
    assert acc.weight_bytes(68_976_648_192, "int4") == 34_488_324_096


@pytest.mark.parametrize(
    "num_bytes, decimal, binary",
    [(85_899_345_920, "85.90 GB", "80.00 GiB"), (327_680, "327.68 kB", "320.00 KiB"),
     (512, "512 B", "512 B"), (Fraction(3, 2), "1.5 B", "1.5 B"),
     (3 * 2**40, "3.30 TB", "3.00 TiB")],
)
def test_format_bytes(num_bytes, decimal, binary):
    assert acc.format_bytes(num_bytes) == decimal
    assert acc.format_bytes(num_bytes, binary=True) == binary


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_layers"):
        acc.bytes_per_token(GQA_70B, 0)
    with pytest.raises(ValueError, match="tokens"):
        acc.bytes_per_sequence(GQA_70B, LAYERS, -1)
    with pytest.raises(ValueError, match="batch"):
        acc.bytes_per_batch(GQA_70B, LAYERS, 10, 0)
    with pytest.raises(TypeError, match="AttentionSpec or MLASpec"):
        acc.elements_per_token_per_layer(object())
    with pytest.raises(TypeError, match="KVFormat or a dtype name"):
        acc.bytes_per_token(GQA_70B, LAYERS, 16)


def test_import_does_not_pull_in_jax():
    # Load kvjax.memory with `jax` made unimportable. The kvjax package __init__
    # is bypassed (a bare package stands in for it) because what it imports is
    # not this layer's business; only kvjax.memory's own imports are checked.
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys, types

        class NoJax(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("jax", "jaxlib"):
                    raise ImportError("jax is blocked: " + name)

        sys.meta_path.insert(0, NoJax())
        pkg = types.ModuleType("kvjax")
        pkg.__path__ = [{str(REPO / "kvjax")!r}]
        sys.modules["kvjax"] = pkg

        import kvjax.memory as m

        class Geometry:
            cache_heads, cache_widths = 8, (128, 128)

        assert m.bytes_per_token(Geometry(), 80, "bf16") == 327_680
        assert m.get_preset("llama-2-70b").num_layers == 80
        assert m.paging_waste([1, 17]).paged_bytes == 48
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
