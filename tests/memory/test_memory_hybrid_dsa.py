"""Qwen3-Next (hybrid Gated DeltaNet + GQA) and DeepSeek-V3.2 (MLA + DSA indexer) caches.

Every expected figure is worked out here from the config numbers, not read
from the program: the presets against the configs (and against transformers'
config classes when it is installed), the functions against hand arithmetic,
and the CLI's printed rows against the same arithmetic.
"""

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from kvjax.__main__ import main
from kvjax.memory import (
    GatedDeltaNetSpec,
    IndexerSpec,
    ModelPreset,
    dsa_cache_bytes,
    get_preset,
    hybrid_cache_bytes,
    kv_format,
    linear_state_bytes,
)
from kvjax.specs import AttentionSpec, MLASpec

REPO = Path(__file__).resolve().parents[2]

# -- Qwen3NextConfig() defaults (transformers 5.x), the numbers the arithmetic below uses.
QN_LAYERS = 48  # num_hidden_layers
QN_INTERVAL = 4  # full_attention_interval: layer i is full attention iff (i + 1) % 4 == 0
QN_HIDDEN, QN_VOCAB = 2048, 151_936  # hidden_size, vocab_size
QN_Q_HEADS, QN_KV_HEADS, QN_HEAD_DIM = 16, 2, 256  # num_attention_heads, num_key_value_heads
QN_LK_HEADS, QN_LV_HEADS = 16, 32  # linear_num_key_heads, linear_num_value_heads
QN_LK_DIM, QN_LV_DIM = 128, 128  # linear_key_head_dim, linear_value_head_dim
QN_CONV = 4  # linear_conv_kernel_dim
QN_EXPERTS, QN_TOPK_EXPERTS, QN_MOE_INTER, QN_SHARED_INTER = 512, 10, 512, 512

QN_FULL = QN_LAYERS // QN_INTERVAL  # 12 full-attention layers
QN_LINEAR = QN_LAYERS - QN_FULL  # 36 Gated DeltaNet layers
# Conv channels: q and k (16 heads x 128 each) and v (32 heads x 128) = 4,096 + 4,096 = 8,192.
QN_CONV_DIM = 2 * QN_LK_HEADS * QN_LK_DIM + QN_LV_HEADS * QN_LV_DIM
assert QN_CONV_DIM == 8192
# Conv state per layer: 8,192 x (4 - 1) = 24,576 elements, bf16 (2 bytes) = 49,152 bytes.
QN_CONV_BYTES = QN_CONV_DIM * (QN_CONV - 1) * 2
assert QN_CONV_BYTES == 49_152
# Recurrent state per layer: 32 x 128 x 128 = 524,288 elements, fp32 (4 bytes) = 2 MiB.
QN_RECURRENT_BYTES = QN_LV_HEADS * QN_LK_DIM * QN_LV_DIM * 4
assert QN_RECURRENT_BYTES == 2_097_152
# State per sequence: 36 layers x 2,146,304 = 77,266,944 bytes (73.69 MiB), whatever the context.
QN_STATE = QN_LINEAR * (QN_CONV_BYTES + QN_RECURRENT_BYTES)
assert QN_STATE == 77_266_944
# KV per token and full layer: K and V, 2 heads x 256, bf16 = 2,048 bytes; 12 layers = 24,576.
QN_KV_LAYER = 2 * QN_KV_HEADS * QN_HEAD_DIM * 2
QN_KV_TOKEN = QN_FULL * QN_KV_LAYER
assert (QN_KV_LAYER, QN_KV_TOKEN) == (2_048, 24_576)

