"""The generic cache operations: every page kind, one dispatch.

    cache = init_cache(spec)                               # any kind, from the spec
    cache, status = reserve(cache, num_new)                # jitted, cache donated
    for layer in ...:                                      # inside the model's forward
        cache = write(cache, layer, k, v, q_lengths=q_lengths, seq_ids=seq_ids)
        out, lse = attend(cache, layer, q, q_lengths=q_lengths, seq_ids=seq_ids,
                          selection=None, impl="auto")
    cache, status = fork(cache, src, dst)                  # share pages (no copy)
    cache = free(cache, seqs)                              # pages return to the pool

A model calls only `write` and `attend` (and a DeepSeek-V3.2 model, whose MLA cache holds
lightning-indexer keys beside the latents, `indexer_topk` for the tokens each query
attends to: `write(..., index_keys=)`, then `attend(..., selection=TokenSelection)`);
which page kind the cache holds
(full-precision K/V or MLA latents, KIVI-quantized K/V or latents) decides, here and
nowhere else, which implementation runs: `kvjax.cache.paged` for full-precision pages,
`kvjax.cache.quantized` for KIVI pages, and the matching `kvjax.attention` op.

Host-side checks. `reserve`, `fork` and `free` check their arguments on the host
when they are concrete arrays (negative counts, vectors of the wrong length, slots
out of range, integers past int32) and raise `ValueError` / `TypeError` before the
cache is donated, so a bad call leaves the caller's cache intact. Under jit they
cannot: the allocator then returns a failed `AllocStatus` and changes nothing.
`write` and `attend` check layers, shapes and dtypes always, and concrete slots,
lengths and (KIVI) values to be quantized; under jit a row whose slot lies outside
the table writes nothing, and a traced layer outside the cache writes nothing and
reads NaN (indexing would clamp it to another layer).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import attention as kattn
from kvjax.attention import scores as kscores
from kvjax.attention import sparse as ksparse
from kvjax.attention import xla as xla_path
from kvjax.attention import xla_quantized
from kvjax.attention.pages import QuantizedLayerView, Selection, TokenSelection
from kvjax.cache import host, paged, quantized, recurrent, window
from kvjax.cache import page_table as pt
from kvjax.cache import quant as kquant
from kvjax.cache.state import LayerView, PagedKVCache
from kvjax.specs import CacheSpec

__all__ = [
    "init_cache",
    "cache_device_bytes",
    "indexer_topk",
    "reserve",
    "fork",
    "free",
    "truncate",
    "write",
    "attend",
    "layer_view",
    "attention_probs",
    "check_invariants",
]

Query = Float[Array, "batch q_len q_heads head_dim"] | tuple[Array, Array]


def init_cache(spec: CacheSpec) -> PagedKVCache:
    """An empty cache for `spec` (any page kind): zeroed pools, no sequence, every page free.

    Raises:
      ValueError: on a device that reports its memory (GPU, TPU), when the cache would not
        fit in what is free there; nothing is allocated, and the message names the bytes.
    """
    if not isinstance(spec, CacheSpec):
        raise TypeError(f"init_cache: expected a CacheSpec, got {type(spec).__name__}.")
    _check_fits(spec)
    return _init_cache(spec)


def cache_device_bytes(spec: CacheSpec) -> int:
    """Bytes `init_cache(spec)` allocates (pools, tail, page table, groups), from shapes
    alone: nothing is allocated."""
    shapes = jax.eval_shape(functools.partial(_init_cache, spec))
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))


def _device_free_bytes() -> tuple[int, str] | None:
    """(bytes free, the device's kind) on the default device, or None where it does not
    report its memory (the CPU)."""
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:  # a backend that does not report it
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), device.device_kind


def _check_fits(spec: CacheSpec) -> None:
    free = _device_free_bytes()
    if free is None:
        return
    free, kind = free
    need = cache_device_bytes(spec)
    if need > free:
        gib = 1 << 30
        raise ValueError(
            f"init_cache: the cache needs {need / gib:.2f} GiB ({need} bytes: "
            f"{spec.num_pages} pages of {spec.page_size} tokens x {spec.num_layers} layers, "
            f"{f'KIVI {spec.quant.bits}-bit' if spec.quant else str(spec.dtype)} pages) "
            f"but the {kind} has {free / gib:.2f} GiB free; use KIVI pages (CacheSpec.quant), "
            f"fewer pages or tokens, or a sharding plan over more devices.")


def _init_cache(spec: CacheSpec) -> PagedKVCache:
    cache = paged.init_cache(spec) if spec.quant is None else quantized.init_cache(spec)
    if spec.window_groups:
        cache = dataclasses.replace(cache, groups=window.init_groups(spec))
    if spec.recurrent is None:
        return cache
    return dataclasses.replace(cache, recurrent=recurrent.init_state(spec))


def _kind(cache: PagedKVCache):
    """The module implementing the cache's page kind."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"expected a kvjax PagedKVCache, got {type(cache).__name__}.")
    return paged if cache.tail is None else quantized


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _fits_int32(op: str, name: str, x) -> None:
    """ValueError for concrete integers outside int32: converting would wrap them silently
    (2**32 + 3 would become 3)."""
    if not _concrete(x):
        return
    a = np.asarray(x)
    if a.dtype.kind in "iu" and a.size and (a.min() < np.iinfo(np.int32).min
                                            or a.max() > np.iinfo(np.int32).max):
        bad = a[(a < np.iinfo(np.int32).min) | (a > np.iinfo(np.int32).max)].ravel()[0]
        raise ValueError(f"{op}: {name} holds {int(bad)}, outside int32; the cache counts "
                         f"tokens and slots in int32.")


def _seq_vector(op: str, name: str, x, spec: CacheSpec, kind: str):
    _fits_int32(op, name, x)
    x = jnp.asarray(x)
    if x.shape != (spec.max_seqs,):
        raise ValueError(f"{op}: {name} must have shape (max_seqs,) = ({spec.max_seqs},), got "
                         f"{x.shape}.")
    if jnp.dtype(x.dtype).kind not in kind:
        raise TypeError(f"{op}: {name} must be {'bool' if kind == 'b' else 'integer'}, got "
                        f"{x.dtype}.")
    return x


@functools.partial(jax.jit, donate_argnames="cache")
def _reserve(cache, num_new):
    if cache.groups:
        return window.reserve(cache, num_new.astype(jnp.int32), _kind(cache).reserve)
    return _kind(cache).reserve(cache, num_new.astype(jnp.int32))


def reserve(
    cache: PagedKVCache, num_new: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Grows sequences by `num_new[s]` tokens: allocates pages, copies shared pages first.

    Args:
      cache: the cache (donated).
      num_new: int32[max_seqs] >= 0, tokens each sequence is about to receive (0 for idle
        slots).

    Returns:
      (cache, status): `cache.lengths` already counts the new tokens; write them with
      `write` at positions [old_length, old_length + num_new). All or nothing: on failure
      (out of pages, a sequence longer than `max_pages_per_seq * page_size`) nothing
      changes, and `status.raise_if_error()` raises `CacheFullError` on the host.

    Raises:
      ValueError: a wrong shape, or (concrete arguments) a negative count or one past int32.
      TypeError: counts that are not integers.
    """
    num_new = _seq_vector("reserve", "num_new", num_new, cache.spec, "iu")
    if _concrete(num_new) and (np.asarray(num_new) < 0).any():
        bad = int(np.nonzero(np.asarray(num_new) < 0)[0][0])
        raise ValueError(f"reserve: num_new must be >= 0 for every slot; slot {bad} asks for "
                         f"{int(num_new[bad])} tokens (free a sequence with free(...)).")
    return _reserve(cache, num_new)


@functools.partial(jax.jit, donate_argnames="cache")
def _fork(cache, src, dst):
    new, status = _kind(cache).fork(cache, src, dst)
    new = window.fork(new, src, dst)
    new = recurrent.fork_rows(new, src, dst, status.ok)
    return host.after_fork(new, src, dst, status), status


def fork(
    cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Makes each `dst[i]` slot share every page of sequence `src[i]` (no copy).

    Full-precision pages are shared until a write copies the shared last page
    (copy-on-write); KIVI pages are immutable once complete and stay shared, and the
    full-precision tail is copied (it is private to each slot).

    Args:
      cache: the cache (donated).
      src, dst: int32[n] slot ids; each dst must be empty, distinct, and not a src.

    Returns:
      (cache, status): status code BAD_FORK (nothing changed) if a target is unusable.

    Raises:
      ValueError: src and dst of different lengths (or not vectors), or (concrete
        arguments) a slot outside [0, max_seqs), a dst that is not empty, repeated, or
        also a src.
      TypeError: slots that are not integers.
    """
    _fits_int32("fork", "src", src)
    _fits_int32("fork", "dst", dst)
    # Shapes and dtypes as the allocator takes them: a float slot is an error, not a cast.
    src, dst = pt.check_fork_pairs(cache.table, src, dst)
    if _concrete(src, dst, cache.lengths):
        s, d = np.asarray(src), np.asarray(dst)
        n = cache.spec.max_seqs
        bad = [x for x in (*s, *d) if not 0 <= x < n]
        if bad:
            raise ValueError(f"fork: slot {bad[0]} is outside [0, max_seqs={n}).")
        if len(set(d.tolist())) != d.size or set(d.tolist()) & set(s.tolist()):
            raise ValueError(f"fork: dst slots must be distinct and not sources; got src "
                             f"{s.tolist()}, dst {d.tolist()}.")
        busy = [int(x) for x in d if int(np.asarray(cache.lengths)[x]) > 0]
        if busy:
            raise ValueError(f"fork: dst slot {busy[0]} holds a sequence; free it first.")
    return _fork(cache, src, dst)


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="scrub")
def _free(cache, seqs, scrub):
    cache = window.free(_kind(cache).free(cache, seqs, scrub=scrub), seqs, scrub=scrub)
    cache = recurrent.free_rows(cache, seqs)
    return host.after_free(cache, seqs)


def free(
    cache: PagedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
) -> PagedKVCache:
    """Frees the flagged sequences; pages nobody else holds return to the pool.

    Args:
      cache: the cache (donated).
      seqs: bool[max_seqs], the sequences to free.
      scrub: zero the released pages (and a quantized cache's freed tails) (static).
    """
    seqs = _seq_vector("free", "seqs", seqs, cache.spec, "b")
    return _free(cache, seqs, scrub)


@functools.partial(jax.jit, donate_argnames="cache")
def _truncate(cache, new_lengths):
    allowed = host.truncate_allowed(cache, new_lengths) & window.truncate_allowed(cache,
                                                                                 new_lengths)
    if cache.recurrent is not None:
        # A recurrent state cannot be rolled back: a sequence keeps its length or ends.
        allowed &= jnp.all((new_lengths == cache.lengths) | (new_lengths == 0))
    new, status = _kind(cache).truncate(cache, jnp.where(allowed, new_lengths, cache.lengths))
    new = window.truncate(new, jnp.where(allowed & status.ok, new_lengths, new.lengths))
    status = dataclasses.replace(
        status, code=jnp.where(allowed, status.code, pt.BAD_TRUNCATE).astype(jnp.int32))
    ended = status.ok & (new_lengths == 0) & (cache.lengths > 0)
    new = recurrent.free_rows(new, ended)
    return host.after_truncate(new, new_lengths, status), status


def truncate(
    cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Shortens sequences to `new_lengths`; pages past the new ends return to the pool.

    A page other sequences still share only loses this sequence's reference. On a
    quantized cache a sequence can only end on a whole quantized page (its
    full-precision tail is dropped) or keep its length: see `quantized.truncate`.

    Args:
      cache: the cache (donated).
      new_lengths: int32[max_seqs], each in [0, current length].

    Returns:
      (cache, status): BAD_TRUNCATE (nothing changed) when a length is not allowed.

    Raises:
      ValueError: (concrete arguments) a length that is not allowed, naming it.
    """
    new_lengths = _seq_vector("truncate", "new_lengths", new_lengths, cache.spec, "iu")
    if _concrete(new_lengths, cache.lengths):
        new, old = np.asarray(new_lengths), np.asarray(cache.lengths)
        bad = np.nonzero((new < 0) | (new > old))[0]
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"truncate: slot {s} holds {old[s]} tokens; a new length must lie "
                             f"in [0, {old[s]}], got {new[s]}.")
        if cache.tail is not None:
            q, ps = np.asarray(cache.quant_lengths), cache.spec.page_size
            bad = np.nonzero((new != old) & ((new > q) | (new % ps != 0)))[0]
            if bad.size:
                s = int(bad[0])
                raise ValueError(
                    f"truncate: on a quantized cache a sequence can only end on a whole "
                    f"quantized page; slot {s} holds {q[s]} quantized tokens (pages of {ps}), "
                    f"so its new length must be a multiple of {ps} up to {q[s]} or stay "
                    f"{old[s]}, got {new[s]}.")
        if cache.recurrent is not None:
            bad = np.nonzero((new != old) & (new != 0))[0]
            if bad.size:
                s = int(bad[0])
                raise ValueError(
                    f"truncate: a hybrid model's cache keeps a recurrent state per slot, "
                    f"which cannot be rolled back; slot {s} can keep its {old[s]} tokens or "
                    f"end (0), got {new[s]}.")
        if cache.groups and not bool(window.truncate_allowed(cache, jnp.asarray(new))):
            raise ValueError(
                f"truncate: a window group no longer holds the pages the new lengths' windows "
                f"reach (its ring keeps the last pages only); new lengths {new.tolist()}, "
                f"current {old.tolist()}. Keep a length, end a sequence (0), or shorten it "
                f"by less.")
        if cache.host is not None:
            hl = np.asarray(host.host_pages(cache)) * cache.spec.page_size
            bad = np.nonzero((new < hl) & (new % cache.spec.page_size != 0))[0]
            if bad.size:
                s = int(bad[0])
                raise ValueError(
                    f"truncate: slot {s} holds its first {hl[s]} tokens in host pages; a new "
                    f"length below that must be a whole number of pages "
                    f"({cache.spec.page_size} tokens), got {new[s]}.")
    # A copy: `truncate(cache, cache.lengths)` must not pass a donated buffer twice.
    return _truncate(cache, jnp.array(new_lengths, jnp.int32, copy=True))


def _rows_vector(op: str, name: str, x, batch: int):
    """x as int32[batch]; ValueError / TypeError naming a wrong shape or dtype."""
    _fits_int32(op, name, x)
    x = jnp.asarray(x)
    if x.shape != (batch,):
        raise ValueError(f"{op}: {name} must have one entry per row, shape ({batch},), got "
                         f"{x.shape}.")
    if jnp.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{op}: {name} must be integer, got {x.dtype}.")
    return x.astype(jnp.int32)


def _slot_ids(op: str, seq_ids, batch: int, spec: CacheSpec, distinct: bool = True):
    """The rows' slots as int32[batch]; when concrete: inside [0, max_seqs) (and distinct)."""
    seq_ids = _rows_vector(op, "seq_ids", seq_ids, batch)
    if _concrete(seq_ids):
        s = np.asarray(seq_ids)
        out = (s < 0) | (s >= spec.max_seqs)
        if out.any():
            r = int(np.nonzero(out)[0][0])
            raise ValueError(f"{op}: seq_ids[{r}] = {int(s[r])} is outside the cache's slots "
                             f"[0, {spec.max_seqs}).")
        if distinct and len(set(s.tolist())) != s.size:
            raise ValueError(f"{op}: seq_ids must be distinct (two rows would share one slot), "
                             f"got {s.tolist()}.")
    return seq_ids


def _check_kivi_values(cache: PagedKVCache, a, b, seq_ids) -> None:
    """ValueError for a concrete value a KIVI write would quantize but cannot represent.

    The tokens the last `reserve` added to each row are written; every one of them is
    quantized sooner or later (when its page leaves the tail), so all are checked, by
    `kvjax.cache.quant`'s rule: finite and within `representable_range(scale_dtype)`.
    MLA's rotary key (`b`) stays full precision and is not checked.
    """
    if not _concrete(a, b, seq_ids, cache.lengths, cache.tail.pending):
        return
    spec = cache.spec
    ids = np.arange(spec.max_seqs) if seq_ids is None else np.asarray(seq_ids)
    pending = np.asarray(cache.tail.pending)[0][ids]
    real = np.arange(a.shape[1])[None, :] < pending[:, None]  # [batch, q_len]
    lim = kquant.representable_range(spec.quant.scale_dtype)
    scale = jnp.dtype(spec.quant.scale_dtype).name
    pools = (("a", a, "keys, per channel"),) if spec.is_mla else (
        ("a", a, "keys, per channel"), ("b", b, "values, per token"))
    for name, x, what in pools:
        xs = np.asarray(x.astype(jnp.float32))
        bad = ~(np.abs(xs) <= lim) & real.reshape(real.shape + (1,) * (xs.ndim - 2))
        if not bad.any():
            continue
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        val = xs[idx]
        where = f"{name}{list(idx)} (row {idx[0]}, slot {int(ids[idx[0]])}, token {idx[1]})"
        if np.isfinite(val):
            raise ValueError(
                f"write: {where} = {val:.6g} lies outside +-{lim:.6g}, the range {scale} "
                f"scales represent; it would be saturated when quantized ({what}). Store "
                f"scales in bfloat16 (QuantSpec(scale_dtype='bfloat16')) or keep such values "
                f"out of the cache.")
        raise ValueError(
            f"write: {where} = {val} is not finite; once quantized ({what}) its whole group "
            f"would dequantize to NaN. Only finite values can be quantized "
            f"(kvjax.cache.quant.check_quantizable).")


def _positions(cache, q_lengths, q_len, seq_ids):
    """Cache positions of new tokens: row b's token t sits at lengths - q_lengths + t."""
    lengths = cache.lengths if seq_ids is None else cache.lengths[seq_ids]
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    valid = t < q_lengths[:, None]
    return jnp.maximum(lengths[:, None] - q_lengths[:, None] + t, 0), valid


def write(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    a: Float[Array, "batch q_len heads width_a"],
    b: Float[Array, "batch q_len heads width_b"],
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    index_keys: Float[Array, "batch q_len d_index"] | None = None,
) -> PagedKVCache:
    """Writes one layer's new tokens (reserved by the last `reserve`) into the cache.

    Args:
      cache: the cache; pure function, jit it with the cache donated to update in place.
      layer: layer index (may be traced, e.g. inside a scan over layers; a quantized cache
        whose layers have different bit widths needs an int).
      a, b: K and V `[batch, q_len, kv_heads, head_dim]`; for MLA c_KV `[batch, q_len, d_c]`
        and k_rope `[batch, q_len, d_rope]` (a head axis of 1 may be present). Cast to the
        cache dtype here.
      q_lengths: int32[batch], real tokens per row: row b's token t (t < q_lengths[b])
        goes to position `lengths[seq_b] - q_lengths[b] + t`; later tokens are padding.
      seq_ids: int32[batch], distinct cache slots of the rows (default every slot in order).
      index_keys: the tokens' lightning-indexer keys `[batch, q_len, d_index]`, given
        exactly when the cache has an indexer (`CacheSpec.indexer`); cast to its dtype
        and stored beside the latents, in the same pages (never quantized).

    Returns:
      The cache with the tokens written (a quantized cache also quantizes the pages they
      complete).

    Raises:
      ValueError / TypeError: (before anything is written) a layer outside the cache, K/V
        of the wrong shape, `q_lengths` or `seq_ids` of the wrong shape or dtype; with
        concrete values also a `q_lengths` entry outside [0, q_len], a slot outside
        [0, max_seqs) or repeated, and, on a KIVI cache, a value to be quantized that is
        not finite or beyond what the scale dtype represents (as
        `kvjax.cache.quant.check_quantizable`). Under jit those values cannot be checked:
        rows of slots outside the table write nothing, as does a traced layer outside
        the cache, and a non-finite value turns only its own quantization group into NaN.
    """
    _kind(cache)
    spec = cache.spec
    paged.check_layer(spec, layer)
    dt = spec.dtype
    a, b = jnp.asarray(a).astype(dt), jnp.asarray(b).astype(dt)
    if a.ndim < 2 or b.shape[:2] != a.shape[:2]:
        raise ValueError(f"write: a and b must be [batch, q_len, ...] alike, got {a.shape} and "
                         f"{b.shape}.")
    batch, q_len = a.shape[:2]
    q_lengths = _rows_vector("write", "q_lengths", q_lengths, batch)
    if _concrete(q_lengths):
        ql = np.asarray(q_lengths)
        if ((ql < 0) | (ql > q_len)).any():
            r = int(np.nonzero((ql < 0) | (ql > q_len))[0][0])
            raise ValueError(f"write: q_lengths[{r}] = {int(ql[r])} is outside [0, q_len={q_len}]"
                             f" (the real tokens of row {r}).")
    if seq_ids is not None:
        seq_ids = _slot_ids("write", seq_ids, batch, spec)
    if (index_keys is None) != (spec.indexer is None):
        raise ValueError(
            "write: " + ("the cache holds lightning-indexer keys (CacheSpec.indexer); give "
                         "index_keys=[batch, q_len, d_index]" if spec.indexer is not None else
                         "index_keys given, but the cache has no indexer (CacheSpec.indexer)")
            + ".")
    if index_keys is not None:
        index_keys = jnp.asarray(index_keys).astype(spec.indexer.dtype)
        want = (batch, q_len, spec.indexer.head_dim)
        if index_keys.shape != want:
            raise ValueError(f"write: index_keys must be [batch, q_len, d_index] = {want}, got "
                             f"{index_keys.shape}.")
    g, index = window.home(spec, layer)
    if g is not None:  # full-precision rings, also beside KIVI pages
        want = (batch, q_len, spec.attention.kv_heads, spec.attention.head_dim)
        if a.shape != want or b.shape != want:
            raise ValueError(f"write: K and V must have shape [batch, q_len, kv_heads, "
                             f"head_dim] = {want}, got {a.shape} and {b.shape}.")
        positions, valid = _positions(cache, q_lengths, q_len, seq_ids)
        return window.write_layer(cache, g, index, positions, valid, seq_ids, a, b)
    if cache.tail is not None:
        _check_kivi_values(cache, a, b, seq_ids)
        return quantized.write_layer(cache, index, a, b, seq_ids, index_keys=index_keys)
    positions, valid = _positions(cache, q_lengths, q_len, seq_ids)
    slots = paged.token_slots(cache, positions, valid, seq_ids)
    return paged.write_layer(cache, index, slots, a, b, index_keys=index_keys)


def layer_view(
    cache: PagedKVCache, layer: int | Int[Array, ""], *, whole_pools: bool = False
) -> LayerView | QuantizedLayerView:
    """One layer's pages with the page table, in the form `kvjax.attention` takes.

    A `LayerView` (full-precision K/V or MLA latents, one layer) or, for a quantized
    cache, a `QuantizedLayerView` (`whole_pools=True` keeps its pools whole, see
    `kvjax.cache.quantized.layer_view`).
    """
    paged.check_layer(cache.spec, layer)
    g, index = window.home(cache.spec, layer)
    if g is None and cache.tail is not None:
        return quantized.layer_view(cache, index, whole_pools=whole_pools)
    if g is None:
        return paged.layer_view(cache, index)
    (k, v), tables, index = window.attention_inputs(cache, layer)
    ok = paged.traced_layer_ok(cache.spec, layer)
    return LayerView(k=paged.poison_unless(ok, k[index]), v=paged.poison_unless(ok, v[index]),
                     block_tables=tables, lengths=cache.lengths)


def _rows_view(view: QuantizedLayerView, seq_ids) -> QuantizedLayerView:
    """The view of the batch rows `seq_ids` (tables, lengths, tails)."""
    if seq_ids is None:
        return view
    return dataclasses.replace(
        view, block_tables=view.block_tables[seq_ids], quant_lengths=view.quant_lengths[seq_ids],
        lengths=view.lengths[seq_ids], tail_k=view.tail_k[:, seq_ids],
        tail_v=view.tail_v[:, seq_ids])


def attend(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    q: Query,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    selection: Selection | TokenSelection | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl="auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_width"], Float[Array, "batch q_len q_heads"]]:
    """Attention of one layer's new queries over the cache (their own tokens written).

    Decode (q_len 1) and chunked prefill (q_len > 1, causal over the cache) alike, for
    every page kind; the implementation comes from `kvjax.attention`'s registry (`impl`).

    Args:
      cache: the cache holding the new tokens (after `write`).
      layer: the layer.
      q: `[batch, q_len, q_heads, head_dim]` (post-RoPE) for MHA/GQA/MQA; for MLA the
        absorbed pair `(q_latent [batch, q_len, q_heads, d_c], q_rope [..., d_rope])`.
      q_lengths: int32[batch], real queries per row (query t of row b sits at position
        `lengths[seq_b] - q_lengths[b] + t`).
      seq_ids: int32[batch], the rows' cache slots (default every slot in order).
      selection: decode only: the pages to read instead of each sequence's own
        (`kvjax.attention.Selection`, one row per slot; on a quantized cache, quantized
        pages, the tail being read besides). Or, on an MLA cache, decode and prefill
        alike: the tokens each query reads (`kvjax.attention.TokenSelection`, one row
        per batch row, from `indexer_topk`): attention over those tokens only.
      scale: logit scale (default 1/sqrt(head_dim); MLA needs it given).
      soft_cap, sliding_window: as in `kvjax.attention.paged_decode_attention` (MHA/GQA/MQA).
      impl, interpret: the attention implementation (`kvjax.attention.IMPLS` or a
        `kvjax.sharding.ShardedAttention`).

    Returns:
      (out `[batch, q_len, q_heads, width]` in the query's dtype — MLA: in latent space —,
      lse float32 `[batch, q_len, q_heads]`).

    Raises:
      ValueError / TypeError: a layer outside the cache, queries or `q_lengths` /
        `seq_ids` of the wrong shape or dtype, or (concrete) a slot outside [0, max_seqs).
        Under jit a layer cannot be checked: for a traced one outside the cache, out and
        lse are NaN (never another layer's result).
    """
    spec = cache.spec
    mla = spec.is_mla
    paged.check_layer(spec, layer)
    if mla and not (isinstance(q, tuple) and len(q) == 2):
        raise TypeError("attend: an MLA cache takes q = (q_latent, q_rope).")
    if not mla and isinstance(q, tuple):
        raise TypeError("attend: an MHA/GQA/MQA cache takes one query array, not a tuple.")
    if mla and (soft_cap is not None or sliding_window is not None):
        raise ValueError("attend: soft_cap and sliding_window apply to MHA/GQA/MQA caches.")
    q0 = q[0] if mla else q
    if q0.ndim != 4:
        raise ValueError(f"attend: queries must be [batch, q_len, q_heads, width], got "
                         f"{q0.shape}.")
    q_len = q0.shape[1]
    q_lengths = _rows_vector("attend", "q_lengths", q_lengths, q0.shape[0])
    if seq_ids is not None:
        seq_ids = _slot_ids("attend", seq_ids, q0.shape[0], spec, distinct=False)
    if isinstance(selection, TokenSelection):
        if not mla:
            raise ValueError("attend: a TokenSelection (DeepSeek Sparse Attention) applies to "
                             "MLA caches.")
        want = (q0.shape[0], q_len)
        if selection.positions.ndim != 3 or selection.positions.shape[:2] != want:
            raise ValueError(f"attend: TokenSelection positions must be [batch, q_len, k] with "
                             f"[batch, q_len] = {want}, got {selection.positions.shape}.")
    elif selection is not None and q_len != 1:
        raise ValueError(f"attend: a selection applies to decode (q_len 1), got q_len {q_len}.")
    if spec.window_groups:
        g, _ = window.home(spec, layer)
        if g is not None:
            w = spec.window_groups[g].window
            if sliding_window is None or sliding_window > w:
                raise ValueError(
                    f"attend: layer {layer} keeps only the pages of its {w}-token window "
                    f"(CacheSpec.window_groups), so it must attend with sliding_window <= {w}"
                    f", got {sliding_window}.")
            if selection is not None:
                raise ValueError("attend: a selection names pages by position; a window "
                                 "group's layer holds only its window's pages.")
    if scale is None:
        if mla:
            raise ValueError("attend: MLA needs its softmax scale (scale=...).")
        scale = q0.shape[-1] ** -0.5
    out, lse = _attend(cache, layer, q, q_lengths, seq_ids, selection, scale, soft_cap,
                       sliding_window, dict(impl=impl, interpret=interpret))
    ok = paged.traced_layer_ok(spec, layer)
    return paged.poison_unless(ok, out), paged.poison_unless(ok, lse)


def _attend(cache, layer, q, q_lengths, seq_ids, selection, scale, soft_cap, sliding_window,
            kw):
    """`attend` after its checks: the op of the cache's page kind."""
    spec = cache.spec
    if isinstance(selection, TokenSelection):
        return _attend_tokens(cache, layer, q, seq_ids, selection, scale, kw)
    # A window group's layer reads its device-resident ring only (the tier holds main pages).
    if (cache.host is not None and cache.host.stream_pages > 0
            and window.home(spec, layer)[0] is None):
        if selection is not None:
            raise ValueError("attend: a selection does not combine with host-resident pages "
                             "(a host tier with stream_pages > 0).")
        # Both parts in float32, so that only the merged result is rounded to q's dtype.
        q32 = jax.tree.map(lambda x: x.astype(jnp.float32), q)
        dev = _attend(host.device_part(cache), layer, q32, q_lengths, seq_ids, None, scale,
                      soft_cap, sliding_window, kw)
        out, lse = host.merge(dev, host.attend_host(
            cache, layer, q32, q_lengths, seq_ids, scale=scale, soft_cap=soft_cap,
            sliding_window=sliding_window))
        return out.astype((q[0] if spec.is_mla else q).dtype), lse
    spec = cache.spec
    mla = spec.is_mla
    q_len = (q[0] if mla else q).shape[1]
    group, index = window.home(spec, layer)
    if cache.tail is not None and group is None:
        view = quantized.layer_view(cache, index, whole_pools=True)
        if selection is not None:
            rows = _rows_view(view, seq_ids)
            sel = selection.rows(seq_ids)
            if mla:
                out, lse = kattn.quantized_mla_selected_decode_attention(
                    q[0][:, 0], q[1][:, 0], rows, sel, scale=scale, **kw)
            else:
                out, lse = kattn.quantized_selected_decode_attention(
                    q[:, 0], rows, sel, scale=scale, soft_cap=soft_cap, **kw)
            return out[:, None], lse[:, None]
        if mla:
            return kattn.quantized_mla_prefill_attention(
                q[0], q[1], view, q_lengths, scale=scale, seq_ids=seq_ids, **kw)
        return kattn.quantized_prefill_attention(
            q, view, q_lengths, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
            seq_ids=seq_ids, **kw)
    pools, tables, kw["layer"] = window.attention_inputs(cache, layer, seq_ids)
    lengths = cache.lengths if seq_ids is None else cache.lengths[seq_ids]
    if selection is not None:
        sel = selection.rows(seq_ids)
        if mla:
            out, lse = kattn.mla_selected_decode_attention(
                q[0][:, 0], q[1][:, 0], *pools, sel, scale=scale, **kw)
        else:
            out, lse = kattn.selected_decode_attention(
                q[:, 0], *pools, sel, scale=scale, soft_cap=soft_cap,
                sliding_window=sliding_window, **kw)
        return out[:, None], lse[:, None]
    if q_len == 1:
        if mla:
            out, lse = kattn.mla_decode_attention(q[0][:, 0], q[1][:, 0], *pools, lengths,
                                                  tables, scale=scale, **kw)
        else:
            out, lse = kattn.paged_decode_attention(
                q[:, 0], *pools, lengths, tables, scale=scale, soft_cap=soft_cap,
                sliding_window=sliding_window, **kw)
        return out[:, None], lse[:, None]
    if mla:
        return kattn.mla_prefill_attention(q[0], q[1], *pools, lengths, tables, q_lengths,
                                           scale=scale, **kw)
    return kattn.paged_prefill_attention(q, *pools, lengths, tables, q_lengths, scale=scale,
                                         soft_cap=soft_cap, sliding_window=sliding_window, **kw)


def _attend_tokens(cache, layer, q, seq_ids, selection, scale, kw):
    """MLA attention over a `TokenSelection` of each row's tokens, on either page kind."""
    if cache.host is not None:
        raise ValueError("attend: a TokenSelection does not combine with a host tier.")
    if cache.tail is not None:
        view = _rows_view(quantized.layer_view(cache, layer, whole_pools=True), seq_ids)
        return ksparse.quantized_mla_sparse_attention(q[0], q[1], view, selection, scale=scale,
                                                      **kw)
    pools = paged._pools(cache.pages)
    tables = cache.block_tables if seq_ids is None else cache.block_tables[seq_ids]
    return ksparse.mla_sparse_attention(q[0], q[1], *pools, tables, selection, scale=scale,
                                        layer=layer, **kw)


def indexer_topk(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    q: Float[Array, "batch q_len index_heads d_index"],
    weights: Float[Array, "batch q_len index_heads"],
    *,
    topk: int,
    scale: float,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl="auto",
) -> TokenSelection | None:
    """The lightning indexer's choice: each query's `topk` best cached tokens (DeepSeek-V3.2).

    Scores every token of the row's sequence visible to the query (the new tokens
    written, causal) by `sum_h weights[h] * relu(scale * q[h] . k_index)` against the
    cache's indexer keys (`kvjax.attention.indexer_scores`; on a KIVI cache the keys
    of its quantized pages and of its full-precision tail ring), and keeps the
    `min(topk, seen)` best (ties: the earlier position).

    Args:
      cache: a cache with an indexer (`CacheSpec.indexer`) holding the queries' tokens.
      layer: the layer.
      q: indexer queries (rotated) `[batch, q_len, index_heads, d_index]`.
      weights: per-head weights `[batch, q_len, index_heads]`.
      topk: tokens per query (`index_topk`, static).
      scale: the score scale (`index_head_dim ** -0.5`).
      q_lengths, seq_ids: as in `attend`.
      impl: as in `attend` (a `ShardedAttention` scores each device's pages).

    Returns:
      A `TokenSelection` for `attend`, or None when no sequence can hold more than
      `topk` tokens (every query then attends to all it sees: dense attention is the
      same set, read without scoring).

    Raises:
      ValueError / TypeError: a cache without an indexer, a layer outside it, or
        queries, weights, q_lengths or seq_ids of the wrong shape or dtype.
    """
    spec = cache.spec
    if spec.indexer is None:
        raise ValueError("indexer_topk: the cache holds no indexer keys; build it from a "
                         "spec with indexer=IndexerCacheSpec(...) (a DeepSeek-V3.2 model's "
                         "make_cache_spec).")
    paged.check_layer(spec, layer)
    if isinstance(topk, bool) or not isinstance(topk, int | np.integer) or topk < 1:
        raise ValueError(f"indexer_topk: topk must be a positive int, got {topk!r}.")
    if q.ndim != 4 or q.shape[-1] != spec.indexer.head_dim:
        raise ValueError(f"indexer_topk: q must be [batch, q_len, index_heads, "
                         f"{spec.indexer.head_dim}], got {q.shape}.")
    batch, q_len = q.shape[:2]
    q_lengths = _rows_vector("indexer_topk", "q_lengths", q_lengths, batch)
    if seq_ids is not None:
        seq_ids = _slot_ids("indexer_topk", seq_ids, batch, spec, distinct=False)
    if spec.max_tokens_per_seq <= topk:
        return None
    lengths = cache.lengths if seq_ids is None else cache.lengths[seq_ids]
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    q_pos = jnp.where(t < q_lengths[:, None], lengths[:, None] - q_lengths[:, None] + t, -1)
    tables = cache.block_tables if seq_ids is None else cache.block_tables[seq_ids]
    key_lengths = cache.table.lengths if seq_ids is None else cache.table.lengths[seq_ids]
    scores = ksparse.indexer_scores(q, weights, cache.pages.index_k, tables, key_lengths, q_pos,
                                    scale=scale, impl=impl, layer=layer)
    if cache.tail is None:
        return ksparse.select_topk(scores, topk)
    ring = quantized.tail_capacity(spec)
    ring_keys = cache.tail.c[layer, 0]
    if seq_ids is not None:
        ring_keys = ring_keys[seq_ids]
    tail = ksparse.tail_indexer_scores(q, weights, ring_keys, key_lengths, lengths, q_pos,
                                       scale=scale)
    # select_topk breaks ties by column: put the ring's slots in position order (the ring
    # wraps, slot p mod ring holding position p), so ties go to the earlier position.
    order = (key_lengths[:, None] + jnp.arange(ring, dtype=jnp.int32)[None, :]) % ring
    tail = jnp.take_along_axis(tail, order[:, None, :], axis=2)
    cols = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=jnp.int32), (batch,
                                                                           scores.shape[-1]))
    positions = jnp.concatenate(
        [cols, jnp.take_along_axis(ksparse.tail_positions(key_lengths, ring), order, axis=1)],
        axis=1)
    return ksparse.select_topk(jnp.concatenate([scores, tail], axis=-1), topk, positions)


