"""Host-side (NumPy) read-back of a KIVI cache's sequences: the K/V a test's reference
attends over.

It follows the layout documented in `kernels_pallas/quantized_attention/layout.py`
(planar packing, `code * scale + zero` in float32, scales repeated over their group)
without its jnp code, so the references stay independent of the code under test and
cost no compilation: `kvjax.cache.quantized.dequantized_sequence` runs eager jnp ops
whose shapes change with each sequence's page count, one program each.
"""

import jax
import numpy as np

from kvjax.attention.pages import QuantLayer
from kvjax.cache import quantized as qz

__all__ = ["dequantize", "dequantized_sequences", "unpack_codes"]


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes from planar-packed bytes: bit field i of byte j is element i * n + j."""
    mask = (1 << bits) - 1
    return np.concatenate([(packed >> (i * bits)) & mask for i in range(8 // bits)], axis=-1)


def dequantize(packed, scale, zero, *, bits: int, grouping: str) -> np.ndarray:
    """float32 `code * scale + zero`; keys ("tokens") hold one scale per channel per group
    of rows, values and MLA latents ("channels") one per row per group of channels."""
    codes = unpack_codes(np.asarray(packed), bits).astype(np.float32)
    s, z = np.asarray(scale, np.float32), np.asarray(zero, np.float32)
    axis = -2 if grouping == "tokens" else -1
    rep = codes.shape[axis] // s.shape[axis]
    return codes * np.repeat(s, rep, axis) + np.repeat(z, rep, axis)


def dequantized_sequences(cache, layer: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence slot, float32 `(a, b)` of shape `[tokens, heads, width]`: K and V (MLA:
    c_KV and k_rope), the quantized positions dequantized, the tail's as stored."""
    cache = jax.tree.map(np.asarray, cache)  # the view's slices in NumPy, not eager programs
    view = qz.layer_view(cache, layer, whole_pools=True)
    lengths, quant, tables = cache.lengths, cache.quant_lengths, cache.block_tables
    page_size = cache.spec.page_size

    def pages_of(pool):  # [heads, pages, page_size, width]
        if isinstance(pool, QuantLayer):
            return dequantize(np.asarray(pool.codes)[pool.layer],
                              np.asarray(pool.scale)[pool.layer],
                              np.asarray(pool.zero)[pool.layer], bits=pool.bits,
                              grouping=pool.grouping)
        return np.asarray(pool, np.float32)[view.layer]  # MLA's k_rope, full precision

    out = []
    pools = [(pages_of(view.k), np.asarray(view.tail_k, np.float32)),
             (pages_of(view.v), np.asarray(view.tail_v, np.float32))]
    for s in range(len(lengths)):
        pages = tables[s, :quant[s] // page_size]
        ab = []
        for x, tail in pools:
            x = x[:, pages].reshape(x.shape[0], -1, x.shape[-1])
            t = tail[:, s, np.arange(quant[s], lengths[s]) % tail.shape[2]]
            ab.append(np.concatenate([x, t], axis=1).transpose(1, 0, 2))
        out.append((ab[0], ab[1]))
    return out
