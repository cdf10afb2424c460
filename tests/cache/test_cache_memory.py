"""A cache that would not fit in the device's free memory is refused before anything is
allocated, with the bytes named; `cache_device_bytes` counts what `init_cache` allocates."""

import jax
import numpy as np
import pytest

import kvjax as kvx
from kvjax.cache import ops
from kvjax.generate import CacheConfig
from kvjax.models import llama
from kvjax.models.base import get_family
from kvjax.rope import RopeConfig
from kvjax.specs import QuantSpec


def _spec(quant=None, dtype="bfloat16"):
    return kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16),
                         num_layers=3, page_size=8, num_pages=24, max_seqs=2,
                         max_pages_per_seq=12, dtype=dtype, quant=quant)


@pytest.mark.parametrize("quant", [None, QuantSpec(bits=2, group_size=8, residual=8)])
def test_device_bytes_are_what_init_cache_allocates(quant):
    spec = _spec(quant)
    cache = ops.init_cache(spec)
    allocated = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert ops.cache_device_bytes(spec) == allocated
    if quant is None:  # K and V pools by hand: 2 x layers x pages x page x heads x width x 2 B
        assert allocated >= 2 * 3 * 24 * 8 * 2 * 16 * 2


def test_a_cache_over_the_free_memory_is_refused_before_allocating(monkeypatch):
    spec = _spec()
    need = ops.cache_device_bytes(spec)

    def never(_spec):
        raise AssertionError("allocated a cache that does not fit")

    monkeypatch.setattr(ops, "_device_free_bytes", lambda: (need - 1, "NVIDIA H200"))
    monkeypatch.setattr(ops, "cache_device_bytes", lambda s, n=need: n if s == spec else 2**40)
    monkeypatch.setattr(ops, "_init_cache", never)
    with pytest.raises(ValueError, match=rf"needs .* GiB \({need} bytes: 24 pages of 8 tokens "
                                         r"x 3 layers, bfloat16 pages\) but the NVIDIA H200 "
                                         r"has .* GiB free; use KIVI pages"):
        ops.init_cache(spec)
    # The same through kvjax.generate's cache builder: refused, nothing allocated.
    config = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_layers=3, q_heads=4, kv_heads=2, head_dim=16,
                               rope=RopeConfig(theta=10000.0, dim=16))
    model = get_family("llama").model(config)
    with pytest.raises(ValueError, match="NVIDIA H200"):
        CacheConfig(dtype="bfloat16").build(model, num_seqs=2, max_tokens=4096)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "_device_free_bytes", lambda: (need, "NVIDIA H200"))
    cache = ops.init_cache(spec)  # exactly fits
    assert np.asarray(cache.lengths).sum() == 0
