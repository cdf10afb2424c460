"""Tiny random HuggingFace models for parity tests (built and saved locally, no download)."""

import numpy as np
import pytest

# The HuggingFace reference: where torch is not installed (no CPU wheel of it for this
# Python here, say) every test built on these models is skipped, saying so.
REASON = ("needs torch and transformers, the HuggingFace reference (`pip install -e "
          "'.[test]'` installs them)")
torch = pytest.importorskip("torch", reason=REASON)
T = pytest.importorskip("transformers", reason=REASON)

# One torch thread: on models this small the intra-op pool's threads mostly spin waiting
# for work, which costs far more CPU than it saves (a 32-token greedy `generate` of a tiny
# DeepSeek: about 2.4 s of CPU with 2 threads, 0.13 s with 1), more so on a busy machine.
torch.set_num_threads(1)

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               initializer_range=0.1, rms_norm_eps=1e-6, max_position_embeddings=256)

# name -> (config class, extra config fields)
VARIANTS = {
    "llama_mha": (T.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": (T.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=8, tie_word_embeddings=True)),
    "llama_mqa": (T.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama31": (T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16))),
    "mistral": (T.MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=8)),
    "qwen2": (T.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    # Layer 0 full attention, layer 1 a 6-token window: the per-layer (unrolled) path.
    "qwen2_swa": (T.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                      use_sliding_window=True, sliding_window=6,
                                      max_window_layers=1)),
    "qwen3": (T.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # YaRN context extension (Qwen2.5's long-context setting): scaled frequencies and
    # cos / sin multiplied by the attention factor 0.1 ln(4) + 1.
    "qwen2_yarn": (T.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64))),
}

# Hybrid (non-Llama-family) variants, built by the same `build`. Qwen3-Next: three Gated
# DeltaNet layers then a full one, sparse MoE with a shared expert, GQA in both mixers
# (2 key heads for 4 value heads), partial rotary; and alternating layers with dense
# MLPs, q/k/v/o biases, tied embeddings and a kernel-3 convolution (a pattern that
# repeats: the scanned path).
HYBRID_VARIANTS = {
    "qwen3_next_moe": (T.Qwen3NextConfig, dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    "qwen3_next_dense": (T.Qwen3NextConfig, dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=0,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
}


# DeepSeek-V3.2 (MLA + MoE + the lightning indexer). "v32_moe": a dense first layer then
# MoE, YaRN rope (its attention factor scales the indexer's rotation too), index_topk 8
# below the contexts; "v32_dense": dense MLPs, tied embeddings, index_topk 64 above them
# (every query selects all it sees).
DSA_VARIANTS = {
    "v32_moe": (T.DeepseekV32Config, dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=12, first_k_dense_replace=1,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5,
        index_topk=8, index_head_dim=16, index_n_heads=16,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64, mscale=0.707,
                             mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))),
    "v32_dense": (T.DeepseekV32Config, dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        tie_word_embeddings=True, index_topk=64, index_head_dim=24, index_n_heads=4)),
}


# Gemma: 8-token windows on 4-token pages. "gemma2": local/global alternating, soft caps
# small enough that tanh bends these logits, a query scale apart from head_dim, an untied
# LM head (the released models tie it; the loader reads either). "gemma3":
# QK-norm, local RoPE base 10k, global base 1M with linear scaling 8, two local layers to
# one global, query_pre_attn_scalar apart from head_dim (as Gemma 3 27B's).
GEMMA_VARIANTS = {
    "gemma2": (T.Gemma2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
        tie_word_embeddings=False)),
    "gemma3": (T.Gemma3TextConfig, dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                          "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=12,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1e6,
                                                factor=8.0)})),
}


def build(name: str, seed: int = 0):
    """A tiny random float32 HF causal LM for variant `name`, in eval mode."""
    cls, extra = {**VARIANTS, **HYBRID_VARIANTS, **DSA_VARIANTS, **GEMMA_VARIANTS}[name]
    config = cls(**{**_COMMON, **extra}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():  # biases and norm weights start at 0 / 1: perturb them
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(m, ids) -> np.ndarray:
    """transformers' float32 logits of every position of `ids`."""
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(m, prompt, new) -> list[int]:
    """transformers' `new` greedy tokens after `prompt` (no EOS)."""
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                         max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy(m, prompt, ours, ref, tie_tol=1e-4):
    """Greedy tokens must match; a divergence is accepted only at a true near-tie (fresh
    random draws can put transformers' own top two logits closer than float32 rounding)."""
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
    top2 = np.sort(hf_logits(m, prompt + ref[:i])[-1])[-2:]
    assert top2[1] - top2[0] < tie_tol, (
        f"greedy tokens differ at step {i} (ours {ours[i]}, HF {ref[i]}) although HF's top-2 "
        f"gap is {top2[1] - top2[0]:.2e}\nours {ours}\nHF   {ref}")
