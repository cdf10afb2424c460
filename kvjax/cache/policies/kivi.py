"""Quest and H2O on a KIVI-quantized cache (`kvjax.cache.quantized`), on the packed pages.

The full-precision policies (`quest.py`, `h2o.py`) read and rewrite `KVPages`.
A KIVI cache holds packed low-bit codes with float16 scales and zeros in pages
(keys grouped per channel over G tokens, values per token over G channels) and
a full-precision ring tail of the R .. R + page_size - 1 most recent tokens.
These two policies act on that cache as it is: no full-precision shadow copy,
no fake quantization.

`KIVIQuest` — selection (arXiv 2406.10774) from the stored key scales.
  A key group with zero z and scale s (per channel) is reconstructed as
  code * s + z with codes in [0, 2^b - 1] and s >= 0 (`kvjax.cache.quant`
  rounds z down and s up, a constant group gets s = 0), so every
  dequantized key of the group lies in [z, z + s (2^b - 1)] per channel, and
  with the 2- and 4-bit grids both ends are attained by the group's minimum
  and maximum. A page's Quest bounds are the min / max of those over its
  groups: no extra metadata, and they bound exactly the keys attention reads.
  Each decode step and layer scores a sequence's quantized pages per KV head
  with Quest's rule (`quest_page_bounds`, the query group's bounds summed),
  keeps the `top_k` best per KV head (in page order) and attends over them
  plus the whole tail (recent tokens are always read), merged by
  log-sum-exp (`kvjax.attention.quantized_selected`). `top_k` counts
  quantized pages; the first `dense_layers` layers read everything.

`KIVIH2O` — a page-granular H2O variant (arXiv 2306.14048).
  The tokens of a quantized page share their key scales and zeros (per
  channel over G tokens), so evicting single tokens would mean requantizing
  the rest of the group from already-quantized values (a second rounding).
  Here the quantized part is evicted a whole page at a time instead:
    * the score of every cached token is its attention probability summed
      over all queries so far (as H2O), over all layers, KV heads and query
      heads — one block-table row serves every layer and head, so a page is
      kept or freed for all of them; a page's mass is the sum of its tokens'
      scores, which includes the mass its tokens collected while they were
      still in the tail;
    * the budget is a number of tokens held per sequence: quantized pages
      kept x page_size + tail tokens. When a sequence exceeds it (checked
      after the prefill and after every decode step), the quantized pages
      with the lowest mass are freed, as many as needed; the tail (the
      recent window of H2O) is never evicted, nor the first `sink_pages`
      pages. Default `sink_pages = 0`: the first tokens of a text usually are
      the heaviest hitters and are kept by the ranking itself; set 1 to pin
      them whatever their mass;
    * freeing is real: the kept pages move to the front of the block-table
      row (bookkeeping only, no data moves), `page_table.truncate` drops the
      evicted references (refcounts down, pages at zero back on the free
      stack; a page a fork still holds stays), and the sequence's cache
      indices shift down by page_size per evicted page. The tail's ring is
      rotated by the same amount so that position p still lives in slot
      p mod ring, which keeps every invariant of the quantized cache
      (Q(L) = page_size * floor((L - R) / page_size)). Keys are cached after
      RoPE at their text positions, so decode attention does not care about
      cache indices (as for full-precision H2O's compaction);
    * the budget must fit the tail: budget >= sink_pages * page_size + R +
      page_size - 1 (checked by `init_state`); then every sequence holds at
      most `budget` tokens after every hook.

Both need an MHA/GQA/MQA quantized cache (not MLA) and a decode loop that
calls them as `kvjax.decoding` does: `before_attention` per layer (KIVIQuest)
and `after_prefill` / `after_step` (KIVIH2O).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas.quantized_attention import reference as qref
from kvjax.cache import page_table as pt
from kvjax.cache import quantized
from kvjax.cache.policies.base import CachePolicy, Selection, active_rows
from kvjax.cache.policies.quest import quest_page_bounds
from kvjax.cache.quantized import QuantizedKVCache

__all__ = ["KIVIPolicy", "KIVIQuest", "KIVIH2O", "KIVIH2OState", "kivi_key_bounds"]


def kivi_key_bounds(
    scale: Float[Array, "... groups head_dim"],
    zero: Float[Array, "... groups head_dim"],
    bits: int,
) -> tuple[Float[Array, "... head_dim"], Float[Array, "... head_dim"]]:
    """Per-channel (min, max) bounds of the dequantized keys of pages, from scales and zeros.

    Args:
      scale, zero: a key pool's per-channel scales and zeros, `[..., page_size / G,
        head_dim]` (one row per group of G tokens).
      bits: the code width.

    Returns:
      float32 (kmin, kmax) `[..., head_dim]`: min over groups of min(z, z + s (2^b - 1)) and
      max over groups of max(z, z + s (2^b - 1)) (the quantizer's s is >= 0; both are taken
      so that a negative scale would still give a valid bound).
    """
    s = scale.astype(jnp.float32)
    z = zero.astype(jnp.float32)
    top = s * jnp.float32((1 << bits) - 1) + z  # computed as `dequantize` does: code * s + z
    return jnp.min(jnp.minimum(z, top), axis=-2), jnp.max(jnp.maximum(z, top), axis=-2)


def _check_cache(owner: str, cache) -> None:
    if not isinstance(cache, QuantizedKVCache) or cache.spec.is_mla:
        raise ValueError(f"{owner} acts on the QuantizedKVCache of an MHA/GQA/MQA model "
                         f"(kvjax.cache.quantized), got {type(cache).__name__}"
                         + (" (MLA)" if isinstance(cache, QuantizedKVCache) else "") + ".")


def _check_int(owner: str, name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KIVIPolicy(CachePolicy):
    """Marker base of the policies whose hooks take a `QuantizedKVCache`.

    `before_attention` returns a `Selection` of quantized pages for
    `quantized_selected_decode_attention`, or None for "read everything" (the
    plain `quantized_decode_attention`).
    """

    def before_attention(self, cache, state, layer, q):
        del cache, state, layer, q
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KIVIQuest(KIVIPolicy):
    """Quest on a KIVI cache: the top_k quantized pages per KV head plus the whole tail.

    Attributes:
      top_k: quantized pages read per step and KV head (the tail is read in full besides).
      dense_layers: the first `dense_layers` layers read every page (paper: 2).
    """

    top_k: int = 64
    dense_layers: int = 2

    def __post_init__(self):
        _check_int("KIVIQuest", "top_k", self.top_k, 1)
        _check_int("KIVIQuest", "dense_layers", self.dense_layers, 0)

    def init_state(self, cache: QuantizedKVCache) -> None:
        """No state: the bounds are the key pool's own scales and zeros."""
        _check_cache("KIVIQuest", cache)
        return None

    def before_attention(
        self,
        cache: QuantizedKVCache,
        state: None,
        layer: int | Int[Array, ""],
        q: Float[Array, "batch q_heads head_dim"],
    ) -> Selection | None:
        """Per-KV-head selection of quantized pages; None (read all) for dense layers.

        With a traced `layer` the table is max_pages wide and dense layers select
        every quantized page through it.
        """
        del state
        max_pages = cache.spec.max_pages_per_seq
        if isinstance(layer, int):
            if layer < self.dense_layers or self.top_k >= max_pages:
                return None
            return self._select(cache, layer, q, self.top_k, self.top_k)
        k_eff = jnp.where(layer < self.dense_layers, max_pages, min(self.top_k, max_pages))
        return self._select(cache, layer, q, k_eff, max_pages)

    def _select(self, cache, layer, q, k_eff, width: int) -> Selection:
        spec = cache.spec
        ps, num_pages = spec.page_size, spec.num_pages
        view = quantized.layer_view(cache, layer)
        bt = cache.block_tables
        batch, max_pages = bt.shape
        kv_heads = view.k.codes.shape[0]
        n = cache.quant_lengths // ps  # quantized pages of each sequence
        safe = jnp.clip(bt, 0, num_pages - 1)
        kmin, kmax = kivi_key_bounds(view.k.scale[:, safe], view.k.zero[:, safe],
                                     view.k.bits)  # [H, B, M, D]
        bound = quest_page_bounds(q, jnp.swapaxes(kmin, 0, 1), jnp.swapaxes(kmax, 0, 1))
        bound = bound.reshape(batch, kv_heads, -1, max_pages).sum(axis=2)  # [B, H, M]
        cols = jnp.arange(max_pages, dtype=jnp.int32)
        bound = jnp.where(cols[None, None, :] < n[:, None, None], bound, -jnp.inf)
        _, top = jax.lax.top_k(bound, width)  # best first; non-candidates last
        n_sel = jnp.minimum(k_eff, n)  # [B]
        chosen = jnp.arange(width)[None, None, :] < n_sel[:, None, None]
        # Read the chosen pages in page order (attention does not depend on key order;
        # page order makes "every page selected" read exactly what plain attention reads).
        top = jnp.sort(jnp.where(chosen, top, max_pages), axis=2)
        table = jnp.take_along_axis(jnp.broadcast_to(bt[:, None, :], (batch, kv_heads,
                                                                       max_pages)),
                                    jnp.clip(top, 0, max_pages - 1), axis=2)
        table = jnp.where(chosen, table, -1).astype(jnp.int32)
        lengths = jnp.broadcast_to((n_sel * ps)[:, None], (batch, kv_heads)).astype(jnp.int32)
        return Selection(block_tables=table, lengths=lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KIVIH2OState:
    """Accumulated attention per cache index.

    Attributes:
      scores: float32[max_seqs, max_tokens]: token at cache index j of sequence s,
        summed over layers, KV heads and query heads; moves with its token when
        pages are evicted.
    """

    scores: Float[Array, "max_seqs max_tokens"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KIVIH2O(KIVIPolicy):
    """Page-granular H2O on a KIVI cache: lowest-mass quantized pages go, the tail stays.

    Attributes:
      budget: tokens held per sequence (quantized pages kept x page_size + tail tokens).
      sink_pages: first quantized pages never evicted (default 0, see the module doc).
      scale: attention logit scale for scoring, default 1/sqrt(head_dim).
    """

    budget: int = 1024
    sink_pages: int = 0
    scale: float | None = None

    def __post_init__(self):
        _check_int("KIVIH2O", "budget", self.budget, 1)
        _check_int("KIVIH2O", "sink_pages", self.sink_pages, 0)

    def min_budget(self, spec) -> int:
        """Smallest budget every sequence can be held to: sink pages + the largest tail."""
        return self.sink_pages * spec.page_size + quantized.tail_capacity(spec) - 1

    def init_state(self, cache: QuantizedKVCache) -> KIVIH2OState:
        _check_cache("KIVIH2O", cache)
        spec = cache.spec
        if self.budget < self.min_budget(spec):
            raise ValueError(
                f"KIVIH2O.budget={self.budget} cannot be held: the full-precision tail alone "
                f"holds up to R + page_size - 1 = {quantized.tail_capacity(spec) - 1} tokens "
                f"(R={spec.quant.residual}, page_size={spec.page_size}) plus "
                f"{self.sink_pages} sink page(s); need budget >= {self.min_budget(spec)} "
                f"(or a smaller residual R).")
        return KIVIH2OState(scores=jnp.zeros((spec.max_seqs, spec.max_tokens_per_seq),
                                             jnp.float32))

    def _probs(self, cache: QuantizedKVCache, layer: int, q, q_lengths):
        """Attention probabilities of q [B, T, Hq, D] over cache indices, summed: [B, S]."""
        view = quantized.layer_view(cache, layer)
        lengths, ql = cache.lengths, cache.quant_lengths
        k = qref.gather_dequantize(view.k.codes, view.k.scale, view.k.zero,
                                   cache.block_tables, ql, bits=view.k.bits,
                                   grouping="tokens")  # [B, H, S, D] f32, only own pages
        ring = view.tail_k.shape[2]
        j = jnp.arange(k.shape[2], dtype=jnp.int32)
        tail = jnp.swapaxes(view.tail_k, 0, 1)[:, :, j % ring].astype(jnp.float32)
        k = jnp.where((j[None, :] < ql[:, None])[:, None, :, None], k, tail)
        b, t, hq, d = q.shape
        kv_heads = k.shape[1]
        qg = q.astype(jnp.float32).reshape(b, t, kv_heads, hq // kv_heads, d)
        scale = d ** -0.5 if self.scale is None else self.scale
        logits = jnp.einsum("btkgd,bksd->btkgs", qg, k,
                            precision=jax.lax.Precision.HIGHEST) * jnp.float32(scale)
        q_pos = lengths[:, None] - q_lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
        vis = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < lengths[:, None,
                                                                                   None])
        vis &= (jnp.arange(t)[None, :] < q_lengths[:, None])[:, :, None]
        vis = vis[:, :, None, None, :]
        logits = jnp.where(vis, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(vis, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.float32(1e-30))
        return p.sum(axis=(1, 2, 3))

    def _accumulate(self, cache, scores, queries, q_lengths):
        for layer in range(cache.spec.num_layers):
            scores = scores + self._probs(cache, layer, queries[layer], q_lengths)
        return scores

    def _evict(self, cache: QuantizedKVCache, state: KIVIH2OState,
               rows: Bool[Array, " max_seqs"]):
        spec = cache.spec
        ps, max_pages = spec.page_size, spec.max_pages_per_seq
        lengths, ql = cache.lengths, cache.quant_lengths
        n_q = ql // ps
        over = lengths - self.budget
        k = jnp.where(rows & (over > 0), (over + ps - 1) // ps, 0)
        k = jnp.minimum(k, jnp.maximum(n_q - self.sink_pages, 0)).astype(jnp.int32)
        scores = state.scores
        mass = scores.reshape(spec.max_seqs, max_pages, ps).sum(axis=-1)  # [B, M]
        cols = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
        evictable = (cols >= self.sink_pages) & (cols < n_q[:, None])
        order = jnp.argsort(jnp.where(evictable, mass, jnp.inf), axis=1, stable=True)
        evict = jnp.zeros(mass.shape, bool).at[
            jnp.arange(spec.max_seqs)[:, None], order].set(cols < k[:, None])
        # Kept quantized pages first, then the evicted ones, then unused entries, each in
        # page order: truncating to the kept count then drops exactly the evicted ones.
        group = jnp.where(cols < n_q[:, None], evict.astype(jnp.int32), 2)
        perm = jnp.argsort(group * max_pages + cols, axis=1).astype(jnp.int32)
        table = cache.table
        table = dataclasses.replace(
            table, block_tables=jnp.take_along_axis(table.block_tables, perm, axis=1))
        new_q = ql - k * ps
        table, _, status = pt.truncate(table, new_q)
        new_len = lengths - k * ps
        # Scores follow their tokens: kept pages' tokens, then the tail shifted down.
        j = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :]
        src_page = jnp.take_along_axis(perm, jnp.broadcast_to(j // ps, scores.shape), axis=1)
        src = jnp.where(j < new_q[:, None], src_page * ps + j % ps, j + (k * ps)[:, None])
        moved = jnp.take_along_axis(scores, jnp.clip(src, 0, scores.shape[1] - 1), axis=1)
        moved = jnp.where(j < new_len[:, None], moved, 0.0)

        def rotate(tail):  # position p must stay in slot p mod ring after the shift
            ring = tail.a.shape[3]
            idx = (jnp.arange(ring)[None, :] + (k * ps)[:, None]) % ring  # [B, ring]
            return jax.tree.map(
                lambda x: jnp.take_along_axis(x, idx[None, None, :, :, None], axis=3), tail)

        tail = jax.lax.cond(jnp.any(k > 0), rotate, lambda t: t, cache.tail)
        cache = dataclasses.replace(
            cache, paged=dataclasses.replace(cache.paged, table=table), tail=tail,
            lengths=new_len.astype(jnp.int32),
            pending=jnp.where((k > 0)[None, :], 0, cache.pending))
        return cache, KIVIH2OState(scores=moved), status

    def after_prefill(
        self,
        cache: QuantizedKVCache,
        state: KIVIH2OState,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[QuantizedKVCache, KIVIH2OState, pt.AllocStatus]:
        fresh = (q_lengths > 0) & (cache.lengths == q_lengths)  # a new sequence in this slot
        scores = jnp.where(fresh[:, None], 0.0, state.scores)
        scores = self._accumulate(cache, scores, queries, q_lengths)
        return self._evict(cache, KIVIH2OState(scores=scores), q_lengths > 0)

    def after_step(
        self,
        cache: QuantizedKVCache,
        state: KIVIH2OState,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[QuantizedKVCache, KIVIH2OState, pt.AllocStatus]:
        rows = active_rows(cache, active)
        scores = self._accumulate(cache, state.scores, queries[:, :, None],
                                  rows.astype(jnp.int32))
        return self._evict(cache, KIVIH2OState(scores=scores), rows)
