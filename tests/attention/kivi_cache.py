"""A new KIVI cache holding given lengths, as `kvjax.cache.reserve` leaves it, for tests.

What `reserve` allocates (the page table, the tail's lengths and pending counts) depends
only on the page geometry of the spec: pages, page size, slots, pages per slot and the
residual. So it runs once per geometry, on a one-layer cache of one 8-wide 8-bit head
(`page_geometry`), instead of compiling a reserve of every pool of every spec; the
cache's structure comes from `jax.eval_shape` of `init_cache` and its pools and rings
are zeros made on the host, as `init_cache` makes them.
"""

import dataclasses
import functools

import jax
import numpy as np

import kvjax as kvx
from kvjax.cache import quantized as qz
from kvjax.specs import QuantSpec

__all__ = ["page_geometry", "reserved_cache"]


@functools.partial(jax.jit, static_argnums=0)
def _reserved(spec, lengths):
    """The public reserve on a new cache of `spec`, as one program: (page table, tail
    lengths, tail pending, status)."""
    cache, status = kvx.cache.reserve(qz.init_cache(spec), lengths)
    return cache.table, cache.tail.lengths, cache.tail.pending, status


def page_geometry(spec):
    """`spec` with one layer of one 8-wide 8-bit head and the same pages, page size, slots
    and residual: `reserve` allocates the same table, tail lengths and pending counts."""
    return dataclasses.replace(
        spec, attention=kvx.AttentionSpec(q_heads=1, kv_heads=1, head_dim=8), num_layers=1,
        dtype="float32", recurrent=None, indexer=None,
        quant=QuantSpec(bits=8, group_size=min(spec.quant.group_size, 8),
                        residual=spec.quant.residual))


def reserved_cache(spec, lengths):
    """`kvx.cache.reserve(qz.init_cache(spec), lengths)` without compiling either for
    `spec`: (cache, status). Zero pools and rings, the table and counts of the reserve on
    `page_geometry(spec)`."""
    shapes = jax.eval_shape(lambda: qz.init_cache(spec))
    table, tail_lengths, pending, status = _reserved(
        page_geometry(spec), jax.device_put(np.asarray(lengths, np.int32)))
    zeros = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), shapes)
    tail = dataclasses.replace(zeros.tail, lengths=tail_lengths, pending=pending)
    return dataclasses.replace(zeros, table=table, tail=tail), status
