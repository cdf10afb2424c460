"""Paged MLA decode in absorbed form as a Pallas TPU kernel.

MLA's cache is one latent "head" per token: `c_KV` (d_c) and `k_rope` (d_rope).
With W_UK absorbed into the query this is MQA over the latent: key
[c_KV, k_rope], value c_KV. The kernel is the paged GQA TPU kernel
(`kernels_pallas/paged_attention/tpu.py`) with one KV head whose group is all
query heads and whose key is the sum of two parts, so each latent page is
copied once (its c_KV slot serves as key and value) for every query head of
the sequence. See that module for the grid, DMA and masking design.
"""

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels_pallas.mla_decode._common import check_mla_shapes
from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_table_width,
    resolve_block_sizes,
)
from kernels_pallas.paged_attention.tpu import decode_tpu

__all__ = ["mla_decode_attention", "BlockSizes"]


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    block_sizes: BlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Absorbed-MLA decode on TPU; same contract as `reference.mla_decode_attention`.

    Args:
      q_latent: [batch, q_heads, d_c], queries already multiplied by W_UK.
      q_rope: [batch, q_heads, d_rope].
      latent_pages, rope_pages: one layer's pools [pages, page_size, d_c | d_rope], left in
        HBM; only the pages below each sequence's length are read.
      lengths, block_tables: as in the reference.
      scale: softmax scale.
      block_sizes, max_pages, interpret: as in `paged_attention.tpu.paged_decode_attention`.

    Returns:
      (out in latent space [batch, q_heads, d_c] in q_latent's dtype, lse float32[batch,
      q_heads]).

    Raises:
      ValueError: on unsupported widths, a block table wider than `max_pages` or than SMEM
        holds, or block sizes that are not whole pages; before any tracing.
    """
    op = "mla_decode_attention[tpu]"
    check_mla_shapes(op, "tpu", q_latent, q_rope, latent_pages, rope_pages, lengths,
                     block_tables)
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    page_size = latent_pages.shape[1]
    batch, q_heads, _ = q_latent.shape
    bs = resolve_block_sizes(op, "tpu", block_sizes, page_size, block_tables.shape[1],
                             rows=q_heads)
    out, lse = decode_tpu(
        (q_latent[:, None], q_rope[:, None]), (latent_pages[None], rope_pages[None]), None,
        lengths, block_tables,
        value_is_key0=True,
        scale=float(scale),
        soft_cap=None,
        sliding_window=None,
        block_tokens=bs.block_tokens,
        interpret=interpret,
        name=f"kvjax_mla_decode_tpu_h{q_heads}_bt{bs.block_tokens}",
    )
    return out[:, 0].astype(q_latent.dtype), lse[:, 0].astype(jnp.float32)
