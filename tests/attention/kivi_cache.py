"""A new KIVI cache holding given lengths, as `kvjax.cache.reserve` leaves it, for tests.

What `reserve` allocates (the page table, the tail's lengths and pending counts) depends
only on the page geometry of the spec: pages, page size, slots, pages per slot and the
residual. So it runs once per geometry, on a one-layer cache of one 8-wide 8-bit head
(`page_geometry`), instead of compiling a reserve of every pool of every spec; the
cache's structure comes from `jax.eval_shape` of `init_cache` and its pools and rings
are zeros made on the host, as `init_cache` makes them. `reserve` of a filled cache runs
the same way, on the geometry's cache holding the filled cache's table and tail counts.
"""

import dataclasses
import functools

import jax
import numpy as np

import kvjax as kvx
from kvjax.cache import quantized as qz
from kvjax.specs import QuantSpec

__all__ = ["page_geometry", "reserve", "reserved_cache"]


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


@functools.partial(jax.jit, static_argnums=0)
def _reserve_geometry(spec, table, lengths, pending, num_new):
    """The public reserve on a new cache of `spec` given the table and tail counts, as one
    program: (page table, tail lengths, tail pending, status)."""
    new = qz.init_cache(spec)
    tail = dataclasses.replace(new.tail, lengths=lengths, pending=pending)
    cache, status = kvx.cache.reserve(dataclasses.replace(new, table=table, tail=tail),
                                      num_new)
    return cache.table, cache.tail.lengths, cache.tail.pending, status


def reserve(cache, num_new):
    """`kvx.cache.reserve(cache, num_new)` of a KIVI cache without compiling it for
    `cache.spec`: (cache, status). Run on `page_geometry(cache.spec)` (one program per
    geometry); the pools and rings are the cache's own, as reserve leaves them (KIVI's
    pages are complete when allocated: reserve plans no copy-on-write)."""
    table, lengths, pending, status = _reserve_geometry(
        page_geometry(cache.spec), cache.table, cache.tail.lengths, cache.tail.pending,
        jax.device_put(np.asarray(num_new, np.int32)))
    tail = dataclasses.replace(cache.tail, lengths=lengths, pending=pending)
    return dataclasses.replace(cache, table=table, tail=tail), status
