"""DeepSeek Sparse Attention ops (`kvjax.attention.sparse`) against float64 NumPy references.

Pools hold fresh random values under randomly permuted page ids; rows have lengths at
and around page boundaries; queries sit at several positions (prefill chunks) or one
(decode). Checked: the indexer's scores (every position, -inf where not visible) and
its top-k; MLA over a token selection equals softmax attention over exactly those
tokens (float32 and bfloat16 pools, whole pools with a layer index); on KIVI latents it
equals attention over the dequantized sequence restricted to the selection; the
sharded versions (8 devices, pages over a context axis) equal one device.

Compiling is most of these tests' time on CPU: each op under test runs in one jitted
program (eagerly, each of its jnp ops compiles for each new shape), inputs are made on the
host and sent with `jax.device_put` (`jnp.asarray` of a NumPy array compiles a program per
shape), and the KIVI references read the cache back with NumPy (`kivi_numpy`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_numpy import dequantized_sequences

import kvjax.cache as kc
from kvjax import sharding as kvs
from kvjax.attention import (
    TokenSelection,
    indexer_scores,
    mla_sparse_attention,
    quantized_mla_sparse_attention,
    select_topk,
    sparse,
)
from kvjax.specs import CacheSpec, IndexerCacheSpec, MLASpec, QuantSpec

PS = 4
LENGTHS = np.array([1, 4, 9, 23], np.int32)  # at and around page boundaries
MAX_PAGES = 8
NUM_PAGES = 40


def _paged(rng, width, dtype, layers=None):
    """A pool of random pages (ids permuted) and the rows' dense copies [batch, T, width]."""
    batch = len(LENGTHS)
    dtype = jnp.dtype(dtype)  # cast on the host: no conversion programs
    dense = rng.standard_normal((batch, MAX_PAGES * PS, width)).astype(np.float32)
    dense = dense.astype(dtype).astype(np.float32)
    ids = rng.permutation(NUM_PAGES)[:batch * MAX_PAGES].reshape(batch, MAX_PAGES)
    pool = rng.standard_normal((NUM_PAGES, PS, width)).astype(np.float32)
    for b in range(batch):
        pool[ids[b]] = dense[b].reshape(MAX_PAGES, PS, width)
    pool = pool.astype(dtype)
    if layers is not None:  # whole pools [layers, 1, pages, ps, width], the layer at 1
        noise = rng.standard_normal((layers, 1, *pool.shape)).astype(dtype)
        noise[1, 0] = pool
        pool = noise
    return jax.device_put(pool), jax.device_put(ids.astype(np.int32)), dense


def _q_pos(rng, q_len):
    """Query positions: the last q_len positions of each row (-1 where a row is shorter)."""
    pos = LENGTHS[:, None] - q_len + np.arange(q_len)[None, :]
    return np.where(pos >= 0, pos, -1).astype(np.int32)


def _ref_scores(q, w, keys, q_pos, scale):
    s = np.einsum("bthd,bsd->bths", q.astype(np.float64), keys.astype(np.float64)) * scale
    s = np.einsum("bths,bth->bts", np.maximum(s, 0.0), w.astype(np.float64))
    pos = np.arange(keys.shape[1])
    vis = (pos[None, None] <= q_pos[:, :, None]) & (pos[None, None] < LENGTHS[:, None, None])
    return np.where(vis, s, -np.inf)


