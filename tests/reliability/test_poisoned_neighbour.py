"""End to end: NaN or inf in pages a sequence cannot see leaves its tokens bit-identical.

Through `generate`: slot 0 holds a finished request; then every
floating-point element of the cache is overwritten with NaN (or +inf) — slot 0's pages,
the free pages slot 1 will be given (so the rows of its last page it never writes stay
poisoned), and on a KIVI cache every scale, zero-point and tail ring — and slot 1
decodes a new prompt. Its tokens must equal those on the clean cache (they used to come
out as all 0 with status OK: one request poisoning another). Prefill and decode alike,
for each page kind and attention impl.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kc
from kvjax import generate as kvg
from kvjax.specs import QuantSpec
from tests.reliability import tiny

KIVI = QuantSpec(bits=4, group_size=4, residual=4)
KW = dict(key=jax.random.key(0), chunk_size=8)
needs_cpu_kernel = pytest.mark.cpu_kernels

CASES = [
    pytest.param("gqa", None, "xla", id="gqa-xla"),
    pytest.param("gqa", None, "reference", id="gqa-reference"),
    pytest.param("gqa", None, "cpu", id="gqa-cpu", marks=needs_cpu_kernel),
    pytest.param("gqa", KIVI, "xla", id="gqa-kivi-xla"),
    pytest.param("mla", None, "xla", id="mla-xla"),
    pytest.param("mla", KIVI, "xla", id="mla-kivi-xla"),
]


def _poison(cache, value):
    """Every floating-point element of the pools and tail rings set to `value`."""
    def fill(x):
        return jnp.full_like(x, value) if jnp.issubdtype(x.dtype, jnp.floating) else x

    tail = None if cache.tail is None else jax.tree.map(fill, cache.tail)
    if tail is not None:  # the ring only: the token counts are ints anyway
        tail = tail.__class__(a=tail.a, b=tail.b, lengths=cache.tail.lengths,
                              pending=cache.tail.pending)
    return cache.__class__(pages=jax.tree.map(fill, cache.pages), table=cache.table,
                           spec=cache.spec, tail=tail)


@pytest.mark.slow
@pytest.mark.parametrize("kind, quant, impl", CASES)
def test_poisoned_cache_leaves_the_other_sequence_alone(kind, quant, impl):
    model, params = tiny.model_and_params(kind)
    spec = model.make_cache_spec(page_size=4, num_pages=16, max_seqs=2, max_pages_per_seq=8,
                                 dtype="float32")
    spec = spec if quant is None else spec.replace(quant=quant)
    rng = np.random.default_rng(5)
    p0, p1 = tiny.prompts(rng, [9, 11])
    first = kvg.generate(model, params, [p0], cache=kc.init_cache(spec), seq_ids=[0],
                         max_new_tokens=3, free_finished=False, impl=impl, **KW)
    snap = tiny.snapshot(first.cache)
    clean = kvg.generate(model, params, [p1], cache=tiny.restore(first.cache, snap),
                         seq_ids=[1], max_new_tokens=6, impl=impl, **KW)
    assert int(clean.status.code) == 0
    for value in (np.nan, np.inf):
        dirty = kvg.generate(model, params, [p1], seq_ids=[1], max_new_tokens=6, impl=impl,
                             cache=_poison(tiny.restore(first.cache, snap), value), **KW)
        assert int(dirty.status.code) == 0
        np.testing.assert_array_equal(dirty.tokens, clean.tokens, err_msg=str(value))
    # The poison is real: slot 0, which owns the poisoned pages, decodes differently.
    own = [kvg.generate(model, params, [p1], seq_ids=[0], max_new_tokens=6, impl=impl,
                        cache=c, **KW).tokens
           for c in (tiny.restore(first.cache, snap),
                     _poison(tiny.restore(first.cache, snap), np.nan))]
    assert not np.array_equal(*own), own