# -- DeepseekV32Config() defaults (transformers 5.x).
DS_LAYERS, DS_HIDDEN, DS_VOCAB = 61, 7168, 129_280
DS_HEADS, DS_Q_LORA, DS_KV_LORA, DS_ROPE, DS_NOPE, DS_V = 128, 1536, 512, 64, 128, 128
DS_INDEX_HEADS, DS_INDEX_DIM, DS_INDEX_TOPK = 64, 128, 2048  # index_n_heads/_head_dim/_topk
DS_DENSE_LAYERS, DS_INTER = 3, 18_432  # first_k_dense_replace, intermediate_size
DS_EXPERTS, DS_TOPK_EXPERTS, DS_MOE_INTER = 256, 8, 2048
# Latent per token: 61 layers x (512 + 64) x 2 bytes = 70,272; indexer: 61 x 128 x 2 = 15,616.
DS_LATENT_TOKEN = DS_LAYERS * (DS_KV_LORA + DS_ROPE) * 2
DS_INDEX_TOKEN = DS_LAYERS * DS_INDEX_DIM * 2
assert (DS_LATENT_TOKEN, DS_INDEX_TOKEN) == (70_272, 15_616)


def _qwen3_next_params() -> tuple[int, int]:
    """(total, active) parameters of Qwen3NextForCausalLM, counted from the config by hand."""
    h = QN_HIDDEN
    q_out = QN_Q_HEADS * QN_HEAD_DIM  # 4,096; q_proj emits query and output gate: 2 x 4,096
    full = (h * 2 * q_out + 2 * h * QN_KV_HEADS * QN_HEAD_DIM + q_out * h
            + 2 * QN_HEAD_DIM)  # q, k, v, o projections; q_norm and k_norm
    key_dim, value_dim = QN_LK_HEADS * QN_LK_DIM, QN_LV_HEADS * QN_LV_DIM
    linear = (h * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
              + h * 2 * QN_LV_HEADS  # in_proj_ba
              + QN_CONV_DIM * QN_CONV  # depthwise conv1d, no bias
              + 2 * QN_LV_HEADS  # dt_bias, A_log
              + QN_LV_DIM  # gated RMSNorm
              + value_dim * h)  # out_proj
    expert = 3 * h * QN_MOE_INTER  # gate, up, down
    moe = (QN_EXPERTS * h + QN_EXPERTS * expert + 3 * h * QN_SHARED_INTER
           + h)  # router, experts, shared expert, shared expert gate
    total = (2 * QN_VOCAB * h + h  # untied embedding and LM head, final norm
             + QN_LAYERS * (moe + 2 * h) + QN_FULL * full + QN_LINEAR * linear)
    active = total - QN_VOCAB * h - QN_LAYERS * (QN_EXPERTS - QN_TOPK_EXPERTS) * expert
    return total, active


def _deepseek_v32_params() -> tuple[int, int]:
    """(total, active) parameters of DeepseekV32ForCausalLM, counted from the config by hand."""
    h = DS_HIDDEN
    mla = (h * DS_Q_LORA + DS_Q_LORA  # q_a_proj, q_a_layernorm
           + DS_Q_LORA * DS_HEADS * (DS_NOPE + DS_ROPE)  # q_b_proj
           + h * (DS_KV_LORA + DS_ROPE) + DS_KV_LORA  # kv_a_proj_with_mqa, kv_a_layernorm
           + DS_KV_LORA * DS_HEADS * (DS_NOPE + DS_V)  # kv_b_proj
           + DS_HEADS * DS_V * h)  # o_proj
    indexer = (DS_Q_LORA * DS_INDEX_HEADS * DS_INDEX_DIM  # wq_b
               + h * DS_INDEX_DIM + 2 * DS_INDEX_DIM  # wk, k_norm (LayerNorm weight and bias)
               + h * DS_INDEX_HEADS)  # weights_proj
    expert = 3 * h * DS_MOE_INTER
    moe_layers = DS_LAYERS - DS_DENSE_LAYERS
    moe = DS_EXPERTS * h + DS_EXPERTS * expert + expert  # router, routed, one shared expert
    total = (2 * DS_VOCAB * h + h + DS_LAYERS * (mla + indexer + 2 * h)
             + DS_DENSE_LAYERS * 3 * h * DS_INTER + moe_layers * moe)
    active = total - DS_VOCAB * h - moe_layers * (DS_EXPERTS - DS_TOPK_EXPERTS) * expert
    return total, active


