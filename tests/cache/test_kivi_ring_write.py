"""A KIVI cache's token write inside the layer loop updates its bf16 tail rings in place.

The write reads the ring (the rows a completed page takes) and then writes the new
tokens into it in place (`kvjax.backends.cpu.write_rows`). Unless the read is ordered
before the write, XLA keeps the read's value by copying the ring -- every layer's ring,
twice per layer and step, more bytes than the layer's quantized pages hold at short
contexts. The read is a copy of the rows (`read_rows`), not XLA's gather. Checked on the
optimised HLO of one decode step's writes over every layer
(reserve, then `write_layer` in a scan, the cache donated, as a model's step runs them).
"""

import re

import jax
import jax.numpy as jnp
import pytest

import kvjax as kvx
from kvjax.cache import quantized as qz
from kvjax.specs import QuantSpec

LAYERS, HEADS, WIDTH, SEQS = 3, 2, 32, 4


def _step_hlo(bits: int) -> tuple[str, tuple[int, ...]]:
    """The compiled text of one step's writes, and the shape of the cache's ring `a`."""
    spec = kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=4, kv_heads=HEADS, head_dim=WIDTH),
        num_layers=LAYERS, page_size=8, num_pages=64, max_seqs=SEQS, max_pages_per_seq=8,
        dtype="bfloat16", quant=QuantSpec(bits=bits, group_size=8, residual=8))
    cache = jax.eval_shape(lambda: qz.init_cache(spec))
    token = jax.ShapeDtypeStruct((SEQS, 1, HEADS, WIDTH), jnp.bfloat16)

    def step(cache, a, b):
        cache, _ = kvx.cache.reserve(cache, jnp.ones((SEQS,), jnp.int32))

        def body(c, layer):
            return qz.write_layer(c, layer, a, b), None

        return jax.lax.scan(body, cache, jnp.arange(LAYERS))[0]

    text = jax.jit(step, donate_argnums=0).lower(cache, token, token).compile().as_text()
    return text, cache.tail.a.shape


@pytest.mark.cpu_kernels
def test_the_tail_rings_are_written_in_place_not_copied():
    text, ring = _step_hlo(bits=4)
    shape = "bf16[" + ",".join(map(str, ring)) + "]"
    assert "kvjax_write_rows" in text  # the in-place row writes run here
    # The rows a flush may take are read by copies, not by XLA's element-by-element gather.
    assert "kvjax_read_rows" in text
    copies = [line.strip()[:160] for line in text.splitlines()
              if re.search(r"= " + re.escape(shape) + r"\{[0-9,]*\} copy\(", line)]
    assert not copies, copies
