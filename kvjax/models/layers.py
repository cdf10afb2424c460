"""Building blocks shared by the model families: RMSNorms, SwiGLU, and RoPE from `kvjax.rope`.

Plain functions over arrays: the params live in the families' params pytrees,
so the same function serves a `lax.scan` over stacked layers and a Python loop.
Numerics follow HuggingFace `transformers` (the reference the tests compare
against): norms and rotary tables are computed in float32 and cast back to the
activation dtype at the same points. The rotary embedding is `kvjax.rope`'s (the
one the cache policies use too), re-exported here for the families.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.backends.linear import LayerSlice, layer_params, linear
from kvjax.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "RopeConfig",
    "rms_norm",
    "rms_norm_1p",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "silu",
    "swiglu",
    "linear",
    "LayerSlice",
    "layer_params",
    "embed_rows",
]


def embed_rows(table: Float[Array, "vocab hidden"], tokens: Int[Array, "..."]
               ) -> Float[Array, "... hidden"]:
    """`table[tokens]`: on one CPU device, a 16-bit float table's rows are copied by a
    custom call (`kvjax.backends.cpu.take_rows`). XLA:CPU gathers 16-bit floats in
    float32: it converts the whole table, and inside a decode loop hoists that conversion
    out of the loop, writing a float32 copy of the table on every call (65 MB for a
    32000 x 512 vocabulary)."""
    if jax.default_backend() == "cpu" and jnp.dtype(table.dtype).itemsize == 2:
        from kvjax.backends import cpu

        if cpu.choose("take_rows", dtype=table.dtype).use_kernel:
            return cpu.take_rows(table, tokens)
    return table[tokens]


def rms_norm(
    x: Float[Array, "*batch width"], weight: Float[Array, " width"], eps: float
) -> Float[Array, "*batch width"]:
    """RMSNorm: `weight * x / sqrt(mean(x**2) + eps)`, statistics in float32.

    The normalised activations are cast back to x's dtype before the weight
    multiplies them (as transformers does), so bf16 models round at the same place.
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype)
    return weight.astype(x.dtype) * y


def rms_norm_1p(
    x: Float[Array, "*batch width"], weight: Float[Array, " width"], eps: float
) -> Float[Array, "*batch width"]:
    """The (1 + weight) RMSNorm of Gemma and Qwen3-Next: `x / rms(x) * (1 + weight)`.

    All in float32 and cast to x's dtype at the end: the weight multiplies before the
    cast, unlike `rms_norm` (transformers' Gemma and Qwen3-Next norms round there).
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + jnp.float32(eps))
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def silu(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """x * sigmoid(x) in float32, rounded once to x's dtype (as PyTorch's kernels compute
    it for 16-bit tensors). `jax.nn.silu` on a bfloat16 array rounds after each of its
    negate, exp, add, divide and multiply: five roundings where transformers has one, and
    on XLA:CPU five conversion round trips (the decode step's costliest elementwise
    fusion)."""
    if jnp.dtype(x.dtype).itemsize >= 4:
        return jax.nn.silu(x)
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def swiglu(
    x: Float[Array, "*batch hidden"],
    w_gate: Float[Array, "hidden inter"],
    w_up: Float[Array, "hidden inter"],
    w_down: Float[Array, "inter hidden"],
    b_gate=None,
    b_up=None,
    b_down=None,
) -> Float[Array, "*batch hidden"]:
    """The gated MLP of Llama-style models: down(silu(gate(x)) * up(x)), `silu` rounding
    once."""
    return linear(silu(linear(x, w_gate, b_gate)) * linear(x, w_up, b_up), w_down, b_down)