def _row(out: str, label: str) -> str:
    """The one printed line that starts with `label`."""
    lines = [line for line in out.splitlines() if line.startswith(label)]
    assert len(lines) == 1, (label, lines)
    return lines[0]


def _main(capsys, *args: str) -> str:
    assert main(["memory", *args]) == 0
    return capsys.readouterr().out


# -- presets


def test_qwen3_next_preset_matches_config():
    p = get_preset("qwen3-next-80b-a3b")
    assert (p.num_layers, p.hidden_size, p.vocab, p.full_attention_interval) == (
        QN_LAYERS, QN_HIDDEN, QN_VOCAB, QN_INTERVAL)
    assert p.attention == AttentionSpec(q_heads=QN_Q_HEADS, kv_heads=QN_KV_HEADS,
                                        head_dim=QN_HEAD_DIM)
    assert p.linear_attention == GatedDeltaNetSpec(
        num_key_heads=QN_LK_HEADS, num_value_heads=QN_LV_HEADS, key_head_dim=QN_LK_DIM,
        value_head_dim=QN_LV_DIM, conv_kernel=QN_CONV)
    assert (p.kind, p.label, p.is_hybrid, p.indexer) == ("GQA", "GQA+GDN", True, None)
    assert (p.kv_layers, p.linear_layers) == (12, 36)
    # Layers 4, 8, ..., 48 (1-based) are full attention.
    assert [i for i, t in enumerate(p.layer_types) if t == "full_attention"] == list(
        range(3, 48, 4))
    assert (p.num_params, p.active_params) == _qwen3_next_params()
    assert (p.num_params, p.active_params) == (79_674_391_296, 3_563_764_480)
    for field in ("full_attention_interval", "linear_num_value_heads", "linear_conv_kernel_dim",
                  "head_dim 256", "huggingface.co/Qwen/Qwen3-Next-80B-A3B"):
        assert field in p.source


def test_deepseek_v32_preset_extends_v3():
    v3, p = get_preset("deepseek-v3"), get_preset("deepseek-v3.2")
    assert p.attention == v3.attention == MLASpec(
        q_heads=DS_HEADS, kv_lora_rank=DS_KV_LORA, qk_rope_head_dim=DS_ROPE,
        qk_nope_head_dim=DS_NOPE, v_head_dim=DS_V, q_lora_rank=DS_Q_LORA)
    assert (p.num_layers, p.hidden_size, p.vocab) == (DS_LAYERS, DS_HIDDEN, DS_VOCAB)
    assert p.indexer == IndexerSpec(n_heads=DS_INDEX_HEADS, head_dim=DS_INDEX_DIM,
                                    topk=DS_INDEX_TOPK)
    assert (p.kind, p.label, p.kv_layers, p.is_hybrid) == ("MLA", "MLA+DSA", 61, False)
    assert v3.indexer is None and v3.label == "MLA"
    assert (p.num_params, p.active_params) == _deepseek_v32_params()
    for field in ("index_n_heads 64", "index_head_dim 128", "index_topk 2048",
                  "DeepseekV32Config"):
        assert field in p.source


