"""Presets against the published configs, and their caches against hand arithmetic."""

import pytest

from kvjax.memory import accounting as acc
from kvjax.memory.presets import PRESETS, ModelPreset, get_preset, preset_names
from kvjax.specs import AttentionSpec, MLASpec

EXPECTED_NAMES = (
    "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b",
    "mistral-7b", "qwen2.5-7b", "qwen2.5-72b", "deepseek-67b", "deepseek-v2",
    "deepseek-v2-lite", "deepseek-v3", "deepseek-v3.2", "qwen3-next-80b-a3b",
    "gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b",
    "gemma-3-27b",
)


def test_all_expected_presets_exist_under_lowercase_names():
    assert preset_names() == EXPECTED_NAMES
    for name, preset in PRESETS.items():
        assert name == preset.name == name.lower()
        assert "huggingface.co/" in preset.source


def test_llama_2_70b():
    p = get_preset("llama-2-70b")
    assert (p.num_layers, p.q_heads, p.kv_heads, p.head_dim, p.hidden_size) == (
        80, 64, 8, 128, 8192)
    assert round(p.num_params / 1e9) == 69
    assert p.kind == "GQA"
    assert p.attention == AttentionSpec(q_heads=64, kv_heads=8, head_dim=128)


def test_deepseek_67b():
    p = get_preset("deepseek-67b")
    assert (p.num_layers, p.q_heads, p.kv_heads, p.head_dim) == (95, 64, 8, 128)
    assert round(p.num_params / 1e9) == 67


@pytest.mark.parametrize(
    "name, layers, heads, q_lora, params",
    [("deepseek-v2", 60, 128, 1536, 236e9), ("deepseek-v2-lite", 27, 16, None, 15.7e9),
     ("deepseek-v3", 61, 128, 1536, 671e9)],
)
def test_deepseek_mla_presets(name, layers, heads, q_lora, params):
    p = get_preset(name)
    assert p.kind == "MLA" and p.is_mla
    assert (p.num_layers, p.q_heads, p.num_params) == (layers, heads, params)
    assert p.attention == MLASpec(
        q_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, q_lora_rank=q_lora,
    )


# Qwen3-Next (hybrid) sets head_dim 256 in its config, wider than hidden_size / heads = 128;
# the Gemma configs set theirs too (tests/memory/test_memory_window.py checks them).
@pytest.mark.parametrize(
    "name", [n for n in EXPECTED_NAMES if not PRESETS[n].is_mla and not PRESETS[n].is_hybrid
             and PRESETS[n].sliding_window is None])
def test_dense_presets_are_consistent(name):
    p = PRESETS[name]
    assert p.head_dim * p.q_heads == p.hidden_size
    assert p.q_heads % p.kv_heads == 0
    assert isinstance(p.attention, AttentionSpec)


@pytest.mark.parametrize(
    "name, bytes_per_token",
    [
        ("llama-2-7b", 2 * 32 * 32 * 128 * 2),  # 524,288: MHA
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072: GQA-8
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # 57,344: GQA-4 over 28 layers
        ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),  # 516,096
        ("deepseek-v2-lite", 27 * (512 + 64) * 2),  # 31,104: MLA latent
        ("deepseek-v3", 61 * (512 + 64) * 2),  # 70,272
    ],
)
def test_bf16_bytes_per_token(name, bytes_per_token):
    p = get_preset(name)
    assert acc.bytes_per_token(p.attention, p.num_layers, "bf16") == bytes_per_token


def test_lookup_is_case_insensitive():
    assert get_preset("Llama-2-70B") is PRESETS["llama-2-70b"]


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"'gpt-5'.*llama-2-7b.*deepseek-v3"):
        get_preset("gpt-5")


def test_mla_fields_come_together():
    with pytest.raises(ValueError, match="missing"):
        ModelPreset(name="x", num_layers=1, hidden_size=8, q_heads=1, kv_heads=1, head_dim=8,
                    num_params=1, vocab=1, source="test", kv_lora_rank=4)