@functools.partial(jax.jit, static_argnums=(6, 7))
def _scores_and_topk(q, w, pool, tables, lengths, q_pos, scale, k):
    """The indexer's scores (layer 1 of whole pools) and their top-k, in one program."""
    scores = indexer_scores(q, w, pool, tables, lengths, q_pos, scale=scale, layer=1)
    return scores, select_topk(scores, k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_indexer_scores_and_topk(rng, dtype, q_len):
    heads, d, k = 4, 16, 5
    pool, tables, keys = _paged(rng, d, dtype, layers=3)
    q = rng.standard_normal((len(LENGTHS), q_len, heads, d)).astype(np.float32)
    w = rng.standard_normal((len(LENGTHS), q_len, heads)).astype(np.float32)
    q_pos = _q_pos(rng, q_len)
    got, sel = _scores_and_topk(jax.device_put(q), jax.device_put(w), pool, tables,
                                jax.device_put(LENGTHS), jax.device_put(q_pos), d ** -0.5, k)
    want = _ref_scores(q, w, keys, q_pos, d ** -0.5)
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5,
                               atol=1e-5)

    sel = np.asarray(sel.positions)
    for b in range(len(LENGTHS)):
        for t in range(q_len):
            seen = int(np.isfinite(want[b, t]).sum())
            chosen = sel[b, t][sel[b, t] >= 0]
            assert len(chosen) == min(k, seen) and (sel[b, t] == -1).sum() == k - len(chosen)
            if not len(chosen):
                continue
            # The k best; a swap only between equal scores (relu makes ties at 0 common).
            score = np.where(np.isfinite(want[b, t]), want[b, t], -1e30)
            kth = np.sort(score)[::-1][len(chosen) - 1]
            best = set(np.argsort(-score)[:len(chosen)].tolist())
            swapped = best ^ set(chosen.tolist())
            assert all(abs(score[i] - kth) <= 1e-5 for i in swapped), (b, t, chosen, best)


def _ref_mla(q_latent, q_rope, c, r, positions, scale):
    """Softmax attention of each query over its selected rows of dense c, r."""
    batch, q_len, heads, _ = q_latent.shape
    out = np.zeros(q_latent.shape)
    lse = np.full((batch, q_len, heads), -np.inf)
    for b in range(batch):
        for t in range(q_len):
            p = positions[b, t][positions[b, t] >= 0]
            if not len(p):
                continue
            logits = (q_latent[b, t].astype(np.float64) @ c[b, p].T
                      + q_rope[b, t].astype(np.float64) @ r[b, p].T) * scale
            m = logits.max(-1, keepdims=True)
            e = np.exp(logits - m)
            out[b, t] = (e / e.sum(-1, keepdims=True)) @ c[b, p]
            lse[b, t] = (m + np.log(e.sum(-1, keepdims=True)))[:, 0]
    return out, lse


def _selection(rng, q_pos, k, upto):
    """k random visible positions per query (fewer where fewer are visible), -1 padded."""
    batch, q_len = q_pos.shape
    sel = np.full((batch, q_len, k), -1, np.int32)
    for b in range(batch):
        for t in range(q_len):
            n = min(q_pos[b, t] + 1, upto[b])
            if n > 0:
                pick = rng.permutation(n)[:k]
                sel[b, t, :len(pick)] = pick
    return sel


@pytest.mark.parametrize("dtype,blocked", [("float32", False), ("bfloat16", False),
                                           ("float32", True)])
def test_mla_over_a_token_selection(rng, dtype, blocked, monkeypatch):
    """`blocked`: queries taken two at a time (a long prefill chunk's path)."""
    if blocked:
        monkeypatch.setattr(sparse, "QUERY_BLOCK_BYTES", 2 * 4 * len(LENGTHS) * 6 * 24)
    heads, dc, dr, k, q_len = 4, 16, 8, 6, 3
    latent, tables, c = _paged(rng, dc, dtype, layers=2)
    rope, _, _ = _paged(np.random.default_rng(0), dr, dtype, layers=2)
    # the same page ids for both pools: rebuild the rope rows through the latent's table
    r_pool = np.asarray(rope.astype(jnp.float32))[1, 0]
    r = np.stack([r_pool[np.asarray(tables)[b]].reshape(-1, dr) for b in range(len(LENGTHS))])
    q_latent = rng.standard_normal((len(LENGTHS), q_len, heads, dc)).astype(np.float32)
    q_rope = rng.standard_normal((len(LENGTHS), q_len, heads, dr)).astype(np.float32)
    q_pos = _q_pos(rng, q_len)
    sel = _selection(rng, q_pos, k, LENGTHS)
    # A jit of its own: QUERY_BLOCK_BYTES (patched above) is read when the op is traced.
    out, lse = jax.jit(lambda *a: mla_sparse_attention(*a, scale=0.3, layer=1))(
        jax.device_put(q_latent), jax.device_put(q_rope), latent, rope, tables,
        TokenSelection(jax.device_put(sel)))
    want_out, want_lse = _ref_mla(q_latent, q_rope, c, r, sel, 0.3)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=1e-5, atol=1e-5)


