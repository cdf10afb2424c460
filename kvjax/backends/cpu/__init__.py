"""CPU attention kernels: XLA FFI custom calls that stream each live page once.

On CPU the XLA path (`kvjax/attention/xla.py`) is bound by per-element work, not by
memory: each block of pages is gathered (a copy), bf16 is converted, and XLA:CPU's
batched matmuls with a few query rows run far below bandwidth.
These kernels (C++ in this folder, built on first use by `build.py`) read each live
page of each sequence once, in place in the pool (bf16 widened and KIVI codes converted
in registers; rows that are not 16 whole rows of one page staged in a small float32
buffer), and keep the online softmax in float32;
(sequence, KV head) work items are spread over the caller and XLA's intra-op thread
pool. Kernels: GQA/MQA decode over full-precision pages (`paged_decode.cc`), over
KIVI-quantized pages and their tail ring (`quantized_kernel.h`) and MLA decode
in absorbed form (`mla_decode.cc`); GQA/MQA chunked prefill over full-precision pages
(`paged_prefill.cc`: causal flash attention, each query block reading only the keys it
sees), and over KIVI-quantized pages and their tail (key blocks dequantized once per
block of queries). MLA prefill stays on the XLA path. The same library holds the model's
other CPU pieces: a matmul (`matmul.py`, used by `kvjax.models.layers.linear`; a few
rows streamed at memory speed, many rows as a packed GEMM) and in-place row writes and
page copies for 16-bit cache pools (`write_rows`, `read_rows`, `copy_pages`;
`write_rows.cc`), which XLA:CPU would do by widening or copying the whole pool (or, for
the reads, element by element).

`kvjax.attention` registers them as `impl="cpu"`; `choose(op)` says whether "auto"
should take the kernel for an op on this CPU and build (measured rules, `policy.py`),
and it is the XLA path whenever the kernels are unavailable (no compiler, failed build,
`CpuOptions.kernels` False; `unavailable_reason()` says why). Every knob lives in
`CpuOptions` (`options.py`: `get_options`, `set_options`, `override`); the wrappers read
the options in force when they are traced.

`jax.vmap` of these ops is supported only by running the kernel once per mapped
element (`vmap_method="sequential"`); kvjax's own code never maps over them.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from kvjax.backends.cpu.build import Library, available, library, load, unavailable_reason
from kvjax.backends.cpu.options import CpuOptions, get_options, override, set_options
from kvjax.backends.cpu.policy import Choice, choose, unstack_layers_for

__all__ = ["available", "unavailable_reason", "library", "Library", "CpuOptions", "get_options",
           "set_options", "override", "choose", "Choice", "unstack_layers_for",
           "paged_decode_attention", "paged_prefill_attention", "PREFILL_ITEM_ROWS",
           "quantized_attention", "quantized_supported", "mla_decode_attention", "mla_supported",
           "write_rows", "read_rows", "take_rows", "copy_pages", "shared_runs", "argmax_rows",
           "decode_positions_walked"]


def _as_pools(pages, layer):
    """Pages (one layer, 4-D) or whole pools (5-D, with `layer`) as 5-D pools and a layer."""
    if layer is None:
        return pages[None], jnp.zeros((), jnp.int32)
    return pages, jnp.asarray(layer, jnp.int32)


def paged_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "*layers kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "*layers kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention with the CPU kernel; the reference's signature and semantics.

    Args:
      q: [batch, q_heads, head_dim], float32 or bfloat16 (the kernel computes in float32).
      k_pages, v_pages: [kv_heads, pages, page_size, width] float32 or bfloat16, or with
        `layer` a cache's whole pools [layers, kv_heads, pages, page_size, width]: the
        kernel then reads that layer's pages in place (no slice of the pool is formed).
      lengths: int32[batch]; block_tables: int32[batch, max_pages].
      scale, soft_cap, sliding_window: as in the reference.
      layer: an int or traced int32 scalar, or None.

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).

    Raises:
      RuntimeError: the kernels are unavailable (`unavailable_reason()`).
    """
    opts = get_options()
    return _paged_decode(q, k_pages, v_pages, lengths, block_tables, layer, scale=scale,
                         soft_cap=soft_cap, sliding_window=sliding_window,
                         target=load(opts).target("paged_decode"), tuning=opts.tuning)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "target",
                                             "tuning"))
