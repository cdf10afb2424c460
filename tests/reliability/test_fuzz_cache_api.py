"""Fuzz the public cache API: after every call, a clear error and the cache unchanged, or a
consistent cache.

Found a corrupted allocator state (`check_invariants` after each call) before.
Hypothesis drives `kvjax.cache.reserve`, `fork`, `free` and `write` — eagerly (the host
checks run) and under a caller's jit (the values are traced: statuses and masking
instead of errors) — on a full-precision and a KIVI cache, with valid and invalid
arguments: negative, huge and int32-overflowing counts, float or mis-shaped vectors,
slots outside the table, repeated or busy, layers past the cache, K/V of the wrong
shape, non-finite values. After each call:

  * an exception must be a ValueError or TypeError, and the cache it was given must
    still exist and hold exactly what it held;
  * a failed status (out of pages, too long, bad count, bad fork) must leave the cache
    as it was (a KIVI cache clears its pending counts: the step's write that follows
    then writes nothing);
  * otherwise `check_invariants` holds and every sequence's length is what the calls
    so far make it; on the full-precision cache every token written so far reads back
    exactly (a write never lands in another sequence's page, copy-on-write isolates
    forks, a freed sequence takes nothing with it).

The default run makes at least 2,000 calls (2 caches x 21 examples x 50 calls) in a few
seconds once compiled; `--slow` (or KVJAX_SLOW=1) makes five times as many. Shapes are
fixed so that every jitted function compiles once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax.cache as kc
from kvjax.cache import page_table as pt
from kvjax.cache import quantized as qz
from kvjax.specs import AttentionSpec, CacheSpec, QuantSpec
from tests.reliability import tiny

MAX_SEQS, PS, MAX_PAGES, NUM_PAGES, LAYERS = 4, 4, 4, 10, 2
HEADS, WIDTH = 2, 8
Q_LEN = 8  # tokens per write (a KIVI write must cover everything the last reserve added)
MAX_TOKENS = MAX_PAGES * PS
STEPS, EXAMPLES = 50, 21
KIVI = QuantSpec(bits=4, group_size=4, residual=4)


def _spec(kivi: bool) -> CacheSpec:
    return CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=HEADS, head_dim=WIDTH),
                     num_layers=LAYERS, page_size=PS, num_pages=NUM_PAGES, max_seqs=MAX_SEQS,
                     max_pages_per_seq=MAX_PAGES, dtype="float32",
                     quant=KIVI if kivi else None)


# A caller's jit around the public operations: arguments traced, the cache donated.
_reserve_jit = jax.jit(kc.reserve, donate_argnames="cache")
_fork_jit = jax.jit(kc.fork, donate_argnames="cache")


_quantized_write = jax.jit(qz.write_layer, static_argnames="layer")


@functools.cache
def _write_jit(layer: int):
    def write(cache, a, b, q_lengths, seq_ids):
        return kc.write(cache, layer, a, b, q_lengths=q_lengths, seq_ids=seq_ids)

    return jax.jit(write, donate_argnames="cache")


class Shadow:
    """What the calls so far make the cache hold: lengths, the last reserve's counts and
    (full precision) every token written, with a mask of the positions written."""

    def __init__(self, kivi: bool):
        self.kivi = kivi
        self.lengths = np.zeros(MAX_SEQS, np.int64)
        self.pending = np.zeros(MAX_SEQS, np.int64)
        shape = (2, LAYERS, MAX_SEQS, MAX_TOKENS, HEADS, WIDTH)  # K and V
        self.values = np.zeros(shape, np.float32)
        self.known = np.zeros(shape[:4], bool)

    def reserved(self, counts):
        self.known[:, :, np.arange(MAX_SEQS)] &= (
            np.arange(MAX_TOKENS)[None, :] < self.lengths[:, None])[None, None]
        self.lengths = self.lengths + counts
        self.pending = np.asarray(counts, np.int64).copy()

    def forked(self, src, dst):
        self.lengths[dst] = self.lengths[src]
        self.values[:, :, dst] = self.values[:, :, src]
        self.known[:, :, dst] = self.known[:, :, src]
        # A KIVI fork keeps the source's pending tokens (its write still covers them); on
        # full-precision pages they now sit in pages shared with the fork, so the shadow
        # writes them no more.
        if not self.kivi:
            self.pending[src] = 0
        self.pending[dst] = 0

    def freed(self, flags):
        self.lengths[flags] = 0
        self.pending[flags] = 0
        self.known[:, :, flags] = False

    def written(self, layer, a, b, q_lengths, seq_ids):
        for r, s in enumerate(seq_ids):
            if not 0 <= s < MAX_SEQS:
                continue
            n = int(self.pending[s]) if self.kivi else int(q_lengths[r])
            end = int(self.lengths[s])
            for i, x in enumerate((a, b)):
                self.values[i, layer, s, end - n:end] = x[r, :n]
                self.known[i, layer, s, end - n:end] = True


def _read_back(cache, shadow: Shadow):
    """Every written token of every sequence equals what was written (full precision)."""
    bt = np.asarray(cache.block_tables)
    pools = (np.asarray(cache.pages.k), np.asarray(cache.pages.v))
    for s in range(MAX_SEQS):
        pos = np.arange(int(shadow.lengths[s]))
        pages, offsets = bt[s, pos // PS], pos % PS
        for i, pool in enumerate(pools):
            for layer in range(LAYERS):
                got = pool[layer][:, pages, offsets].transpose(1, 0, 2)  # [tokens, heads, w]
                mask = shadow.known[i, layer, s, : pos.size]
                want = shadow.values[i, layer, s, : pos.size]
                np.testing.assert_array_equal(got[mask], want[mask],
                                              err_msg=f"slot {s} layer {layer} pool {i}")


def _unchanged(cache, snap, *, failed_reserve=False):
    if failed_reserve and cache.tail is not None:
        snap = snap.__class__(pages=snap.pages, table=snap.table, spec=snap.spec,
                              tail=snap.tail.__class__(
                                  a=snap.tail.a, b=snap.tail.b, lengths=snap.tail.lengths,
                                  pending=np.zeros_like(snap.tail.pending)))
    tiny.assert_same(cache, snap)


# ----------------------------------------------------------------- argument strategies


def _counts(data, shadow):
    """num_new for reserve: mostly valid, sometimes not (and what kind of wrong)."""
    mode = data.draw(st.sampled_from(
        ["valid"] * 6 + ["negative", "huge", "past_table", "int64", "float", "shape",
                         "bool"]))
    counts = np.asarray([data.draw(st.integers(0, 3)) for _ in range(MAX_SEQS)], np.int32)
    if data.draw(st.booleans()):  # room for whole pages, and for running out of them
        counts[data.draw(st.integers(0, MAX_SEQS - 1))] = data.draw(st.integers(0, Q_LEN))
    s = data.draw(st.integers(0, MAX_SEQS - 1))
    if mode == "negative":
        counts[s] = -data.draw(st.integers(1, 2**31 - 1))
    elif mode == "huge":
        counts[s] = data.draw(st.sampled_from([2**31 - 1, 2**31 - 2 - MAX_TOKENS]))
    elif mode == "past_table":
        counts[s] = MAX_TOKENS + 1 - min(int(shadow.lengths[s]), MAX_TOKENS)
    elif mode == "int64":
        counts = counts.astype(np.int64)
        counts[s] = data.draw(st.sampled_from([2**32 + 1, -(2**32) + 2, 2**40]))
    elif mode == "float":
        counts = counts.astype(np.float32)
    elif mode == "shape":
        counts = counts[: data.draw(st.integers(0, MAX_SEQS - 1))]
    elif mode == "bool":
        counts = counts > 0
    return mode, counts


def _slots(data, shadow, n):
    """(src, dst, expect) for fork: a valid pair set ("ok"), or random slots (busy,
    repeated, outside: a status or an error) of any shape and dtype."""
    if data.draw(st.integers(0, 2)):
        live = [s for s in range(MAX_SEQS) if shadow.lengths[s] > 0] or [0]
        empty = [s for s in range(MAX_SEQS) if shadow.lengths[s] == 0 and s not in live]
        if len(empty) >= n:
            src = [data.draw(st.sampled_from(live)) for _ in range(n)]
            dst = data.draw(st.permutations(empty))[:n]
            return np.asarray(src, np.int32), np.asarray(dst, np.int32), "ok"
    slot = st.integers(-2, MAX_SEQS + 1)
    m = n if data.draw(st.integers(0, 4)) else 3 - n  # sometimes lengths that differ
    src = np.asarray([data.draw(slot) for _ in range(n)], np.int32)
    dst = np.asarray([data.draw(slot) for _ in range(m)], np.int32)
    kind = data.draw(st.sampled_from(["int32"] * 4 + ["float", "int64", "2d"]))
    if kind == "float":
        src = src.astype(np.float32)
    elif kind == "int64":
        dst = dst.astype(np.int64) + 2**32
    elif kind == "2d":
        dst = dst[None]
    return src, dst, "either" if kind == "int32" and m == n else "error"


def _write_args(data, shadow, rng, *, traced):
    """(expect, layer, a, b, q_lengths, seq_ids) for write: expect is "ok" or "error"."""
    seq_ids = np.asarray(data.draw(st.permutations(range(MAX_SEQS))), np.int32)
    q_lengths = np.minimum(shadow.pending[seq_ids], Q_LEN).astype(np.int32)
    a = rng.standard_normal((MAX_SEQS, Q_LEN, HEADS, WIDTH)).astype(np.float32)
    b = rng.standard_normal((MAX_SEQS, Q_LEN, HEADS, WIDTH)).astype(np.float32)
    layer = data.draw(st.integers(0, LAYERS - 1))
    choices = ["valid"] * 3 + ["slot_outside", "nonfinite"]
    if not traced:
        choices += ["layer", "slot_repeated", "q_lengths", "q_float", "heads", "q_shape"]
    mode = data.draw(st.sampled_from(choices))
    r = data.draw(st.integers(0, MAX_SEQS - 1))
    # Traced, nothing can be checked: every call goes through.
    expect = "ok" if traced or mode == "valid" else "error"
    if mode == "slot_outside":
        seq_ids[r] = data.draw(st.sampled_from([-1, -MAX_SEQS, MAX_SEQS, MAX_SEQS + 3]))
    elif mode == "nonfinite":
        t = data.draw(st.integers(0, Q_LEN - 1))
        a[r, t, 0, 0] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
        # Full precision stores any value; KIVI refuses one it would quantize (a real
        # token of the row), eagerly.
        if not shadow.kivi or t >= shadow.pending[seq_ids[r]]:
            expect = "ok"
    elif mode == "layer":
        layer = data.draw(st.sampled_from([LAYERS, -1, 7]))
    elif mode == "slot_repeated":
        seq_ids[r] = seq_ids[(r + 1) % MAX_SEQS]
    elif mode == "q_lengths":
        q_lengths[r] = data.draw(st.sampled_from([-1, Q_LEN + 1]))
    elif mode == "q_float":
        q_lengths = q_lengths.astype(np.float32)
    elif mode == "heads":
        a = a[:, :, :1]
    elif mode == "q_shape":
        q_lengths = q_lengths[:-1]
    return expect, layer, a, b, q_lengths, seq_ids


# ------------------------------------------------------------------------- the driver


def _step(data, cache, shadow, rng, calls):
    """One random call; returns the cache to continue with.

    `expect` says what the arguments allow: "ok" (a result, maybe a failed status),
    "error" (a ValueError / TypeError) or "either" (random slots: a status or an error).
    """
    op = data.draw(st.sampled_from(
        ["reserve", "reserve", "reserve_jit", "fork", "fork_jit", "free", "write",
         "write", "write_jit", "write_jit"]))
    snap = tiny.snapshot(cache)
    calls[0] += 1
    expect = "ok"
    try:
        if op.startswith("reserve"):
            mode, counts = _counts(data, shadow)
            if op == "reserve_jit":
                if mode in ("int64", "float", "shape", "bool"):
                    counts = np.zeros(MAX_SEQS, np.int32)  # a caller's jit takes int32
                new, status = _reserve_jit(cache, jnp.asarray(counts))
            else:
                expect = "ok" if mode in ("valid", "huge", "past_table") else "error"
                new, status = kc.reserve(cache, counts)
            assert expect != "error", (op, mode, counts)
            if int(status.code) == pt.OK:
                assert (counts >= 0).all() and counts.shape == (MAX_SEQS,), (mode, counts)
                shadow.reserved(np.asarray(counts, np.int64))
            else:
                _unchanged(new, snap, failed_reserve=True)
                shadow.pending[:] = 0
        elif op.startswith("fork"):
            src, dst, expect = _slots(data, shadow, data.draw(st.integers(1, 2)))
            if op == "fork_jit":
                src, dst = src.astype(np.int32).ravel(), dst.astype(np.int32).ravel()
                expect = "ok" if src.shape == dst.shape else "error"
                new, status = _fork_jit(cache, jnp.asarray(src), jnp.asarray(dst))
            else:
                new, status = kc.fork(cache, src, dst)
            assert expect != "error", (op, src, dst)
            if int(status.code) == pt.OK:
                assert len(set(dst.tolist())) == dst.size and not set(dst) & set(src)
                shadow.forked(src, dst)
            else:
                assert expect != "ok" or op == "fork_jit", (op, src, dst, int(status.code))
                _unchanged(new, snap)
        elif op == "free":
            flags = np.asarray([data.draw(st.booleans()) for _ in range(MAX_SEQS)])
            bad = data.draw(st.sampled_from([None] * 6 + ["int", "shape"]))
            expect = "ok" if bad is None else "error"
            arg = flags.astype(np.int32) if bad == "int" else flags[:2] if bad else flags
            new = kc.free(cache, arg, scrub=data.draw(st.booleans()))
            assert expect != "error", (op, arg)
            shadow.freed(flags)
        else:
            traced = op == "write_jit"
            expect, layer, a, b, q_lengths, seq_ids = _write_args(data, shadow, rng,
                                                                  traced=traced)
            if traced:
                new = _write_jit(layer)(cache, a, b, q_lengths, seq_ids)
            else:
                new = kc.write(cache, layer, jnp.asarray(a), jnp.asarray(b),
                               q_lengths=q_lengths, seq_ids=seq_ids)
            assert expect != "error", (op, layer, q_lengths, seq_ids)
            shadow.written(layer, a, b, q_lengths, seq_ids)
    except (ValueError, TypeError) as err:
        assert expect != "ok", (op, err)
        assert str(err), op
        _unchanged(cache, snap)
        return cache
    kc.check_invariants(new)
    np.testing.assert_array_equal(np.asarray(new.lengths), shadow.lengths, err_msg=op)
    if new.tail is not None:
        np.testing.assert_array_equal(np.asarray(new.tail.pending)[0], shadow.pending,
                                      err_msg=op)
    else:
        _read_back(new, shadow)
    return new


def test_random_calls_keep_the_cache_consistent(full_sweeps, monkeypatch):
    # An eager KIVI write runs its page flush (a lax.cond) op by op, compiling it anew on
    # every call (~0.5 s). The eager calls here exist for the host-side checks of
    # `kvjax.cache.write`, which run before the kind's write: that write is compiled once.
    # (The KIVI write's own concrete check, that a write covers every reserved token, is
    # tests/cache/test_quant_cache.py's; the calls here always cover them.)
    monkeypatch.setattr(qz, "write_layer", _quantized_write)
    calls = [0]
    examples = EXAMPLES * (5 if full_sweeps else 1)

    @settings(max_examples=examples, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def run(kivi, data, seed):
        rng = np.random.default_rng(seed)
        cache, shadow = kc.init_cache(_spec(kivi)), Shadow(kivi)
        for _ in range(STEPS):
            cache = _step(data, cache, shadow, rng, calls)

    for kivi in (False, True):
        run(kivi)
    assert calls[0] >= 2000 * (5 if full_sweeps else 1), calls[0]