def test_mla_over_a_token_selection_on_kivi_latents(rng):
    """Selected quantized rows dequantized after their gather plus selected tail tokens
    equal attention over the dequantized sequence (`quantized.dequantized_sequence`)."""
    spec = CacheSpec(attention=MLASpec(q_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                                       qk_nope_head_dim=8, v_head_dim=8),
                     num_layers=1, page_size=PS, num_pages=NUM_PAGES, max_seqs=len(LENGTHS),
                     max_pages_per_seq=MAX_PAGES, indexer=IndexerCacheSpec(head_dim=8),
                     quant=QuantSpec(bits=4, group_size=8, residual=PS))
    cache, status = kc.reserve(jax.jit(kc.init_cache, static_argnums=0)(spec),
                               jax.device_put(LENGTHS))
    status.raise_if_error()
    n = int(LENGTHS.max())
    draw = lambda width: jax.device_put(  # noqa: E731
        rng.standard_normal((len(LENGTHS), n, width)).astype(np.float32))
    cache = jax.jit(lambda cache, a, b, keys: kc.write(
        cache, 0, a, b, q_lengths=jax.device_put(LENGTHS), index_keys=keys))(
        cache, draw(16), draw(8), draw(8))
    assert int(cache.quant_lengths.max()) > 0
    c = np.zeros((len(LENGTHS), n, 16))
    r = np.zeros((len(LENGTHS), n, 8))
    for b, (length, (cb, rb)) in enumerate(zip(LENGTHS, dequantized_sequences(cache),
                                               strict=True)):
        c[b, :length], r[b, :length] = cb[:, 0], rb[:, 0]
    q_len = 2
    q_latent = rng.standard_normal((len(LENGTHS), q_len, 4, 16)).astype(np.float32)
    q_rope = rng.standard_normal((len(LENGTHS), q_len, 4, 8)).astype(np.float32)
    sel = _selection(rng, _q_pos(rng, q_len), 7, LENGTHS)
    out, lse = jax.jit(lambda ql, qr, cache, sel: quantized_mla_sparse_attention(
        ql, qr, kc.layer_view(cache, 0, whole_pools=True), sel, scale=0.3))(
        jax.device_put(q_latent), jax.device_put(q_rope), cache,
        TokenSelection(jax.device_put(sel)))
    want_out, want_lse = _ref_mla(q_latent, q_rope, c, r, sel, 0.3)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=1e-5, atol=1e-5)


def test_sharded_ops_equal_one_device(rng):
    """Pages over 8 devices (context axis): each device scores and gathers only the pages
    it holds; the pmax of scores and the log-sum-exp merge give the one-device results."""
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((8,), ("context",)), strategies=("context",))
    impl = kvs.ShardedAttention(plan)
    heads, d, q_len = 4, 16, 2
    pool, tables, _ = _paged(rng, d, "float32", layers=2)
    rope, _, _ = _paged(rng, 8, "float32", layers=2)
    put = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(
        None, None, "context", None, None))
    def draw(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32))

    q, w = draw(len(LENGTHS), q_len, heads, d), draw(len(LENGTHS), q_len, heads)
    q_pos = jax.device_put(_q_pos(rng, q_len))
    qr = draw(len(LENGTHS), q_len, heads, 8)
    lengths = jax.device_put(LENGTHS)

    @jax.jit  # each side one program: one device here, the 8 devices below
    def one_device(q, w, qr, pool, rope, tables, lengths, q_pos):
        scores = indexer_scores(q, w, pool, tables, lengths, q_pos, scale=0.25, layer=1)
        sel = select_topk(scores, 5)
        return scores, sel, mla_sparse_attention(q, qr, pool, rope, tables, sel, scale=0.3,
                                                 layer=1)

    @jax.jit
    def sharded(q, w, qr, pool, rope, tables, lengths, q_pos, sel):
        return (indexer_scores(q, w, pool, tables, lengths, q_pos, scale=0.25, layer=1,
                               impl=impl),
                mla_sparse_attention(q, qr, pool, rope, tables, sel, scale=0.3, layer=1,
                                     impl=impl))

    one, sel, one_mla = one_device(q, w, qr, pool, rope, tables, lengths, q_pos)
    many, many_mla = sharded(q, w, qr, jax.device_put(pool, put), jax.device_put(rope, put),
                             tables, lengths, q_pos, sel)
    np.testing.assert_array_equal(np.asarray(many), np.asarray(one))
    for a, b in zip(many_mla, one_mla, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
