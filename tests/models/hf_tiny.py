"""Tiny random HuggingFace models for parity tests (built and saved locally, no download)."""

import torch
import transformers as T

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


def build(name: str, seed: int = 0):
    """A tiny random float32 HF causal LM for variant `name`, in eval mode."""
    cls, extra = VARIANTS[name]
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