def _paged_decode(q, k_pages, v_pages, lengths, block_tables, layer, *, scale, soft_cap,
                  sliding_window, target, tuning):
    batch, q_heads, head_dim = q.shape
    if scale is None:
        scale = head_dim**-0.5
    k_pools, layer_idx = _as_pools(k_pages, layer)
    v_pools, _ = _as_pools(v_pages, layer)
    v_head_dim = v_pools.shape[-1]
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((batch, q_heads, v_head_dim), jnp.float32),
         jax.ShapeDtypeStruct((batch, q_heads), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(
        q.astype(jnp.float32), k_pools, v_pools, layer_idx,
        lengths.astype(jnp.int32), block_tables.astype(jnp.int32),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
        window=np.int64(sliding_window or 0), prefetch=np.int64(tuning.prefetch),
        touch=np.int64(tuning.touch), rows=np.int64(tuning.rows),
        share=np.int64(tuning.share),
    )
    return out.astype(q.dtype), lse



def shared_runs(lengths, block_tables, *, page_size: int, group: int = 1, kv_heads: int = 1,
                share: int | None = None, workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Which sequences the decode kernel reads together, for pages they share.

    Sequences whose block tables begin with the same pages (prefix caching, `fork`) form
    runs: their query rows read those leading pages together, once per KV head, and each
    continues alone over the rest (the results are the same bits as without runs). A run
    needs at least `share` common tokens (`CpuOptions.share`; cut to a multiple of 16);
    runs are halved while runs x `kv_heads` < `workers`. Sliding windows and f16 pages
    take no runs, nor does the staging path (`CpuOptions.rows` False).

    Args:
      lengths: int[batch]; block_tables: int[batch, max_pages] (host arrays).
      page_size, group (query heads per KV head), kv_heads: the cache's geometry.
      share: None: the options in force; workers: the kernel call's workers.

    Returns:
      (run_of int64[batch]: each sequence's run or -1, tokens int64[batch]: the positions
      it reads in its run, 0 outside one).

    Raises:
      RuntimeError: the kernels are unavailable (`unavailable_reason()`).
      ValueError: shapes that do not match.
    """
    lengths = np.ascontiguousarray(lengths, np.int32)
    tables = np.ascontiguousarray(block_tables, np.int32)
    if lengths.ndim != 1 or tables.ndim != 2 or tables.shape[0] != lengths.shape[0]:
        raise ValueError(f"shared_runs: expected lengths [batch] and block_tables [batch, "
                         f"max_pages], got {lengths.shape} and {tables.shape}.")
    opts = get_options()
    lib = load(opts)
    share = opts.share if share is None else share
    batch, max_pages = tables.shape
    run_of = np.full(batch, -1, np.int64)
    tokens = np.zeros(batch, np.int64)
    if not batch or not max_pages:
        return run_of, tokens
    i64 = ctypes.c_int64

    def ptr(a):
        return a.ctypes.data_as(ctypes.c_void_p)

    lib.cdll.KvjaxSharedRuns(ptr(lengths), ptr(tables), i64(batch), i64(max_pages),
                             i64(page_size), i64(group), i64(kv_heads), i64(share),
                             i64(workers), ptr(run_of), ptr(tokens))
    return run_of, tokens


def decode_positions_walked() -> int:
    """Key positions the paged decode kernel has walked since the last call, summed over
    its work items (one per sequence and KV head; a run reads its shared positions once
    for all its members, each member then its own), and resets the count: a diagnostic
    of what `shared_runs` saves. Counts every call of the loaded library, in any thread.

    Raises:
      RuntimeError: the kernels are unavailable (`unavailable_reason()`).
    """
    return int(load().cdll.KvjaxDecodePositionsWalked())


# Query rows per work item of the prefill kernel (benchmarks/attention.py --cpu-choice).
PREFILL_ITEM_ROWS = 192


def paged_prefill_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_pages: Float[Array, "*layers kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "*layers kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | Int[Array, ""] | None = None,
    item_rows: int | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill attention with the CPU kernel; the reference's signature and semantics.

    Causal flash attention over the pages (`paged_prefill.cc`): each block of query
    positions reads only the keys it can see, in float32.

    Args:
      q: [batch, q_len, q_heads, head_dim] float32 or bfloat16.
      k_pages, v_pages: [kv_heads, pages, page_size, width] float32, bfloat16 or float16,
        or with `layer` a cache's whole pools [layers, ...] read in place.
      lengths: int32[batch], tokens in the cache, the new ones included.
      block_tables: int32[batch, max_pages].
      q_lengths: int32[batch], real queries per row (query t sits at position
        lengths - q_lengths + t; queries past q_lengths are padding: output 0, lse -inf).
      scale, soft_cap, sliding_window: as in the reference.
      layer: an int or traced int32 scalar, or None.
      item_rows: query rows (positions x query heads per KV head) per work item (default
        `PREFILL_ITEM_ROWS`): each item gathers the keys it sees once for its rows.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_len, q_heads]).

    Raises:
      ValueError: item_rows < 1. RuntimeError: the kernels are unavailable
        (`unavailable_reason()`).
    """
    item_rows = PREFILL_ITEM_ROWS if item_rows is None else int(item_rows)
    if item_rows < 1:
        raise ValueError(f"paged_prefill_attention: item_rows must be >= 1, got {item_rows}.")
    return _paged_prefill(q, k_pages, v_pages, lengths, block_tables, q_lengths, layer,
                          scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                          item_rows=item_rows, target=load().target("paged_prefill"))


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "item_rows",
                                             "target"))
