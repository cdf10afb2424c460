"""The XLA path of attention over quantized pages: dequantize one block of pages at a time.

The gather reference (`kernels_pallas/quantized_attention/reference.py`)
gathers each sequence's packed codes and scales, dequantizes all of its pages
to float32 `[batch, kv_heads, max_tokens, width]` and then attends: a float32
copy of every live token (2-8x the bytes of the float pages it replaces, 8-32x
the codes it read), written and read back once per step. This path runs the
full-precision XLA path's online-softmax loop (`xla.paged_attention_core`)
with `BlockReader`s that, per block of `pages_per_block` table columns,

  1. gather the packed uint8 codes and the scale/zero rows of the block's
     pages, `[heads, batch, block_pages, ...]` (with `layer=`, from the
     cache's whole pools: the layer is indexed inside the gather);
  2. unpack the codes with shifts and masks (planar layout,
     `kernels_pallas/quantized_attention/layout.py`: field i of each byte is
     the contiguous channel slice [i W/k, (i+1) W/k));
  3. dequantize in float32, `code * scale + zero`, the scales broadcast over
     their group: keys per channel over G tokens ("tokens" grouping), values
     and MLA's latent per token over G channels ("channels");

so the only float copy of K/V ever formed is one block, `[heads, batch,
block_tokens, width]`, that stays in cache while the block's two matmuls use
it. The block is returned as width slices (`BlockReader`'s tuple form: the
loop multiplies each slice with its slice of the queries and accumulates each
value slice on its own): int4 as its two bit fields, int2 as two pairs of
fields, so at most two fields are ever concatenated (XLA:CPU emits a
concatenation as a per-element select between its operands; the choice was
measured: docs/attention-backends.md).
The loop passes the readers' arrays through the core's optimization barrier,
which also keeps XLA:CPU from hoisting a whole-pool float32 conversion of the
float16 scale/zero pools out of the loop (XLA:CPU has no f16 gather, the
same trap as bf16 pages: docs/attention-backends.md).

The full-precision tail (positions [Q, L), at most R + page_size tokens per
sequence) is attended as the reference does and merged with the pages'
result by log-sum-exp.

MLA: the latent c_KV pages (channel groups) are the first key part and the
values (read and dequantized once per block); the full-precision k_rope pages
are the second key part, read with the dense reader.

Signatures are the reference's, plus keyword `block_tokens` (tokens per
sequence per loop step) and `layer` (with `layer`, the codes/scale/zero and
rope arguments are a cache's whole pools with a leading layers axis; see
`kvjax.cache.quantized.layer_view(..., whole_pools=True)`).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention.layout import GROUPINGS
from kvjax.attention import xla
from kvjax.attention.xla import BlockReader

__all__ = [
    "quantized_reader",
    "quantized_attention",
    "quantized_mla_attention",
]

_ROW_GATHER = jax.lax.GatherDimensionNumbers(
    offset_dims=(0, 2), collapsed_slice_dims=(1,), start_index_map=(1,)
)


def _gather_pages(pool, layer, idx):
    """Rows of the pages `idx` of one layer, `[heads, batch, block_pages, a, b]`, pool dtype.

    pool: `[heads, pages, a, b]` or with `layer` `[layers, heads, pages, a, b]`; the layer
    index is fused into the gather (never a copy of the layer). Out-of-range ids are
    clipped, as in `xla._read_dense` (dead table entries were already replaced by page 0).
    """
    if layer is not None:
        pool = pool[layer]
    heads, num_pages, a, b = pool.shape
    batch, block_pages = idx.shape
    rows = pool.reshape(heads, num_pages, a * b)
    block = jax.lax.gather(
        rows, idx.reshape(-1, 1), _ROW_GATHER, (heads, 1, a * b),
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    return block.reshape(heads, batch, block_pages, a, b)


def _dequantize_fields(c, s, z, *, bits, grouping):
    """Dequantized float32 block as consecutive width slices (one or two).

    c: uint8 `[h, b, bp, page_size, W/k]`; s, z: the block's scales and zeros (see
    `_read_quantized`). Field i of the bytes holds channels [i W/k, (i+1) W/k)
    (layout.py), so each field is dequantized with its own slice of the scales and
    can be returned as its own width slice, without concatenating the k fields.
    """
    heads, batch, bp, ps, wk = c.shape
    k = 8 // bits
    mask = jnp.uint8((1 << bits) - 1)
    s = s.astype(jnp.float32)
    z = z.astype(jnp.float32)
    out = []
    for i in range(k):
        f = c if k == 1 else (c >> jnp.uint8(i * bits)) & mask
        f = f.astype(jnp.float32)
        if grouping == "tokens":  # s, z: [h, b, bp, ps / G, W]
            n = s.shape[3]
            si = s[..., i * wk:(i + 1) * wk][:, :, :, :, None, :]
            zi = z[..., i * wk:(i + 1) * wk][:, :, :, :, None, :]
            x = f.reshape(heads, batch, bp, n, ps // n, wk) * si + zi
        else:  # s, z: [h, b, bp, ps, W / G]
            group = wk * k // s.shape[4]
            if wk % group == 0:  # the field spans whole groups
                ng = wk // group
                si, zi = (a[..., i * ng:(i + 1) * ng, None] for a in (s, z))
                x = f.reshape(heads, batch, bp, ps, ng, group) * si + zi
            else:  # the field lies inside one group
                g = i * wk // group
                x = f * s[..., g:g + 1] + z[..., g:g + 1]
        out.append(x.reshape(heads, batch, bp * ps, wk))
    # At most two slices: int4 gives its two fields, int2 pairs of fields (fields 2j and
    # 2j+1 are adjacent channels). Measured at head_dim 128 (docs/attention-backends.md):
    # four 32-channel slices (int2) cost ~25% more than two concatenated pairs, and
    # concatenating int4's two fields into one slice ~35% more than two slices.
    m = k // min(k, 2)
    if m > 1:
        out = [jnp.concatenate(out[j:j + m], axis=-1) for j in range(0, k, m)]
    return tuple(out)


def _read_quantized(arrays, idx, *, bits, grouping):
    codes, scale, zero, layer = arrays
    return _dequantize_fields(
        _gather_pages(codes, layer, idx), _gather_pages(scale, layer, idx),
        _gather_pages(zero, layer, idx), bits=bits, grouping=grouping)


def quantized_reader(
    codes: UInt8[Array, "*layers heads pages page_size packed"],
    scale: Float[Array, "*layers heads pages srows scols"],
    zero: Float[Array, "*layers heads pages srows scols"],
    *,
    bits: int,
    grouping: str,
    layer: int | Int[Array, ""] | None = None,
) -> BlockReader:
    """A `BlockReader` that dequantizes one block of quantized pages to float32.

    Args:
      codes: packed uint8 codes `[heads, pages, page_size, width * bits / 8]`
        (layout.py's planar order), or with `layer` a cache's whole pool with
        a leading layers axis.
      scale, zero: `[heads, pages, page_size / G, width]` ("tokens") or
        `[heads, pages, page_size, width / G]` ("channels"), any float dtype;
        with `layer` also with the leading layers axis.
      bits: 2, 4 or 8.
      grouping: "tokens" (keys, per channel over G tokens) or "channels"
        (values and MLA latents, per token over G channels).
      layer: index into the leading layers axis (traced is fine), or None.

    Returns:
      A reader giving float32 `[heads, batch, block_pages * page_size, width]` as a
      tuple of consecutive width slices (one for int8, two for int4 and int2).
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}.")
    return BlockReader(
        arrays=(codes, scale, zero, layer),
        read=functools.partial(_read_quantized, bits=bits, grouping=grouping),
    )