def test_presets_match_transformers_configs():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextConfig") or not hasattr(
            transformers, "DeepseekV32Config"):
        pytest.skip("this transformers has no Qwen3NextConfig / DeepseekV32Config")
    c = transformers.Qwen3NextConfig()
    p = get_preset("qwen3-next-80b-a3b")
    assert tuple(c.layer_types) == p.layer_types
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size) == (p.num_layers, p.hidden_size, p.q_heads, p.kv_heads,
                                          p.head_dim, p.vocab)
    g = p.linear_attention
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim) == (
        g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel)
    d = transformers.DeepseekV32Config()
    q = get_preset("deepseek-v3.2")
    assert set(d.layer_types) == {"indexed_attention"} and len(d.layer_types) == q.num_layers
    assert (d.num_attention_heads, d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim,
            d.v_head_dim, d.q_lora_rank) == (q.q_heads, q.kv_lora_rank, q.qk_rope_head_dim,
                                             q.qk_nope_head_dim, q.v_head_dim, q.q_lora_rank)
    assert (d.index_n_heads, d.index_head_dim, d.index_topk) == (
        q.indexer.n_heads, q.indexer.head_dim, q.indexer.topk)


def test_param_counts_match_transformers_models():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextForCausalLM") or not hasattr(
            transformers, "DeepseekV32ForCausalLM"):
        pytest.skip("this transformers has no Qwen3-Next / DeepSeek-V3.2 models")
    for name, config, model in (
        ("qwen3-next-80b-a3b", transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        ("deepseek-v3.2", transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
    ):
        with torch.device("meta"):  # shapes only: no memory for 80B / 672B weights
            m = model(config())
        assert sum(t.numel() for t in m.parameters()) == get_preset(name).num_params, name


# -- functions against hand arithmetic


@pytest.mark.parametrize("context, batch", [(262_144, 1), (262_144, 3), (1, 2), (0, 1),
                                            (3_144, 5), (100_003, 7)])
def test_hybrid_cache_bytes(context, batch):
    h = hybrid_cache_bytes(get_preset("qwen3-next-80b-a3b"), context, batch=batch)
    assert (h.kv_layers, h.linear_layers, h.num_layers) == (12, 36, 48)
    assert h.conv_bytes_per_layer == QN_CONV_BYTES
    assert h.recurrent_bytes_per_layer == QN_RECURRENT_BYTES
    assert h.state_bytes == QN_STATE  # does not grow with the context
    assert h.kv_bytes_per_token == QN_KV_TOKEN
    assert h.kv_bytes == context * QN_KV_TOKEN
    # Dense twin: all 48 layers with 2,048 bytes per token each = 98,304 bytes per token.
    assert h.dense_kv_bytes == context * QN_LAYERS * QN_KV_LAYER
    assert h.total_bytes == QN_STATE + context * QN_KV_TOKEN
    assert h.batch_state_bytes == batch * QN_STATE
    assert h.batch_kv_bytes == batch * context * QN_KV_TOKEN
    assert h.batch_total_bytes == batch * (QN_STATE + context * QN_KV_TOKEN)
    assert h.batch_dense_kv_bytes == batch * context * 98_304
    # 77,266,944 / 24,576 = 3,144 tokens exactly.
    assert h.breakeven_tokens == 3_144


def test_hybrid_figures_at_262144_tokens():
    h = hybrid_cache_bytes(get_preset("qwen3-next-80b-a3b"), 262_144)
    assert h.kv_bytes == 6 * 2**30 == 6_442_450_944  # 24,576 x 2^18
    assert h.dense_kv_bytes == 24 * 2**30 == 25_769_803_776  # 4x the hybrid's KV
    assert h.total_bytes == 6_519_717_888
    assert Fraction(h.total_bytes, h.dense_kv_bytes) == Fraction(6_519_717_888, 25_769_803_776)


def test_state_dtypes_are_parameters():
    p = get_preset("qwen3-next-80b-a3b")
    # A bf16 recurrent state halves it (2 bytes/element); an fp32 conv state doubles that part.
    h = hybrid_cache_bytes(p, 10, state_dtype="bf16", conv_dtype="fp32")
    assert h.recurrent_bytes_per_layer == QN_LV_HEADS * QN_LK_DIM * QN_LV_DIM * 2 == 1_048_576
    assert h.conv_bytes_per_layer == QN_CONV_DIM * (QN_CONV - 1) * 4 == 98_304
    assert h.state_bytes == 36 * (1_048_576 + 98_304)
    assert linear_state_bytes(p.linear_attention, 36) == QN_STATE
    assert linear_state_bytes(p.linear_attention, 1, state_dtype="bf16",
                              conv_dtype="bf16") == 1_048_576 + 49_152
    # An int4 KV cache with a 16-bit scale and zero per 32: 5 bits/element; 12 x 1,024 x 5 / 8.
    h4 = hybrid_cache_bytes(p, 1000, fmt=kv_format("int4", group_size=32))
    assert h4.kv_bytes_per_token == 12 * 1024 * 5 // 8 == 7_680
    assert h4.state_bytes == QN_STATE


@pytest.mark.parametrize("context, batch", [(131_072, 1), (131_072, 4), (2_048, 1), (2_049, 2),
                                            (1_000, 3), (1, 1)])
def test_dsa_cache_bytes(context, batch):
    d = dsa_cache_bytes(get_preset("deepseek-v3.2"), context, batch=batch)
    selected = min(DS_INDEX_TOPK, context)
    assert (d.topk, d.selected) == (2048, selected)
    assert d.latent_bytes_per_token == DS_LATENT_TOKEN
    assert d.indexer_bytes_per_token == DS_INDEX_TOKEN
    assert d.latent_bytes == context * DS_LATENT_TOKEN
    assert d.indexer_bytes == context * DS_INDEX_TOKEN
    assert d.total_bytes == context * (70_272 + 15_616)
    assert d.dense_read_bytes == context * DS_LATENT_TOKEN
    assert d.dsa_read_bytes == selected * DS_LATENT_TOKEN + context * DS_INDEX_TOKEN
    assert d.batch_latent_bytes == batch * context * DS_LATENT_TOKEN
    assert d.batch_indexer_bytes == batch * context * DS_INDEX_TOKEN
    assert d.batch_total_bytes == batch * d.total_bytes
    assert d.batch_dsa_read_bytes == batch * (selected * 70_272 + context * 15_616)
    assert d.batch_dense_read_bytes == batch * context * 70_272


def test_dsa_figures_at_131072_tokens():
    d = dsa_cache_bytes(get_preset("deepseek-v3.2"), 131_072)
    assert d.latent_bytes == 9_210_691_584  # 70,272 x 2^17
    assert d.indexer_bytes == 2_046_820_352  # 15,616 x 2^17
    # 2,048 latent tokens (143,917,056) + every indexer key (2,046,820,352).
    assert d.dsa_read_bytes == 143_917_056 + 2_046_820_352 == 2_190_737_408


def test_dsa_indexer_dtype_is_a_parameter():
    d = dsa_cache_bytes(get_preset("deepseek-v3.2"), 4096, indexer_dtype="fp8")
    assert d.indexer_bytes_per_token == 61 * 128 * 1 == 7_808
    assert d.dsa_read_bytes == 2048 * 70_272 + 4096 * 7_808


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="has no linear-attention layers"):
        hybrid_cache_bytes(get_preset("llama-3-8b"), 10)
    with pytest.raises(ValueError, match="has no lightning indexer"):
        dsa_cache_bytes(get_preset("qwen3-next-80b-a3b"), 10)
    with pytest.raises(ValueError, match="context"):
        hybrid_cache_bytes(get_preset("qwen3-next-80b-a3b"), -1)
    with pytest.raises(ValueError, match="must divide num_value_heads=30"):
        GatedDeltaNetSpec(num_key_heads=16, num_value_heads=30, key_head_dim=128,
                          value_head_dim=128, conv_kernel=4)
    with pytest.raises(ValueError, match="topk"):
        IndexerSpec(n_heads=64, head_dim=128, topk=0)
    with pytest.raises(ValueError, match="needs both full_attention_interval"):
        ModelPreset(name="x", num_layers=8, hidden_size=64, q_heads=4, kv_heads=2, head_dim=16,
                    num_params=1, vocab=10, source="-", full_attention_interval=4)


# -- the CLI, against the same arithmetic


def test_cli_qwen3_next_compare(capsys):
    out = _main(capsys, "--model", "qwen3-next-80b-a3b", "--context", "262144", "--compare",
                "--batch", "2")
    kv, dense = 262_144 * QN_KV_TOKEN, 262_144 * QN_LAYERS * QN_KV_LAYER
    assert f"{QN_KV_TOKEN:,}" in _row(out, "KV per token (12 full-attention layers of 48)")
    assert f"{kv:,}" in _row(out, "KV per sequence (262,144 tokens)")
    assert f"{QN_CONV_BYTES:,}" in _row(out, "conv state per layer")
    assert f"{QN_RECURRENT_BYTES:,}" in _row(out, "recurrent state per layer")
    state = _row(out, "state per sequence (36 layers, any context)")
    assert f"{QN_STATE:,}" in state and "73.69 MiB" in state
    assert f"{QN_STATE + kv:,}" in _row(out, "state + KV per sequence")
    assert f"{2 * QN_STATE:,}" in _row(out, "state per batch (2 seqs)")
    assert f"{2 * kv:,}" in _row(out, "KV per batch (2 x 262,144 tokens)")
    assert f"{2 * kv:,}" in _row(out, "KV per batch (12 layers, 2 x 262,144 tokens)")
    assert f"{2 * (QN_STATE + kv):,}" in _row(out, "state + KV per batch")
    assert "The state equals the KV of 3,144 tokens" in out
    assert "24,576 elements in bf16" in out and "524,288 elements in fp32" in out
    # --compare: dense GQA with all 48 layers (24 GiB per sequence) against the hybrid.
    dense_row = _row(out, "dense GQA: KV of 48 layers")
    assert f"{dense:,}" in dense_row and f"{2 * dense:,}" in dense_row
    assert "24.00 GiB" in dense_row and "100.00%" in dense_row
    assert f"{kv:,}" in _row(out, "hybrid: KV of 12 full-attention layers")
    assert "25.00%" in _row(out, "hybrid: KV of 12 full-attention layers")
    total = _row(out, "hybrid: state + KV")
    assert f"{QN_STATE + kv:,}" in total
    assert f"{100 * (QN_STATE + kv) / dense:.2f}%" in total  # 25.30%
    assert f"hybrid / dense: {(QN_STATE + kv) / dense:.4f}" in out
    assert f"saves {2 * (dense - QN_STATE - kv):,} B" in out
    # The MHA/GQA/MQA/MLA variants table is for models where every layer has a KV cache.
    assert "Cache variants" not in out


def test_cli_qwen3_next_state_dtype_flags(capsys):
    out = _main(capsys, "--model", "qwen3-next-80b-a3b", "--state-dtype", "bf16",
                "--conv-dtype", "fp32")
    # 36 x (32 x 128 x 128 x 2 + 8,192 x 3 x 4) = 36 x 1,146,880.
    assert f"{36 * (32 * 128 * 128 * 2 + 8192 * 3 * 4):,}" in _row(
        out, "state per sequence (36 layers, any context)")


def test_cli_deepseek_v32(capsys):
    out = _main(capsys, "--model", "deepseek-v3.2", "--context", "131072", "--batch", "4")
    ctx = 131_072
    latent, index = ctx * DS_LATENT_TOKEN, ctx * DS_INDEX_TOKEN
    dsa_read = DS_INDEX_TOPK * DS_LATENT_TOKEN + index
    assert f"{DS_LATENT_TOKEN:,}" in _row(out, "latent per token (61 layers)")
    assert f"{DS_INDEX_TOKEN:,}" in _row(out, "indexer keys per token (61 layers)")
    assert f"{latent:,}" in _row(out, "latent per sequence (131,072 tokens)")
    assert f"{index:,}" in _row(out, "indexer keys per sequence (131,072 tokens)")
    assert f"{latent + index:,}" in _row(out, "latent + indexer per sequence")
    assert f"{4 * index:,}" in _row(out, "indexer keys per batch (4 x 131,072 tokens)")
    assert f"{4 * (latent + index):,}" in _row(out, "latent + indexer per batch")
    assert f"{100 * DS_INDEX_TOKEN / DS_LATENT_TOKEN:.2f}%" in _row(out, "indexer / latent")
    dense_row = _row(out, "dense MLA: whole latent cache")
    assert f"{latent:,}" in dense_row and f"{4 * latent:,}" in dense_row
    dsa_row = _row(out, "DSA: top-2048 latent + all indexer keys")
    assert f"{dsa_read:,}" in dsa_row and f"{4 * dsa_read:,}" in dsa_row
    assert f"DSA / dense MLA reads: {dsa_read / latent:.4f}" in out
    assert f"({latent / dsa_read:.2f}x fewer bytes)" in out


def test_cli_deepseek_v32_short_context(capsys):
    # 1,000 tokens < top-2048: DSA reads the whole latent cache and the indexer keys too.
    out = _main(capsys, "--model", "deepseek-v3.2", "--context", "1000", "--indexer-dtype", "fp8")
    read = 1000 * DS_LATENT_TOKEN + 1000 * 61 * 128
    assert f"{read:,}" in _row(out, "DSA: top-2048 latent + all indexer keys")
    assert "the context is within top-2048" in out


def test_cli_list_shows_new_presets(capsys):
    out = _main(capsys, "--list")
    qn = _row(out, "qwen3-next-80b-a3b")
    assert "GQA+GDN" in qn and "48 (12 KV)" in qn and f"{QN_KV_TOKEN:,}" in qn
    assert "73.69 MiB/seq" in qn
    ds = _row(out, "deepseek-v3.2")
    assert "MLA+DSA" in ds and f"{DS_LATENT_TOKEN:,}" in ds and f"{DS_INDEX_TOKEN:,} B/token" in ds


def test_cli_help_names_new_flags_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for text in ("--state-dtype", "--conv-dtype", "--indexer-dtype", "qwen3-next-80b-a3b",
                 "deepseek-v3.2", "dense GQA model of the same width"):
        assert text in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama-3-8b", "--state-dtype", "bf16"],
         "argument --state-dtype: llama-3-8b has no linear-attention state"),
        (["--model", "deepseek-v3.2", "--conv-dtype", "bf16"], "argument --conv-dtype"),
        (["--model", "qwen3-next-80b-a3b", "--indexer-dtype", "fp8"],
         "argument --indexer-dtype: qwen3-next-80b-a3b has no DSA lightning indexer"),
        (["--model", "qwen3-next-80b-a3b", "--budget", "10"],
         "argument --budget: not available for qwen3-next-80b-a3b"),
        (["--model", "qwen3-next-80b-a3b", "--lengths", "1,2"], "argument --lengths"),
        (["--model", "deepseek-v3.2", "--host-fraction", "0.5"],
         "argument --host-fraction: not available for deepseek-v3.2"),
        (["--model", "deepseek-v3.2", "--length-spread", "4"], "indexer's key cache"),
    ],
)
def test_cli_rejects_flags_that_do_not_apply(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["memory", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--model", "qwen3-next-80b-a3b", "--context", "262144", "--compare"],
    ["--model", "deepseek-v3.2", "--context", "131072"],
])
def test_cli_commands_subprocess(args):
    r = subprocess.run([sys.executable, "-m", "kvjax", "memory", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if "qwen3-next-80b-a3b" in args:
        assert f"{262_144 * QN_KV_TOKEN:,}" in r.stdout and f"{QN_STATE:,}" in r.stdout
    else:
        assert f"{131_072 * DS_INDEX_TOKEN:,}" in r.stdout
