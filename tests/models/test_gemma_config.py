"""`GemmaConfig.from_hf` on the config.json formats Gemma checkpoints come in (no torch).

The released checkpoints' configs (Gemma 2's alternating layers without `layer_types`;
Gemma 3's `rope_theta` / `rope_local_base_freq` / `rope_scaling` and
`sliding_window_pattern`; the multimodal models' `text_config`) and transformers 5's
(`layer_types`, `rope_parameters` keyed by layer type). `tests/models/test_gemma.py`
checks these readings against transformers' own config classes.
"""

import numpy as np
import pytest

from kvjax.models import gemma
from kvjax.rope import RopeConfig, rope_inv_freq

L, G = gemma.LOCAL, gemma.GLOBAL

# Released Gemma 3 27B text config (Gemma3ForConditionalGeneration): the fields it sets.
GEMMA3_27B = dict(
    architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
    text_config=dict(model_type="gemma3_text", head_dim=128, hidden_size=5376,
                     intermediate_size=21504, num_attention_heads=32, num_hidden_layers=62,
                     num_key_value_heads=16, query_pre_attn_scalar=168, sliding_window=1024,
                     rope_scaling={"factor": 8.0, "rope_type": "linear"}, vocab_size=262208,
                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    torch_dtype="bfloat16")
# Released Gemma 3 1B (Gemma3ForCausalLM): no scaling, window 512, MQA.
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
    num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
    query_pre_attn_scalar=256, rope_local_base_freq=10000, rope_scaling=None,
    rope_theta=1000000, sliding_window=512, sliding_window_pattern=6, vocab_size=262144,
    torch_dtype="bfloat16")
# Released Gemma 2 9B.
GEMMA2_9B = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
    hidden_activation="gelu_pytorch_tanh", hidden_size=3584, intermediate_size=14336,
    num_attention_heads=16, num_hidden_layers=42, num_key_value_heads=8,
    query_pre_attn_scalar=256, rope_theta=10000.0, sliding_window=4096, vocab_size=256000,
    torch_dtype="float32")


def test_released_gemma3_27b():
    c = gemma.GemmaConfig.from_hf(GEMMA3_27B)
    assert (c.num_layers, c.q_heads, c.kv_heads, c.head_dim) == (62, 32, 16, 128)
    assert c.architecture == "Gemma3ForConditionalGeneration" and c.dtype == "bfloat16"
    # 5 local : 1 global, the 6th, 12th, ... layer global; 62 = 10 * 6 + 2 local.
    assert c.layer_types == ((L,) * 5 + (G,)) * 10 + (L, L)
    assert c.sliding_windows[:6] == (1024,) * 5 + (None,)
    assert c.scale == pytest.approx(168 ** -0.5)
    assert c.qk_norm and c.tie_word_embeddings
    # transformers' Gemma 3 applies neither soft cap (the multimodal model not even the final).
    assert c.attn_softcap is None and c.final_softcap is None
    assert c.rope_local == RopeConfig(theta=10000.0, dim=128)
    assert c.rope_global == RopeConfig(theta=1e6, dim=128, rope_type="linear", factor=8.0)
    np.testing.assert_array_equal(
        rope_inv_freq(c.rope_global),
        (1.0 / 1e6 ** (np.arange(0, 128, 2, dtype=np.float32) / 128)).astype(np.float32) / 8)
    assert c.rope(5) == c.rope_global and c.rope(4) == c.rope_local


def test_released_gemma3_1b_and_gemma2_9b():
    c = gemma.GemmaConfig.from_hf(GEMMA3_1B)
    assert c.attention.kind == "MQA" and c.sliding_window == 512
    assert c.layer_types.count(G) == 4 and c.layer_types[5] == G  # 26 layers: 4 global
    assert c.rope_global == RopeConfig(theta=1e6, dim=256) and c.scale == 256 ** -0.5
    c2 = gemma.GemmaConfig.from_hf(GEMMA2_9B)
    assert c2.layer_types == (L, G) * 21 and c2.sliding_window == 4096
    assert (c2.attn_softcap, c2.final_softcap) == (50.0, 30.0) and not c2.qk_norm
    assert c2.rope_local == c2.rope_global == RopeConfig(theta=10000.0, dim=256)


def test_transformers5_format():
    """`layer_types` and `rope_parameters` per layer type, as transformers 5 writes them."""
    cfg = dict(GEMMA3_1B, num_hidden_layers=3, layer_types=[L, G, L],
               rope_parameters={G: {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                                L: {"rope_type": "default", "rope_theta": 2e4}})
    for k in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        cfg.pop(k)
    c = gemma.GemmaConfig.from_hf(cfg, dtype="float32")
    assert c.layer_types == (L, G, L) and c.dtype == "float32"
    assert c.rope_global == RopeConfig(theta=5e5, dim=256, rope_type="linear", factor=4.0)
    assert c.rope_local == RopeConfig(theta=2e4, dim=256)
    # A missing theta is transformers' default for the layer type.
    del cfg["rope_parameters"][G]["rope_theta"]
    assert gemma.GemmaConfig.from_hf(cfg).rope_global.theta == 1e6


def test_rope_parameters_by_layer_type():
    hf = {"rope_parameters": {L: {"rope_type": "default", "rope_theta": 3.0},
                              G: {"rope_type": "linear", "rope_theta": 7.0, "factor": 2.0}},
          "rope_theta": 99.0}
    assert RopeConfig.from_hf(hf, 8, layer_type=G) == RopeConfig(theta=7.0, dim=8,
                                                                 rope_type="linear", factor=2.0)
    assert RopeConfig.from_hf(hf, 8, layer_type=L) == RopeConfig(theta=3.0, dim=8)
    with pytest.raises(ValueError, match="layer type 'chunked_attention'"):
        RopeConfig.from_hf(hf, 8, layer_type="chunked_attention")


@pytest.mark.parametrize("change, words", [
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(layer_types=[L] * 25 + ["chunked_attention"]), "layer_types"),
    (dict(num_key_value_heads=3), "kv_heads=3 must divide q_heads=4"),
    (dict(rope_parameters={G: "linear", L: {}}), r"rope_parameters\['full_attention'\]"),
])
def test_bad_configs_are_named(change, words):
    with pytest.raises(ValueError, match=words):
        gemma.GemmaConfig.from_hf({**GEMMA3_1B, **change})
    with pytest.raises(ValueError, match="text_config"):
        gemma.GemmaConfig.from_hf({"model_type": "gemma3"})
