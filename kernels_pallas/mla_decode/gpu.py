"""Paged MLA decode in absorbed form as a Pallas GPU (Triton) kernel.

MQA over the latent (key [c_KV, k_rope], value c_KV): the paged GQA GPU
kernel (`kernels_pallas/paged_attention/gpu.py`) with one KV head, all query
heads as its group and a two-part key, so every latent page gathered serves
all query heads of the sequence as key and value. Split-K over pages with a
log-sum-exp merge, as there.
"""

from jaxtyping import Array, Float, Int

from kernels_pallas.mla_decode._common import check_mla_shapes
from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_table_width,
    resolve_block_sizes,
)
from kernels_pallas.paged_attention.gpu import check_page_size, decode_gpu

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
    interpret: bool = False,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Absorbed-MLA decode on GPU; same contract as `reference.mla_decode_attention`.

    Args:
      q_latent: [batch, q_heads, d_c], queries already multiplied by W_UK.
      q_rope: [batch, q_heads, d_rope].
      latent_pages, rope_pages: one layer's pools [pages, page_size, d_c | d_rope].
      lengths, block_tables: as in the reference.
      scale: softmax scale.
      block_sizes, max_pages, interpret: as in `paged_attention.gpu.paged_decode_attention`.

    Returns:
      (out in latent space [batch, q_heads, d_c] in q_latent's dtype, lse float32[batch,
      q_heads]).

    Raises:
      ValueError: on unsupported widths or page size, a block table wider than `max_pages`,
        or block sizes that are not a power-of-two number of pages; before any tracing.
    """
    op = "mla_decode_attention[gpu]"
    check_mla_shapes(op, "gpu", q_latent, q_rope, latent_pages, rope_pages, lengths,
                     block_tables)
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    page_size = latent_pages.shape[1]
    check_page_size(op, page_size)
    check_table_width(op, block_tables.shape, max_pages, "gpu")
    bs = resolve_block_sizes(op, "gpu", block_sizes, page_size, block_tables.shape[1])
    q_heads = q_latent.shape[1]
    out, lse = decode_gpu(
        (q_latent[:, None], q_rope[:, None]), (latent_pages[None], rope_pages[None]), None,
        lengths, block_tables,
        value_is_key0=True,
        scale=float(scale),
        soft_cap=None,
        sliding_window=None,
        block_sizes=bs,
        interpret=interpret,
        name=f"kvjax_mla_decode_gpu_h{q_heads}_bt{bs.block_tokens}",
    )
    return out[:, 0], lse[:, 0]
