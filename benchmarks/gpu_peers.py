"""What a GPU decode kernel is measured against, in the same process and on the same data.

* the card's nominal HBM bandwidth (`nominal_gbps`, from its device kind);
* a read ceiling measured here (`read_ceiling`): torch's sum over a cold 4 GiB buffer where
  torch with CUDA is installed, and a device copy (read + write counted) always; the
  ceiling is the faster of the two, so a kernel is never compared with a slow probe;
* the bf16 matmul rate measured here (`matmul_tflops`), the bound of compute-bound rows
  (MLA decode at 128 heads);
* the peers: jax's own paged attention op for GPU (`jax_paged_attention`, where the
  installed jax ships one) and torch's `scaled_dot_product_attention` on contiguous K/V of
  the same bytes (`torch_sdpa`, a reference without paging).

Kernel times come from `pipelined_ms`: calls issued back to back and one wait at the end,
so a microsecond-scale kernel is timed without the host's launch latency per call.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NOMINAL_TBPS", "nominal_gbps", "read_ceiling", "copy_gbps", "matmul_tflops",
           "pipelined_ms", "torch_read_gbps", "jax_paged_attention", "torch_sdpa", "torch_ms",
           "torch_cuda"]

# Nominal HBM bandwidth in TB/s by a substring of the device kind (SXM parts).
NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35, "H800": 3.35, "H20": 4.0, "A100": 2.04,
                "B200": 8.0}


def nominal_gbps(device_kind: str) -> float | None:
    """The card's nominal bandwidth in GB/s, or None for a device kind not in the table."""
    for name, tbps in NOMINAL_TBPS.items():
        if name in device_kind:
            return tbps * 1e3
    return None


def pipelined_ms(fn, args, calls: int = 20, trials: int = 5) -> tuple[float, object]:
    """Median over `trials` of the mean ms per call of `calls` back-to-back calls (one wait
    at the end), after a compiling call and a warm-up round; returns (ms, first output)."""
    out = jax.block_until_ready(fn(*args))
    jax.block_until_ready([fn(*args) for _ in range(2)])
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        last = None
        for _ in range(calls):
            last = fn(*args)
        jax.block_until_ready(last)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times), out


def copy_gbps(mib: int, repeats: int = 10) -> float:
    """GB/s of read + write of an on-device array copy between two buffers (donated in and
    fed back, so no run first-touches fresh memory)."""
    n = mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    fn = jax.jit(lambda a, s: a * s, donate_argnums=0)  # a traced scalar: no elided copy
    one = jnp.float32(1.0)
    for _ in range(3):
        x = jax.block_until_ready(fn(x, one))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(fn(x, one))
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times) / 1e9


def torch_cuda():
    """torch, when it is installed and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_read_gbps(gib: float, repeats: int = 10) -> float | None:
    """GB/s of torch's sum over a cold `gib` GiB bf16 buffer (two buffers read in turn), or
    None without torch/CUDA. Run it before jax's allocator takes the device's memory."""
    torch = torch_cuda()
    if torch is None:
        return None
    n = int(gib * 2**30) // 2
    # Two buffers read in turn: each read finds the other's data evicted from L2.
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for b in bufs:
        b.sum()
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        bufs[i % 2].sum()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del bufs
    torch.cuda.empty_cache()
    return n * 2 / statistics.median(times) / 1e9


def read_ceiling(gib: float = 4.0, copy_mib: int = 1024, repeats: int = 10) -> dict:
    """The read ceiling: the faster of torch's reduction over a cold `gib` GiB buffer (where
    torch has CUDA) and a device copy of `copy_mib` MiB (read + write counted). Returns
    dict(gbps, probe, torch_read_gbps, copy_gbps)."""
    torch_read = torch_read_gbps(gib, repeats)
    copy = copy_gbps(copy_mib, repeats)
    if torch_read is not None and torch_read >= copy:
        best, probe = torch_read, f"torch sum over a cold {gib:g} GiB bf16 buffer"
    else:
        best, probe = copy, f"device copy of {copy_mib} MiB (read + write)"
    return dict(gbps=best, probe=probe, torch_read_gbps=torch_read, copy_gbps=copy)


def matmul_tflops(n: int = 8192, dtype=jnp.bfloat16) -> float:
    """TFLOP/s of an n x n x n matmul in `dtype` (float32 accumulation) on the default
    device."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype))
    ms, _ = pipelined_ms(fn, (a, b), calls=10, trials=5)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def jax_paged_attention():
    """jax's own paged GQA decode op for GPU (`jax.experimental.pallas.ops.gpu
    .paged_attention`) as `fn(q, k_pages, v_pages, lengths, block_tables, scale) -> out`, or
    None where the installed jax does not ship it (it left with the Triton ops in 0.12)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as mod
    except ImportError:
        return None

    def fn(q, k_pages, v_pages, lengths, block_tables, *, scale):
        pages = block_tables.shape[1]
        splits = max(d for d in (16, 8, 4, 2, 1) if pages % d == 0)
        per_split = pages // splits
        ppcb = max(d for d in (8, 4, 2, 1) if per_split % d == 0)
        return mod.paged_attention((q * scale).astype(q.dtype), k_pages, v_pages,
                                   block_tables, lengths, k_splits=splits,
                                   pages_per_compute_block=ppcb)

    return fn


def torch_sdpa(q, k_pages, v_pages, block_tables, *, scale):
    """torch's `scaled_dot_product_attention` on contiguous K/V holding the same tokens as
    the pages (every row at the full width of its block table): returns (fn, args) where
    fn(*args) runs the attention and returns torch's output, or None without torch/CUDA."""
    torch = torch_cuda()
    if torch is None:
        return None
    gather = jax.jit(lambda p, t: jnp.swapaxes(p[:, t], 0, 1).reshape(
        t.shape[0], p.shape[0], -1, p.shape[-1]))  # [batch, kv_heads, tokens, head_dim]
    k = torch.from_dlpack(jax.block_until_ready(gather(k_pages, block_tables)))
    v = torch.from_dlpack(jax.block_until_ready(gather(v_pages, block_tables)))
    tq = torch.from_dlpack(jax.block_until_ready(q[:, :, None, :]))
    group = q.shape[1] // k_pages.shape[0]

    def fn(tq, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            tq, k, v, scale=scale, enable_gqa=group > 1)

    return fn, (tq, k, v)


def torch_ms(fn, args, calls: int = 20, trials: int = 5) -> tuple[float, np.ndarray]:
    """Like `pipelined_ms` for a torch CUDA function; returns (ms, first output as float32
    NumPy [batch, heads, width])."""
    torch = torch_cuda()
    out = fn(*args)
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times), out[:, :, 0].float().cpu().numpy()
