"""`linear(x, w, b)`: the models' matmul, on whichever backend runs it.

Weights are stored [d_in, d_out] (or stacked [layers, d_in, d_out] and read through a
`LayerSlice`). On the CPU backend a decode's few rows take kvjax's small-M matmul
kernel where `kvjax.backends.cpu.choose("matmul", rows=...)` says it is faster than
XLA's dot (it reads each weight byte once at memory speed, bfloat16 weights widened in
registers, and reads a `LayerSlice` inside its stack); everything else runs
`jnp.einsum`. Both accumulate in float32 and are differentiable. Models call only this
module: no model knows whether a kernel ran.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.backends.cpu import matmul as cpu_matmul
from kvjax.backends.cpu import options as options_mod

__all__ = ["LayerSlice", "layer_params", "linear", "uses_kernel"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `index` of stacked weights [layers, d_in, d_out], not sliced yet.

    `linear` takes it in place of a [d_in, d_out] weight: the CPU matmul kernel then
    reads that layer inside the stack, where slicing first (a `lax.scan` over stacked
    params does) makes XLA:CPU copy the layer's weights every step; other paths slice.
    """

    stack: Float[Array, "layers d_in d_out"]
    index: Int[Array, ""]

    @property
    def shape(self) -> tuple[int, int]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def get(self) -> Float[Array, "d_in d_out"]:
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)


def layer_params(stacked, index: int | Int[Array, ""]):
    """One layer of a stacked params pytree: matrices (3-D leaves) as `LayerSlice`s,
    the rest (norms, biases) sliced."""
    index = jnp.asarray(index, jnp.int32)
    return jax.tree.map(
        lambda p: LayerSlice(p, index) if p.ndim == 3
        else jax.lax.dynamic_index_in_dim(p, index, keepdims=False), stacked)


def uses_kernel(x, w_shape: tuple[int, ...], w_dtype,
                options: options_mod.CpuOptions | None = None) -> bool:
    """Whether `linear(x, w)` runs a native kernel for an x of this shape and dtype and a
    [d_in, d_out] weight (static: call it at trace time; x may be a ShapeDtypeStruct)."""
    return cpu_matmul.use_kernel(x, tuple(w_shape), w_dtype, options=options)


def linear(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "d_in d_out"] | LayerSlice,
    b: Float[Array, " d_out"] | None = None,
    *,
    widen: bool = False,
) -> Float[Array, "*batch d_out"]:
    """x @ w (+ b) in x's dtype, float32 accumulation; w stored [d_in, d_out] or a
    `LayerSlice` of a stack.

    With `widen`, the same values returned as float32 (`linear(x, w, b).astype(float32)`):
    the CPU kernel then rounds its sums to x's dtype in place instead of storing a
    bfloat16 result that is widened again (an LM head's logits, 32 x 32000 of them per
    decode step, make those two conversions a tenth of a bf16 step there).

    Raises:
      ValueError: w is not [d_in, d_out] with d_in = x.shape[-1].
    """
    if len(w.shape) != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"linear: expected x [..., d_in] and w [d_in, d_out], got {x.shape} "
                         f"and {tuple(w.shape)}.")
    if uses_kernel(x, w.shape, w.dtype):
        # A bias is added to the result in x's dtype, so the rounding waits for it.
        kw = dict(widen=widen and b is None)
        if isinstance(w, LayerSlice):
            y = cpu_matmul.matmul(x, w.stack, layer=w.index, **kw)
        else:
            y = cpu_matmul.matmul(x, w, **kw)
    else:
        w = w.get() if isinstance(w, LayerSlice) else w
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    y = y if b is None else y + b.astype(y.dtype)
    return y.astype(jnp.float32) if widen else y
