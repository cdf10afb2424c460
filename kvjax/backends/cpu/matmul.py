"""Matmul on CPU (`matmul.cc`): `x @ w` for a few rows at memory speed, or for many.

Decode multiplies batch x new-token rows (a handful) by every weight matrix once
per step: the work is reading the weights. XLA:CPU's dot streams them at about a
third of the read bandwidth for 8 rows; the kernel reads each weight byte once, on all
cores, with float32 accumulation, and widens bfloat16 weights in registers (no
converted copy of the weights). For more than `MAX_ROWS` rows (prefill, training) the
same call runs a packed, cache-blocked GEMM instead (`packed`: w packed into column
panels once per call, x in row panels, a register block of the build's width),
compute-bound there. bfloat16 activations with bfloat16 weights run both on vdpbf16ps
where the build has AVX512_BF16 (two k's per instruction; the products are exact in
float32 either way).

`use_kernel(x, w_shape, w_dtype)` says whether `kvjax.backends.linear.linear` takes
the kernel: `choose("matmul", rows=..., dtype=...)` on the CPU backend (the options,
the build's instruction sets, the row count: the product of x's leading dims, static
under jit; with several devices only when `CpuOptions.matmul` is "on", since the call
has no partitioning rule and GSPMD would gather sharded weights around it) and 2-D
float32 / bfloat16 weights with float32 / bfloat16 activations. Larger row counts run
XLA's dot, which is compute-bound there and as fast, except bfloat16 x and w on a
build with AVX512_BF16, where the packed vdpbf16ps GEMM is faster (XLA widens the
weights to float32 on every call).

`matmul` is differentiable (`jax.custom_vjp`; the backward pass is the einsum's
gradients) and `jax.vmap` runs the kernel once per mapped element.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.backends.cpu import options as options_mod
from kvjax.backends.cpu.build import load
from kvjax.backends.cpu.policy import MATMUL_MAX_ROWS, choose

__all__ = ["MAX_ROWS", "matmul", "use_kernel"]

# Rows up to which the kernel serves at most (per ISA class: `policy.MATMUL_MAX_ROWS`).
MAX_ROWS = max(MATMUL_MAX_ROWS.values())
# Kernel tuning (benchmarks/matmul.py --sweep): tile width in vectors of the build's
# width (16 floats with AVX-512, 8 with AVX2; float32 weights: the register block is
# kMaxRows rows x this many vectors; bf16 tiles are two vectors; 0: the build's own, 2 on
# AVX-512, 3 on AVX2), column-block width (at most; smaller N get about 4 blocks per core;
# 0: always that), rows per panel (0: all K), rows prefetched ahead; and whether one row
# of x sweeps whole column ranges row by row of w instead (matmul.cc: sweep_columns).
TILE_VECTORS = 0
BLOCK = 512
PANEL = 32
AHEAD = 32
SWEEP = True
# Rows of w per packed block of the many-row GEMM (0 would mean the streaming kernel).
PACK_K = 256

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def use_kernel(x: jax.Array, w_shape: tuple[int, ...], w_dtype,
               options: options_mod.CpuOptions | None = None) -> bool:
    """Whether `linear` runs the kernel for x and a [d_in, d_out] weight of this dtype
    (static: shapes, dtypes, backend, the options and the build's rules)."""
    if len(w_shape) != 2 or x.ndim < 1 or x.shape[-1] != w_shape[0]:
        return False
    if jnp.dtype(x.dtype) not in _DTYPES or jnp.dtype(w_dtype) not in _DTYPES:
        return False
    if jax.default_backend() != "cpu":
        return False
    shared = jnp.dtype(x.dtype) if jnp.dtype(x.dtype) == jnp.dtype(w_dtype) else None
    return choose("matmul", rows=math.prod(x.shape[:-1]), dtype=shared,
                  options=options).use_kernel


def _kernel(x2, w, layer, target, tuning):
    tile_vectors, block, panel, ahead, sweep, packed, round_bf16 = tuning
    call = jax.ffi.ffi_call(
        target,
        jax.ShapeDtypeStruct((x2.shape[0], w.shape[-1]), jnp.float32),
        vmap_method="sequential",
    )
    return call(x2, w, layer, tile_vectors=np.int64(tile_vectors),
                block=np.int64(block), panel=np.int64(panel), ahead=np.int64(ahead),
                sweep=np.int64(sweep), packed=np.int64(packed), round_bf16=np.int64(round_bf16))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(x, w, layer, target, tuning):
    lead = x.shape[:-1]
    y = _kernel(x.reshape(-1, x.shape[-1]), w, layer, target, tuning)
    # round_bf16: the kernel rounded y to x's bfloat16 and widened it back (`widen`).
    return y.reshape(*lead, w.shape[-1]).astype(jnp.float32 if tuning[-1] else x.dtype)


def _fwd(x, w, layer, target, tuning):
    return _matmul(x, w, layer, target, tuning), (x, w, layer)


def _bwd(target, tuning, res, g):
    # The gradients of einsum("...i,io->...o", x, w_l.astype(x.dtype)), each in its
    # primal's dtype; stacked weights get theirs in layer `layer`'s slot.
    del target, tuning
    x, w, layer = res
    w_l = w if w.ndim == 2 else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    g = g.astype(x.dtype)  # a widened result's cotangent, in the dtype x's result has
    dx = jnp.einsum("...o,io->...i", g, w_l.astype(g.dtype))
    dw = jnp.einsum("...i,...o->io", x.astype(g.dtype), g).astype(w.dtype)
    if w.ndim == 3:
        dw = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w), dw, layer, 0)
    return dx.astype(x.dtype), dw, None