def _check_layer(op, layer, *arrays):
    want = 4 if layer is None else 5
    for a in arrays:
        if a.ndim != want:
            raise ValueError(
                f"{op}: with layer={'None' if layer is None else '...'} the pools must have "
                f"{want} axes ([{'' if layer is None else 'layers, '}heads, pages, rows, cols]),"
                f" got shape {a.shape}."
            )


@functools.partial(
    jax.jit,
    static_argnames=("k_bits", "v_bits", "scale", "soft_cap", "sliding_window", "block_tokens"),
)
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
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Quantized pages (blocked online softmax) and the full-precision tail, merged by LSE.

    Arguments as `reference.quantized_attention` (one layer's pools), except:
      block_tokens: tokens per sequence per loop step (None: `xla.default_block_tokens`).
      layer: if given, the six pool arguments are a cache's whole pools of this
        layer's bit width, `[layers_g, kv_heads, pages, ...]`, and `layer`
        indexes their first axis (an int or a traced int32 scalar).

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32 [batch, q_len, q_heads]).
    """
    op = "xla_quantized.quantized_attention"
    _check_layer(op, layer, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _, q_len, q_heads, _ = q.shape
    kv_heads, _, page_size, _ = k_codes.shape[-4:]
    group = q_heads // kv_heads
    rows_pos = jnp.tile(q_pos.astype(jnp.int32), (1, group))  # rows ordered (g, t)
    out_q, lse_q = xla.paged_attention_core(
        (xla._fold_queries(q, kv_heads),),
        (quantized_reader(k_codes, k_scale, k_zero, bits=k_bits, grouping="tokens",
                          layer=layer),),
        quantized_reader(v_codes, v_scale, v_zero, bits=v_bits, grouping="channels",
                         layer=layer),
        rows_pos, quant_lengths.astype(jnp.int32), block_tables,
        page_size=page_size, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        block_tokens=block_tokens,
    )
    out_q, lse_q = xla._unfold(out_q, lse_q, q_len, q_heads)
    # The tail is at most residual + page_size tokens per sequence: the reference's
    # dense attention on it costs little next to the pages.
    return qref.merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos,
                                scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)


@functools.partial(jax.jit, static_argnames=("bits", "scale", "block_tokens"))
def quantized_mla_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    c_codes: UInt8[Array, "*layers pages page_size c_packed"],
    c_scale: Float[Array, "*layers pages page_size c_groups"],
    c_zero: Float[Array, "*layers pages page_size c_groups"],
    rope_pages: Float[Array, "*layers pages page_size d_rope"],
    tail_c: Float[Array, "batch ring d_c"],
    tail_rope: Float[Array, "batch ring d_rope"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    bits: int,
    scale: float,
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
    rope_layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Absorbed MLA over quantized latent pages plus the full-precision tail.

    Arguments as `reference.quantized_mla_attention` (one layer's pools), except:
      block_tokens: as in `quantized_attention`.
      layer: if given, c_codes/c_scale/c_zero are a cache's whole latent pools
        of this layer's bit width, `[layers_g, 1, pages, ...]`, and `layer`
        indexes their first axis.
      rope_layer: if given, rope_pages is the cache's whole k_rope pool
        `[layers, 1, pages, page_size, d_rope]` and `rope_layer` indexes it
        (with mixed bit widths it differs from `layer`). Give both or neither.

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c] in q_latent's dtype,
      lse float32 [batch, q_len, q_heads]).
    """
    op = "xla_quantized.quantized_mla_attention"
    if (layer is None) != (rope_layer is None):
        raise ValueError(f"{op}: give both layer and rope_layer or neither.")
    if layer is None:  # one layer's pools: add the single "KV head" axis
        c_codes, c_scale, c_zero, rope_pages = (x[None] for x in (c_codes, c_scale, c_zero,
                                                                  rope_pages))
    _check_layer(op, layer, c_codes, c_scale, c_zero, rope_pages)
    _, q_len, q_heads, _ = q_latent.shape
    page_size = c_codes.shape[-2]
    rows_pos = jnp.tile(q_pos.astype(jnp.int32), (1, q_heads))
    out_q, lse_q = xla.paged_attention_core(
        (xla._fold_queries(q_latent, 1), xla._fold_queries(q_rope, 1)),
        (quantized_reader(c_codes, c_scale, c_zero, bits=bits, grouping="channels",
                          layer=layer),
         xla.dense_reader(rope_pages, rope_layer)),
        None,  # the values are the latent key part, dequantized once per block
        rows_pos, quant_lengths.astype(jnp.int32), block_tables,
        page_size=page_size, scale=scale, block_tokens=block_tokens,
    )
    out_q, lse_q = xla._unfold(out_q, lse_q, q_len, q_heads)
    return qref.mla_merge_with_tail(out_q, lse_q, q_latent, q_rope, tail_c, tail_rope,
                                    quant_lengths, lengths, q_pos, scale=scale)
