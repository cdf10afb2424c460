"""The XLA path over quantized pages (`kvjax.attention.xla_quantized`) against the reference.

Both paths dequantize the same codes with the same float32 arithmetic (code *
scale + zero) and attend in float32; only the summation order differs (blocked
online softmax vs one softmax, block-wise vs whole-sequence matmuls), so
float32 results agree to float32 rounding: 2e-5 relative to values of order 1
(dequantized elements here lie in about [-4, 4]). With bf16 queries and tails
the outputs are bf16 in both, so they agree to a couple of bf16 ulps (2e-2).

Caches are built with the real page table (`reserve` allocates the quantized pages for
the lengths; `kivi_cache.reserved_cache` runs it once per page geometry) and then filled
with random codes, scales, zeros, k_rope pages and tails, so every layout detail (page
ids, ring slots, Q vs L) is the cache's own. Unused block-table entries are overwritten
with garbage.

Compiling is most of these tests' time on CPU, so each test runs the implementations it
compares in one jitted program (`_attend`: the views are taken inside it, with the layer
a Python int as a model step has it) and draws its inputs on the host (a float64 draw
cast by `jnp.asarray(x, dtype)` compiles a conversion per shape, and `jnp.asarray` of a
NumPy array a `stage` program per shape: host arrays go over with `jax.device_put`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_written import written
from jax.extend import core as jcore
from kivi_cache import reserved_cache

import kvjax as kvx
from kernels_pallas.quantized_attention import reference as qref
from kvjax import attention
from kvjax.attention import registry
from kvjax.attention import xla_quantized as xq
from kvjax.backends.cpu import options as cpu_options
from kvjax.cache import quantized as qz
from kvjax.specs import QuantSpec

PS, G, R, MAX_PAGES = 16, 8, 16, 6  # page size, group size, residual, pages per sequence
D = 32  # head_dim (GQA); MLA widths below
DC, DR = 32, 8


def _lengths(rng, batch):
    """Edges around the page and tail boundaries (Q(L) = PS floor((L - R)/PS)), then random."""
    edge = [0, 1, R - 1, R, R + 1, R + PS - 1, R + PS, R + PS + 1, PS * MAX_PAGES]
    extra = rng.integers(0, PS * MAX_PAGES + 1, size=max(0, batch - len(edge))).tolist()
    return np.asarray((edge + extra)[:batch], np.int32)


def _host(x, dtype):
    """A device array of `x` cast to `dtype` on the host (no conversion program)."""
    return jax.device_put(np.asarray(x).astype(dtype))


def _normal(rng, shape, dtype=np.float32):
    return _host(rng.standard_normal(shape), dtype)


def _rand_pool(rng, pool: qz.QuantPool, *, nan_pages=None):
    span = 1.0 / ((1 << pool.bits) - 1)
    scale = rng.uniform(0.5 * span, 2.0 * span, pool.scale.shape)
    if nan_pages is not None:  # pages nobody may read
        scale[:, :, nan_pages] = np.nan
    return dataclasses.replace(
        pool,
        codes=_host(rng.integers(0, 256, pool.codes.shape), np.uint8),
        scale=_host(scale, pool.scale.dtype),
        zero=_host(rng.uniform(-2.0, 0.0, pool.zero.shape), pool.zero.dtype),
    )


def random_cache(rng, *, mla=False, bits=4, kv_heads=2, q_heads=8, layers=1, batch=9,
                 lengths=None, dtype="float32", nan_unused=False, num_pages=None):
    """A quantized cache holding `lengths` tokens per slot, with random contents."""
    if mla:
        att = kvx.MLASpec(q_heads=q_heads, kv_lora_rank=DC, qk_rope_head_dim=DR,
                          qk_nope_head_dim=16, v_head_dim=16)
    else:
        att = kvx.AttentionSpec(q_heads=q_heads, kv_heads=kv_heads, head_dim=D)
    spec = kvx.CacheSpec(
        attention=att, num_layers=layers, page_size=PS,
        num_pages=num_pages or batch * MAX_PAGES + 3,
        max_seqs=batch, max_pages_per_seq=MAX_PAGES, dtype=dtype,
        quant=QuantSpec(bits=bits, group_size=G, residual=R))
    lengths = _lengths(rng, batch) if lengths is None else np.asarray(lengths, np.int32)
    cache, status = reserved_cache(spec, lengths)  # one reserve program per page geometry
    status.raise_if_error()
    q_len = np.asarray(cache.quant_lengths)
    tables = np.asarray(cache.block_tables)
    used = np.arange(MAX_PAGES)[None, :] * PS < q_len[:, None]
    nan_pages = None
    if nan_unused:
        live = set(tables[used].tolist()) | {0}  # dead columns read page 0 (masked)
        nan_pages = np.array([p not in live for p in range(spec.num_pages)])
    garbage = rng.integers(-(10**6), 10**6, size=tables.shape)
    tables = np.where(used, tables, garbage).astype(np.int32)
    pages = cache.pages
    if mla:
        rope = rng.standard_normal(pages.k_rope.shape)
        if nan_unused:
            rope[:, :, nan_pages] = np.nan
        pages = qz.QuantizedLatentPages(
            c_kv=tuple(_rand_pool(rng, p, nan_pages=nan_pages) for p in pages.c_kv),
            k_rope=_host(rope, pages.k_rope.dtype))
    else:
        pages = qz.QuantizedKVPages(
            k=tuple(_rand_pool(rng, p, nan_pages=nan_pages) for p in pages.k),
            v=tuple(_rand_pool(rng, p, nan_pages=nan_pages) for p in pages.v))
    a, b = (_normal(rng, x.shape, x.dtype) for x in (cache.tail.a, cache.tail.b))
    tail = dataclasses.replace(cache.tail, a=a, b=b)
    table = dataclasses.replace(cache.table, block_tables=jax.device_put(tables))
    return dataclasses.replace(cache, pages=pages, table=table, tail=tail)


def _close(got, want, tol):
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.dtype == o_ref.dtype and o.shape == o_ref.shape
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               rtol=tol, atol=tol)
    # lse is float32 in both and -inf exactly where a row sees nothing.
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=2e-5, atol=2e-5)


def _gqa_decode(view, impl, q, **kw):
    return attention.quantized_decode_attention(q, view, impl=impl, **kw)


def _gqa_prefill(view, impl, q, q_lengths, seq_ids, **kw):
    return attention.quantized_prefill_attention(q, view, q_lengths, seq_ids=seq_ids, impl=impl,
                                                 **kw)


def _mla_decode(view, impl, ql, qr):
    return attention.quantized_mla_decode_attention(ql, qr, view, scale=0.2, impl=impl)


def _mla_prefill(view, impl, ql, qr, q_lengths):
    return attention.quantized_mla_prefill_attention(ql, qr, view, q_lengths, scale=0.2,
                                                     impl=impl)


@functools.partial(jax.jit, static_argnames=("op", "runs", "kw"))
def _attend(cache, *args, op, runs, kw=()):
    """`op(view, impl, *args, **kw)` for each `(layer, whole_pools, impl)` of `runs`, the view
    `layer_view(cache, layer, whole_pools=whole_pools)`: one program for all of them."""
    return tuple(op(qz.layer_view(cache, layer, whole_pools=whole), impl, *args, **dict(kw))
                 for layer, whole, impl in runs)


# The oracle on the sliced view, the XLA path on the sliced and on the whole-pool view.
REF_XLA_WHOLE = ((0, False, "reference"), (0, False, "xla"), (0, True, "xla"))
REF_WHOLE = ((0, False, "reference"), (0, True, "xla"))
WHOLE = ((0, True, "xla"),)


# int2/int4/int8; MHA, GQA 4 and 8, MQA.
@pytest.mark.parametrize("bits,q_heads,kv_heads", [
    (2, 8, 2), (4, 8, 1), (8, 4, 4), (4, 16, 2), (2, 8, 1), (8, 8, 2)])
def test_decode_matches_reference(rng, bits, q_heads, kv_heads):
    cache = random_cache(rng, bits=bits, q_heads=q_heads, kv_heads=kv_heads)
    q = _normal(rng, (cache.spec.max_seqs, q_heads, D))
    want, one, whole = _attend(cache, q, op=_gqa_decode, runs=REF_XLA_WHOLE)
    _close(one, want, 2e-5)
    _close(whole, want, 2e-5)


_reference = jax.jit(qref.quantized_attention, static_argnames=(
    "k_bits", "v_bits", "scale", "soft_cap", "sliding_window"))


@pytest.mark.parametrize("block_tokens", [1, PS, 3 * PS, 1000])
def test_block_sizes(rng, block_tokens):
    # Blocks smaller than a page, of one page, not dividing the table, larger than the table.
    cache = random_cache(rng, bits=4)
    view = qz.layer_view(jax.tree.map(np.asarray, cache), 0)  # sliced on the host
    q = _normal(rng, (cache.spec.max_seqs, 1, 8, D))
    q_pos = jax.device_put(np.asarray(view.lengths)[:, None] - 1)
    args = (q, view.k.codes, view.k.scale, view.k.zero, view.v.codes, view.v.scale,
            view.v.zero, view.tail_k, view.tail_v, view.quant_lengths, view.lengths,
            view.block_tables, q_pos)
    kw = dict(k_bits=4, v_bits=4, scale=D**-0.5)
    got = xq.quantized_attention(*args, **kw, block_tokens=block_tokens)
    _close(got, _reference(*args, **kw), 2e-5)


@pytest.mark.parametrize("soft_cap,window", [(None, None), (2.0, None), (None, 1), (3.0, 21)])
def test_prefill_rows_soft_cap_window(rng, soft_cap, window):
    cache = random_cache(rng, bits=2)
    # Chunks of 0 (idle row), 1, the whole width, random, never past the row's length;
    # rows are a subset of the slots, in another order.
    seq_ids = jax.device_put(np.asarray([8, 0, 5, 3, 7, 2], np.int32))
    lengths = np.asarray(cache.lengths)[np.asarray(seq_ids)]
    q_lengths = np.minimum([0, 1, 5, 3, 5, 2], lengths).astype(np.int32)
    q = _normal(rng, (6, 5, 8, D))
    want, got = _attend(cache, q, jax.device_put(q_lengths), seq_ids, op=_gqa_prefill,
                        runs=REF_WHOLE, kw=(("soft_cap", soft_cap), ("sliding_window", window)))
    _close(got, want, 2e-5)
    out, lse = map(np.asarray, want)  # indexed on the host: no slicing programs
    assert not out[0].any() and np.isneginf(lse[0]).all()


def test_bf16_cache(rng):
    cache = random_cache(rng, bits=4, dtype="bfloat16")
    q = _normal(rng, (cache.spec.max_seqs, 8, D), jnp.bfloat16)
    want, got = _attend(cache, q, op=_gqa_decode, runs=REF_WHOLE)
    _close(got, want, 2e-2)


def test_empty_rows(rng):
    cache = random_cache(rng, bits=4, lengths=[0] * 9)
    q = _normal(rng, (9, 8, D))
    (out, lse), = _attend(cache, q, op=_gqa_decode, runs=WHOLE)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("mla", [False, True])
def test_unused_pages_are_never_read(rng, mla):
    # Scales (and MLA rope rows) of every page no sequence uses are NaN: reading one, even
    # with zero weight, would leak NaN into the output.
    cache = random_cache(rng, bits=4, mla=mla, nan_unused=True)
    b = cache.spec.max_seqs
    if mla:
        qs, op = (_normal(rng, (b, 8, DC)), _normal(rng, (b, 8, DR))), _mla_decode
    else:
        qs, op = (_normal(rng, (b, 8, D)),), _gqa_decode
    (out, lse), = _attend(cache, *qs, op=op, runs=WHOLE)
    assert np.all(np.isfinite(np.asarray(out)))
    assert not np.any(np.isnan(np.asarray(lse)))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_mla_matches_reference(rng, bits):
    cache = random_cache(rng, bits=bits, mla=True)
    b = cache.spec.max_seqs
    ql, qr = _normal(rng, (b, 8, DC)), _normal(rng, (b, 8, DR))
    want, one, whole = _attend(cache, ql, qr, op=_mla_decode, runs=REF_XLA_WHOLE)
    _close(one, want, 2e-5)
    _close(whole, want, 2e-5)


def test_mla_prefill_matches_reference(rng):
    cache = random_cache(rng, bits=2, mla=True)
    b = cache.spec.max_seqs
    q_lengths = jax.device_put(np.minimum(rng.integers(0, 5, b), np.asarray(cache.lengths))
                            .astype(np.int32))
    ql, qr = _normal(rng, (b, 4, 8, DC)), _normal(rng, (b, 4, 8, DR))
    want, got = _attend(cache, ql, qr, q_lengths, op=_mla_prefill, runs=REF_WHOLE)
    _close(got, want, 2e-5)


@functools.partial(jax.jit, static_argnames="op")
def _each_layer(cache, qs, op):
    """Per layer (its own queries): the oracle on the sliced view, then the XLA path and
    the oracle on the whole-pool view."""
    out = []
    for layer, q in enumerate(qs):
        one = qz.layer_view(cache, layer)
        whole = qz.layer_view(cache, layer, whole_pools=True)
        out.append((op(one, "reference", *q), op(whole, "xla", *q), op(whole, "reference", *q)))
    return out


@pytest.mark.parametrize("mla", [False, True])
def test_mixed_bits_layers_of_whole_pools(rng, mla):
    # Layers with different widths live in different pools (layer 1 is entry 0 of the
    # 2-bit pool, layer 2 entry 1); MLA's k_rope pool is indexed by the layer itself.
    # Every edge length (9 slots): with 5, no slot is long enough to have quantized pages.
    cache = random_cache(rng, bits=(8, 2, 2), layers=3, mla=mla, batch=9)
    b = cache.spec.max_seqs
    if mla:
        qs = [(_normal(rng, (b, 8, DC)), _normal(rng, (b, 8, DR))) for _ in range(3)]
    else:
        qs = [(_normal(rng, (b, 8, D)),) for _ in range(3)]
    for want, xla_whole, ref_whole in _each_layer(cache, qs, _mla_decode if mla else _gqa_decode):
        _close(xla_whole, want, 2e-5)
        _close(ref_whole, want, 0.0)  # a whole-pool view sliced for the oracle


@jax.jit
def _scans_and_layers(cache, q):
    """Over a traced layer: scans of the XLA path (whole pools) and of the oracle (sliced
    views); and the oracle of each layer at a Python int."""
    layers = cache.spec.num_layers

    def scan(impl, whole):
        def body(c, layer):
            view = qz.layer_view(cache, layer, whole_pools=whole)
            return c, attention.quantized_decode_attention(q, view, impl=impl)

        return jax.lax.scan(body, 0, jnp.arange(layers))[1]

    return scan("xla", True), scan("reference", False), [
        attention.quantized_decode_attention(q, qz.layer_view(cache, layer), impl="reference")
        for layer in range(layers)]


def test_traced_layer_in_a_scan(rng):
    layers = 3
    # Every edge length (9 slots): with 5, no slot is long enough to have quantized pages.
    cache = random_cache(rng, bits=4, layers=layers, batch=9)
    q = _normal(rng, (9, 8, D))
    got, want, each = jax.tree.map(np.asarray, _scans_and_layers(cache, q))  # on the host
    _close(got, want, 2e-5)
    for layer in range(layers):  # and the scan really visits each layer
        _close((got[0][layer], got[1][layer]), each[layer], 2e-5)


def test_auto_is_xla_and_reference_is_the_oracle(monkeypatch):
    assert jax.default_backend() == "cpu"
    # Without the C++ CPU kernels, which "auto" prefers for GQA decode
    # (tests/attention/test_cpu_kernel.py).
    with cpu_options.override(kernels=False):
        assert registry.resolve("quantized_attention", "auto")[0] is xq.quantized_attention
        assert registry.resolve("quantized_mla_attention", "auto")[0] is (
            xq.quantized_mla_attention)
    assert registry.resolve("quantized_attention", "reference")[0] is qref.quantized_attention
    assert registry.resolve("quantized_mla_attention", "reference")[0] is (
        qref.quantized_mla_attention)


# ----------------------------------------------------------------------------- no big copies


def _float_sizes(jaxpr):
    """Element counts of every float array any equation of `jaxpr` (and its sub-jaxprs:
    while bodies, jit calls) produces. An optimization barrier's outputs are its inputs
    (the attention loop passes the cache's pools through one), not new arrays."""
    out = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if eqn.primitive.name == "optimization_barrier":
                continue
            if jnp.issubdtype(v.aval.dtype, jnp.floating):
                out.append(int(np.prod(v.aval.shape)))
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    out += _float_sizes(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    out += _float_sizes(sub)
    return out


@pytest.mark.parametrize("mla", [False, True])
def test_decode_jaxpr_has_no_dequantized_copy(rng, mla):
    """The jaxpr of a decode step holds no float array as large as the
    dequantized live cache (smaller than the pool), only blocks of pages."""
    batch = 4
    cache = random_cache(rng, bits=2, mla=mla, batch=batch, layers=2,
                         lengths=[PS * MAX_PAGES] * batch)
    heads, width = (1, DC) if mla else (2, D)
    pool = heads * cache.spec.num_pages * PS * width  # one layer, dequantized
    seqs = batch * heads * PS * MAX_PAGES * width  # every sequence's pages, dequantized
    assert seqs <= pool
    view = qz.layer_view(jax.tree.map(np.asarray, cache), 1, whole_pools=True)  # host arrays
    qp = view.lengths[:, None] - 1
    if mla:
        ql, qr = _normal(rng, (batch, 8, DC)), _normal(rng, (batch, 8, DR))

        def public(v, impl):
            return attention.quantized_mla_decode_attention(ql, qr, v, scale=0.2, impl=impl)

        def blocked(v):  # one page per block
            return xq.quantized_mla_attention(
                ql[:, None], qr[:, None], v.k.codes, v.k.scale, v.k.zero, v.v,
                v.tail_k[0], v.tail_v[0], v.quant_lengths, v.lengths, v.block_tables, qp,
                bits=2, scale=0.2, block_tokens=PS, layer=v.k.layer, rope_layer=v.layer)
    else:
        q = _normal(rng, (batch, 8, D))

        def public(v, impl):
            return attention.quantized_decode_attention(q, v, impl=impl)

        def blocked(v):
            return xq.quantized_attention(
                q[:, None], v.k.codes, v.k.scale, v.k.zero, v.v.codes, v.v.scale, v.v.zero,
                v.tail_k, v.tail_v, v.quant_lengths, v.lengths, v.block_tables, qp,
                k_bits=2, v_bits=2, scale=0.2, block_tokens=PS, layer=v.k.layer)

    def largest(fn, v):
        return max(_float_sizes(jax.make_jaxpr(fn)(v).jaxpr))

    # The check can fail: the reference dequantizes every sequence's pages at once.
    assert largest(lambda v: public(v, "reference"), view) >= seqs
    assert largest(lambda v: public(v, "xla"), view) < pool
    # Blocks of one page: nothing larger than two pages of every sequence (the tail ring
    # holds R + PS = 2 pages per sequence; a block holds one).
    assert largest(blocked, view) <= 2 * seqs // MAX_PAGES




@pytest.mark.parametrize("mla", [False, True])
def test_layers_loop_copies_no_pool(rng, mla):
    """A model-like step (a Python loop over layers, as a model's forward unrolls them in
    the decode loop of kvjax.generate when its layers are unstacked or differ) compiles
    with no top-level op as large as a layer's code pool or its float16 scale pool: no
    layer slice copied out of the pools, no whole-pool f16 -> f32 conversion, no
    dequantized copy. Fails with sliced views (whole_pools=False)."""
    batch, layers = 4, 2
    # A pool 16x larger than the live pages, so that a layer's float16 scales outweigh
    # any block and the tails.
    cache = random_cache(rng, bits=4, mla=mla, batch=batch, layers=layers,
                         lengths=[PS * MAX_PAGES] * batch, num_pages=16 * batch * MAX_PAGES)
    pools = cache.pages.c_kv[0] if mla else cache.pages.v[0]
    codes_layer = int(np.prod(pools.codes.shape[1:]))
    scale_layer = int(np.prod(pools.scale.shape[1:]))
    limit = min(codes_layer, scale_layer)
    if mla:
        q = (_normal(rng, (batch, 8, DC)), _normal(rng, (batch, 8, DR)))
    else:
        q = (_normal(rng, (batch, 8, D)),)

    def step(whole):
        def fn(cache, *q):
            x = 0.0
            for layer in range(layers):
                view = qz.layer_view(cache, layer, whole_pools=whole)
                if mla:
                    out, _ = attention.quantized_mla_decode_attention(*q, view, scale=0.2)
                else:
                    out, _ = attention.quantized_decode_attention(*q, view)
                x = x + out
            return x
        return fn

    # `materialised` of each program, compiled once: the same executables then run.
    sliced_step, whole_step = (jax.jit(step(w)).lower(cache, *q).compile() for w in (False, True))
    # The check can fail: sliced views make XLA copy each layer's pools into the loop.
    sliced = written(sliced_step.as_text())
    assert max(n for *_, n in sliced) >= limit
    whole = written(whole_step.as_text())
    assert max(n for *_, n in whole) < limit, whole
    np.testing.assert_allclose(np.asarray(whole_step(cache, *q)),
                               np.asarray(sliced_step(cache, *q)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["llama", "mla"])
def test_quantized_cache_decoder_matches_dense_forward(rng, name):
    """The decode loop runs a quantized cache through whole-pool views (the XLA path reads
    each layer inside its gathers): 8-bit pages over 2 layers stay close to the dense
    float32 forward, token by token (teacher forcing through `kvjax.generate.score`).
    Reading the wrong layer's pages would not: the layers' K/V are unrelated."""
    from kvjax import generate
    from kvjax.models.deepseek.params import init_from_shapes
    from kvjax.models.tiny import forward_dense, init_tiny, tiny_model
    from kvjax.specs import QuantSpec
    from tests.test_train import SMALL

    config = dataclasses.replace(SMALL[name], num_layers=2)
    # Raw key data: a typed key made by jax.random.key compiles a seeding program.
    key = np.asarray([0, rng.integers(1 << 30)], np.uint32)
    # Random params drawn on the host, as DeepSeek's init does (Llama's draws on the device:
    # a compiled program for nothing the test checks).
    params = init_tiny(config, key) if name == "mla" else init_from_shapes(
        jax.eval_shape(lambda k: init_tiny(config, k), key), key)
    tokens = rng.integers(0, 256, (2, 44)).astype(np.int32)
    ref = np.asarray(jax.jit(lambda p, t: jax.nn.log_softmax(forward_dense(p, config, t)))(
        params, jax.device_put(tokens)))
    cc = generate.CacheConfig(dtype="float32", page_size=16,
                              quant=QuantSpec(bits=8, group_size=16, residual=0))
    res = generate.score(tiny_model(config), params, tokens[:, :40].tolist(),
                         tokens[:, 40:44].tolist(), cache=cc, free_finished=False, impl="xla")
    assert int(np.asarray(res.cache.quant_lengths)[0]) == 32  # pages and tail both used
    # log p(token t | tokens < t) for t = 40..43, from the dense forward.
    want = np.take_along_axis(ref[:, 39:43], tokens[:, 40:44, None], axis=2)[..., 0]
    got = res.logprobs[:, :4]
    # 8-bit codes move each K/V element by at most half a step (range / 510): the
    # log-probabilities move by ~1e-3 nats; attending to the other layer's pages (layer
    # index dropped) moves them by ~0.1.
    err = np.max(np.abs(got - want))
    assert err < 1e-2, err