def attention_probs(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    q: Float[Array, "max_seqs q_len q_heads width"],
    q_lengths: Int[Array, " max_seqs"],
    *,
    scale: float,
    soft_cap: float | None = None,
    weights: Float[Array, "max_seqs q_len"] | None = None,
) -> Float[Array, "max_seqs q_heads max_tokens"]:
    """Attention probabilities each cached position of layer `layer` gets, summed over queries.

    For the cache policies that score tokens (H2O, SnapKV, PyramidKV), on every page kind:
    two blocked passes over the keys (`kvjax.attention.scores`), never a gathered or
    dequantized copy of a sequence's keys.

    Args:
      cache: the cache holding the queries' own tokens.
      layer: the layer.
      q: queries, one row per slot: `[max_seqs, q_len, q_heads, head_dim]` (post-RoPE);
        MLA: the absorbed `[q_latent, q_rope]` concatenated on the last axis.
      q_lengths: int32[max_seqs], real queries per slot (query t sits at position
        `lengths - q_lengths + t`).
      scale, soft_cap: the attention's logit scale and soft cap.
      weights: float32[max_seqs, q_len], how much each query counts (default 1 for
        real queries, 0 for padding).

    Returns:
      float32[max_seqs, q_heads, max_pages_per_seq * page_size], column j = position j;
      NaN for a traced layer outside the cache (never another layer's probabilities).
    """
    paged.check_layer(cache.spec, layer)
    if cache.groups:
        raise ValueError("attention_probs: a cache with window groups (CacheSpec.window_groups) "
                         "does not combine with a scoring policy; its windowed layers hold "
                         "only their windows' pages.")
    probs = _attention_probs(cache, layer, q, q_lengths, scale=scale, soft_cap=soft_cap,
                             weights=weights)
    return paged.poison_unless(paged.traced_layer_ok(cache.spec, layer), probs)


