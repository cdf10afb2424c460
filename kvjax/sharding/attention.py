"""Attention over a sharded paged cache: each device attends over its pages, LSE-merged.

`ShardedAttention(plan)` is one more attention implementation (`impl=`): the
registry hands it every op (full-precision, MLA, KIVI-quantized, and decode over a
`Selection`), and it runs the op inside `jax.shard_map`. Every device holds its
shard of the pools (its KV heads, its range of page ids) and runs the ordinary
`kvjax.attention` op (`impl` passed through: reference, XLA, CPU kernels, or Pallas
with plain `interpret=True` on CPU) on the pages it holds:

  * Pages are found by id, not by position: a device takes, in column order, the
    block-table entries (or selected pages) whose ids fall in its range, made local,
    and the tokens they hold. Decode attention does not depend on key order, so any
    page layout gives the right result; the layout `init_sharded_cache` builds (a
    sequence's pages on its data shard, round-robin over context shards) keeps the
    work balanced and the pools in place.
  * Chunked prefill is causal: when a row's pages may be spread over devices (the
    context strategy, or a cache not laid out for the plan) each query becomes a
    decode row that reads the prefix of the device's pages it can see (all but the
    last page of a sequence are full, so the visible tokens are a prefix of the
    compacted list). When every row's pages sit on one device the prefill op runs
    directly.
  * DeepSeek Sparse Attention: each device scores the tokens of the indexer-key pages
    it holds (-inf elsewhere) and a `pmax` over the page axes gives every device the
    scores of all tokens (each lives on one device), so every device selects the same
    tokens; attention over them gathers, per device, the selected tokens its pages
    hold, and the partial results are merged like the dense ones (a KIVI tail ring,
    replicated, is added after the merge). Queries are replicated over `model`.
  * A KIVI cache's quantized pages are attended per device like full-precision
    pages (with an empty tail); after the merge, every device adds the full-precision
    tail of its heads (`merge_with_tail`), which is replicated over the page axes.

The partial (out, lse) pairs are merged over the page axes with `pmax` and `psum`
(the log-sum-exp merge, over N parts at once). Only `[batch, heads, width]` outputs
and `[batch, heads]` LSEs cross devices; the pools never move.

Query heads are split over `model` when its size divides q_heads; if the KV heads
are not split (replicate fallback, MLA), each device slices the KV heads its query
heads read. A sliding window needs key positions: it is supported without the
context strategy, on a cache laid out by `init_sharded_cache` (what
`kvjax.generate` builds).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from kernels_pallas.quantized_attention import reference as qref
from kvjax import attention as kattn
from kvjax.attention import sparse
from kvjax.attention.pages import QuantizedLayerView, QuantLayer, Selection
from kvjax.sharding.mesh import ShardingPlan

__all__ = [
    "ShardedAttention",
    "sharded_paged_decode_attention",
    "sharded_paged_prefill_attention",
    "sharded_mla_decode_attention",
    "sharded_mla_prefill_attention",
]

_NEG_INF = float("-inf")
# Position given to queries that see every key of a device's compacted pages.
_SEES_ALL = 1 << 30


def _merge(out, lse, axes):
    """N-way log-sum-exp merge of per-device partial results over mesh `axes`."""
    if not axes:
        return out, lse
    m = lax.pmax(lse, axes)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    w = jnp.exp(lse - m_safe)  # 0 for devices that saw no key
    den = lax.psum(w, axes)
    num = lax.psum(out.astype(jnp.float32) * w[..., None], axes)
    out = num / jnp.where(den == 0.0, 1.0, den)[..., None]
    lse = jnp.where(den == 0.0, _NEG_INF, m_safe + jnp.log(jnp.where(den == 0.0, 1.0, den)))
    return out, lse


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one call is laid out on the mesh (all static)."""

    q_split: bool        # query heads over "model"
    pool_split: bool     # pool heads over "model"
    kv_local: int        # KV heads each device attends with (GQA)
    hq_local: int        # query heads per device
    group: int           # query heads per KV head


