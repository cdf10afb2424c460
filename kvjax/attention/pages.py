"""What the attention ops read: one layer's quantized pages, and selections of pages.

Full-precision pages are plain arrays (`[kv_heads, pages, page_size, width]`, or a
cache's whole pools with `layer=`). KIVI-quantized pages are packed codes with their
scales and zeros (`QuantLayer`), read together with the sequence's full-precision tail
ring (`QuantizedLayerView`). A `Selection` names the pages a decode step reads instead
of each sequence's own block table (page-selecting cache policies such as Quest); a
`TokenSelection` names single tokens per query (DeepSeek Sparse Attention's indexer).

These are the types the attention layer takes; `kvjax.cache` builds them from a cache
(`kvjax.cache.layer_view`) and re-exports them.
"""

import dataclasses

import jax
from jaxtyping import Array, Float, Int, UInt8

__all__ = ["QuantLayer", "QuantizedLayerView", "Selection", "TokenSelection"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantLayer:
    """One layer's quantized pool: codes `[heads, pages, page_size, packed]`, scales, zeros.

    With `layer` set (`layer_view(..., whole_pools=True)`), codes, scale and
    zero are the whole pool of the layer's bit width, with a leading layers
    axis, and `layer` is the layer's index in it.
    """

    codes: UInt8[Array, "*layers heads pages page_size packed"]
    scale: Float[Array, "*layers heads pages srows scols"]
    zero: Float[Array, "*layers heads pages srows scols"]
    bits: int = dataclasses.field(metadata=dict(static=True))
    grouping: str = dataclasses.field(metadata=dict(static=True))
    layer: int | Int[Array, ""] | None = None

    def one_layer(self) -> "QuantLayer":
        """This layer's slice of whole pools (itself if it already holds one layer)."""
        if self.layer is None:
            return self
        i = self.layer
        return QuantLayer(codes=self.codes[i], scale=self.scale[i], zero=self.zero[i],
                          bits=self.bits, grouping=self.grouping)

    @property
    def arrays(self) -> tuple[Array, Array, Array]:
        return self.codes, self.scale, self.zero


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLayerView:
    """What attention needs from one layer of a KIVI-quantized cache.

    Attributes:
      k: quantized keys (MLA: quantized c_KV, heads = 1).
      v: quantized values, or for MLA the k_rope pool `[1, pages, page_size, d_rope]`.
      tail_k, tail_v: `[heads, max_seqs, ring, width]` full-precision rings (MLA:
        c_KV and k_rope); position p of a sequence lives in slot p mod ring.
      block_tables: int32[max_seqs, max_pages] of the quantized pages.
      quant_lengths: int32[max_seqs], tokens in quantized pages (positions [0, Q)).
      lengths: int32[max_seqs], all tokens; the tail holds positions [Q, L).
      layer: None, or (`layer_view(..., whole_pools=True)`) the layer's index:
        then `k` and `v` hold whole pools (their own `layer` indexes them) and
        MLA's `v` is the whole k_rope pool `[layers, 1, pages, page_size,
        d_rope]`; `one_layer()` slices them. Attention's "xla" and "cpu" paths
        read the layer inside their gathers; slicing first makes XLA copy the
        layer's pools when the slice feeds a loop.
    """

    k: QuantLayer
    v: QuantLayer | Float[Array, "*layers 1 pages page_size d_rope"]
    tail_k: Float[Array, "heads max_seqs ring width_a"]
    tail_v: Float[Array, "heads max_seqs ring width_b"]
    block_tables: Int[Array, "max_seqs max_pages"]
    quant_lengths: Int[Array, " max_seqs"]
    lengths: Int[Array, " max_seqs"]
    layer: int | Int[Array, ""] | None = None

    @property
    def is_mla(self) -> bool:
        return not isinstance(self.v, QuantLayer)

    def one_layer(self) -> "QuantizedLayerView":
        """The same view with one layer's pools (itself if it already holds one layer)."""
        if self.layer is None:
            return self
        v = self.v[self.layer] if self.is_mla else self.v.one_layer()
        return dataclasses.replace(self, k=self.k.one_layer(), v=v, layer=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Which cached pages one layer's decode attention reads.

    Attributes:
      block_tables: int32[batch, sel_heads, sel_pages]; page ids to read, in
        any order (decode attention does not depend on key order), the page
        holding a partial tail last; entries past `lengths` are ignored (-1 by
        convention). `sel_heads` is 1 (all KV heads read the same pages) or
        kv_heads (each KV head reads its own pages).
      lengths: int32[batch, sel_heads]; tokens to read through that table:
        full pages except possibly the last column in use.

    On a KIVI-quantized cache a selection names quantized pages only (its
    lengths count quantized tokens); the full-precision tail of recent tokens
    is always read besides.
    """

    block_tables: Int[Array, "batch sel_heads sel_pages"]
    lengths: Int[Array, "batch sel_heads"]

    def rows(self, seq_ids: Int[Array, " batch"] | None) -> "Selection":
        """The selection of the batch rows `seq_ids` (slots), or itself for None."""
        if seq_ids is None:
            return self
        return Selection(block_tables=self.block_tables[seq_ids], lengths=self.lengths[seq_ids])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenSelection:
    """Which cached tokens each query of one layer reads (DeepSeek Sparse Attention).

    Attributes:
      positions: int32[batch, q_len, k], positions in each row's sequence that query t
        of row b attends to, in any order; -1 marks an unused entry (a query that sees
        fewer than k tokens). Rows are the batch rows of the call (not cache slots).
        Every position must be visible to its query (cached, and not after it): the
        selection is made that way (`kvjax.cache.indexer_topk`), attention does not
        mask it again.
    """

    positions: Int[Array, "batch q_len k"]

    @property
    def k(self) -> int:
        return self.positions.shape[-1]