def _attention_probs(cache, layer, q, q_lengths, *, scale, soft_cap, weights):
    spec = cache.spec
    q_len = q.shape[1]
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    real = t < q_lengths[:, None]
    q_pos = jnp.where(real, cache.lengths[:, None] - q_lengths[:, None] + t, -1)
    weights = real.astype(jnp.float32) if weights is None else jnp.where(real, weights, 0.0)
    d_c = spec.attention.cache_widths[0]
    qs = (q[..., :d_c], q[..., d_c:]) if spec.is_mla else (q,)
    heads = spec.attention.cache_heads
    kw = dict(page_size=spec.page_size, kv_heads=heads, scale=scale, soft_cap=soft_cap)
    if cache.tail is None:
        pools = paged._pools(cache.pages)
        readers = tuple(xla_path.dense_reader(p, layer)
                        for p in (pools if spec.is_mla else pools[:1]))
        return kscores.blocked_attention_probs(qs, readers, cache.lengths, cache.block_tables,
                                               q_pos, weights, **kw)
    view = quantized.layer_view(cache, layer, whole_pools=True)
    k = view.k
    readers = (xla_quantized.quantized_reader(*k.arrays, bits=k.bits, grouping=k.grouping,
                                              layer=k.layer),)
    tails = (view.tail_k,)
    if spec.is_mla:
        readers += (xla_path.dense_reader(view.v, view.layer),)
        tails += (view.tail_v,)
    ring = view.tail_k.shape[2]
    ql = cache.quant_lengths
    t_pos = ql[:, None] + jnp.mod(jnp.arange(ring)[None, :] - ql[:, None], ring)
    t_valid = t_pos < cache.lengths[:, None]
    return kscores.blocked_attention_probs(qs, readers, ql, cache.block_tables, q_pos, weights,
                                           tail=(tails, t_pos, t_valid), **kw)


