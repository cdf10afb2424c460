"""The host-memory tier (`kvjax.cache.host`): pages in pinned_host memory, moves, swaps.

Decoding with most of a sequence's pages on the host gives the tokens of decoding with
all of them on the device (the demo models, bf16 and KIVI int4 pages), a swapped-out
sequence resumes exactly, and random interleavings of moves, swaps, forks and frees
keep both tiers' invariants and every page's bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax as kvx
from kvjax import cache as kc
from kvjax.cache import host
from kvjax.generate import generate, score
from kvjax.models.tiny import load_tiny
from kvjax.specs import QuantSpec

PS = 16


def _memory_kinds(cache):
    leaves = jax.tree.leaves((cache.host.pages, cache.host.tail_a, cache.host.tail_b))
    return {x.sharding.memory_kind for x in leaves}


@pytest.fixture(scope="module")
def gqa():
    return load_tiny("gqa")


def _prompts(seed):
    """Random lowercase words (the byte-level demo model then writes varied text)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    return tuple(rng.choice(letters, n).tolist() for n in (300, 9, 20))


def _spec(model, dtype, quant):
    spec = model.make_cache_spec(page_size=PS, num_pages=48, max_seqs=2, max_pages_per_seq=24,
                                 dtype=dtype)
    return spec if quant is None else spec.replace(quant=quant)


def _prefilled(model, params, spec, prompt):
    """A cache with a host tier holding `prompt` in slot 0."""
    cache = host.attach(kc.init_cache(spec), 40, parked=1, stream_pages=20)
    r = generate(model, params, [prompt], key=jax.random.key(0), max_new_tokens=1,
                 cache=cache, free_finished=False)
    return r.cache


def _attn_spec(kind: str, dtype: str):
    quant = QuantSpec(bits=4, group_size=8, residual=8) if kind.endswith("int4") else None
    attention = (kvx.MLASpec(q_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=8) if kind.startswith("mla")
                 else kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16))
    return kvx.CacheSpec(attention=attention, num_layers=2, page_size=8, num_pages=40,
                         max_seqs=3, max_pages_per_seq=10, dtype=dtype, quant=quant)


@pytest.mark.slow
@pytest.mark.parametrize("kind,dtype", [("gqa", "float32"), ("gqa", "bfloat16"),
                                        ("gqa-int4", "bfloat16"), ("mla", "float32"),
                                        ("mla-int4", "float32")])
