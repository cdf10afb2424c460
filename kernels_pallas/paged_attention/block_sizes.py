"""Block sizes of the paged decode kernels and the shape checks their wrappers share.

One frozen, hashable dataclass serves both backends (it is a static argument
of the jitted kernels). `block_tokens` is the number of cached tokens one
inner step of a kernel reads per KV head: a whole number of pages. The
GPU-only fields describe the split over pages (split-K) and Triton's launch.

`default_block_sizes(backend, page_size, max_pages)` gives a backend's
defaults fitted to a cache geometry (a block never wider than the block
table); block sizes a caller passes explicitly are validated against the
geometry and raise `ValueError` instead of being adjusted.
"""

import dataclasses
import math

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "resolve_block_sizes",
    "check_head_dim",
    "check_table_width",
    "TPU_HEAD_DIMS",
    "GPU_HEAD_DIMS",
]

# Head widths the kernels are written for. TPU: whole multiples of half a
# 128-lane vreg row, up to the widest production head (MLA's 512-wide latent).
# GPU: Triton block shapes must be powers of two and tl.dot needs >= 16.
TPU_HEAD_DIMS = tuple(range(64, 513, 64))
GPU_HEAD_DIMS = (16, 32, 64, 128, 256, 512)

# Defaults per backend: TPU reads ~512 tokens per step (a K and a V buffer,
# double-buffered, of 512 x 128 bf16 is 512 KiB of VMEM); Triton keeps a
# block in registers, so it steps through 64 tokens at a time.
_DEFAULT_TOKENS = {"tpu": 512, "gpu": 64}
# Scalar-prefetched block tables live in SMEM; keep them to a quarter of the
# smallest TPU SMEM (1 MiB on v5e/v6e is generous; 256 KiB is safe).
TPU_MAX_TABLE_ENTRIES = 64 * 1024
# Elements of one step's f32 logits tile on TPU (128 KiB).
_TPU_MAX_LOGITS = 32 * 1024
# tl.dot needs every operand dimension >= 16, the block's token axis included.
GPU_MIN_BLOCK_TOKENS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of a paged decode kernel.

    Attributes:
      block_tokens: cached tokens read per inner step per KV head; must be a
        multiple of the page size (TPU) or a power of two that is (GPU).
      num_splits: GPU only: the pages of a sequence are split into this many
        contiguous ranges computed in parallel and merged by log-sum-exp.
        None lets the wrapper choose from the batch and head counts.
      block_heads: GPU only: query heads of one KV head per program (a power of
        two >= 16, tl.dot's minimum). Groups wider than this (MLA's 16-128 heads)
        are split over programs, each re-reading the pages, to bound registers.
      num_warps, num_stages: GPU only: Triton launch parameters.
    """

    block_tokens: int
    num_splits: int | None = None
    block_heads: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"BlockSizes.block_tokens must be an int >= 1, got "
                             f"{self.block_tokens!r}.")
        if self.num_splits is not None and (
            not isinstance(self.num_splits, int) or self.num_splits < 1
        ):
            raise ValueError(f"BlockSizes.num_splits must be an int >= 1 or None, got "
                             f"{self.num_splits!r}.")
        if (not isinstance(self.block_heads, int) or self.block_heads < 16
                or self.block_heads & (self.block_heads - 1)):
            raise ValueError(f"BlockSizes.block_heads must be a power of two >= 16, got "
                             f"{self.block_heads!r}.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps must be a power of two in [1, 16], got "
                             f"{self.num_warps!r}.")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages must be an int >= 1, got "
                             f"{self.num_stages!r}.")


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(x)))


def default_block_sizes(backend: str, page_size: int, max_pages: int,
                        rows: int = 1) -> BlockSizes:
    """A backend's default block sizes for pages of `page_size` tokens and a table of `max_pages`.

    The block is a whole number of pages and never wider than the table
    (rounded up to a power of two on GPU, where block shapes must be). On TPU
    the [rows, block_tokens] f32 logits of one step stay within 128 KiB, so a
    wide group (`rows` query heads per KV head, e.g. MLA's 128) gets a shorter
    block.
    """
    if backend not in _DEFAULT_TOKENS:
        raise ValueError(f"backend must be one of {sorted(_DEFAULT_TOKENS)}, got {backend!r}.")
    tokens = _DEFAULT_TOKENS[backend]
    if backend == "tpu":
        tokens = min(tokens, _TPU_MAX_LOGITS // max(1, rows))
    pages = max(1, tokens // page_size)
    pages = min(pages, max_pages)
    if backend == "gpu":
        pages = _pow2_ceil(max(pages, -(-GPU_MIN_BLOCK_TOKENS // page_size)))
    return BlockSizes(block_tokens=pages * page_size)


def resolve_block_sizes(
    op: str, backend: str, block_sizes: BlockSizes | None, page_size: int, max_pages: int,
    rows: int = 1,
) -> BlockSizes:
    """Validates explicit block sizes against the cache geometry, or picks the defaults."""
    if block_sizes is None:
        return default_block_sizes(backend, page_size, max_pages, rows)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"{op}: block_sizes must be a BlockSizes or None, got "
                        f"{type(block_sizes).__name__}.")
    if block_sizes.block_tokens % page_size:
        raise ValueError(
            f"{op}: page_size {page_size} does not divide block_tokens "
            f"{block_sizes.block_tokens}; a block must hold whole pages."
        )
    if backend == "gpu":
        if block_sizes.block_tokens < GPU_MIN_BLOCK_TOKENS:
            raise ValueError(
                f"{op}: on GPU block_tokens must be at least {GPU_MIN_BLOCK_TOKENS} (tl.dot's "
                f"smallest operand), got {block_sizes.block_tokens}."
            )
        ppb = block_sizes.block_tokens // page_size
        if ppb & (ppb - 1):
            raise ValueError(
                f"{op}: on GPU block_tokens / page_size must be a power of two (Triton block "
                f"shapes), got {block_sizes.block_tokens} / {page_size} = {ppb}."
            )
    return block_sizes


def check_head_dim(op: str, name: str, width: int, backend: str):
    """Raises ValueError if a head width is not one the backend's kernel supports."""
    allowed = TPU_HEAD_DIMS if backend == "tpu" else GPU_HEAD_DIMS
    if width not in allowed:
        raise ValueError(
            f"{op}: {name} = {width} is not supported by the {backend.upper()} kernel; "
            f"supported widths are {allowed}. Use impl='xla' for other widths."
        )


def check_table_width(op: str, block_tables_shape, max_pages: int | None, backend: str):
    """Raises ValueError if the block table is wider than declared or than the kernel holds."""
    batch, width = block_tables_shape
    if max_pages is not None and width > max_pages:
        raise ValueError(
            f"{op}: block_tables has {width} columns, wider than the declared max_pages="
            f"{max_pages} (CacheSpec.max_pages_per_seq)."
        )
    if backend == "tpu" and batch * width > TPU_MAX_TABLE_ENTRIES:
        raise ValueError(
            f"{op}: block_tables {tuple(block_tables_shape)} holds {batch * width} entries; the "
            f"TPU kernel keeps the table in SMEM and takes at most {TPU_MAX_TABLE_ENTRIES}. "
            f"Call it on smaller batches."
        )