def _layout(plan: ShardingPlan, q_heads: int, kv_heads: int, mla: bool) -> _Layout:
    m = plan.axis_size("model")
    pool_split = (not mla and "heads" in plan.strategies and m > 1 and kv_heads % m == 0)
    group = q_heads // kv_heads
    q_split = m > 1 and q_heads % m == 0
    hq_local = q_heads // m if q_split else q_heads
    if q_split and not pool_split and not mla and hq_local % group and group % hq_local:
        q_split, hq_local = False, q_heads  # no aligned slice of KV heads: replicate queries
    kv_local = kv_heads // m if pool_split else max(hq_local // group, 1)
    if not q_split:
        kv_local = kv_heads
    return _Layout(q_split, pool_split, kv_local, hq_local, group)


def _local_pages(bt, n_tokens, first, n, page_size):
    """A device's pages among `bt` (global ids) holding `n_tokens` tokens, compacted.

    Returns (local table [..., cols] with local ids first in column order and -1 after,
    the tokens they hold [...], the mask of used local columns in the original order,
    and the tokens of each original column [..., cols]).
    """
    cols = bt.shape[-1]
    col = jnp.arange(cols, dtype=jnp.int32)
    tok = jnp.clip(n_tokens[..., None] - col * page_size, 0, page_size)
    local = (tok > 0) & (bt >= first) & (bt < first + n)
    order = jnp.argsort(jnp.where(local, col, cols + col), axis=-1)
    bt_l = jnp.take_along_axis(jnp.where(local, bt - first, -1), order, axis=-1)
    return bt_l.astype(jnp.int32), jnp.sum(jnp.where(local, tok, 0), axis=-1), local


def _seen(local, lim, page_size):
    """Tokens of the local columns below each query's limit `lim` [batch, q_len]."""
    col = jnp.arange(local.shape[-1], dtype=jnp.int32)
    per = jnp.clip(lim[:, :, None] - col * page_size, 0, page_size)
    return jnp.sum(jnp.where(local[:, None, :], per, 0), axis=-1)


def _whole(pools, layer):
    """One layer's pools `[heads, pages, rows, cols]` as 5-D whole pools, and the layer."""
    if layer is None:
        return tuple(p[None] for p in pools), jnp.zeros((), jnp.int32)
    return tuple(pools), jnp.asarray(layer, jnp.int32)


# The jitted shard_map of each op body, so that an eager call (outside an enclosing jit)
# compiles once per op, shapes and options instead of at every call. A body is keyed by
# its code and the values it closes over (dicts by their items). A body is not cached when
# it closes over something unhashable (an array, a tracer) or over a function that has a
# closure of its own (made per call: its values are not in the key).
_JITTED: dict = {}
_JITTED_MAX = 256


def _closure_key(fn):
    vals = []
    for cell in fn.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, dict):
            try:
                v = tuple(sorted(v.items()))
            except TypeError:  # keys that do not sort
                return None
        if callable(v) and not isinstance(v, type) and (
                getattr(v, "__closure__", None) or not hasattr(v, "__code__")):
            return None
        try:
            hash(v)
        except TypeError:
            return None
        vals.append(v)
    return fn.__code__, tuple(vals)


