"""Attention over a sharded paged cache: each device attends over its pages, LSE-merged.

Inside `jax.shard_map` every device holds its shard of one layer's pools
(its KV heads, its range of page ids) and runs the ordinary `kvjax.attention`
op (`impl` passed through: reference, XLA or Pallas with plain
`interpret=True` on CPU) on the pages it holds:

  * its block-table entries are translated to local page ids; rows whose
    pages live on another data shard get length 0 (they return lse -inf);
  * under `context` (pages of a sequence round-robin over C devices) a
    device compacts the columns j = c, c + C, ... it holds; these are a
    sequence's tokens in position order, full pages first, so the tokens a
    query at position p sees form a prefix of the compacted list. Decode
    passes that prefix's length. Chunked prefill passes each query as a
    decode row with its own prefix length (causal masking by count).

The partial (out, lse) pairs are merged over the page axes with `pmax` and
`psum` (the log-sum-exp merge of `kernels_pallas/merge.py`, over N parts
at once). Only `[batch, heads, width]` outputs and `[batch, heads]` LSEs
cross devices; the pools never move.

Query heads are split over `model` when its size divides q_heads; if the KV
heads are not split (replicate fallback, MLA), each device slices the KV
heads its query heads read.

Batch rows are not split over `data`: the model code may pass any rows
(`seq_ids`), so every device takes every row and gives the rows of other data
shards length 0. The per-device ops stop at the longest row they see, so those
rows cost little; a kernel that skips them entirely is future work.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from kvjax import attention as kv_attention
from kvjax.cache.sharded_table import tokens_on_shard
from kvjax.sharding.mesh import ShardingPlan

__all__ = [
    "ShardedAttention",
    "sharded_paged_decode_attention",
    "sharded_paged_prefill_attention",
    "sharded_mla_decode_attention",
    "sharded_mla_prefill_attention",
]

_NEG_INF = float("-inf")


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


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An `impl=` for `kvjax.attention` ops that runs them sharded under `plan`.

    Pass it wherever an attention `impl` string goes (e.g. a model's
    `forward(..., impl=ShardedAttention(plan))`): the op validates its inputs
    as usual, then runs `impl` on every device's shard inside `jax.shard_map`.
    Hashable, so it can be a static argument of `jax.jit`. The pools must be
    laid out as `kvjax.sharding.cache_shardings` says (the compiler reshards
    anything else, which would move the pool).

    Args:
      plan: the mesh and strategies.
      impl: the per-device implementation, one of `kvjax.attention.IMPLS`.
    """

    plan: ShardingPlan
    impl: str = "auto"

    def __post_init__(self):
        if self.impl not in kv_attention.IMPLS:
            raise ValueError(f"ShardedAttention: impl must be one of {kv_attention.IMPLS}, got "
                             f"{self.impl!r}.")

    def resolve_attention(self, op: str, interpret: bool | None = None):
        """The function `kvjax.attention` calls for `op` (same signature as the reference).

        `interpret` goes to the per-device op (Pallas kernels). It must be a bool or None:
        the TPU interpreter (`pltpu.InterpretParams`) hangs inside `shard_map` in jax
        0.10, while plain `interpret=True` works there.
        """
        if interpret is not None and not isinstance(interpret, bool):
            raise ValueError(
                f"ShardedAttention: interpret must be True, False or None inside shard_map, got "
                f"{type(interpret).__name__} (the TPU interpreter hangs inside shard_map)."
            )
        fns = {
            "paged_decode_attention": self._paged_decode,
            "paged_prefill_attention": self._paged_prefill,
            "mla_decode_attention": self._mla_decode,
            "mla_prefill_attention": self._mla_prefill,
        }
        if op not in fns:
            raise NotImplementedError(f"ShardedAttention: no sharded version of {op}.")
        return functools.partial(fns[op], interpret=interpret)

    # -- the four ops ----------------------------------------------------------------------------

    def _paged_decode(self, q, k_pages, v_pages, lengths, block_tables, *, scale=None,
                      soft_cap=None, sliding_window=None, interpret=None):
        kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, impl=self.impl,
                  interpret=interpret)
        return self._run((q,), (k_pages, v_pages), lengths, block_tables, None,
                         kv_attention.paged_decode_attention, kw, mla=False,
                         sliding_window=sliding_window)

    def _paged_prefill(self, q, k_pages, v_pages, lengths, block_tables, q_lengths, *,
                       scale=None, soft_cap=None, sliding_window=None, interpret=None):
        kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, impl=self.impl,
                  interpret=interpret)
        return self._run((q,), (k_pages, v_pages), lengths, block_tables, q_lengths,
                         kv_attention.paged_decode_attention, kw, mla=False,
                         sliding_window=sliding_window,
                         prefill_op=kv_attention.paged_prefill_attention)

    def _mla_decode(self, q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, *,
                    scale, interpret=None):
        kw = dict(scale=scale, impl=self.impl, interpret=interpret)
        return self._run((q_latent, q_rope), (latent_pages, rope_pages), lengths, block_tables,
                         None, kv_attention.mla_decode_attention, kw, mla=True)

    def _mla_prefill(self, q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables,
                     q_lengths, *, scale, interpret=None):
        kw = dict(scale=scale, impl=self.impl, interpret=interpret)
        return self._run((q_latent, q_rope), (latent_pages, rope_pages), lengths, block_tables,
                         q_lengths, kv_attention.mla_decode_attention, kw, mla=True,
                         prefill_op=kv_attention.mla_prefill_attention)

    # -- the shared body --------------------------------------------------------------------------

    def _run(self, qs, pools, lengths, block_tables, q_lengths, decode_op, kw, *, mla,
             sliding_window=None, prefill_op=None):
        plan = self.plan
        C = plan.context_shards
        prefill = q_lengths is not None
        if C > 1 and sliding_window is not None:
            raise NotImplementedError(
                "ShardedAttention: sliding_window is not supported with the 'context' strategy "
                "(a window in positions is not a prefix of a device's pages); use 'heads' or "
                "'sequences' for sliding-window layers."
            )
        q_heads = qs[0].shape[-2]
        kv_heads = 1 if mla else pools[0].shape[0]
        num_pages = pools[0].shape[-3]
        if num_pages % plan.page_shards:
            axes = " * ".join(f"'{a}'={plan.axis_size(a)}" for a in plan.page_axes)
            raise ValueError(
                f"ShardedAttention: the pool's {num_pages} pages do not split over mesh axes "
                f"{axes} = {plan.page_shards} shards; build the cache with "
                f"kvjax.sharding.init_sharded_cache."
            )
        lay = _layout(plan, q_heads, kv_heads, mla)
        page_axes = plan.page_axes
        pages_entry = None if not page_axes else page_axes[0] if len(page_axes) == 1 else page_axes
        heads = "model" if lay.q_split else None
        q_spec = P(*([None] * (qs[0].ndim - 2)), heads, None)
        lse_spec = P(*([None] * (qs[0].ndim - 2)), heads)
        if mla:
            pool_spec = P(pages_entry, None, None)
        else:
            pool_spec = P("model" if lay.pool_split else None, pages_entry, None, None)
        page_size = pools[0].shape[-2]

        def body(*args):
            if prefill:
                *qs_l, a, b, lens, bt, qls = args
            else:
                *qs_l, a, b, lens, bt = args
                qls = None
            if not mla and lay.q_split and not lay.pool_split:
                start = (lax.axis_index("model") * lay.hq_local) // lay.group
                a = lax.dynamic_slice_in_dim(a, start, lay.kv_local, axis=0)
                b = lax.dynamic_slice_in_dim(b, start, lay.kv_local, axis=0)
            n = a.shape[-3]  # local pages
            d = lax.axis_index("data") if plan.data_shards > 1 else 0
            c = lax.axis_index("context") if C > 1 else 0
            first = (d * C + c) * n
            if plan.data_shards > 1:
                mine = (bt[:, 0] // (n * C)) == d
            else:
                mine = jnp.ones(lens.shape, bool)
            if C == 1:
                bt_l = jnp.where(bt >= 0, bt - first, -1)
                lens_l = jnp.where(mine, lens, 0)
                if prefill:
                    out, lse = prefill_op(*qs_l, a, b, lens_l, bt_l, qls, **kw)
                else:
                    out, lse = decode_op(*qs_l, a, b, lens_l, bt_l, **kw)
                return _merge(out, lse, page_axes)
            max_pages = bt.shape[1]
            cols = c + C * jnp.arange(-(-max_pages // C))
            bt_l = jnp.take(bt, jnp.minimum(cols, max_pages - 1), axis=1)
            bt_l = jnp.where(bt_l >= 0, bt_l - first, -1)
            if not prefill:
                lens_l = jnp.where(mine, tokens_on_shard(lens, c, page_size, C), 0)
                out, lse = decode_op(*qs_l, a, b, lens_l, bt_l, **kw)
                return _merge(out, lse, page_axes)
            batch, q_len = qs_l[0].shape[:2]
            t = jnp.arange(q_len)[None, :]
            pos = lens[:, None] - qls[:, None] + t  # [batch, q_len] global query positions
            seen = tokens_on_shard(pos + 1, c, page_size, C)
            seen = jnp.where(mine[:, None] & (t < qls[:, None]) & (pos >= 0), seen, 0)
            flat = [x.reshape(batch * q_len, *x.shape[2:]) for x in qs_l]
            out, lse = decode_op(*flat, a, b, seen.reshape(-1),
                                 jnp.repeat(bt_l, q_len, axis=0), **kw)
            out = out.reshape(batch, q_len, *out.shape[1:])
            lse = lse.reshape(batch, q_len, *lse.shape[1:])
            return _merge(out, lse, page_axes)

        in_specs = [q_spec] * len(qs) + [pool_spec, pool_spec, P(), P()]
        args = [*qs, *pools, lengths, block_tables]
        if prefill:
            in_specs.append(P())
            args.append(q_lengths)
        # check_vma=False: the per-device ops are written for plain arrays (the XLA path's
        # while_loop carries start device-invariant and become varying), and the outputs
        # are made invariant over the page axes by the psum merge above.
        fn = jax.shard_map(body, mesh=plan.mesh, in_specs=tuple(in_specs),
                           out_specs=(q_spec, lse_spec), check_vma=False)
        out, lse = fn(*args)
        return out.astype(qs[0].dtype), lse


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
    return kv_attention.paged_decode_attention(
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
    return kv_attention.paged_prefill_attention(
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
    return kv_attention.mla_decode_attention(
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
    return kv_attention.mla_prefill_attention(
        q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, q_lengths,
        scale=scale, impl=ShardedAttention(plan, impl))


