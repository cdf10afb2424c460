"""Shape checks shared by the MLA decode kernels."""

from kernels_pallas.paged_attention.block_sizes import check_head_dim


def check_mla_shapes(op, backend, q_latent, q_rope, latent_pages, rope_pages, lengths,
                     block_tables):
    """Raises ValueError naming the shapes if they do not form one absorbed-MLA decode."""
    if q_latent.ndim != 3 or q_rope.ndim != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"{op}: q_latent {q_latent.shape} and q_rope {q_rope.shape} must be "
            f"[batch, q_heads, d_c | d_rope] with equal batch and q_heads."
        )
    if (latent_pages.ndim != 3 or rope_pages.ndim != 3
            or latent_pages.shape[:2] != rope_pages.shape[:2]):
        raise ValueError(
            f"{op}: latent_pages {latent_pages.shape} and rope_pages {rope_pages.shape} must be "
            f"[pages, page_size, d_c | d_rope] with equal pages and page_size."
        )
    if latent_pages.shape[2] != q_latent.shape[2] or rope_pages.shape[2] != q_rope.shape[2]:
        raise ValueError(
            f"{op}: page widths ({latent_pages.shape[2]}, {rope_pages.shape[2]}) must equal the "
            f"query widths ({q_latent.shape[2]}, {q_rope.shape[2]})."
        )
    batch = q_latent.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(
            f"{op}: block_tables {block_tables.shape} must be [batch={batch}, max_pages] and "
            f"lengths {lengths.shape} must be [batch]."
        )
    check_head_dim(op, "d_c", q_latent.shape[2], backend)
    check_head_dim(op, "d_rope", q_rope.shape[2], backend)
