"""The paged references against dense attention computed independently in float64 NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax import attention

# ---------------------------------------------------------------- helpers


def dense_attention(q, k, v, q_pos, *, scale, soft_cap=None, window=None):
    """float64 attention of one sequence. q [T, Hq, D], k/v [S, Hkv, D], q_pos [T] -> out, lse."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t, hq, _ = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    out = np.zeros((t, hq, v.shape[-1]))
    lse = np.full((t, hq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        logits = q[:, h] @ kh.T * scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        kp = np.arange(s)[None, :]
        visible = kp <= q_pos[:, None]
        if window is not None:
            visible &= q_pos[:, None] - kp < window
        logits = np.where(visible, logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        p = np.exp(logits - m)
        out[:, h] = p @ vh / p.sum(-1, keepdims=True)
        lse[:, h] = m[:, 0] + np.log(p.sum(-1))
    return out, lse


def scatter_to_pages(seqs, num_pages, page_size, max_pages, rng):
    """Lays sequences' [S, H, D] arrays into a pool at randomly permuted pages.

    Returns pool [H, P, ps, D] (unused slots random, never trusted), block
    tables with garbage past each length, lengths.
    """
    heads, width = seqs[0].shape[1:]
    pool = rng.standard_normal((heads, num_pages, page_size, width)).astype(np.float32) * 100
    perm = rng.permutation(num_pages)
    tables = rng.integers(-5, num_pages + 5, (len(seqs), max_pages))  # garbage everywhere
    nxt = 0
    for b, x in enumerate(seqs):
        n_pages = -(-len(x) // page_size)
        for j in range(n_pages):
            page = perm[nxt]
            nxt += 1
            tables[b, j] = page
            chunk = x[j * page_size:(j + 1) * page_size]
            pool[:, page, :len(chunk)] = np.swapaxes(chunk, 0, 1)
    return pool, tables.astype(np.int32), np.array([len(x) for x in seqs], np.int32)


def random_seqs(rng, lengths, heads, width):
    return [rng.standard_normal((n, heads, width)).astype(np.float32) for n in lengths]


def edge_lengths(page_size, max_pages):
    return [1, page_size - 1, page_size, page_size + 1, page_size * max_pages]


# ---------------------------------------------------------------- decode

GROUPS = [(8, 8), (8, 4), (8, 2), (8, 1), (4, 1)]  # (q_heads, kv_heads): ratios 1,2,4,8 and MQA


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("q_heads,kv_heads", GROUPS)
def test_decode_matches_dense_f32(rng, page_size, q_heads, kv_heads):
    head_dim, max_pages = 16, 4
    lengths = edge_lengths(page_size, max_pages)
    ks = random_seqs(rng, lengths, kv_heads, head_dim)
    vs = random_seqs(rng, lengths, kv_heads, head_dim)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    pool, tables, lens = scatter_to_pages(
        [np.concatenate([a, b], -1) for a, b in zip(ks, vs, strict=True)],
        num_pages, page_size, max_pages, rng,
    )
    k_pool, v_pool = pool[..., :head_dim], pool[..., head_dim:]
    q = rng.standard_normal((len(lengths), q_heads, head_dim)).astype(np.float32)

    out, lse = attention.paged_decode_attention(
        jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(lens),
        jnp.asarray(tables),
    )
    for b, n in enumerate(lengths):
        ref_out, ref_lse = dense_attention(q[b][None], ks[b], vs[b], np.array([n - 1]),
                                           scale=head_dim**-0.5)
        np.testing.assert_allclose(np.asarray(out[b]), ref_out[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[b]), ref_lse[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 1)])
def test_decode_matches_dense_bf16(rng, q_heads, kv_heads):
    page_size, head_dim, max_pages = 16, 32, 4
    lengths = edge_lengths(page_size, max_pages)
    ks = random_seqs(rng, lengths, kv_heads, head_dim)
    k_pool, tables, lens = scatter_to_pages(ks, 40, page_size, max_pages, rng)
    v_pool = rng.standard_normal(k_pool.shape).astype(np.float32)
    q = rng.standard_normal((len(lengths), q_heads, head_dim)).astype(np.float32)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    out, _ = attention.paged_decode_attention(bf(q), bf(k_pool), bf(v_pool), jnp.asarray(lens),
                                              jnp.asarray(tables))
    assert out.dtype == jnp.bfloat16
    # Reference on the bf16-rounded inputs in float64: the remaining error is the
    # bf16 rounding of the output and of the probabilities, < 2e-2 relative.
    r = lambda x: np.asarray(bf(x).astype(jnp.float32))  # noqa: E731
    qr, kpr, vpr = r(q), r(k_pool), r(v_pool)
    for b, n in enumerate(lengths):
        pages = tables[b, :-(-n // page_size)]
        k = np.swapaxes(kpr[:, pages].reshape(kv_heads, -1, head_dim)[:, :n], 0, 1)
        v = np.swapaxes(vpr[:, pages].reshape(kv_heads, -1, head_dim)[:, :n], 0, 1)
        ref, _ = dense_attention(qr[b][None], k, v, np.array([n - 1]), scale=head_dim**-0.5)
        got = np.asarray(out[b].astype(jnp.float32))
        err = np.abs(got - ref[0]).max() / np.abs(ref[0]).max()
        assert err < 2e-2, (b, n, err)


@pytest.mark.parametrize("soft_cap,window", [(5.0, None), (None, 7), (3.0, 20)])
def test_decode_soft_cap_and_window(rng, soft_cap, window):
    page_size, head_dim, max_pages, q_heads, kv_heads = 8, 16, 5, 4, 2
    lengths = [1, 7, 8, 9, 40]
    ks = random_seqs(rng, lengths, kv_heads, head_dim)
    vs = random_seqs(rng, lengths, kv_heads, head_dim)
    kv = [np.concatenate([a, b], -1) for a, b in zip(ks, vs, strict=True)]
    pool, tables, lens = scatter_to_pages(kv, 30, page_size, max_pages, rng)
    q = rng.standard_normal((len(lengths), q_heads, head_dim)).astype(np.float32) * 3
    out, lse = attention.paged_decode_attention(
        jnp.asarray(q), jnp.asarray(pool[..., :head_dim]), jnp.asarray(pool[..., head_dim:]),
        jnp.asarray(lens), jnp.asarray(tables), soft_cap=soft_cap, sliding_window=window,
        scale=0.3,
    )
    for b, n in enumerate(lengths):
        ref, ref_lse = dense_attention(q[b][None], ks[b], vs[b], np.array([n - 1]), scale=0.3,
                                       soft_cap=soft_cap, window=window)
        np.testing.assert_allclose(np.asarray(out[b]), ref[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[b]), ref_lse[0], rtol=1e-5, atol=1e-5)


def test_empty_sequence_gives_zero_and_neg_inf(rng):
    k = jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    out, lse = attention.paged_decode_attention(
        q, k, k, jnp.array([0, 3], jnp.int32), jnp.array([[-1, -1], [2, -1]], jnp.int32)
    )
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    assert np.all(np.isfinite(np.asarray(out[1])))


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("q_heads,kv_heads,page_size", [(4, 4, 8), (8, 2, 16), (4, 1, 8)])
def test_chunked_prefill_equals_full_causal(rng, q_heads, kv_heads, page_size):
    """New queries attend to the old cache plus themselves, exactly as one causal pass."""
    head_dim, max_pages = 16, 6
    old = [0, 5, 8, 17, 3]      # tokens already cached
    new = [9, 1, 8, 7, 16]      # new tokens this chunk (ragged)
    q_len = max(new)
    total = [a + b for a, b in zip(old, new, strict=True)]
    ks = random_seqs(rng, total, kv_heads, head_dim)
    vs = random_seqs(rng, total, kv_heads, head_dim)
    kv = [np.concatenate([a, b], -1) for a, b in zip(ks, vs, strict=True)]
    pool, tables, lens = scatter_to_pages(kv, 40, page_size, max_pages, rng)
    qs = [rng.standard_normal((n, q_heads, head_dim)).astype(np.float32) for n in total]
    q = np.stack([np.pad(x[o:], ((0, q_len - n), (0, 0), (0, 0)))
                  for x, o, n in zip(qs, old, new, strict=True)])
    out, lse = attention.paged_prefill_attention(
        jnp.asarray(q), jnp.asarray(pool[..., :head_dim]), jnp.asarray(pool[..., head_dim:]),
        jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(new, jnp.int32),
    )
    for b in range(len(total)):
        # Full causal attention over the concatenated sequence, keeping the new rows.
        ref, ref_lse = dense_attention(qs[b], ks[b], vs[b], np.arange(total[b]),
                                       scale=head_dim**-0.5)
        n = new[b]
        np.testing.assert_allclose(np.asarray(out[b, :n]), ref[old[b]:], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[b, :n]), ref_lse[old[b]:], rtol=1e-5,
                                   atol=1e-5)
        assert np.all(np.asarray(out[b, n:]) == 0)
        assert np.all(np.isneginf(np.asarray(lse[b, n:])))


# ---------------------------------------------------------------- MLA


@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_mla_absorbed_equals_naive(rng, page_size):
    """Absorbed decode over latents equals decompressing K/V per head from the same latents."""
    heads, d_c, d_rope, d_nope, d_v, max_pages = 4, 32, 8, 16, 12, 3
    lengths = [1, page_size - 1, page_size, page_size + 1, page_size * max_pages]
    c_kv = random_seqs(rng, lengths, 1, d_c)
    k_rope = random_seqs(rng, lengths, 1, d_rope)
    latent_pool, tables, lens = scatter_to_pages(
        [np.concatenate([a, b], -1) for a, b in zip(c_kv, k_rope, strict=True)],
        sum(-(-n // page_size) for n in lengths) + 2, page_size, max_pages, rng,
    )
    w_uk = rng.standard_normal((heads, d_nope, d_c)).astype(np.float32) / np.sqrt(d_c)
    w_uv = rng.standard_normal((heads, d_v, d_c)).astype(np.float32) / np.sqrt(d_c)
    q_nope = rng.standard_normal((len(lengths), heads, d_nope)).astype(np.float32)
    q_rope = rng.standard_normal((len(lengths), heads, d_rope)).astype(np.float32)
    scale = (d_nope + d_rope) ** -0.5

    q_latent = np.einsum("bhn,hnc->bhc", q_nope, w_uk)
    out_latent, lse = attention.mla_decode_attention(
        jnp.asarray(q_latent), jnp.asarray(q_rope), jnp.asarray(latent_pool[0, ..., :d_c]),
        jnp.asarray(latent_pool[0, ..., d_c:]), jnp.asarray(lens), jnp.asarray(tables),
        scale=scale,
    )
    out = np.einsum("bhc,hvc->bhv", np.asarray(out_latent, np.float64), w_uv)
    for b, n in enumerate(lengths):
        c = c_kv[b][:, 0].astype(np.float64)                # [S, d_c]
        k_nope = np.einsum("sc,hnc->shn", c, w_uk)           # decompressed keys per head
        k = np.concatenate([k_nope, np.broadcast_to(k_rope[b], (n, heads, d_rope))], -1)
        v = np.einsum("sc,hvc->shv", c, w_uv)
        qb = np.concatenate([q_nope[b], q_rope[b]], -1)[None]
        ref, ref_lse = dense_attention(qb, k, v, np.array([n - 1]), scale=scale)
        np.testing.assert_allclose(out[b], ref[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[b]), ref_lse[0], rtol=1e-5, atol=1e-5)


def test_mla_prefill_matches_decode_rows(rng):
    """Each prefill row equals a decode at that row's position."""
    heads, d_c, d_rope, page_size = 2, 16, 4, 8
    n = 13
    pool = rng.standard_normal((4, page_size, d_c + d_rope)).astype(np.float32)
    tables = jnp.array([[2, 0, 3]], jnp.int32)
    ql = rng.standard_normal((1, 5, heads, d_c)).astype(np.float32)
    qr = rng.standard_normal((1, 5, heads, d_rope)).astype(np.float32)
    lat, rope = jnp.asarray(pool[..., :d_c]), jnp.asarray(pool[..., d_c:])
    out, lse = attention.mla_prefill_attention(
        jnp.asarray(ql), jnp.asarray(qr), lat, rope, jnp.array([n], jnp.int32), tables,
        jnp.array([5], jnp.int32), scale=0.2,
    )
    for t in range(5):
        o, s = attention.mla_decode_attention(
            jnp.asarray(ql[:, t]), jnp.asarray(qr[:, t]), lat, rope,
            jnp.array([n - 4 + t], jnp.int32), tables, scale=0.2,
        )
        np.testing.assert_allclose(np.asarray(out[:, t]), np.asarray(o), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse[:, t]), np.asarray(s), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- merge


@pytest.mark.parametrize("split", [0, 1, 2, 3, 4])
def test_split_pages_and_merge_equals_all_pages(rng, split):
    """Attending to pages [0, split) and [split, n) separately, then merging, equals all pages."""
    page_size, heads, kv_heads, head_dim = 8, 4, 2, 16
    n_tokens = 4 * page_size - 3  # 4 pages, the last one partial
    k = random_seqs(rng, [n_tokens], kv_heads, head_dim)[0]
    v = random_seqs(rng, [n_tokens], kv_heads, head_dim)[0]
    pool, tables, lens = scatter_to_pages([np.concatenate([k, v], -1)], 9, page_size, 4, rng)
    kp, vp = jnp.asarray(pool[..., :head_dim]), jnp.asarray(pool[..., head_dim:])
    q = jnp.asarray(rng.standard_normal((1, heads, head_dim)), jnp.float32)
    full, full_lse = attention.paged_decode_attention(q, kp, vp, jnp.asarray(lens),
                                                      jnp.asarray(tables))
    # Piece A: the first `split` pages (all full). Piece B: the rest. Decode
    # attention sees every cached token, so each piece is a plain decode over
    # its own pages.
    len_a = min(split * page_size, n_tokens)
    a, lse_a = attention.paged_decode_attention(
        q, kp, vp, jnp.array([len_a], jnp.int32), jnp.asarray(tables))
    tb = np.full_like(tables, -1)
    tb[0, :4 - split] = tables[0, split:4]
    b, lse_b = attention.paged_decode_attention(
        q, kp, vp, jnp.array([n_tokens - len_a], jnp.int32), jnp.asarray(tb))
    out, lse = attention.merge_attention_states(a, lse_a, b, lse_b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(full_lse), rtol=1e-6, atol=1e-6)


def test_merge_of_two_empty_pieces():
    out = jnp.ones((2, 3, 4), jnp.float32)
    lse = jnp.full((2, 3), -jnp.inf, jnp.float32)
    o, s = attention.merge_attention_states(out, lse, out, lse)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(s)))


# ---------------------------------------------------------------- through the cache API


def test_cache_writes_then_attention_match_dense(rng):
    """reserve + token_slots + write_layer (prefill, then decode steps) feed attention correctly."""
    q_heads, kv_heads, head_dim, page_size = 4, 2, 16, 8
    spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=q_heads, kv_heads=kv_heads,
                                                     head_dim=head_dim),
                         num_layers=2, page_size=page_size, num_pages=24, max_seqs=3,
                         max_pages_per_seq=5)
    cache = kvx.init_cache(spec)
    prompt = np.array([9, 16, 1])
    total = prompt + 4
    ks = random_seqs(rng, total.tolist(), kv_heads, head_dim)
    vs = random_seqs(rng, total.tolist(), kv_heads, head_dim)
    layer = 1

    def write(cache, start, n):
        t = int(n.max())
        cache, status = kvx.cache.reserve(cache, jnp.asarray(n, jnp.int32))
        status.raise_if_error()
        pos = start[:, None] + np.arange(t)[None]
        valid = np.arange(t)[None] < n[:, None]
        slots = kvx.cache.paged.token_slots(cache, jnp.asarray(pos, jnp.int32), jnp.asarray(valid))
        take = lambda xs: np.stack([  # noqa: E731
            np.pad(x[s:s + k], ((0, t - k), (0, 0), (0, 0)))
            for x, s, k in zip(xs, start, n, strict=True)])
        return kvx.cache.paged.write_layer(cache, layer, slots, jnp.asarray(take(ks)),
                                     jnp.asarray(take(vs)))

    cache = write(cache, np.zeros(3, int), prompt)
    for step in range(4):
        cache = write(cache, prompt + step, np.ones(3, int))
    kvx.cache.check_invariants(cache.table)
    view = kvx.cache.layer_view(cache, layer)
    q = rng.standard_normal((3, q_heads, head_dim)).astype(np.float32)
    out, _ = attention.paged_decode_attention(jnp.asarray(q), view.k, view.v, view.lengths,
                                              view.block_tables)
    for b in range(3):
        ref, _ = dense_attention(q[b][None], ks[b], vs[b], np.array([total[b] - 1]),
                                 scale=head_dim**-0.5)
        np.testing.assert_allclose(np.asarray(out[b]), ref[0], rtol=1e-5, atol=1e-5)
    # The other layer was never written.
    assert not np.any(np.asarray(cache.pages.k[0]))


# ---------------------------------------------------------------- bad input


def _good(rng):
    k = jnp.asarray(rng.standard_normal((2, 6, 8, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    return q, k, k, jnp.array([9, 3], jnp.int32), jnp.array([[1, 2], [0, 5]], jnp.int32)


@pytest.mark.parametrize("case,match", [
    ("table_outside", r"block_tables\[1, 0\] = 6 points outside the pool of 6 pages"),
    ("negative_page", r"block_tables\[0, 1\] = -1 points outside"),
    ("too_long", r"lengths must lie in \[0, max_pages \* page_size = 16\]"),
    ("heads", r"q has 3 heads, which is not a multiple of the cache's 2 KV heads"),
    ("head_dim", r"query head_dim 8 does not match k_pages width 16"),
    ("dtype", r"k_pages dtype float32 differs from v_pages dtype bfloat16"),
    ("impl", r"impl must be one of"),
])
def test_bad_input_raises_at_the_boundary(rng, case, match):
    q, k, v, lens, bt = _good(rng)
    kw = {}
    if case == "table_outside":
        bt = jnp.array([[1, 2], [6, 0]], jnp.int32)
    elif case == "negative_page":
        bt = jnp.array([[1, -1], [0, 5]], jnp.int32)
    elif case == "too_long":
        lens = jnp.array([17, 3], jnp.int32)
    elif case == "heads":
        q = q[:, :3]
    elif case == "head_dim":
        q = q[..., :8]
    elif case == "dtype":
        v = v.astype(jnp.bfloat16)
    elif case == "impl":
        kw["impl"] = "cuda"
    with pytest.raises((ValueError, TypeError), match=match):
        attention.paged_decode_attention(q, k, v, lens, bt, **kw)


def test_entries_past_length_are_not_trusted(rng):
    """Garbage past a sequence's length is neither validated nor read."""
    q, k, v, _, _ = _good(rng)
    lens = jnp.array([8, 3], jnp.int32)
    a, _ = attention.paged_decode_attention(q, k, v, lens, jnp.array([[1, 999], [0, -7]],
                                                                      jnp.int32))
    b, _ = attention.paged_decode_attention(q, k, v, lens, jnp.array([[1, 0], [0, 0]],
                                                                      jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
