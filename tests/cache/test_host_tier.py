"""The host-memory tier (`kvjax.cache.host`): pages in pinned_host memory, moves, swaps.

Decoding with most of a sequence's pages on the host gives the tokens of decoding with
all of them on the device (the demo models, bf16 and KIVI int4 pages), a swapped-out
sequence resumes exactly in another slot, and interleavings of moves, swaps, forks and
frees (a fixed start that takes every path, then random operations) keep both tiers'
invariants and every page's bytes, refused operations change nothing.

Pages that a copy should fill are scrubbed first (every free page of both tiers and
every empty ring holds random bytes, `_scrub`): a copy that writes nothing, or writes a
page short, leaves random bytes where the data should be, whichever pages the allocator
hands out. The small caches' writes and attention run as jitted programs, one per cache
kind, shared by the tests (compiling is most of this file's time).
"""

import collections
import dataclasses
import functools

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


def _prompts(rng):
    """Random lowercase words (the byte-level demo model then writes varied text): a
    prompt, a second chunk of prompt as long (its prefill runs the first one's compiled
    program) and a continuation to score."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    return tuple(rng.choice(letters, n).tolist() for n in (160, 160, 20))


def _spec(model, dtype, quant):
    spec = model.make_cache_spec(page_size=PS, num_pages=48, max_seqs=2, max_pages_per_seq=24,
                                 dtype=dtype)
    return spec if quant is None else spec.replace(quant=quant)


def _committed(cache):
    """The cache committed to its device, as every cache a jitted call returns: a fresh
    cache's uncommitted arrays make a program's first call compile a second program
    (jit's cache tells committed arguments from uncommitted ones)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), cache)


# Every decode of the demo model below generates this many tokens: the decode loop's
# programs (their shapes depend on it) are compiled once per cache kind and shared.
NEW_TOKENS = 16


def _prefilled(model, params, spec, prompt):
    """A cache with a host tier holding `prompt` and what the model wrote after it in
    slot 0 (greedy, so the same each time)."""
    cache = _committed(host.attach(kc.init_cache(spec), 24, parked=1, stream_pages=12))
    r = generate(model, params, [prompt], key=jax.random.key(0), max_new_tokens=NEW_TOKENS,
                 cache=cache, free_finished=False)
    return r.cache


def _noise(rng, shape, dtype, like):
    """Random values of `like`'s type (finite floats, any integer), stored as `dtype`
    (a host pool holds 16-bit floats as their bits)."""
    like = jnp.dtype(like)
    if jnp.issubdtype(like, jnp.floating):
        x = (4 * rng.standard_normal(shape)).astype(like)
    else:
        info = np.iinfo(like)
        x = rng.integers(info.min, info.max, shape, dtype=like, endpoint=True)
    return x.view(dtype)


def _scrub(cache, rng):
    """The cache with random bytes in every free page of both tiers, in the rings of empty
    slots and in those of free parked rows (page and row axis 2 everywhere): whatever a
    later copy should have filled, it cannot hold the right bytes by chance."""

    def garble(x, rows, like=None):
        a = np.array(x, copy=True)
        rows = np.flatnonzero(rows)
        a[:, :, rows] = _noise(rng, a[:, :, rows].shape, a.dtype,
                               a.dtype if like is None else like)
        return jax.device_put(a, x.sharding)

    tier, tail = cache.host, cache.tail
    free_dev = np.asarray(cache.table.refcounts) == 0
    free_host = np.asarray(tier.table.refcounts) == 0
    pages = jax.tree.map(lambda d: garble(d, free_dev), cache.pages)
    tier = dataclasses.replace(tier, pages=jax.tree.map(
        lambda h, d: garble(h, free_host, d.dtype), tier.pages, cache.pages))
    if tail is not None:
        empty = np.asarray(cache.lengths) == 0
        free_rows = np.asarray(tier.parked_lengths) == 0
        tier = dataclasses.replace(tier, tail_a=garble(tier.tail_a, free_rows, tail.a.dtype),
                                   tail_b=garble(tier.tail_b, free_rows, tail.b.dtype))
        tail = dataclasses.replace(tail, a=garble(tail.a, empty), b=garble(tail.b, empty))
    return dataclasses.replace(cache, pages=pages, tail=tail, host=tier)


@functools.partial(jax.jit, donate_argnums=0)
def _write_all(cache, a, b, q_lengths, seq_ids):
    """Every layer's new tokens (a, b: [layers, batch, T, heads, width], the first
    q_lengths[i] of row i real) written: one program per cache kind and T."""
    for layer in range(cache.spec.num_layers):
        cache = kc.write(cache, layer, a[layer], b[layer], q_lengths=q_lengths, seq_ids=seq_ids)
    return cache


@functools.partial(jax.jit, static_argnames="scale")
def _attend_both(plain, tiered, layer, q, q_lengths, scale=None):
    """(out, lse) of `plain` and of `tiered`, computed apart: one program per cache kind
    and query length instead of two."""
    return tuple(kc.attend(c, layer, q, q_lengths=q_lengths, scale=scale)
                 for c in (plain, tiered))


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
            total, q = int(np.asarray(tier.parked_lengths)[row]), int(hlen[r])
            ring = cache.tail.a.shape[3]
            pos = np.arange(q, total) % ring
            parts += [np.asarray(t).view(d.dtype)[:, :, row][:, :, pos]
                      for t, d in ((tier.tail_a, cache.tail.a), (tier.tail_b, cache.tail.b))]
        return parts
    n = -(-int(np.asarray(cache.table.lengths)[slot]) // ps)
    h = int(hlen[slot]) // ps
    dids = np.asarray(cache.table.block_tables)[slot, h:n]
    parts = [np.concatenate([hh[:, :, htab[slot, :h]], d[:, :, dids]], axis=2)
             for d, hh in zip(dev, hst, strict=True)]
    if cache.tail is not None:
        total, q = int(np.asarray(cache.lengths)[slot]), int(np.asarray(cache.quant_lengths)[slot])
        ring = cache.tail.a.shape[3]
        pos = np.arange(q, total) % ring
        parts += [np.asarray(t)[:, :, slot][:, :, pos] for t in (cache.tail.a, cache.tail.b)]
    return parts


def _same(a, b, what=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        np.testing.assert_array_equal(x, y, err_msg=f"{what} (array {i})")


# ------------------------------------------------------------------ attention over both tiers


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
def test_attention_over_host_pages_equals_attention_on_the_device(kind, dtype, rng):
    """Decode and chunked prefill, rows with 0, some and most pages on the host: the
    merged result equals that of the same cache without a host tier to float32 rounding
    (both sides compute in float32 from the same stored values)."""
    spec = _attn_spec(kind, dtype)
    lens = [int(rng.integers(57, 80)), int(rng.integers(20, 40)), int(rng.integers(3, 12))]
    mla = kind.startswith("mla")
    widths = spec.attention.cache_widths
    heads = 1 if mla else spec.attention.kv_heads
    t = spec.max_pages_per_seq * spec.page_size
    kv = [jax.device_put(rng.standard_normal((2, 3, t, heads, w)).astype(np.float32))
          for w in widths]
    lengths = np.array(lens, np.int32)

    plain, status = kc.reserve(_committed(kc.init_cache(spec)), lengths)
    status.raise_if_error()
    plain = _write_all(plain, *kv, lengths, None)
    # The same bytes with a tier attached (a copy: the moves below donate the cache), so
    # the writes compile once per kind.
    tiered = _committed(host.attach(
        jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), plain), 30,
        parked=1, stream_pages=8))
    # The queries' own tokens (up to 3 of them) stay on the device.
    most = min(host._movable(tiered, 0), 8, (lens[0] - 3) // 8)
    # A page at a time: every move runs the one program of one-page moves (how pages
    # reach the host is the business of the tests below).
    for s, n in [(0, i) for i in range(1, most + 1)] + [(1, 1)]:
        tiered, status = host.move(tiered, s, n)
        status.raise_if_error()
    assert host.host_pages(tiered).tolist() == [most, 1, 0] and most >= 5
    assert _memory_kinds(tiered) == {"pinned_host"}
    for q_len in (1, 3):
        if mla:
            q = tuple(jax.device_put(rng.standard_normal((3, q_len, 4, w)).astype(np.float32))
                      for w in widths)
            scale = 0.2
        else:
            q = jax.device_put(rng.standard_normal((3, q_len, 4, 16)).astype(np.float32))
            scale = None
        for layer in (0, 1):
            ql = np.full((3,), q_len, np.int32)
            (want, want_lse), (got, got_lse) = _attend_both(plain, tiered, layer, q, ql,
                                                            scale=scale)
            np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
            np.testing.assert_allclose(got_lse, want_lse, atol=2e-6, rtol=0)


# ------------------------------------------------------------------ end to end, the demo model


KINDS = [("float32", None), ("bfloat16", None),
         ("bfloat16", QuantSpec(bits=4, group_size=16, residual=16))]


@pytest.mark.rotate(1)  # one kind a run in turn (each end-to-end decode is 4-8 s)
@pytest.mark.parametrize("dtype,quant", KINDS, ids=["f32", "bf16", "int4"])
def test_ninety_percent_of_the_pages_on_the_host_decode_the_same_tokens(gqa, dtype, quant,
                                                                       rng):
    model, params = gqa
    spec = _spec(model, dtype, quant)
    p1, p2, cont = _prompts(rng)
    outs, logprobs = [], []
    n = 0
    for on_host in (False, True):
        cache = _prefilled(model, params, spec, p1)
        pages = -(-int(np.asarray(cache.lengths)[0]) // PS)
        if on_host:
            # KIVI: the quantized ones.
            paged_pages = -(-int(np.asarray(cache.table.lengths)[0]) // PS)
            n = min(-(-9 * pages // 10), cache.host.stream_pages, host._movable(cache, 0))
            free = int(cache.num_free_pages)
            cache, status = host.move(cache, 0, n)
            status.raise_if_error()
            # Counted in the device table: entries marked as living on the host, and the
            # device pages the slot still holds.
            bt = np.asarray(cache.table.block_tables)[0]
            marked = int(np.sum(bt == spec.num_pages))
            on_dev = int(np.sum((bt >= 0) & (bt < spec.num_pages)))
            assert (marked, on_dev) == (n, paged_pages - n)
            assert int(np.asarray(host.host_pages(cache))[0]) == n
            assert int(cache.num_free_pages) == free + n
            # Every page but the last one being written; KIVI also keeps its residual
            # (the last page's worth of full-precision tokens) on the device.
            assert n >= 0.9 * pages - (1 if quant is not None else 0), (n, pages)
            assert _memory_kinds(cache) == {"pinned_host"}
            host.check(cache)
        # Continue the sequence: a chunk of prompt (prefill over both tiers), then decode.
        r = generate(model, params, [p2], key=jax.random.key(0), max_new_tokens=NEW_TOKENS,
                     cache=cache, seq_ids=[0], free_finished=False)
        host.check(r.cache)
        assert int(np.asarray(host.host_pages(r.cache))[0]) == n
        outs.append(r.tokens[0])
        if dtype == "float32":
            # Teacher-forced log-probabilities see every attention output. Only with
            # float32 pages: in 16-bit or quantized pages a float32 rounding difference
            # upstream can flip the rounding of a token written later (one bf16 ulp,
            # one int4 step), a real but legitimate difference in what is cached.
            again = _prefilled(model, params, spec, p1)
            if on_host:
                again, status = host.move(again, 0, n)
                status.raise_if_error()
            logprobs.append(np.asarray(score(model, params, [p2], [cont], cache=again,
                                             seq_ids=[0]).logprobs))
    np.testing.assert_array_equal(outs[1], outs[0])
    if logprobs:
        np.testing.assert_allclose(logprobs[1], logprobs[0], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,quant", KINDS[1:], ids=["bf16", "int4"])
def test_a_swapped_out_sequence_resumes_in_another_slot(gqa, dtype, quant, rng):
    model, params = gqa
    spec = _spec(model, dtype, quant)
    p1, p2, _ = _prompts(rng)
    outs = []
    for swap in (False, True):
        cache = _prefilled(model, params, spec, p1)
        slot = 0
        if swap:
            want, length = _content(cache, slot=0), int(np.asarray(cache.lengths)[0])
            assert length > len(p1)
            before = int(cache.num_free_pages)
            cache, status = host.swap_out(cache, 0, 0)
            status.raise_if_error()
            assert int(np.asarray(cache.lengths)[0]) == 0 and int(cache.num_free_pages) > before
            assert int(np.asarray(host.parked_lengths(cache))[0]) == length
            host.check(cache)
            _same(_content(cache, row=0), want, "parked row 0 after the swap-out")
            # The slot's old pages (and every other free page, and slot 1's ring) now hold
            # random bytes: a swap-in that copies nothing cannot leave the right ones.
            cache = _scrub(cache, rng)
            cache, status = host.swap_in(cache, 0, 1)
            status.raise_if_error()
            host.check(cache)
            assert int(np.asarray(host.parked_lengths(cache))[0]) == 0
            _same(_content(cache, slot=1), want, "slot 1 after the swap-in")
            slot = 1
        r = generate(model, params, [p2], key=jax.random.key(1), max_new_tokens=NEW_TOKENS,
                     cache=cache, seq_ids=[slot], free_finished=False)
        outs.append(r.tokens[0])
    np.testing.assert_array_equal(outs[1], outs[0])


# ------------------------------------------------------------------ invariants, bytes

HOST_PAGES = 10  # of the small caches' tiers (the device pools hold 14)


def _spec_small(quant: bool, dtype: str = "float32"):
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=2,
        page_size=8, num_pages=14, max_seqs=3, max_pages_per_seq=6, dtype=dtype,
        quant=QuantSpec(bits=4, group_size=8, residual=8) if quant else None)


def _small_tier(spec, rng):
    """An empty small cache with the tier every test below uses (programs shared)."""
    return _scrub(_committed(host.attach(kc.init_cache(spec), HOST_PAGES, parked=2,
                                         stream_pages=4)), rng)


def _paged_pages(spec, n: int) -> int:
    """Pages n tokens take in the page table (KIVI: the quantized ones, those past the
    residual in whole pages)."""
    ps = spec.page_size
    return -(-n // ps) if spec.quant is None else max(n - spec.quant.residual, 0) // ps


def _fill(cache, slot, n, rng):
    """Slot `slot` (empty) receives n random tokens in every layer; False (nothing
    changed) when the device pool is too small."""
    num = np.zeros(cache.spec.max_seqs, np.int32)
    num[slot] = n
    cache, status = kc.reserve(cache, num)
    if not bool(status.ok):
        return cache, False
    spec, a = cache.spec, cache.spec.attention
    t = spec.max_pages_per_seq * spec.page_size   # one program for every n
    k, v = (jax.device_put(rng.standard_normal((spec.num_layers, 1, t, a.kv_heads,
                                                a.head_dim)).astype(np.float32))
            for _ in range(2))
    return _write_all(cache, k, v, np.array([n], np.int32), np.array([slot], np.int32)), True


def _tables(cache):
    """Both tiers' allocator state, copied to the host (the next call donates the cache)."""
    t, h = cache.table, cache.host.table
    return [np.array(x, copy=True) for x in (
        t.block_tables, t.lengths, t.refcounts, t.free_stack, t.num_free, cache.lengths,
        h.block_tables, h.lengths, h.refcounts, h.free_stack, h.num_free,
        cache.host.parked_lengths)]


def _held(block_row, num_pages: int) -> int:
    """Pages of a pool a block-table row holds (entries of that pool's page ids)."""
    return int(np.sum((block_row >= 0) & (block_row < num_pages)))


PATHS = ("move out", "move back", "swap out", "swap in", "refused")


def _every_path(rng):
    """Operations that take every path whatever the page kind (dense or KIVI on
    `_spec_small`, a tier of HOST_PAGES pages): pages out and back, a sequence parked with
    a page on the host already and back into another slot, then a host pool filled up
    so that a swap-out and a move are refused. Slots, rows and lengths are drawn."""
    s0, s1, s2 = (int(x) for x in rng.permutation(3))
    r0, r1 = (int(x) for x in rng.permutation(2))
    return [("fill", s0, 0, int(rng.integers(40, 49))),  # 5-6 pages (KIVI: 4-5)
            ("move", s0, 0, 32),        # 4 pages out
            ("move", s0, 0, 8),         # 3 back
            ("swap_out", s0, r0, 0),    # parked: its host page moves with it
            ("swap_in", s1, r0, 0),     # into another slot
            ("move", s1, 0, 32),        # 4 out: 6 host pages stay free
            ("fill", s0, 0, 48),
            ("swap_out", s0, r0, 0),    # 6 pages (KIVI: 5): 0 (1) stay free
            ("fill", s2, 0, int(rng.integers(24, 49))),
            ("swap_out", s2, r1, 0),    # refused: 3 pages or more (KIVI: 2)
            ("move", s2, 0, 16)]        # refused: 2 pages out


def _interleave(spec, ops, rng):
    """Runs `ops` on a tiered cache and checks, after each, its status against the pages
    it needed and had, the invariants and every byte; a refused operation must leave
    both tiers' tables as they were. Returns how often each of PATHS was taken."""
    cache = _small_tier(spec, rng)
    live: dict[int, list] = {}      # slot -> content
    parked: dict[int, list] = {}    # row -> content
    taken = collections.Counter()
    for step, (op, a, b, n) in enumerate(ops):
        when = f"after operation {step}, {op}({a}, {b}, {n})"
        before = _tables(cache)
        dev_free, host_free = int(before[4]), int(before[10])
        status = None
        if op == "fill" and a not in live:
            cache, ok = _fill(cache, a, n, rng)
            assert ok == (_paged_pages(spec, n) <= dev_free), f"{when}: {dev_free} pages free"
            if ok:
                live[a] = _content(cache, slot=a)
            else:
                _same(_tables(cache), before, f"the tables {when} (refused)")
        elif op == "move" and a in live:
            h = int(np.asarray(host.host_pages(cache))[a])
            target = min(n // spec.page_size, 4, host._movable(cache, a))
            path = "move out" if target > h else "move back" if target < h else "move none"
            need, free = (target - h, host_free) if target >= h else (h - target, dev_free)
            cache, status = host.move(cache, a, target)
            if bool(status.ok):
                assert int(np.asarray(host.host_pages(cache))[a]) == target
        elif op == "swap_out" and a in live and b not in parked:
            path, need, free = "swap out", _held(before[0][a], spec.num_pages), host_free
            cache, status = host.swap_out(cache, a, b)
            if bool(status.ok):
                parked[b] = live.pop(a)
        elif op == "swap_in" and b in parked and a not in live:
            path, free = "swap in", dev_free
            need = _held(before[6][spec.max_seqs + b], HOST_PAGES)
            cache, status = host.swap_in(cache, b, a)
            if bool(status.ok):
                live[a] = parked.pop(b)
        elif op == "drop" and b in parked:
            cache = host.drop_parked(cache, b)
            del parked[b]
        elif op == "free" and a in live:
            cache = kc.free(cache, np.arange(3) == a)
            del live[a]
        elif op == "fork" and a in live:
            dst = next((s for s in range(3) if s not in live), None)
            if dst is not None:
                cache, fork_status = kc.fork(cache, np.array([a], np.int32),
                                             np.array([dst], np.int32))
                fork_status.raise_if_error()   # an empty target: a fork needs no page
                live[dst] = live[a]
        if status is not None:
            assert bool(status.ok) == (need <= free), (
                f"{when}: status {int(status.code)} with {need} pages needed, {free} free")
            if bool(status.ok):
                taken[path] += 1
            else:
                taken["refused"] += 1
                _same(_tables(cache), before, f"the tables {when} (refused)")
        # Whatever a later copy should fill holds random bytes from here on.
        cache = _scrub(cache, rng)
        host.check(cache)
        for s, want in live.items():
            _same(_content(cache, slot=s), want, f"slot {s} {when}")
        for r, want in parked.items():
            _same(_content(cache, row=r), want, f"parked row {r} {when}")
        for s in range(3):
            if s not in live:
                assert int(np.asarray(cache.lengths)[s]) == 0
    assert _memory_kinds(cache) == {"pinned_host"}
    # Everything released: both pools whole again.
    cache = kc.free(cache, np.ones(3, bool))
    for r in list(parked):
        cache = host.drop_parked(cache, r)
    host.check(cache)
    assert int(cache.num_free_pages) == 14 and int(cache.host.table.num_free) == HOST_PAGES
    return taken


OPS = st.lists(st.tuples(st.sampled_from(["fill", "move", "swap_out", "swap_in", "drop", "free",
                                          "fork"]),
                         st.integers(0, 2), st.integers(0, 1), st.sampled_from([5, 8, 21, 40])),
               min_size=4, max_size=12)


@pytest.mark.rotate(1)
@pytest.mark.parametrize("quant", [False, True], ids=["f32", "int4"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**31 - 1))
def test_random_interleavings_keep_both_tiers_and_every_byte(quant, ops, seed):
    rng = np.random.default_rng(seed)
    taken = _interleave(_spec_small(quant), _every_path(rng) + ops, rng)
    assert all(taken[p] > 0 for p in PATHS), taken


def test_a_full_host_pool_changes_nothing(rng):
    spec = _spec_small(False)
    cache = _small_tier(spec, rng)
    cache, ok = _fill(cache, 0, 48, rng)
    assert ok
    cache, status = host.swap_out(cache, 0, 0)      # 6 of the host's 10 pages
    status.raise_if_error()
    for slot, n in ((1, 48), (2, 40)):
        cache, ok = _fill(cache, slot, n, rng)
        assert ok
    cache, status = host.move(cache, 1, 4)          # the other 4
    status.raise_if_error()
    assert int(cache.host.table.num_free) == 0
    want, before = _content(cache, slot=2), _tables(cache)
    cache, status = host.move(cache, 2, 2)          # 2 more: refused
    assert int(status.code) == 1
    with pytest.raises(kc.CacheFullError):
        status.raise_if_error()
    cache, status = host.swap_out(cache, 2, 1)
    assert int(status.code) == 1
    host.check(cache)
    _same(_tables(cache), before)
    assert np.asarray(host.host_pages(cache))[2] == 0 and np.asarray(cache.lengths)[2] == 40
    _same(_content(cache, slot=2), want)


def test_bad_arguments_name_what_was_given(rng):
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
    cache = _small_tier(plain.spec, rng)
    with pytest.raises(ValueError, match="host tier already"):
        host.attach(cache, 4)
    cache, ok = _fill(cache, 0, 21, rng)            # 3 pages: 2 may move
    assert ok
    with pytest.raises(ValueError, match=r"slot 0 can keep 0 \.\. 2 pages .* got 3"):
        host.move(cache, 0, 3)
    with pytest.raises(ValueError, match="slot 3 is outside"):
        host.move(cache, 3, 1)
    with pytest.raises(ValueError, match="slot 1 holds no sequence"):
        host.swap_out(cache, 1, 0)
    with pytest.raises(ValueError, match="parked row 2 is outside"):
        host.swap_out(cache, 0, 2)
    with pytest.raises(ValueError, match="parked row 0 holds no sequence"):
        host.swap_in(cache, 0, 1)
    cache, status = host.move(cache, 0, 2)
    status.raise_if_error()
    # Truncating into the middle of a host page is refused; whole pages are fine.
    with pytest.raises(ValueError, match="first 16 tokens in host pages.*got 12"):
        kc.truncate(cache, np.array([12, 0, 0]))
    cache, status = kc.truncate(cache, np.array([8, 0, 0]))
    status.raise_if_error()
    host.check(cache)
    assert int(np.asarray(host.host_pages(cache))[0]) == 1


# The jitted programs that copy pages between the tiers (the only callers of
# `_write_host_pages` / `_read_host_pages`, which read PAGE_AT_A_TIME when traced).
_COPYING_PROGRAMS = ("_move", "_swap_out", "_swap_in")


@pytest.fixture
def page_at_a_time(monkeypatch):
    """Moves take the GPU's way (one page at a time, device_put + dynamic_update_slice into
    the donated host pool) on this CPU; a host computation would raise."""
    def no_host_compute(*args, **kwargs):
        raise AssertionError("a page move ran a host computation")

    def retrace():  # only the copying programs: the others are shared with other tests
        for name in _COPYING_PROGRAMS:
            getattr(host, name).clear_cache()

    monkeypatch.setattr(host, "PAGE_AT_A_TIME", True)
    monkeypatch.setattr(host, "_on_host", no_host_compute)
    retrace()
    yield
    retrace()


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "int4"])
def test_page_at_a_time_moves_keep_both_tiers_and_every_byte(page_at_a_time, quant, rng):
    ops = _every_path(rng)
    ops += [(str(rng.choice(["fill", "fill", "move", "swap_out", "swap_in", "drop", "free",
                             "fork"])), int(rng.integers(3)), int(rng.integers(2)),
             int(rng.choice([5, 8, 21, 40]))) for _ in range(12)]
    taken = _interleave(_spec_small(quant, "bfloat16"), ops, rng)
    assert all(taken[p] > 0 for p in PATHS), taken


def test_a_policy_keeps_a_swap_tier_and_refuses_host_resident_pages(gqa, rng):
    from kvjax.cache.policies import StreamingLLM, UndefinedCombination

    model, params = gqa
    spec = _spec(model, "float32", None)
    p1, p2, _ = _prompts(rng)
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
