"""Attention over a quantized paged cache with a full-precision tail (GQA and MLA).

Each op takes the `QuantizedLayerView` of one layer (`kvjax.cache.quantized.layer_view`)
and computes attention on the quantized pages each sequence's block table names
(dequantized after the gather, never the whole pool) and on its full-precision
tail, then merges the two with `merge_attention_states`. Inside a model's
step, pass `layer_view(cache, layer, whole_pools=True)`: the "xla" path then
reads the layer's pages straight from the cache's pools (other impls get the
layer's slice).

`impl` chooses the implementation from the one registry (`registry.py`), as for
the full-precision ops:
  "reference": `kernels_pallas/quantized_attention/reference.py` (gather the
    used pages' codes and scales, dequantize them all in float32, attend): the oracle;
  "xla": `kvjax/attention/xla_quantized.py` (online softmax over blocks of pages,
    each block's codes dequantized in float32 as it is read);
  "pallas": the Pallas kernels (`kernels_pallas/quantized_attention/{tpu,gpu}.py`:
    packed codes, scales and zeros of the block table's pages are copied and
    dequantized in VMEM/registers; the tail is merged by log-sum-exp) — the
    Triton kernel on a GPU backend, the TPU kernel otherwise (interpreted on
    CPU); decode and prefill alike;
  "cpu": the C++ CPU kernel (`kvjax/backends/cpu/quantized_kernel.h`: the pages
    streamed once, their packed codes multiplied in registers with the scales folded
    into queries and probabilities, then the tail ring in the same online softmax) for
    GQA decode; its prefill (q_len > 1) and the MLA ops' "cpu" entry run the "xla" path.

`quantized_selected_decode_attention` reads a `Selection` of quantized pages (one
table per sequence or per KV head, e.g. Quest's) plus the whole tail: the selected
pages through the registered op (per-KV-head tables as batch rows over the pools
viewed as one head of `kv_heads * pages` pages, a free reshape), the tail by the
reference's dense tail attention, merged by log-sum-exp.
"""

import functools

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.attention import registry
from kvjax.attention.pages import QuantizedLayerView, QuantLayer

__all__ = [
    "quantized_decode_attention",
    "quantized_prefill_attention",
    "quantized_mla_decode_attention",
    "quantized_mla_prefill_attention",
]


def _with_layer(op: str, impl, interpret, view: QuantizedLayerView):
    """The implementation and the view to pass it: for impls that read whole pools a
    whole-pool view stays whole (they read the layer in place), others get one layer."""
    fn, takes_layer = registry.resolve(op, impl, interpret, dtype=view.tail_k.dtype)
    if view.layer is None:
        return fn, view
    if takes_layer:
        kw = dict(layer=view.k.layer)
        if view.is_mla:  # MLA's k_rope pool holds every layer
            kw["rope_layer"] = view.layer
        return functools.partial(fn, **kw), view
    return fn, view.one_layer()


def _rows(view: QuantizedLayerView, seq_ids, batch: int, op: str):
    """Block tables, lengths and tails of the batch rows."""
    max_seqs = view.lengths.shape[0]
    if seq_ids is None:
        if batch != max_seqs:
            raise ValueError(
                f"{op}: q has batch {batch} but the cache has {max_seqs} slots; pass seq_ids."
            )
        return view.block_tables, view.quant_lengths, view.lengths, view.tail_k, view.tail_v
    if seq_ids.shape != (batch,):
        raise ValueError(f"{op}: seq_ids must be int32[{batch}], got shape {seq_ids.shape}.")
    return (view.block_tables[seq_ids], view.quant_lengths[seq_ids], view.lengths[seq_ids],
            view.tail_k[:, seq_ids], view.tail_v[:, seq_ids])


def _q_pos(lengths, q_lengths, q_len):
    """Query t of row b sits at lengths[b] - q_lengths[b] + t; padding rows get -1."""
    t = jnp.arange(q_len)[None, :]
    pos = lengths[:, None] - q_lengths[:, None] + t
    return jnp.where(t < q_lengths[:, None], pos, -1).astype(jnp.int32)


def _check_gqa(op, q, view):
    if not isinstance(view, QuantizedLayerView) or not isinstance(view.v, QuantLayer):
        raise TypeError(f"{op}: view must be the QuantizedLayerView of a GQA/MHA/MQA cache.")
    kv_heads, head_dim = view.k.codes.shape[-4], view.tail_k.shape[-1]
    if q.shape[-1] != head_dim:
        raise ValueError(f"{op}: q head_dim {q.shape[-1]} != cache head_dim {head_dim}.")
    if q.shape[-2] % kv_heads:
        raise ValueError(
            f"{op}: q has {q.shape[-2]} heads, not a multiple of the cache's {kv_heads} KV heads."
        )