def test_attention_over_host_pages_equals_attention_on_the_device(kind, dtype):
    """Decode and chunked prefill, rows with 0, some and most pages on the host: the
    merged result equals the all-device one to float32 rounding."""
    spec = _attn_spec(kind, dtype)
    rng = np.random.default_rng()
    lens = [int(rng.integers(57, 80)), int(rng.integers(20, 40)), int(rng.integers(3, 12))]
    a = spec.attention
    mla = kind.startswith("mla")
    widths = a.cache_widths
    heads = 1 if mla else a.kv_heads
    kv = [[jnp.asarray(rng.standard_normal((3, max(lens), heads, w)), jnp.float32)
           for w in widths] for _ in range(2)]

    def build(moves):
        c = host.attach(kc.init_cache(spec), 30, parked=1, stream_pages=8)
        c, status = kc.reserve(c, jnp.array(lens))
        status.raise_if_error()
        for layer in range(2):
            c = kc.write(c, layer, *kv[layer], q_lengths=jnp.array(lens))
        for s, n in moves:
            c, status = host.move(c, s, n)
            status.raise_if_error()
        return c

    plain = build([])
    # The queries' own tokens (up to 3 of them) stay on the device.
    most = min(host._movable(plain, 0), 8, (lens[0] - 3) // 8)
    tiered = build([(0, most), (1, 1)])
    assert host.host_pages(tiered).tolist() == [most, 1, 0] and most >= 5
    assert _memory_kinds(tiered) == {"pinned_host"}
    for q_len in (1, 3):
        if mla:
            q = tuple(jnp.asarray(rng.standard_normal((3, q_len, 4, w)), jnp.float32)
                      for w in widths)
            kw = dict(scale=0.2)
        else:
            q = jnp.asarray(rng.standard_normal((3, q_len, 4, 16)), jnp.float32)
            kw = {}
        for layer in (0, 1):
            ql = jnp.full((3,), q_len, jnp.int32)
            want, want_lse = kc.attend(plain, layer, q, q_lengths=ql, **kw)
            got, got_lse = kc.attend(tiered, layer, q, q_lengths=ql, **kw)
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
            np.testing.assert_allclose(got_lse, want_lse, atol=2e-6, rtol=0)


KINDS = [("float32", None), ("bfloat16", None),
         ("bfloat16", QuantSpec(bits=4, group_size=16, residual=16))]


@pytest.mark.rotate(1)  # one kind a day in turn (each end-to-end decode is 4-8 s)
@pytest.mark.parametrize("dtype,quant", KINDS, ids=["f32", "bf16", "int4"])
def test_ninety_percent_of_the_pages_on_the_host_decode_the_same_tokens(gqa, dtype, quant):
    model, params = gqa
    spec = _spec(model, dtype, quant)
    p1, p2, cont = _prompts(int(np.random.default_rng().integers(1 << 30)))
    outs, logprobs = [], []
    for on_host in (False, True):
        cache = _prefilled(model, params, spec, p1)
        pages = -(-int(cache.lengths[0]) // PS)
        if on_host:
            n = int(0.9 * pages)
            cache, status = host.move(cache, 0, n)
            status.raise_if_error()
            assert int(host.host_pages(cache)[0]) == n >= 0.9 * pages - 1
            assert _memory_kinds(cache) == {"pinned_host"}
            host.check(cache)
        # Continue the sequence: a chunk of prompt (prefill over both tiers), then decode.
        r = generate(model, params, [p2], key=jax.random.key(0), max_new_tokens=24,
                     cache=cache, seq_ids=[0], free_finished=False)
        host.check(r.cache)
        assert int(host.host_pages(r.cache)[0]) == (n if on_host else 0)
        outs.append(r.tokens[0])
        if dtype == "float32":
            # Teacher-forced log-probabilities see every attention output. Only with
            # float32 pages: in 16-bit or quantized pages a float32 rounding difference
            # upstream can flip the rounding of a token written later (one bf16 ulp,
            # one int4 step), a real but legitimate difference in what is cached.
            again = _prefilled(model, params, spec, p1)
            if on_host:
                again, _ = host.move(again, 0, n)
            logprobs.append(np.asarray(score(model, params, [p2], [cont], cache=again,
                                             seq_ids=[0]).logprobs))
    np.testing.assert_array_equal(outs[1], outs[0])
    if logprobs:
        np.testing.assert_allclose(logprobs[1], logprobs[0], rtol=2e-5, atol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("dtype,quant", KINDS[1:], ids=["bf16", "int4"])
def test_a_swapped_out_sequence_resumes_in_another_slot(gqa, dtype, quant):
    model, params = gqa
    spec = _spec(model, dtype, quant)
    p1, p2, _ = _prompts(int(np.random.default_rng().integers(1 << 30)))
    outs = []
    for swap in (False, True):
        cache = _prefilled(model, params, spec, p1)
        slot = 0
        if swap:
            before = int(cache.num_free_pages)
            cache, status = host.swap_out(cache, 0, 0)
            status.raise_if_error()
            assert int(cache.lengths[0]) == 0 and int(cache.num_free_pages) > before
            assert int(host.parked_lengths(cache)[0]) == len(p1)
            host.check(cache)
            cache, status = host.swap_in(cache, 0, 1)
            status.raise_if_error()
            host.check(cache)
            assert int(host.parked_lengths(cache)[0]) == 0
            slot = 1
        r = generate(model, params, [p2], key=jax.random.key(1), max_new_tokens=16,
                     cache=cache, seq_ids=[slot], free_finished=False)
        outs.append(r.tokens[0])
    np.testing.assert_array_equal(outs[1], outs[0])


# ------------------------------------------------------------------ invariants, bytes


def _spec_small(quant: bool, dtype: str = "float32"):
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=2,
        page_size=8, num_pages=14, max_seqs=3, max_pages_per_seq=6, dtype=dtype,
        quant=QuantSpec(bits=4, group_size=8, residual=8) if quant else None)


def _fill(cache, slot, n, rng):
    """Slot `slot` (empty) receives n random tokens in every layer."""
    num = np.zeros(cache.spec.max_seqs, np.int32)
    num[slot] = n
    cache, status = kc.reserve(cache, jnp.asarray(num))
    if not bool(status.ok):
        return cache, False
    a = cache.spec.attention
    for layer in range(cache.spec.num_layers):
        k, v = (jnp.asarray(rng.standard_normal((1, n, a.kv_heads, a.head_dim)), jnp.float32)
                for _ in range(2))
        cache = kc.write(cache, layer, k, v, q_lengths=jnp.array([n]), seq_ids=jnp.array([slot]))
    return cache, True


def _content(cache, slot=None, row=None):
    """Every byte a sequence holds, in logical order, wherever its pages live."""
    spec, tier = cache.spec, cache.host
    ps = spec.page_size
    dev = [np.asarray(x) for x in jax.tree.leaves(cache.pages)]
    # Host pools hold 16-bit floats as their bits: read them in the device pools' types.
    hst = [np.asarray(x).view(d.dtype) for x, d in zip(jax.tree.leaves(tier.pages), dev,
                                                       strict=True)]
    htab = np.asarray(tier.table.block_tables)
    hlen = np.asarray(tier.table.lengths)
    if row is not None:
        r = spec.max_seqs + row
        ids = htab[r, : -(-int(hlen[r]) // ps)]
        parts = [h[:, :, ids] for h in hst]
        if cache.tail is not None:
            total, q = int(tier.parked_lengths[row]), int(hlen[r])
            ring = cache.tail.a.shape[3]
            pos = np.arange(q, total) % ring
            parts += [np.asarray(t).view(d.dtype)[:, :, row][:, :, pos]
                      for t, d in ((tier.tail_a, cache.tail.a), (tier.tail_b, cache.tail.b))]
        return parts
    n = -(-int(cache.table.lengths[slot]) // ps)
    h = int(hlen[slot]) // ps
    dids = np.asarray(cache.table.block_tables)[slot, h:n]
    parts = [np.concatenate([hh[:, :, htab[slot, :h]], d[:, :, dids]], axis=2)
             for d, hh in zip(dev, hst, strict=True)]
    if cache.tail is not None:
        total, q = int(cache.lengths[slot]), int(cache.quant_lengths[slot])
        ring = cache.tail.a.shape[3]
        pos = np.arange(q, total) % ring
        parts += [np.asarray(t)[:, :, slot][:, :, pos] for t in (cache.tail.a, cache.tail.b)]
    return parts


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


OPS = st.lists(st.tuples(st.sampled_from(["fill", "move", "swap_out", "swap_in", "drop", "free",
                                          "fork"]),
                         st.integers(0, 2), st.integers(0, 1), st.sampled_from([5, 8, 21, 40])),
               min_size=4, max_size=14)


@pytest.mark.rotate(1)
@pytest.mark.parametrize("quant", [False, True], ids=["f32", "int4"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**31 - 1))
def test_random_interleavings_keep_both_tiers_and_every_byte(quant, ops, seed):
    _interleave(_spec_small(quant), ops, np.random.default_rng(seed))


@pytest.fixture
def page_at_a_time(monkeypatch):
    """Moves take the GPU's way (one page at a time, device_put + dynamic_update_slice into
    the donated host pool) on this CPU; a host computation would raise."""
    def no_host_compute(*args, **kwargs):
        raise AssertionError("a page move ran a host computation")

    monkeypatch.setattr(host, "PAGE_AT_A_TIME", True)
    monkeypatch.setattr(host, "_on_host", no_host_compute)
    jax.clear_caches()  # the tier's programs retrace with the patched path
    yield
    jax.clear_caches()


@pytest.mark.heavy
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "int4"])
def test_page_at_a_time_moves_keep_both_tiers_and_every_byte(page_at_a_time, quant):
    rng = np.random.default_rng()
    # Every kind of move at least once (pages out and back, a sequence parked with some of
    # its pages on the host already, and back into another slot), then a random sequence.
    ops = [("fill", 0, 0, 40), ("move", 0, 0, 40), ("move", 0, 0, 0), ("move", 0, 0, 21),
           ("swap_out", 0, 1, 0), ("swap_in", 1, 1, 0)]
    ops += [(str(rng.choice(["fill", "fill", "move", "swap_out", "swap_in", "drop", "free",
                             "fork"])), int(rng.integers(3)), int(rng.integers(2)),
             int(rng.choice([5, 8, 21, 40]))) for _ in range(20)]
    _interleave(_spec_small(quant, "bfloat16"), ops, rng)


def _interleave(spec, ops, rng):
    """Runs `ops` on a tiered cache and checks the invariants and every byte after each."""
    cache = host.attach(kc.init_cache(spec), 10, parked=2, stream_pages=4)
    live: dict[int, list] = {}      # slot -> content
    parked: dict[int, list] = {}    # row -> content
    for op, a, b, n in ops:
        if op == "fill" and a not in live:
            cache, ok = _fill(cache, a, n, rng)
            if ok:
                live[a] = _content(cache, slot=a)
        elif op == "move" and a in live:
            limit = min(4, host._movable(cache, a))
            target = min(n // 8, limit)
            cache, status = host.move(cache, a, target)
            assert int(host.host_pages(cache)[a]) == (target if bool(status.ok) else
                                                      int(host.host_pages(cache)[a]))
        elif op == "swap_out" and a in live and b not in parked:
            cache, status = host.swap_out(cache, a, b)
            if bool(status.ok):
                parked[b] = live.pop(a)
        elif op == "swap_in" and b in parked and a not in live:
            cache, status = host.swap_in(cache, b, a)
            if bool(status.ok):
                live[a] = parked.pop(b)
        elif op == "drop" and b in parked:
            cache = host.drop_parked(cache, b)
            del parked[b]
        elif op == "free" and a in live:
            cache = kc.free(cache, jnp.arange(3) == a)
            del live[a]
        elif op == "fork" and a in live:
            dst = next((s for s in range(3) if s not in live), None)
            if dst is not None:
                cache, status = kc.fork(cache, jnp.array([a]), jnp.array([dst]))
                if bool(status.ok):
                    live[dst] = live[a]
        host.check(cache)
        for s, want in live.items():
            _same(_content(cache, slot=s), want)
        for r, want in parked.items():
            _same(_content(cache, row=r), want)
        for s in range(3):
            if s not in live:
                assert int(cache.lengths[s]) == 0
    assert _memory_kinds(cache) == {"pinned_host"}
    # Everything released: both pools whole again.
    cache = kc.free(cache, jnp.ones(3, bool))
    for r in list(parked):
        cache = host.drop_parked(cache, r)
    host.check(cache)
    assert int(cache.num_free_pages) == 14 and int(cache.host.table.num_free) == 10


@pytest.mark.heavy
def test_a_full_host_pool_changes_nothing():
    rng = np.random.default_rng(3)
    cache = host.attach(kc.init_cache(_spec_small(False)), 2, parked=1, stream_pages=4)
    cache, _ = _fill(cache, 0, 40, rng)
    want = _content(cache, slot=0)
    cache, status = host.move(cache, 0, 4)          # 4 pages, the host holds 2
    assert int(status.code) == 1
    with pytest.raises(kc.CacheFullError):
        status.raise_if_error()
    cache, status = host.swap_out(cache, 0, 0)
    assert not bool(status.ok)
    host.check(cache)
    assert int(host.host_pages(cache)[0]) == 0 and int(cache.lengths[0]) == 40
    _same(_content(cache, slot=0), want)


def test_bad_arguments_name_what_was_given():
    rng = np.random.default_rng(4)
    plain = kc.init_cache(_spec_small(False))
    with pytest.raises(ValueError, match="no host tier"):
        host.move(plain, 0, 1)
    with pytest.raises(ValueError, match="stream_pages must be below"):
        host.attach(plain, 4, stream_pages=6)
    mesh = jax.make_mesh((8,), ("model",))
    spread = jax.tree.map(lambda x: jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())), plain)
    with pytest.raises(ValueError, match="sharded over a mesh"):
        host.attach(spread, 4)
    cache = host.attach(plain, 6, parked=1, stream_pages=3)
    with pytest.raises(ValueError, match="host tier already"):
        host.attach(cache, 4)
    cache, _ = _fill(cache, 0, 21, rng)            # 3 pages: 2 may move
    with pytest.raises(ValueError, match=r"slot 0 can keep 0 \.\. 2 pages .* got 3"):
        host.move(cache, 0, 3)
    with pytest.raises(ValueError, match="slot 3 is outside"):
        host.move(cache, 3, 1)
    with pytest.raises(ValueError, match="slot 1 holds no sequence"):
        host.swap_out(cache, 1, 0)
    with pytest.raises(ValueError, match="parked row 1 is outside"):
        host.swap_out(cache, 0, 1)
    with pytest.raises(ValueError, match="parked row 0 holds no sequence"):
        host.swap_in(cache, 0, 1)
    cache, _ = host.move(cache, 0, 2)
    # Truncating into the middle of a host page is refused; whole pages are fine.
    with pytest.raises(ValueError, match="first 16 tokens in host pages.*got 12"):
        kc.truncate(cache, jnp.array([12, 0, 0]))
    cache, status = kc.truncate(cache, jnp.array([8, 0, 0]))
    status.raise_if_error()
    host.check(cache)
    assert int(host.host_pages(cache)[0]) == 1


@pytest.mark.heavy
def test_a_policy_keeps_a_swap_tier_and_refuses_host_resident_pages(gqa):
    from kvjax.cache.policies import StreamingLLM, UndefinedCombination

    model, params = gqa
    spec = _spec(model, "float32", None)
    p1, p2, _ = _prompts(int(np.random.default_rng().integers(1 << 30)))
    policy = StreamingLLM(n_sink=4, window=40)
    want = generate(model, params, [p1[:120]], key=jax.random.key(0), max_new_tokens=12,
                    cache=kc.init_cache(spec), policy=policy)
    swaps = host.attach(kc.init_cache(spec), 8, parked=1, stream_pages=0)
    got = generate(model, params, [p1[:120]], key=jax.random.key(0), max_new_tokens=12,
                   cache=swaps, policy=policy)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.cache.host is not None and _memory_kinds(got.cache) == {"pinned_host"}
    streaming = host.attach(kc.init_cache(spec), 8, parked=1, stream_pages=4)
    with pytest.raises(UndefinedCombination, match="stream_pages=4"):
        generate(model, params, [p2], key=jax.random.key(0), max_new_tokens=4,
                 cache=streaming, policy=policy)