def check_invariants(cache: PagedKVCache | pt.PageTable) -> None:
    """Host-side check of a cache's (or a page table's) invariants; AssertionError on a breach.

    The allocator's (`page_table.check_invariants`: refcounts match the block tables,
    the free stack holds exactly the unreferenced pages, ...) and, for a quantized cache,
    the token counts: each sequence's quantized tokens are a multiple of the page size
    between `Q(lengths)` and its length (more only after `truncate` to whole pages),
    and nothing is pending past its length.
    """
    if not isinstance(cache, PagedKVCache):
        return paged.allocator(cache).check_invariants(cache)
    paged.allocator(cache.table).check_invariants(cache.table)
    window.check_invariants(cache)
    if cache.tail is None:
        return None
    lengths = np.asarray(cache.lengths)
    q = np.asarray(cache.quant_lengths)
    pending = np.asarray(cache.tail.pending)
    want = np.asarray(quantized.quantized_tokens(cache.spec, jnp.asarray(lengths)))
    if (lengths < q).any():
        s = int(np.nonzero(lengths < q)[0][0])
        raise AssertionError(f"sequence {s} has {lengths[s]} tokens but {q[s]} quantized")
    if (q < want).any() or (q % cache.spec.page_size).any():
        s = int(np.nonzero((q < want) | (q % cache.spec.page_size != 0))[0][0])
        raise AssertionError(f"sequence {s} of {lengths[s]} tokens has {q[s]} quantized, "
                             f"expected a multiple of {cache.spec.page_size} from {want[s]} "
                             f"to {lengths[s]}")
    if (pending < 0).any() or (pending[0] > lengths).any() or (pending[1] > q).any():
        raise AssertionError(f"pending counts {pending.tolist()} exceed the lengths")
    return None
