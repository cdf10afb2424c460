"""Reading Qwen3-Next HuggingFace checkpoints into `Qwen3NextParams`.

Experts come from the per-expert names of published checkpoints and `save_pretrained`
(`mlp.experts.{e}.gate_proj.weight`, ...) or from transformers 5's fused in-memory
names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). The multi-token-prediction
weights of published checkpoints (`mtp.*`) are not read.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.qwen3_next.config import FULL, Qwen3NextConfig
from kvjax.models.qwen3_next.params import Qwen3NextParams, param_shapes

__all__ = ["params_from_hf"]


def params_from_hf(config: Qwen3NextConfig, get_tensor: Callable[[str], np.ndarray]
                   ) -> Qwen3NextParams:
    """Maps HuggingFace Qwen3-Next tensors to kvjax params, one tensor at a time.

    Each stacked parameter is allocated once on the host and filled layer by layer,
    so no second full copy of the model exists at any time.

    Args:
      config: the architecture.
      get_tensor: returns the tensor stored under an HF name as a NumPy array (any
        float dtype); raises KeyError if absent.

    Returns:
      `Qwen3NextParams` (jax arrays in `config.dtype`).

    Raises:
      KeyError: naming a tensor the checkpoint lacks.
      ValueError: naming a tensor whose shape does not match the config.
    """
    c = config
    buffers = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), param_shapes(c))

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            t = get_tensor(name)
        except KeyError as e:
            raise KeyError(f"params_from_hf: checkpoint has no tensor {name!r}.") from e
        t = np.asarray(t)
        if t.shape != shape:
            raise ValueError(f"params_from_hf: tensor {name!r} has shape {t.shape}, expected "
                             f"{shape} for this config.")
        return t

    def has(name: str) -> bool:
        try:
            get_tensor(name)
        except KeyError:
            return False
        return True

    h = c.hidden_size

    def linear(name, out_dim, in_dim):  # HF Linear weight [out, in] -> ours [in, out]
        return fetch(name + ".weight", (out_dim, in_dim)).T

    def load_swiglu(buf, i, prefix, inner):
        buf.gate[i] = linear(prefix + "gate_proj", inner, h)
        buf.up[i] = linear(prefix + "up_proj", inner, h)
        buf.down[i] = linear(prefix + "down_proj", h, inner)

    buffers.embed[...] = fetch("model.embed_tokens.weight", (c.vocab_size, h))
    buffers.final_norm[...] = fetch("model.norm.weight", (h,))
    if not c.tie_word_embeddings:
        buffers.lm_head[...] = linear("lm_head", c.vocab_size, h)

    nk, nv = c.linear_key_heads, c.linear_value_heads
    dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    dh, nq = c.head_dim, c.q_heads
    counts = {"full": 0, "linear": 0, "mlp": 0, "moe": 0}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        buffers.input_norm[layer] = fetch(p + "input_layernorm.weight", (h,))
        buffers.post_norm[layer] = fetch(p + "post_attention_layernorm.weight", (h,))
        if c.layer_types[layer] == FULL:
            i, b, a = counts["full"], buffers.full, p + "self_attn."
            counts["full"] += 1
            # q_proj rows are, per head, the query's dh rows then the gate's dh rows.
            wq = fetch(a + "q_proj.weight", (2 * nq * dh, h)).reshape(nq, 2, dh, h)
            b.wq[i] = wq[:, 0].reshape(nq * dh, h).T
            b.w_gate[i] = wq[:, 1].reshape(nq * dh, h).T
            b.wk[i] = linear(a + "k_proj", c.kv_heads * dh, h)
            b.wv[i] = linear(a + "v_proj", c.kv_heads * dh, h)
            b.wo[i] = linear(a + "o_proj", h, nq * dh)
            b.q_norm[i] = fetch(a + "q_norm.weight", (dh,))
            b.k_norm[i] = fetch(a + "k_norm.weight", (dh,))
            if c.attention_bias:
                bq = fetch(a + "q_proj.bias", (2 * nq * dh,)).reshape(nq, 2, dh)
                b.bq[i], b.b_gate[i] = bq[:, 0].reshape(-1), bq[:, 1].reshape(-1)
                b.bk[i] = fetch(a + "k_proj.bias", (c.kv_heads * dh,))
                b.bv[i] = fetch(a + "v_proj.bias", (c.kv_heads * dh,))
                b.bo[i] = fetch(a + "o_proj.bias", (h,))
        else:
            i, b, a = counts["linear"], buffers.linear, p + "linear_attn."
            counts["linear"] += 1
            # in_proj_qkvz rows are grouped per key head: [q dk | k dk | v r*dv | z r*dv].
            w = fetch(a + "in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, h))
            w = w.reshape(nk, 2 * dk + 2 * r * dv, h)
            cuts = np.cumsum([dk, dk, r * dv])
            parts = np.split(w, cuts, axis=1)  # q, k, v, z, each [nk, width, h]
            b.w_qkvz[i] = np.concatenate([x.reshape(-1, h) for x in parts], axis=0).T
            ba = fetch(a + "in_proj_ba.weight", (2 * nv, h)).reshape(nk, 2 * r, h)
            b.w_ba[i] = np.concatenate([ba[:, :r].reshape(nv, h), ba[:, r:].reshape(nv, h)]).T
            b.conv[i] = fetch(a + "conv1d.weight", (c.conv_dim, 1, c.linear_conv_kernel))[:, 0]
            b.dt_bias[i] = fetch(a + "dt_bias", (nv,))
            b.a_log[i] = fetch(a + "A_log", (nv,))
            b.norm[i] = fetch(a + "norm.weight", (dv,))
            b.w_out[i] = linear(a + "out_proj", h, nv * dv)
        m = p + "mlp."
        if c.is_moe(layer):
            i, b = counts["moe"], buffers.moe
            counts["moe"] += 1
            e, im = c.num_experts, c.moe_intermediate_size
            b.router[i] = linear(m + "gate", e, h)
            if has(m + "experts.gate_up_proj"):
                gu = fetch(m + "experts.gate_up_proj", (e, 2 * im, h))
                b.experts.gate[i] = gu[:, :im].transpose(0, 2, 1)
                b.experts.up[i] = gu[:, im:].transpose(0, 2, 1)
                b.experts.down[i] = fetch(m + "experts.down_proj", (e, h, im)).transpose(0, 2, 1)
            else:
                for j in range(e):
                    prefix = f"{m}experts.{j}."
                    b.experts.gate[i, j] = linear(prefix + "gate_proj", im, h)
                    b.experts.up[i, j] = linear(prefix + "up_proj", im, h)
                    b.experts.down[i, j] = linear(prefix + "down_proj", h, im)
            if b.shared is not None:
                load_swiglu(b.shared, i, m + "shared_expert.",
                            c.shared_expert_intermediate_size)
                b.shared_gate[i] = linear(m + "shared_expert_gate", 1, h)
        else:
            i = counts["mlp"]
            counts["mlp"] += 1
            load_swiglu(buffers.mlp, i, m, c.intermediate_size)
    return jax.tree.map(jnp.asarray, buffers)