_matmul.defvjp(_fwd, _bwd)


def matmul(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "*layers d_in d_out"],
    *,
    layer: int | Int[Array, ""] | None = None,
    tile_vectors: int | None = None,
    block: int | None = None,
    panel: int | None = None,
    ahead: int | None = None,
    sweep: bool | None = None,
    packed: int | None = None,
    widen: bool = False,
) -> Float[Array, "*batch d_out"]:
    """`x @ w` with the CPU kernel, float32 accumulation, result in x's dtype (or, with
    `widen`, that result as float32).

    Args:
      x: [..., d_in] float32 or bfloat16 (read as is; a few rows, or many with `packed`).
      w: [d_in, d_out] float32 or bfloat16, read in place (bf16 widened in registers);
        with `layer`, stacked weights [layers, d_in, d_out] of which layer `layer` is
        used, read in place (no slice of the stack is formed).
      layer: None, or an int / traced int32 scalar indexing w's first axis (a traced
        index outside [0, layers) is clamped by the kernel; a Python int is checked).
      tile_vectors, block, panel, ahead, sweep: tuning of the few-row kernel (default:
        the module constants); tile_vectors in 0..3 (float32 tile width in vectors of
        the build's width: 16 floats with AVX-512, 8 with AVX2, 4 elsewhere; 0: the
        build's own), block the column-block width (0: automatic), panel the rows walked
        per tile before the next tile (0: all), ahead the rows each tile prefetches
        ahead (0: none); sweep: one row of x sweeps contiguous column ranges row by row
        of w instead of the tile walk.
      packed: rows of w per block of the many-row GEMM, or 0 for the few-row kernel
        (default: `PACK_K` when x has more than `MAX_ROWS` rows, else 0).
      widen: return float32, holding exactly `matmul(x, w).astype(float32)`: for
        bfloat16 x and w the kernel rounds its float32 sums to bfloat16 in place, so the
        bfloat16 result is never stored and widened again (bf16 logits wanted as float32).

    Returns:
      [..., d_out] in x's dtype, or float32 with `widen`.

    Raises:
      ValueError / TypeError: shapes or dtypes the kernel does not take.
      RuntimeError: the kernel is unavailable (`kvjax.backends.cpu.unavailable_reason`).
    """
    want = 2 if layer is None else 3
    if w.ndim != want or x.ndim < 1 or x.shape[-1] != w.shape[-2]:
        raise ValueError(
            f"matmul: expected x [..., d_in] and w [{'layers, ' if want == 3 else ''}d_in, "
            f"d_out] (layer={layer!r}), got {x.shape} and {w.shape}.")
    if isinstance(layer, int) and not 0 <= layer < w.shape[0]:
        raise ValueError(f"matmul: layer {layer} is outside [0, {w.shape[0]}).")
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) not in _DTYPES:
            raise TypeError(f"matmul: {name} must be float32 or bfloat16, got {a.dtype}.")
    tile_vectors = TILE_VECTORS if tile_vectors is None else int(tile_vectors)
    if not 0 <= tile_vectors <= 3:
        raise ValueError(f"matmul: tile_vectors must be 0 (the build's own), 1, 2 or 3, got "
                         f"{tile_vectors}.")
    block = BLOCK if block is None else int(block)
    panel = PANEL if panel is None else int(panel)
    ahead = AHEAD if ahead is None else int(ahead)
    sweep = SWEEP if sweep is None else bool(sweep)
    if min(block, panel, ahead) < 0:
        raise ValueError(
            f"matmul: block, panel and ahead must be >= 0, got {block}, {panel}, {ahead}.")
    rows = math.prod(x.shape[:-1])
    packed = (PACK_K if rows > MAX_ROWS else 0) if packed is None else int(packed)
    if packed < 0:
        raise ValueError(f"matmul: packed must be >= 0, got {packed}.")
    target = load().target("matmul")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    # The kernel rounds where x and w are bfloat16 (matmul.cc: round_to_bf16); otherwise
    # the result is converted to x's dtype and back.
    round_bf16 = bool(widen) and jnp.dtype(x.dtype) == jnp.dtype(w.dtype) == jnp.bfloat16
    y = _matmul(x, w, layer, target,
                (tile_vectors, block, panel, ahead, sweep, packed, round_bf16))
    return y.astype(jnp.float32) if widen else y
