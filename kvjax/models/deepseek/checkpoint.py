"""Reading DeepSeek-V2/V3 HuggingFace checkpoints into `DeepseekParams`.

Experts come from the per-expert names of published checkpoints and
`save_pretrained`, or from transformers 5's fused in-memory names; DeepSeek-V3's
block-FP8 weights (`weight` + `weight_scale_inv`) are dequantized to the params
dtype; multi-token-prediction layers past `num_hidden_layers` are not read.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.params import DeepseekParams, param_shapes

__all__ = ["params_from_hf", "read_tensor"]


def params_from_hf(
    config: DeepseekConfig, get_tensor: Callable[[str], np.ndarray]
) -> DeepseekParams:
    """Maps HuggingFace DeepSeek-V2/V3 tensors to kvjax params, one tensor at a time.

    Each stacked parameter is allocated once on the host and filled layer by
    layer, so no second full copy of the model exists at any time. Experts are
    read from either the per-expert names `save_pretrained` and the published
    checkpoints use (`mlp.experts.{e}.gate_proj.weight`, ...) or transformers 5's
    fused in-memory names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).

    Args:
      config: the architecture.
      get_tensor: returns the tensor stored under an HF name as a NumPy array
        (any float dtype); raises KeyError if absent.

    Returns:
      `DeepseekParams` (jax arrays in `config.dtype`; router weights float32).

    Raises:
      KeyError: naming a tensor the checkpoint lacks.
      ValueError: naming a tensor whose shape does not match the config.
    """
    buffers = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), param_shapes(config))

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return read_tensor(get_tensor, name, shape, config.fp8_block_size)

    c = config
    h, nh = c.hidden_size, c.num_heads
    dn, dv, dc = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank

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

    for layer in range(c.num_layers):
        moe = layer >= c.num_dense_layers
        buf = buffers.moe_layers if moe else buffers.dense_layers
        i = layer - c.num_dense_layers if moe else layer
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        buf.input_norm[i] = fetch(p + "input_layernorm.weight", (h,))
        buf.post_norm[i] = fetch(p + "post_attention_layernorm.weight", (h,))
        if c.q_lora_rank is None:
            buf.q_proj[i] = linear(a + "q_proj", nh * c.qk_head_dim, h)
        else:
            buf.q_a_proj[i] = linear(a + "q_a_proj", c.q_lora_rank, h)
            buf.q_a_norm[i] = fetch(a + "q_a_layernorm.weight", (c.q_lora_rank,))
            buf.q_b_proj[i] = linear(a + "q_b_proj", nh * c.qk_head_dim, c.q_lora_rank)
        buf.kv_a_proj[i] = linear(a + "kv_a_proj_with_mqa", dc + c.qk_rope_head_dim, h)
        buf.kv_a_norm[i] = fetch(a + "kv_a_layernorm.weight", (dc,))
        kv_b = fetch(a + "kv_b_proj.weight", (nh * (dn + dv), dc)).reshape(nh, dn + dv, dc)
        buf.w_uk[i] = kv_b[:, :dn]
        buf.w_uv[i] = kv_b[:, dn:].transpose(0, 2, 1)
        del kv_b
        buf.o_proj[i] = linear(a + "o_proj", h, nh * dv)
        if not moe:
            load_swiglu(buf.mlp, i, p + "mlp.", c.intermediate_size)
            continue
        m, mb = p + "mlp.", buf.moe
        e, im = c.n_routed_experts, c.moe_intermediate_size
        mb.router[i] = fetch(m + "gate.weight", (e, h))
        if mb.bias is not None:
            mb.bias[i] = fetch(m + "gate.e_score_correction_bias", (e,))
        ex = mb.experts
        try:
            gate_up = get_tensor(m + "experts.gate_up_proj")
        except KeyError:
            gate_up = None
        if gate_up is not None:  # transformers 5 fused layout
            gate_up = np.asarray(gate_up)
            if gate_up.shape != (e, 2 * im, h):
                raise ValueError(f"params_from_hf: tensor {m + 'experts.gate_up_proj'!r} has "
                                 f"shape {gate_up.shape}, expected {(e, 2 * im, h)}.")
            ex.gate[i] = gate_up[:, :im].transpose(0, 2, 1)
            ex.up[i] = gate_up[:, im:].transpose(0, 2, 1)
            del gate_up
            ex.down[i] = fetch(m + "experts.down_proj", (e, h, im)).transpose(0, 2, 1)
        else:
            for j in range(e):
                q = f"{m}experts.{j}."
                ex.gate[i, j] = linear(q + "gate_proj", im, h)
                ex.up[i, j] = linear(q + "up_proj", im, h)
                ex.down[i, j] = linear(q + "down_proj", h, im)
        if mb.shared is not None:
            load_swiglu(mb.shared, i, m + "shared_experts.", im * c.n_shared_experts)

    # One stacked tensor at a time moves to the device; its host buffer is then dropped.
    leaves, treedef = jax.tree.flatten(buffers)
    out = []
    for j in range(len(leaves)):
        out.append(jnp.asarray(leaves[j]))
        leaves[j] = None
    return jax.tree.unflatten(treedef, out)


def read_tensor(get_tensor: Callable[[str], np.ndarray], name: str, shape: tuple[int, ...],
                fp8_block: tuple[int, int]) -> np.ndarray:
    """One checkpoint tensor as a NumPy array of `shape`; block-FP8 weights dequantized.

    Raises:
      KeyError: the checkpoint has no tensor `name`. ValueError: its shape is not `shape`.
    """
    try:
        t = get_tensor(name)
    except KeyError as e:
        raise KeyError(f"params_from_hf: checkpoint has no tensor {name!r}.") from e
    t = np.asarray(t)
    if t.shape != shape:
        raise ValueError(f"params_from_hf: tensor {name!r} has shape {t.shape}, expected "
                         f"{shape} for this config.")
    if t.dtype.name.startswith("float8"):
        t = _dequantize_fp8(name, t, get_tensor, fp8_block)
    return t


def _dequantize_fp8(name: str, w: np.ndarray, get_tensor, block: tuple[int, int]) -> np.ndarray:
    """float32 weights from a block-quantized FP8 checkpoint tensor (DeepSeek-V3's format).

    Each `block[0] x block[1]` tile of the [out, in] weight has one float32 factor in
    `<name>_scale_inv` (despite its name, a multiplier: w = fp8 * scale_inv).
    """
    scale_name = name + "_scale_inv"
    try:
        scale = np.asarray(get_tensor(scale_name), np.float32)
    except KeyError as e:
        raise KeyError(f"params_from_hf: {name!r} is {w.dtype.name} but the checkpoint has no "
                       f"{scale_name!r} to dequantize it.") from e
    if w.ndim != 2:
        raise ValueError(f"params_from_hf: FP8 tensor {name!r} must be 2-D, got {w.shape}.")
    bo, bi = block
    want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
    if scale.shape != want:
        raise ValueError(
            f"params_from_hf: {scale_name!r} has shape {scale.shape}; a {w.shape} weight in "
            f"{block} blocks needs {want}."
        )
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    return w.astype(np.float32) * full