def _paged_prefill(q, k_pages, v_pages, lengths, block_tables, q_lengths, layer, *, scale,
                   soft_cap, sliding_window, item_rows, target):
    batch, q_len, q_heads, head_dim = q.shape
    if scale is None:
        scale = head_dim**-0.5
    k_pools, layer_idx = _as_pools(k_pages, layer)
    v_pools, _ = _as_pools(v_pages, layer)
    v_head_dim = v_pools.shape[-1]
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((batch, q_len, q_heads, v_head_dim), jnp.float32),
         jax.ShapeDtypeStruct((batch, q_len, q_heads), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(
        q.astype(jnp.float32), k_pools, v_pools, layer_idx, lengths.astype(jnp.int32),
        block_tables.astype(jnp.int32), q_lengths.astype(jnp.int32),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
        window=np.int64(sliding_window or 0), item_rows=np.int64(item_rows),
        q_bf16=np.int64(q.dtype == jnp.bfloat16),
    )
    return out.astype(q.dtype), lse


def quantized_supported(q, k_scale, k_zero, v_scale, v_zero, tail_k, tail_v) -> bool:
    """Whether `quantized_attention`'s kernels take these inputs (static: shapes and dtypes).

    Scales and zeros of one dtype (the kernels take one; widening would copy whole pools
    every call); a float32, bfloat16 or float16 tail. Any q_len: decode (q_len 1) and
    chunked prefill (q_len > 1) have a kernel each.
    """
    del q
    return (len({x.dtype for x in (k_scale, k_zero, v_scale, v_zero)}) == 1
            and tail_k.dtype == tail_v.dtype
            and tail_k.dtype in (jnp.float32, jnp.bfloat16, jnp.float16))


def mla_supported(latent_pages, rope_pages) -> bool:
    """Whether `mla_decode_attention`'s kernel takes these pools (one dtype for both)."""
    return latent_pages.dtype == rope_pages.dtype


def quantized_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_codes: UInt8[Array, "*layers kv_heads pages page_size k_packed"],
    k_scale: Float[Array, "*layers kv_heads pages k_srows head_dim"],
    k_zero: Float[Array, "*layers kv_heads pages k_srows head_dim"],
    v_codes: UInt8[Array, "*layers kv_heads pages page_size v_packed"],
    v_scale: Float[Array, "*layers kv_heads pages page_size v_groups"],
    v_zero: Float[Array, "*layers kv_heads pages page_size v_groups"],
    tail_k: Float[Array, "kv_heads batch ring head_dim"],
    tail_v: Float[Array, "kv_heads batch ring v_head_dim"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    k_bits: int,
    v_bits: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Attention over KIVI-quantized pages plus the full-precision tail, with the CPU kernel.

    The signature and semantics of `reference.quantized_attention` (with `layer` as in
    `xla_quantized.quantized_attention`: the six pool arguments are then a cache's whole
    pools and the kernels read that layer in place). Decode (q_len = 1,
    `quantized_kernel.h`) streams the quantized pages once, multiplying the packed codes in
    registers (key scales folded into the query, value scales into the probabilities),
    then the tail ring (at most residual + page_size tokens, f32/bf16/f16 rows) in the
    same online softmax. Chunked prefill (q_len > 1, `paged_prefill.cc`) is the causal
    flash attention of `paged_prefill_attention` over key blocks dequantized once per
    block of `PREFILL_ITEM_ROWS` query rows (pages below `quant_lengths`, the tail ring
    above), each query at its own `q_pos`. Scales / zeros of mixed dtypes and tails of
    other dtypes are not supported (`quantized_supported` says; callers take the XLA path
    for them).

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_len, q_heads]).
    """
    if not quantized_supported(q, k_scale, k_zero, v_scale, v_zero, tail_k, tail_v):
        raise ValueError("quantized_attention: the CPU kernels take one scale dtype and a "
                         "float32/bfloat16/float16 tail; check quantized_supported first.")
    if q.shape[1] > 1:
        return _quantized_prefill(
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v,
            quant_lengths, lengths, block_tables, q_pos, layer, k_bits=k_bits, v_bits=v_bits,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
            item_rows=PREFILL_ITEM_ROWS, target=load().target("quantized_prefill"))
    opts = get_options()
    return _quantized(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v,
                      quant_lengths, lengths, block_tables, q_pos, layer, k_bits=k_bits,
                      v_bits=v_bits, scale=scale, soft_cap=soft_cap,
                      sliding_window=sliding_window,
                      target=load(opts).target("quantized_decode"), tuning=opts.tuning)


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "scale", "soft_cap",
                                             "sliding_window", "target", "tuning"))
def _quantized(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v,
               quant_lengths, lengths, block_tables, q_pos, layer, *, k_bits, v_bits, scale,
               soft_cap, sliding_window, target, tuning):
    pools = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    layer_idx = _as_pools(k_codes, layer)[1]
    pools = tuple(_as_pools(p, layer)[0] for p in pools)
    batch, _, q_heads, _ = q.shape
    v_head_dim = tail_v.shape[-1]
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((batch, q_heads, v_head_dim), jnp.float32),
         jax.ShapeDtypeStruct((batch, q_heads), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(
        q[:, 0].astype(jnp.float32), *pools, tail_k, tail_v,
        layer_idx, quant_lengths.astype(jnp.int32), lengths.astype(jnp.int32),
        q_pos[:, 0].astype(jnp.int32), block_tables.astype(jnp.int32),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
        window=np.int64(sliding_window or 0), k_bits=np.int64(k_bits), v_bits=np.int64(v_bits),
        prefetch=np.int64(tuning.prefetch), touch=np.int64(tuning.touch),
        rows=np.int64(tuning.rows), int_logits=np.int64(tuning.int_logits),
        int_values=np.int64(tuning.int_values),
    )
    return out[:, None].astype(q.dtype), lse[:, None]


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "scale", "soft_cap",
                                             "sliding_window", "item_rows", "target"))
def _quantized_prefill(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v,
                       quant_lengths, lengths, block_tables, q_pos, layer, *, k_bits, v_bits,
                       scale, soft_cap, sliding_window, item_rows, target):
    pools = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    layer_idx = _as_pools(k_codes, layer)[1]
    pools = tuple(_as_pools(p, layer)[0] for p in pools)
    batch, q_len, q_heads, _ = q.shape
    v_head_dim = tail_v.shape[-1]
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((batch, q_len, q_heads, v_head_dim), jnp.float32),
         jax.ShapeDtypeStruct((batch, q_len, q_heads), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(
        q.astype(jnp.float32), *pools, tail_k, tail_v, layer_idx,
        quant_lengths.astype(jnp.int32), lengths.astype(jnp.int32), q_pos.astype(jnp.int32),
        block_tables.astype(jnp.int32), scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0), window=np.int64(sliding_window or 0),
        k_bits=np.int64(k_bits), v_bits=np.int64(v_bits), item_rows=np.int64(item_rows),
    )
    return out.astype(q.dtype), lse


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "*layers pages page_size d_c"],
    rope_pages: Float[Array, "*layers pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """MLA decode (absorbed form) with the CPU kernel; the reference's signature.

    Each sequence's latent and rope rows are read once per step and serve as keys and
    (the latent part) values for all its query heads. With `layer`, the pages are a
    cache's whole latent pools `[layers, 1, pages, page_size, width]`, read in place.
    Latent and rope pools of different dtypes are not supported (`mla_supported`).

    Returns:
      (out in latent space [batch, q_heads, d_c] in q_latent's dtype,
      lse float32[batch, q_heads]).
    """
    if not mla_supported(latent_pages, rope_pages):
        raise ValueError("mla_decode_attention: the CPU kernel needs latent and rope pools "
                         "of one dtype; check mla_supported first.")
    opts = get_options()
    return _mla(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, layer,
                scale=scale, target=load(opts).target("mla_decode"), tuning=opts.tuning)


@functools.partial(jax.jit, static_argnames=("scale", "target", "tuning"))
def _mla(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, layer, *, scale,
         target, tuning):
    if layer is None:  # one layer [pages, page_size, width]: add the layer and head axes
        latent_pages, rope_pages = latent_pages[None, None], rope_pages[None, None]
        layer_idx = jnp.zeros((), jnp.int32)
    else:
        layer_idx = jnp.asarray(layer, jnp.int32)
    batch, q_heads, d_c = q_latent.shape
    q = jnp.concatenate([q_latent.astype(jnp.float32), q_rope.astype(jnp.float32)], axis=-1)
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((batch, q_heads, d_c), jnp.float32),
         jax.ShapeDtypeStruct((batch, q_heads), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse = call(q, latent_pages, rope_pages, layer_idx, lengths.astype(jnp.int32),
                    block_tables.astype(jnp.int32), scale=np.float32(scale),
                    prefetch=np.int64(tuning.prefetch))
    return out.astype(q_latent.dtype), lse


def write_rows(
    pool: Float[Array, "layers heads n1 n2 width"],
    layer: int | Int[Array, ""],
    i1: Int[Array, " rows"],
    i2: Int[Array, " rows"],
    x: Float[Array, "rows heads width"],
    *,
    after: tuple[Array, ...] = (),
) -> Float[Array, "layers heads n1 n2 width"]:
    """`pool.at[layer, :, i1, i2, :].set(x, mode="drop")` in place, by a custom call.

    For 16-bit float pools on CPU, where XLA has no in-place 16-bit float scatter (it
    widens or copies the whole pool per write). The pool is aliased to the result:
    inside a jit that donates it, no copy is made. Rows whose indices are out of range
    are skipped (as "drop" does); x must have the pool's dtype.

    `after`: arrays computed from reads of `pool` that must happen before this write.
    The kernel does not read them; as operands they order the reads first. Without them
    XLA cannot tell that a read of the pool precedes the in-place write and copies the
    whole pool (twice, inside a loop) to keep the read's value.
    """
    call = jax.ffi.ffi_call(load().target("write_rows"),
                            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(pool, jnp.asarray(layer, jnp.int32), i1.astype(jnp.int32), i2.astype(jnp.int32),
                x.astype(pool.dtype), *after)


def read_rows(
    pool: Float[Array, "layers heads n1 n2 width"],
    layer: int | Int[Array, ""],
    i1: Int[Array, " rows"],
    i2: Int[Array, " rows"],
) -> Float[Array, "rows heads width"]:
    """`pool[layer, :, i1, i2, :]` as [rows, heads, width], by a custom call that copies the
    rows (the rows `write_rows` writes; out-of-range indices read zeros).

    For 16-bit float pools on CPU, where XLA's gather of them runs element by element.
    Pass the result to the in-place write that follows as its `after`.
    """
    call = jax.ffi.ffi_call(load().target("read_rows"),
                            jax.ShapeDtypeStruct((i1.shape[0], pool.shape[1], pool.shape[4]),
                                                 pool.dtype), vmap_method="sequential")
    return call(pool, jnp.asarray(layer, jnp.int32), i1.astype(jnp.int32), i2.astype(jnp.int32))


def take_rows(table: Float[Array, "rows width"], idx: Int[Array, "..."]
              ) -> Float[Array, "... width"]:
    """`table[idx]` by a custom call that copies rows (an embedding lookup): XLA:CPU
    gathers 16-bit floats in float32, converting the whole table first (and, in a decode
    loop, hoisting that conversion out as a float32 copy of the table on every call).
    Indices as jnp's: negative ones count from the end, then they clamp."""
    flat = jnp.reshape(idx, (-1,)).astype(jnp.int32)
    call = jax.ffi.ffi_call(load().target("take_rows"),
                            jax.ShapeDtypeStruct((flat.shape[0], table.shape[1]), table.dtype),
                            vmap_method="sequential")
    return call(table, flat).reshape(*jnp.shape(idx), table.shape[1])


