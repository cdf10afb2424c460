"""The cache pytree: one `PagedKVCache` type whose page leaf is one of four page kinds.

    page kind               pools (every one `[layers*, heads, pages, rows, cols]`)
    KVPages                 K and V, full precision (MHA / GQA / MQA)
    LatentPages             MLA's c_KV and rotary key, full precision (one latent "head")
    QuantizedKVPages        KIVI codes + scales + zeros of K (per channel) and V (per token)
    QuantizedLatentPages    KIVI codes + scales + zeros of c_KV, full-precision k_rope

An MLA cache with a lightning indexer (DeepSeek-V3.2, `CacheSpec.indexer`) holds a
third pool in its latent pages, `index_k`: one indexer key per token, with the latent
pools' page ids (one block table for both), full precision on every kind.

The page axis is always axis 2 of every pool, so paging operations (copy-on-write,
scrubbing) and sharding treat all pools alike. A quantized cache also carries a
`KIVITail`: the full-precision ring of each sequence's most recent tokens and the
token counts (its page table counts only the quantized tokens). Which kind a cache
holds is fixed by its static `CacheSpec` (`spec.is_mla`, `spec.quant`); the generic
operations of `kvjax.cache` dispatch on it in one place (`kvjax.cache.ops`).
"""

import dataclasses

import jax
from jaxtyping import Array, Float, Int, UInt8

from kvjax.cache import page_table as pt
from kvjax.specs import CacheSpec