def _jitted_map(attn, body, in_specs, out_specs):
    """jax.jit(shard_map(body)) over `attn`'s mesh, from the cache when it can be."""
    def build():
        return jax.jit(jax.shard_map(lambda a, b, c: body(a, b, c), mesh=attn.plan.mesh,
                                     in_specs=in_specs, out_specs=out_specs, check_vma=False))

    closure = _closure_key(body)
    if closure is None:
        return build()
    key = (attn, closure, jax.tree.structure(in_specs), tuple(jax.tree.leaves(in_specs)),
           jax.tree.structure(out_specs), tuple(jax.tree.leaves(out_specs)))
    try:
        fn = _JITTED.get(key)
    except TypeError:  # an unhashable spec
        return build()
    if fn is None:
        if len(_JITTED) >= _JITTED_MAX:
            _JITTED.clear()
        fn = _JITTED[key] = build()
    return fn


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An `impl=` for `kvjax.attention` ops that runs them sharded under `plan`.

    Pass it wherever an attention `impl` string goes (a model's forward, the decode
    loop): the op validates its inputs as usual, then runs `impl` on every device's
    shard inside `jax.shard_map`. Hashable, so it can be a static argument of
    `jax.jit`. The pools should be laid out as `kvjax.sharding.cache_shardings` says
    (otherwise the compiler moves them into that layout at every call).

    Args:
      plan: the mesh and strategies.
      impl: the per-device implementation, one of `kvjax.attention.IMPLS`.
    """

    plan: ShardingPlan
    impl: str = "auto"

    # The registry hands this impl a cache's whole pools and the layer index.
    takes_layer = True

    def __post_init__(self):
        if self.impl not in kattn.IMPLS:
            raise ValueError(f"ShardedAttention: impl must be one of {kattn.IMPLS}, got "
                             f"{self.impl!r}.")

    def resolve_attention(self, op: str, interpret: bool | None = None):
        """The function the registry calls for `op` (the op's own signature).

        `interpret` goes to the per-device op (Pallas kernels). It must be a bool or None:
        the TPU interpreter (`pltpu.InterpretParams`) hangs inside `shard_map`, while plain
        `interpret=True` works there.
        """
        if interpret is not None and not isinstance(interpret, bool):
            raise ValueError(
                f"ShardedAttention: interpret must be True, False or None inside shard_map, got "
                f"{type(interpret).__name__} (the TPU interpreter hangs inside shard_map)."
            )
        fns = {
            "paged_decode_attention": self._paged,
            "paged_prefill_attention": self._paged,
            "mla_decode_attention": self._mla,
            "mla_prefill_attention": self._mla,
            "quantized_attention": self._quantized,
            "quantized_mla_attention": self._quantized_mla,
            "selected_decode_attention": self._selected,
            "mla_selected_decode_attention": self._mla_selected,
            "quantized_selected_decode_attention": self._quantized_selected,
            "quantized_mla_selected_decode_attention": self._quantized_mla_selected,
            "indexer_scores": self._indexer_scores,
            "mla_sparse_attention": self._mla_sparse,
            "quantized_mla_sparse_attention": self._quantized_mla_sparse,
        }
        if op not in fns:
            raise NotImplementedError(f"ShardedAttention: no sharded version of {op}.")
        return functools.partial(fns[op], interpret=interpret)

    # -- the mesh ----------------------------------------------------------------------------

    def _shard_info(self, n_local):
        """(first local page id, shard index) inside shard_map."""
        plan = self.plan
        d = lax.axis_index("data") if plan.data_shards > 1 else 0
        c = lax.axis_index("context") if plan.context_shards > 1 else 0
        return (d * plan.context_shards + c) * n_local

    def _page_entry(self):
        axes = self.plan.page_axes
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def _check_window(self, sliding_window):
        if sliding_window is not None and self.plan.context_shards > 1:
            raise NotImplementedError(
                "ShardedAttention: sliding_window is not supported with the 'context' strategy "
                "(a window in positions is not a prefix of a device's pages); use 'heads' or "
                "'sequences' for sliding-window layers.")

    def _heads(self, lay: _Layout, x, axis: int):
        """The KV heads this device's query heads read, from replicated heads (axis)."""
        if not lay.q_split or lay.pool_split:
            return x
        start = (lax.axis_index("model") * lay.hq_local) // lay.group
        return lax.dynamic_slice_in_dim(x, start, lay.kv_local, axis=axis)

    def _run(self, body, qs, pools, others, *, lay: _Layout, mla: bool, out_dims: int):
        """shard_map of `body(qs, pools, others) -> (out, lse)` with the plan's specs.

        qs: query arrays, heads at axis -2 (split over model when lay.q_split).
        pools: 5-D pools [layers, heads, pages, rows, cols] (heads over model when
          lay.pool_split, pages over the page axes), or ("tail", array) pairs for tails
          [heads, batch, ...] (heads over model when lay.pool_split, else replicated).
        others: replicated pytree.
        """
        heads = "model" if lay.q_split else None
        pool_heads = "model" if lay.pool_split else None
        page = self._page_entry()

        def q_spec(x):
            return P(*([None] * (x.ndim - 2)), heads, None)

        def pool_spec(p):
            if isinstance(p, tuple):  # ("tail", x): heads first
                return P(pool_heads, *([None] * (p[1].ndim - 1)))
            return P(None, None if mla else pool_heads, page, None, None)

        arrays = [p[1] if isinstance(p, tuple) else p for p in pools]
        in_specs = (tuple(q_spec(x) for x in qs), tuple(pool_spec(p) for p in pools),
                    jax.tree.map(lambda _: P(), others))
        out_spec = (P(*([None] * (out_dims - 2)), heads, None), P(*([None] * (out_dims - 2)),
                                                                   heads))
        # check_vma=False: the per-device ops are written for plain arrays (the XLA path's
        # while_loop carries start device-invariant and become varying), and the outputs
        # are made invariant over the page axes by the psum merge.
        # Under jit even when called eagerly: an eager shard_map runs (and compiles) its
        # body one primitive at a time, a hundred small SPMD programs per call.
        fn = _jitted_map(self, body, in_specs, out_spec)
        out, lse = fn(tuple(qs), tuple(arrays), others)
        return out.astype(qs[0].dtype), lse

    # -- full-precision pages -----------------------------------------------------------------

    def _dense(self, qs, pools, lengths, block_tables, q_lengths, layer, *, mla, kw, interpret):
        """Decode (q_lengths None) or chunked prefill over full-precision 5-D pools."""
        plan = self.plan
        kv_heads = 1 if mla else pools[0].shape[1]
        lay = _layout(plan, qs[0].shape[-2], kv_heads, mla)
        ps = pools[0].shape[3]
        decode_op = kattn.mla_decode_attention if mla else kattn.paged_decode_attention
        prefill_op = kattn.mla_prefill_attention if mla else kattn.paged_prefill_attention
        opts = dict(kw, impl=self.impl, interpret=interpret)

        def body(qs_l, pools_l, others):
            lens, bt, qls, layer_l = others
            if not mla:
                pools_l = tuple(self._heads(lay, p, 1) for p in pools_l)
            n = pools_l[0].shape[2]

            def call(op, q_args, *rest):
                return op(*q_args, *pools_l, *rest, layer=layer_l, **opts)

            if plan.page_shards == 1:  # no page axis: the op runs as is
                if qls is None:
                    return call(decode_op, qs_l, lens, bt)
                return call(prefill_op, qs_l, lens, bt, qls)
            bt_l, lens_l, local = _local_pages(bt, lens, self._shard_info(n), n, ps)
            if qls is None:
                return _merge(*call(decode_op, qs_l, lens_l, bt_l), plan.page_axes)

            def direct(_):
                out, lse = call(prefill_op, qs_l, lens_l, bt_l, jnp.where(lens_l > 0, qls, 0))
                return out.astype(qs_l[0].dtype), lse

            def rows(_):
                batch, q_len = qs_l[0].shape[:2]
                t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
                pos = lens[:, None] - qls[:, None] + t
                lim = jnp.where(t < qls[:, None], jnp.minimum(pos + 1, lens[:, None]), 0)
                seen = _seen(local, lim, ps).reshape(-1)
                flat = [x.reshape(batch * q_len, *x.shape[2:]) for x in qs_l]
                out, lse = call(decode_op, flat, seen, jnp.repeat(bt_l, q_len, axis=0))
                return (out.reshape(batch, q_len, *out.shape[1:]).astype(qs_l[0].dtype),
                        lse.reshape(batch, q_len, *lse.shape[1:]))

            if plan.context_shards > 1:
                out, lse = rows(None)
            else:  # when one device holds each row's pages (or none), the prefill op runs
                whole = jnp.all((lens_l == 0) | (lens_l == lens))
                out, lse = lax.cond(whole, direct, rows, None)
            return _merge(out, lse, plan.page_axes)

        others = (lengths.astype(jnp.int32), block_tables.astype(jnp.int32),
                  None if q_lengths is None else q_lengths.astype(jnp.int32), layer)
        return self._run(body, qs, pools, others, lay=lay, mla=mla, out_dims=qs[0].ndim)

    def _paged(self, q, k_pages, v_pages, lengths, block_tables, q_lengths=None, *,
               scale=None, soft_cap=None, sliding_window=None, layer=None, interpret=None):
        self._check_window(sliding_window)
        pools, layer = _whole((k_pages, v_pages), layer)
        kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
        return self._dense((q,), pools, lengths, block_tables, q_lengths, layer, mla=False,
                           kw=kw, interpret=interpret)

    def _mla(self, q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables,
             q_lengths=None, *, scale, layer=None, interpret=None):
        if layer is None:  # one layer [pages, page_size, width]: add the head axis
            latent_pages, rope_pages = latent_pages[None], rope_pages[None]
        pools, layer = _whole((latent_pages, rope_pages), layer)
        return self._dense((q_latent, q_rope), pools, lengths, block_tables, q_lengths, layer,
                           mla=True, kw=dict(scale=scale), interpret=interpret)

    # -- selections of full-precision pages ---------------------------------------------------

    def _select_local(self, selection: Selection, first, n, ps, lay: _Layout | None):
        bt, ln = selection.block_tables, selection.lengths
        if lay is not None and bt.shape[1] > 1:  # per KV head: this device's heads
            if lay.pool_split:
                start = lax.axis_index("model") * lay.kv_local
                bt = lax.dynamic_slice_in_dim(bt, start, lay.kv_local, axis=1)
                ln = lax.dynamic_slice_in_dim(ln, start, lay.kv_local, axis=1)
            else:
                bt, ln = self._heads(lay, bt, 1), self._heads(lay, ln, 1)
        if self.plan.page_shards == 1:
            return Selection(block_tables=bt, lengths=ln)
        bt_l, ln_l, _ = _local_pages(bt, ln, first, n, ps)
        return Selection(block_tables=bt_l, lengths=ln_l)

    def _selected(self, q, k_pages, v_pages, selection, *, scale=None, soft_cap=None,
                  layer=None, interpret=None):
        (k_pages, v_pages), layer = _whole((k_pages, v_pages), layer)
        lay = _layout(self.plan, q.shape[-2], k_pages.shape[1], False)
        ps = k_pages.shape[3]

        def body(qs_l, pools_l, others):
            sel, layer_l = others
            pools_l = tuple(self._heads(lay, p, 1) for p in pools_l)
            first = self._shard_info(pools_l[0].shape[2])
            sel_l = self._select_local(sel, first, pools_l[0].shape[2], ps, lay)
            out, lse = kattn.selected_decode_attention(
                qs_l[0], *pools_l, sel_l, scale=scale, soft_cap=soft_cap, impl=self.impl,
                interpret=interpret, layer=layer_l)
            return _merge(out, lse, self.plan.page_axes)

        return self._run(body, (q,), (k_pages, v_pages), (selection, layer), lay=lay, mla=False,
                         out_dims=3)

    def _mla_selected(self, q_latent, q_rope, latent_pages, rope_pages, selection, *, scale,
                      layer=None, interpret=None):
        if layer is None:
            latent_pages, rope_pages = latent_pages[None], rope_pages[None]
        (latent_pages, rope_pages), layer = _whole((latent_pages, rope_pages), layer)
        lay = _layout(self.plan, q_latent.shape[-2], 1, True)
        ps = latent_pages.shape[3]

        def body(qs_l, pools_l, others):
            sel, layer_l = others
            first = self._shard_info(pools_l[0].shape[2])
            sel_l = self._select_local(sel, first, pools_l[0].shape[2], ps, None)
            out, lse = kattn.mla_selected_decode_attention(
                *qs_l, *pools_l, sel_l, scale=scale, impl=self.impl, interpret=interpret,
                layer=layer_l)
            return _merge(out, lse, self.plan.page_axes)

        return self._run(body, (q_latent, q_rope), (latent_pages, rope_pages),
                         (selection, layer), lay=lay, mla=True, out_dims=3)

    # -- KIVI pages ---------------------------------------------------------------------------

    def _quant_pools(self, view: QuantizedLayerView):
        """The view's pools as 5-D arrays and the layer indexes (whole pools or one layer)."""
        if view.layer is None:
            k = tuple(x[None] for x in view.k.arrays)
            v = tuple(x[None] for x in view.v.arrays) if not view.is_mla else (view.v[None],)
            return k, v, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
        v = view.v.arrays if not view.is_mla else (view.v,)
        rope_layer = jnp.asarray(view.layer, jnp.int32)
        return view.k.arrays, v, jnp.asarray(view.k.layer, jnp.int32), rope_layer

    def _quantized_view_call(self, q_parts, view: QuantizedLayerView, selection, q_lengths,
                             *, scale, soft_cap, sliding_window, interpret):
        """Any KIVI op: quantized pages per device (empty tail), merged; then the tail."""
        plan = self.plan
        mla = view.is_mla
        if sliding_window is not None and plan.page_shards > 1:
            raise NotImplementedError(
                "ShardedAttention: a sliding window over KIVI pages needs key positions; it "
                "is not supported when the pages are sharded ('sequences' / 'context').")
        kv_heads = 1 if mla else view.k.codes.shape[-4]
        lay = _layout(plan, q_parts[0].shape[-2], kv_heads, mla)
        k_arr, v_arr, layer, rope_layer = self._quant_pools(view)
        ps = k_arr[0].shape[3]
        q_len = q_parts[0].shape[1]
        decode = q_len == 1

        def body(qs_l, arrays, others):
            sel, bt, ql, lens, qls, layer_l, rope_l = others
            pools_l, tails = arrays[:-2], arrays[-2:]
            if not mla:
                pools_l = tuple(self._heads(lay, p, 1) for p in pools_l)
                tails = tuple(self._heads(lay, t, 0) for t in tails)
            n = pools_l[0].shape[2]
            first = self._shard_info(n)
            t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
            q_pos = jnp.where(t < qls[:, None], lens[:, None] - qls[:, None] + t, -1)
            k = dataclasses.replace(view.k, codes=pools_l[0], scale=pools_l[1],
                                    zero=pools_l[2], layer=layer_l)
            v = pools_l[3] if mla else dataclasses.replace(
                view.v, codes=pools_l[3], scale=pools_l[4], zero=pools_l[5], layer=layer_l)
            opts = dict(scale=scale, impl=self.impl, interpret=interpret)
            if not mla:
                opts["soft_cap"] = soft_cap
            if plan.page_shards == 1 and sel is None:
                # No page axis: the op runs with the real tail, nothing to merge.
                local = QuantizedLayerView(k=k, v=v, tail_k=tails[0], tail_v=tails[1],
                                           block_tables=bt, quant_lengths=ql, lengths=lens,
                                           layer=rope_l)
                if mla:
                    return kattn.quantized_mla_prefill_attention(*qs_l, local, qls, **opts)
                return kattn.quantized_prefill_attention(*qs_l, local, qls,
                                                         sliding_window=sliding_window, **opts)
            batch = bt.shape[0]
            if sel is not None:
                sel_l = self._select_local(sel, first, n, ps, None if mla else lay)
                big = jnp.full((batch,), _SEES_ALL, jnp.int32)
                empty = QuantizedLayerView(
                    k=k, v=v, tail_k=tails[0][:, :, :1], tail_v=tails[1][:, :, :1],
                    block_tables=bt, quant_lengths=big, lengths=big, layer=rope_l)
                if mla:
                    out, lse = kattn.quantized_mla_selected_decode_attention(
                        qs_l[0][:, 0], qs_l[1][:, 0], empty, sel_l, **opts)
                else:
                    out, lse = kattn.quantized_selected_decode_attention(qs_l[0][:, 0], empty,
                                                                         sel_l, **opts)
                out, lse = out[:, None], lse[:, None]
            else:
                bt_l, ql_l, local = _local_pages(bt, ql, first, n, ps)
                if decode:
                    rows_q, rows_bt, rows_n = qs_l, bt_l, ql_l
                else:  # each query a decode row over the local prefix it sees
                    lim = jnp.where(q_pos >= 0, jnp.minimum(q_pos + 1, ql[:, None]), 0)
                    rows_n = _seen(local, lim, ps).reshape(-1)
                    rows_q = tuple(x.reshape(batch * q_len, 1, *x.shape[2:]) for x in qs_l)
                    rows_bt = jnp.repeat(bt_l, q_len, axis=0)
                rows = rows_bt.shape[0]
                empty = QuantizedLayerView(
                    k=k, v=v, tail_k=jnp.zeros((tails[0].shape[0], rows, 1, tails[0].shape[-1]),
                                               tails[0].dtype),
                    tail_v=jnp.zeros((tails[1].shape[0], rows, 1, tails[1].shape[-1]),
                                     tails[1].dtype),
                    block_tables=rows_bt, quant_lengths=rows_n, lengths=rows_n, layer=rope_l)
                ones = jnp.minimum(rows_n, 1)
                if mla:
                    out, lse = kattn.quantized_mla_prefill_attention(*rows_q, empty, ones,
                                                                     **opts)
                else:
                    out, lse = kattn.quantized_prefill_attention(*rows_q, empty, ones, **opts)
                out = out.reshape(batch, q_len, *out.shape[2:])
                lse = lse.reshape(batch, q_len, *lse.shape[2:])
            out, lse = _merge(out, lse, plan.page_axes)
            if mla:
                out, lse = qref.mla_merge_with_tail(out, lse, *qs_l, tails[0][0], tails[1][0],
                                                    ql, lens, q_pos, scale=scale)
            else:
                out, lse = qref.merge_with_tail(out, lse, qs_l[0], *tails, ql, lens, q_pos,
                                                scale=scale, soft_cap=soft_cap,
                                                sliding_window=sliding_window)
            return out, lse

        if q_lengths is None:
            q_lengths = jnp.minimum(view.lengths, 1).astype(jnp.int32)
        others = (selection, view.block_tables.astype(jnp.int32),
                  view.quant_lengths.astype(jnp.int32), view.lengths.astype(jnp.int32),
                  q_lengths.astype(jnp.int32), layer, rope_layer)
        pools = (*k_arr, *v_arr, ("tail", view.tail_k), ("tail", view.tail_v))
        return self._run(body, q_parts, pools, others, lay=lay, mla=mla, out_dims=4)

    def _view(self, k_arrays, v_arrays, tail_k, tail_v, quant_lengths, lengths, block_tables,
              bits, mla, layer, rope_layer=None):
        k = QuantLayer(*k_arrays, bits=bits[0], grouping="tokens" if not mla else "channels",
                       layer=layer)
        v = v_arrays[0] if mla else QuantLayer(*v_arrays, bits=bits[1], grouping="channels",
                                               layer=layer)
        return QuantizedLayerView(k=k, v=v, tail_k=tail_k, tail_v=tail_v,
                                  block_tables=block_tables, quant_lengths=quant_lengths,
                                  lengths=lengths, layer=rope_layer if mla else layer)

    def _quantized(self, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k,
                   tail_v, quant_lengths, lengths, block_tables, q_pos, *, k_bits, v_bits,
                   scale, soft_cap=None, sliding_window=None, layer=None, interpret=None):
        self._check_window(sliding_window)
        view = self._view((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), tail_k, tail_v,
                          quant_lengths, lengths, block_tables, (k_bits, v_bits), False, layer)
        q_lengths = jnp.sum(q_pos >= 0, axis=1).astype(jnp.int32)
        return self._quantized_view_call((q,), view, None, q_lengths, scale=scale,
                                         soft_cap=soft_cap, sliding_window=sliding_window,
                                         interpret=interpret)

    def _quantized_mla(self, q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, tail_c,
                       tail_rope, quant_lengths, lengths, block_tables, q_pos, *, bits, scale,
                       layer=None, rope_layer=None, interpret=None):
        if layer is None:  # one layer's pools: add the single head axis
            c_codes, c_scale, c_zero, rope_pages = (x[None] for x in (c_codes, c_scale, c_zero,
                                                                      rope_pages))
        view = self._view((c_codes, c_scale, c_zero), (rope_pages,), tail_c[None],
                          tail_rope[None], quant_lengths, lengths, block_tables, (bits,), True,
                          layer, rope_layer)
        q_lengths = jnp.sum(q_pos >= 0, axis=1).astype(jnp.int32)
        return self._quantized_view_call((q_latent, q_rope), view, None, q_lengths, scale=scale,
                                         soft_cap=None, sliding_window=None,
                                         interpret=interpret)

    def _quantized_selected(self, q, view, selection, *, scale, soft_cap=None, interpret=None):
        out, lse = self._quantized_view_call((q[:, None],), view, selection, None, scale=scale,
                                             soft_cap=soft_cap, sliding_window=None,
                                             interpret=interpret)
        return out[:, 0], lse[:, 0]

    def _quantized_mla_selected(self, q_latent, q_rope, view, selection, *, scale,
                                interpret=None):
        out, lse = self._quantized_view_call((q_latent[:, None], q_rope[:, None]), view,
                                             selection, None, scale=scale, soft_cap=None,
                                             sliding_window=None, interpret=interpret)
        return out[:, 0], lse[:, 0]


    # -- DeepSeek Sparse Attention ---------------------------------------------------------

    def _page_map(self, body, arrays, pools, others, out_specs):
        """shard_map of `body(arrays, pools, others)`: `arrays` and `others` replicated,
        `pools` 5-D with their pages over the page axes."""
        page = self._page_entry()
        in_specs = (jax.tree.map(lambda _: P(), arrays),
                    tuple(P(None, None, page, None, None) for _ in pools),
                    jax.tree.map(lambda _: P(), others))
        return _jitted_map(self, body, in_specs, out_specs)(arrays, tuple(pools), others)

    def _indexer_scores(self, q, weights, key_pages, block_tables, key_lengths, q_pos, *,
                        scale, layer=None, interpret=None):
        del interpret
        if layer is None:
            key_pages = key_pages[None]
        (key_pages,), layer = _whole((key_pages,), layer)
        axes = self.plan.page_axes

        def body(arrays, pools, others):
            n = pools[0].shape[2]
            s = sparse._indexer_scores(*arrays, pools[0], *others[:3], scale=scale,
                                       layer=others[3], page_range=(self._shard_info(n), n))
            return lax.pmax(s, axes) if axes else s

        others = (block_tables.astype(jnp.int32), key_lengths.astype(jnp.int32),
                  q_pos.astype(jnp.int32), layer)
        return self._page_map(body, (q, weights), (key_pages,), others, P())

    def _mla_sparse(self, q_latent, q_rope, latent_pages, rope_pages, block_tables, selection,
                    *, scale, layer=None, interpret=None):
        del interpret
        if layer is None:
            latent_pages, rope_pages = latent_pages[None], rope_pages[None]
        pools, layer = _whole((latent_pages, rope_pages), layer)

        def body(arrays, pools, others):
            n = pools[0].shape[2]
            out, lse = sparse._mla_sparse(*arrays, *pools, *others[:2], scale=scale,
                                          layer=others[2], page_range=(self._shard_info(n), n))
            return _merge(out, lse, self.plan.page_axes)

        others = (block_tables.astype(jnp.int32), selection, layer)
        out, lse = self._page_map(body, (q_latent, q_rope), pools, others, (P(), P()))
        return out.astype(q_latent.dtype), lse

    def _quantized_mla_sparse(self, q_latent, q_rope, view, selection, *, scale,
                              interpret=None):
        del interpret
        k_arr, v_arr, layer, rope_layer = self._quant_pools(view)

        def body(arrays, pools, others):
            bt, ql, lens, sel, layer_l, rope_l = others
            n = pools[0].shape[2]
            k = dataclasses.replace(view.k, codes=pools[0], scale=pools[1], zero=pools[2],
                                    layer=layer_l)
            local = QuantizedLayerView(k=k, v=pools[3], tail_k=arrays[2], tail_v=arrays[3],
                                       block_tables=bt, quant_lengths=ql, lengths=lens,
                                       layer=rope_l)
            out, lse = sparse._quantized_mla_sparse(
                arrays[0], arrays[1], local, sel, scale=scale,
                page_range=(self._shard_info(n), n), with_tail=False)
            return _merge(out, lse, self.plan.page_axes)

        others = (view.block_tables.astype(jnp.int32), view.quant_lengths.astype(jnp.int32),
                  view.lengths.astype(jnp.int32), selection, layer, rope_layer)
        # The tails ride along unused inside (the local view needs arrays of their shape).
        tails = (view.tail_k[:, :, :1], view.tail_v[:, :, :1])
        out, lse = self._page_map(body, (q_latent, q_rope, *tails), (*k_arr, *v_arr), others,
                                  (P(), P()))
        tail = sparse._tail_part(q_latent, q_rope, view, selection.positions, scale)
        out, lse = kattn.merge_attention_states(out, lse, *tail)
        return out.astype(q_latent.dtype), lse

def sharded_paged_decode_attention(
    plan: ShardingPlan,
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """`kvjax.attention.paged_decode_attention` on a pool sharded under `plan`.

    Same arguments and results; the pools should carry `cache_shardings`'
    layout. Works eagerly and under `jax.jit`.
    """
    return kattn.paged_decode_attention(
        q, k_pages, v_pages, lengths, block_tables, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, impl=ShardedAttention(plan, impl))


def sharded_paged_prefill_attention(
    plan: ShardingPlan,
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """`kvjax.attention.paged_prefill_attention` (chunked prefill) on a sharded pool."""
    return kattn.paged_prefill_attention(
        q, k_pages, v_pages, lengths, block_tables, q_lengths, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, impl=ShardedAttention(plan, impl))


def sharded_mla_decode_attention(
    plan: ShardingPlan,
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    impl: str = "auto",
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """`kvjax.attention.mla_decode_attention` on latent pages sharded by pages."""
    return kattn.mla_decode_attention(
        q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, scale=scale,
        impl=ShardedAttention(plan, impl))


def sharded_mla_prefill_attention(
    plan: ShardingPlan,
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float,
    impl: str = "auto",
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """`kvjax.attention.mla_prefill_attention` on latent pages sharded by pages."""
    return kattn.mla_prefill_attention(
        q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, q_lengths,
        scale=scale, impl=ShardedAttention(plan, impl))