def argmax_rows(x: Float[Array, "*batch n"]) -> Int[Array, "*batch"]:
    """`jnp.argmax(x, axis=-1)` of float32 rows by a custom call (the first index of each
    row's largest value, a NaN counting as the largest): one vectorized pass per row,
    where XLA:CPU runs several unvectorized reductions (greedy decoding's logits)."""
    if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"argmax_rows: expected float32 [..., n] with n > 0, got {x.dtype}"
                         f"{list(x.shape)}.")
    flat = jnp.reshape(x, (-1, x.shape[-1]))
    call = jax.ffi.ffi_call(load().target("argmax_rows"),
                            jax.ShapeDtypeStruct((flat.shape[0],), jnp.int32),
                            vmap_method="sequential")
    return call(flat).reshape(x.shape[:-1])


def copy_pages(
    pool: Float[Array, "layers heads pages page_size width"],
    src: Int[Array, " n"],
    dst: Int[Array, " n"],
) -> Float[Array, "layers heads pages page_size width"]:
    """`pool.at[:, :, dst].set(pool[:, :, src], mode="drop")` in place, by a custom call.

    Copy-on-write of 16-bit pages on CPU (see `write_rows`); pairs with an index out of
    range are skipped. The `dst` pages must be distinct and not among `src` (fresh pages,
    as the allocator gives), so the copies do not depend on their order.
    """
    call = jax.ffi.ffi_call(load().target("copy_pages"),
                            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(pool, src.astype(jnp.int32), dst.astype(jnp.int32))