__all__ = [
    "KVPages",
    "LatentPages",
    "QuantPool",
    "QuantizedKVPages",
    "QuantizedLatentPages",
    "KIVITail",
    "HostTier",
    "RecurrentState",
    "WindowGroup",
    "PagedKVCache",
    "LayerView",
    "Slots",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """Key and value page pools of an MHA/GQA/MQA cache, all layers."""

    k: Float[Array, "layers kv_heads pages page_size head_dim"]
    v: Float[Array, "layers kv_heads pages page_size head_dim"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPages:
    """MLA latent pools, all layers: normalised c_KV and the shared rotary key, and with a
    lightning indexer (`CacheSpec.indexer`) its keys, in the pages of the same ids."""

    c_kv: Float[Array, "layers 1 pages page_size d_c"]
    k_rope: Float[Array, "layers 1 pages page_size d_rope"]
    index_k: Float[Array, "layers 1 pages page_size d_index"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPool:
    """Packed codes with their scales and zeros for the layers of one bit width.

    Attributes:
      codes: uint8[layers_g, heads, pages, page_size, width * bits / 8] (layout.py order).
      scale, zero: scale dtype, `[layers_g, heads, pages, page_size / G, width]`
        for grouping "tokens" (keys) or `[..., page_size, width / G]` for "channels".
      bits: code width (static).
      grouping: "tokens" or "channels" (static).
    """

    codes: UInt8[Array, "layers heads pages page_size packed"]
    scale: Float[Array, "layers heads pages srows scols"]
    zero: Float[Array, "layers heads pages srows scols"]
    bits: int = dataclasses.field(metadata=dict(static=True))
    grouping: str = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVPages:
    """Quantized K and V pools of an MHA/GQA/MQA cache, one `QuantPool` per bit width."""

    k: tuple[QuantPool, ...]
    v: tuple[QuantPool, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLatentPages:
    """MLA: quantized c_KV pools (per token, channel groups) and the full-precision k_rope
    (and indexer keys, with a lightning indexer)."""

    c_kv: tuple[QuantPool, ...]
    k_rope: Float[Array, "layers 1 pages page_size d_rope"]
    index_k: Float[Array, "layers 1 pages page_size d_index"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KIVITail:
    """What a quantized cache holds beside its pages: recent tokens and token counts.

    Attributes:
      a, b: full-precision ring buffers `[layers, heads, max_seqs, ring, width]`; the
        token at position p of slot s lives at `[:, :, s, p % ring]`. `a` holds K
        (MLA: c_KV), `b` holds V (MLA: k_rope), in the cache dtype.
      lengths: int32[max_seqs], all tokens of each sequence (quantized + tail).
      pending: int32[2, max_seqs], what the last `reserve` added: row 0 the new
        tokens (the next write covers positions [lengths - pending[0], lengths)), row 1
        the newly quantized tokens (the next write quantizes [Q - pending[1], Q)). One
        array rather than two fields, so that no jitted step can return one buffer for
        two leaves (XLA merges identical outputs), which donation would reject.
      c: with a lightning indexer, the ring of the tail tokens' indexer keys
        `[layers, 1, max_seqs, ring, d_index]` (flushed into `index_k` pages with the
        latent); None otherwise.
    """

    a: Float[Array, "layers heads max_seqs ring width_a"]
    b: Float[Array, "layers heads max_seqs ring width_b"]
    lengths: Int[Array, " max_seqs"]
    pending: Int[Array, "2 max_seqs"]
    c: Float[Array, "layers 1 max_seqs ring d_index"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """A hybrid model's linear-attention state, one row per sequence slot (axis 1).

    Attributes:
      conv: the causal convolution's last inputs `[layers, max_seqs, conv_dim, width]`
        (oldest first).
      ssm: the delta-rule state `[layers, max_seqs, heads, key_dim, value_dim]`.
    """

    conv: Float[Array, "layers max_seqs conv_dim width"]
    ssm: Float[Array, "layers max_seqs heads key_dim value_dim"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostTier:
    """Pages held in host memory beside the device pools (see `kvjax.cache.host`).

    Attributes:
      pages: pools of the cache's page kind (same layout, page axis 2) with the host
        tier's page count, in host memory; 16-bit float pools (and rings) are held as
        their uint16 bits (`.view` them in the device pools' dtype to read them).
      table: the host pages' page table. Row s < max_seqs holds the leading pages of
        live slot s that live on the host (its length counts their tokens; the device
        table's entries for them hold the device pool's page count); row max_seqs + r
        holds parked sequence r (swapped out, or a prefix kept for later).
      parked_lengths: int32[parked], all tokens of each parked sequence (a KIVI
        sequence's host row counts its quantized tokens only); 0 marks a free row.
      tail_a, tail_b: KIVI: the parked sequences' full-precision rings
        `[layers, heads, parked, ring, width]` in host memory; None otherwise.
      stream_pages: leading pages per live slot that may live on the host; decode
        attention streams that many pages of each row back per layer (static).
      rings: per window group (`CacheSpec.window_groups`), the parked sequences' ring
        pages in host memory, `KVPages` of `[layers_g, heads, parked * R, page_size,
        head_dim]` (parked row r's ring slot j at page r * R + j); () without groups.
      ring_held: per window group, bool[parked, R]: which ring slots the parked row held
        (the others were holes).
    """

    pages: KVPages | LatentPages | QuantizedKVPages | QuantizedLatentPages
    table: pt.PageTable
    parked_lengths: Int[Array, " parked"]
    tail_a: Float[Array, "layers heads parked ring width_a"] | None = None
    tail_b: Float[Array, "layers heads parked ring width_b"] | None = None
    stream_pages: int = dataclasses.field(default=0, metadata=dict(static=True))
    rings: tuple = ()
    ring_held: tuple = ()

    @property
    def num_parked(self) -> int:
        return self.parked_lengths.shape[0]

    @property
    def num_pages(self) -> int:
        return self.table.num_pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowGroup:
    """One window group's pages (`CacheSpec.window_groups`, `kvjax.cache.window`).

    Attributes:
      pages: the group's K and V pools `[layers_g, kv_heads, pages_g, page_size, head_dim]`.
      table: its page table, one ring of `ring_pages` entries per sequence: logical page p
        of sequence s lives at `block_tables[s, p % ring]`; its lengths equal the cache's.
    """

    pages: KVPages
    table: pt.PageTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache of any page kind: pools for every layer and the page table.

    Attributes:
      pages: the page kind's pools (see the module docstring).
      table: block tables, lengths, reference counts and the free stack. For a
        quantized cache it describes the quantized pages only (its lengths are the
        quantized token counts, multiples of the page size).
      spec: the static `CacheSpec` the cache was built from.
      tail: `KIVITail` for a quantized cache, None otherwise.
      host: `HostTier` when the cache has a host-memory tier (`kvjax.cache.host`).
      recurrent: `RecurrentState` when the spec has a `RecurrentSpec` (hybrid models).
      groups: one `WindowGroup` per `spec.window_groups` entry (the windowed layers'
        pages); `pages` then holds the other layers (`spec.global_layers`) only.
    """

    pages: KVPages | LatentPages | QuantizedKVPages | QuantizedLatentPages
    table: pt.PageTable
    spec: CacheSpec = dataclasses.field(metadata=dict(static=True))
    tail: KIVITail | None = None
    host: HostTier | None = None
    recurrent: RecurrentState | None = None
    groups: tuple[WindowGroup, ...] = ()

    @property
    def is_quantized(self) -> bool:
        return self.spec.quant is not None

    @property
    def lengths(self) -> Int[Array, " max_seqs"]:
        """Tokens each sequence holds (for a quantized cache: pages and tail)."""
        return self.table.lengths if self.tail is None else self.tail.lengths

    @property
    def quant_lengths(self) -> Int[Array, " max_seqs"]:
        """Tokens of each sequence held in quantized pages (quantized caches)."""
        return self.table.lengths

    @property
    def block_tables(self) -> Int[Array, "max_seqs max_pages"]:
        return self.table.block_tables

    @property
    def num_free_pages(self) -> Int[Array, ""]:
        return self.table.num_free


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer's full-precision pools with the page table, as `kvjax.attention` takes them.

    For MLA, `k` is the latent pool and `v` the rotary-key pool, both with the
    latent head axis squeezed away ([pages, page_size, width]).
    """

    k: Float[Array, "..."]
    v: Float[Array, "..."]
    block_tables: Int[Array, "max_seqs max_pages"]
    lengths: Int[Array, " max_seqs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Where tokens go in the pools: page id and offset per token; page == num_pages drops it."""

    page: Int[Array, "batch q_len"]
    offset: Int[Array, "batch q_len"]