def quantized_prefill_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    view: QuantizedLayerView,
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    seq_ids: Int[Array, " batch"] | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_len q_heads head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill attention over a quantized layer; the cache already holds the new tokens.

    Query t of row b sits at position `lengths[s] - q_lengths[b] + t` (s the
    row's slot) and sees every cached key at or before it; rows
    t >= q_lengths[b] are padding (output 0, lse -inf).

    Args:
      q: [batch, q_len, q_heads, head_dim].
      view: `layer_view(cache, layer)` of a quantized GQA/MHA/MQA cache (whole_pools=True
        inside a model: see the module docstring).
      q_lengths: int32[batch], new tokens per row.
      scale: logit scale, default 1/sqrt(head_dim).
      soft_cap, sliding_window: as in `kvjax.attention.paged_prefill_attention`.
      seq_ids: int32[batch], the slots of the rows (default: all slots in order).
      impl: one of IMPLS.
      interpret: only for impl "pallas": run the kernel in Pallas' interpret mode (True, or
        a `pltpu.InterpretParams` for the TPU interpreter); None means interpret exactly when
        the backend is CPU.

    Returns:
      (out [batch, q_len, q_heads, head_dim] in q's dtype, lse float32[batch, q_len, q_heads]).
    """
    op = "quantized_prefill_attention"
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [batch, q_len, q_heads, head_dim], got {q.shape}.")
    _check_gqa(op, q, view)
    bt, ql, ln, tk, tv = _rows(view, seq_ids, q.shape[0], op)
    if q_lengths.shape != (q.shape[0],):
        raise ValueError(f"{op}: q_lengths must be int32[{q.shape[0]}], got {q_lengths.shape}.")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn, view = _with_layer("quantized_attention", impl, interpret, view)
    return fn(
        q, view.k.codes, view.k.scale, view.k.zero, view.v.codes, view.v.scale, view.v.zero,
        tk, tv, ql, ln, bt, _q_pos(ln, q_lengths, q.shape[1]),
        k_bits=view.k.bits, v_bits=view.v.bits, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window,
    )


def quantized_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    view: QuantizedLayerView,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    seq_ids: Int[Array, " batch"] | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_heads head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention (one query per row at position lengths - 1) over a quantized layer.

    Arguments as in `quantized_prefill_attention`. Rows whose sequence is
    empty give output 0 and lse -inf.
    """
    if q.ndim != 3:
        raise ValueError(
            f"quantized_decode_attention: q must be [batch, q_heads, head_dim], got {q.shape}."
        )
    lengths = view.lengths if seq_ids is None else view.lengths[seq_ids]
    ones = jnp.minimum(jnp.ones_like(lengths), lengths)
    out, lse = quantized_prefill_attention(
        q[:, None], view, ones, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        seq_ids=seq_ids, impl=impl, interpret=interpret)
    return out[:, 0], lse[:, 0]


def quantized_mla_prefill_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    view: QuantizedLayerView,
    q_lengths: Int[Array, " batch"],
    *,
    scale: float,
    seq_ids: Int[Array, " batch"] | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Absorbed MLA chunked-prefill attention over a quantized latent layer.

    Args:
      q_latent: queries times W_UK, [batch, q_len, q_heads, d_c].
      q_rope: [batch, q_len, q_heads, d_rope].
      view: `layer_view(cache, layer)` of a quantized MLA cache (whole_pools as above).
      q_lengths, seq_ids, impl, interpret: as in `quantized_prefill_attention`.
      scale: softmax scale (1/sqrt(qk_nope + qk_rope) times any mscale).

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c], lse float32[batch, q_len, q_heads]).
    """
    op = "quantized_mla_prefill_attention"
    if isinstance(view.v, QuantLayer) or view.k.codes.shape[-4] != 1:
        raise TypeError(f"{op}: view must be the QuantizedLayerView of an MLA cache.")
    if q_latent.ndim != 4 or q_rope.shape[:-1] != q_latent.shape[:-1]:
        raise ValueError(
            f"{op}: q_latent {q_latent.shape} and q_rope {q_rope.shape} must be "
            f"[batch, q_len, q_heads, width] with the same leading axes."
        )
    if q_latent.shape[-1] != view.tail_k.shape[-1] or q_rope.shape[-1] != view.v.shape[-1]:
        raise ValueError(
            f"{op}: widths {q_latent.shape[-1]}/{q_rope.shape[-1]} do not match the cache's "
            f"d_c={view.tail_k.shape[-1]}, d_rope={view.v.shape[-1]}."
        )
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    bt, ql, ln, tk, tv = _rows(view, seq_ids, q_latent.shape[0], op)
    fn, view = _with_layer("quantized_mla_attention", impl, interpret, view)
    pools = (view.k.codes, view.k.scale, view.k.zero, view.v)
    if view.layer is None:  # one layer's pools: drop the single head axis
        pools = tuple(p[0] for p in pools)
    return fn(
        q_latent, q_rope, *pools,
        tk[0], tv[0], ql, ln, bt, _q_pos(ln, q_lengths, q_latent.shape[1]),
        bits=view.k.bits, scale=scale,
    )


def quantized_mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    view: QuantizedLayerView,
    *,
    scale: float,
    seq_ids: Int[Array, " batch"] | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Absorbed MLA decode attention over a quantized latent layer (query at lengths - 1)."""
    lengths = view.lengths if seq_ids is None else view.lengths[seq_ids]
    ones = jnp.minimum(jnp.ones_like(lengths), lengths)
    out, lse = quantized_mla_prefill_attention(
        q_latent[:, None], q_rope[:, None], view, ones, scale=scale, seq_ids=seq_ids, impl=impl,
        interpret=interpret)
    return out[:, 0], lse[:, 0]
