"""Tiling of the ragged paged attention kernels.

`block_q` query positions of one row make a query block; with the GQA group
folded in (all query heads of one KV head share its pages) a block is
`block_q * group` query rows. `block_tokens` cached tokens (whole pages) are
read per inner step. The defaults keep one step's float32 logits tile
`[block_q * group, block_tokens]` within 128 KiB and aim at about 128 query
rows per block, so decode rows (q_len 1) and prefill chunks both fill a
block's rows: they are the starting point, not measured tunings (no TPU has
timed this kernel yet).
"""

import dataclasses

from kernels_pallas.paged_attention.block_sizes import TPU_MAX_TABLE_ENTRIES

__all__ = ["RaggedBlockSizes", "default_block_sizes", "resolve_block_sizes", "check_work_items"]

# Query rows (positions x group heads) a default block aims at.
_TARGET_ROWS = 128
# Elements of one step's f32 logits tile (128 KiB), as in the paged decode kernel.
_MAX_LOGITS = 32 * 1024
# Widest default key block, in tokens.
_MAX_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedBlockSizes:
    """Tiling of a ragged paged attention kernel.

    Attributes:
      block_q: query positions of one row per query block (times the GQA group
        gives the block's rows). A row's chunk is split into ceil(q_lengths / block_q)
        blocks; rows with no new query have none.
      block_tokens: cached tokens read per inner step per KV head; a multiple of
        the page size.
    """

    block_q: int
    block_tokens: int

    def __post_init__(self):
        for name in ("block_q", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RaggedBlockSizes.{name} must be an int >= 1, got {v!r}.")


def default_block_sizes(page_size: int, max_pages: int, q_len: int,
                        group: int) -> RaggedBlockSizes:
    """Defaults for pages of `page_size` tokens, a table of `max_pages`, chunks of `q_len`
    positions and `group` query heads per KV head (MLA: all of them)."""
    block_q = max(1, min(q_len, _TARGET_ROWS // max(1, group)))
    rows = block_q * group
    tokens = min(_MAX_BLOCK_TOKENS, _MAX_LOGITS // rows)
    pages = min(max(1, tokens // page_size), max_pages)
    return RaggedBlockSizes(block_q=block_q, block_tokens=pages * page_size)


def resolve_block_sizes(op: str, block_sizes: RaggedBlockSizes | None, page_size: int,
                        max_pages: int, q_len: int, group: int) -> RaggedBlockSizes:
    """Validates explicit block sizes against the geometry, or picks the defaults.

    Raises:
      TypeError: block_sizes is not a RaggedBlockSizes.
      ValueError: block_tokens is not a whole number of pages.
    """
    if block_sizes is None:
        return default_block_sizes(page_size, max_pages, q_len, group)
    if not isinstance(block_sizes, RaggedBlockSizes):
        raise TypeError(f"{op}: block_sizes must be a RaggedBlockSizes or None, got "
                        f"{type(block_sizes).__name__}.")
    if block_sizes.block_tokens % page_size:
        raise ValueError(
            f"{op}: page_size {page_size} does not divide block_tokens "
            f"{block_sizes.block_tokens}; a block must hold whole pages."
        )
    return block_sizes


def check_work_items(op: str, batch: int, q_len: int, block_q: int):
    """Raises ValueError if the query blocks' schedule would not fit the kernel's SMEM."""
    items = batch * -(-q_len // block_q)
    if 2 * items > TPU_MAX_TABLE_ENTRIES:
        raise ValueError(
            f"{op}: batch {batch} x ceil(q_len {q_len} / block_q {block_q}) = {items} query "
            f"blocks; the kernel's schedule (two SMEM entries per block) takes at most "
            f"{TPU_MAX_TABLE_ENTRIES // 2}. Use a larger block_q or smaller batches."
        )
