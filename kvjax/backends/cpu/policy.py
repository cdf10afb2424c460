"""Which CPU ops take the C++ kernel: rules by the build's instruction sets, from measurements.

`choose(op, ...)` answers, for the options in force and the library they load, whether
the "auto" implementation of an op should run the C++ kernel or the XLA path, and why.
The answer is a rule on the library's instruction-set class (`Library.isa_class`:
"avx512", "avx2", "neon", "portable"), not a timing taken at build time: a calibration
on a shared 2-core machine is as noisy as the difference it would decide, and a rule
gives every process on a machine the same program. The rules come from side-by-side
runs of each kernel against the XLA path on an AVX-512 build and an AVX2 build
(`-march=haswell`) of the same sources (`python benchmarks/attention.py --cpu-choice`
prints the table; docs/cpu-backend.md has the figures). Where the kernels were never
measured (the portable and NEON builds), "auto" keeps the XLA path: the kernel is a
choice (`impl="cpu"`), not a default, until a measurement says it is faster.
"""

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.backends.cpu import build
from kvjax.backends.cpu import options as options_mod

__all__ = ["Choice", "OPS", "choose", "unstack_layers_for", "MATMUL_MAX_ROWS"]

OPS = ("paged_decode", "paged_prefill", "quantized_decode", "mla_decode", "matmul", "write_rows",
       "copy_pages", "take_rows", "argmax_rows")
# The attention registry's op names: those with a kernel, and those the XLA path serves.
ALIASES = {"paged_decode_attention": "paged_decode", "paged_prefill_attention": "paged_prefill",
           "quantized_attention": "quantized_decode", "mla_decode_attention": "mla_decode"}
NO_KERNEL = ("mla_prefill_attention", "quantized_mla_attention")

# Rows (the product of the activation's leading dims) up to which the matmul kernel beat
# XLA's dot in benchmarks/matmul.py, per ISA class; above, XLA's dot (compute-bound
# there, and blocked for many rows). AVX-512 at 32 rows (AMD EPYC Zen 4): the kernel
# 1.08-1.45x XLA's dot on the 56M Llama's float32 shapes, and the serving engine's
# 32-row decode step 41 -> 33-37 ms (float32), 105-121 -> 78-82 ms (bfloat16 weights,
# whose 32-row shapes alone are mixed: 0.7-1.6x).
MATMUL_MAX_ROWS = {"avx512": 32, "avx2": 32}
# bfloat16 activations with bfloat16 weights on a build with AVX512_BF16 run on vdpbf16ps
# (two k's per instruction) at any row count: above MATMUL_MAX_ROWS the packed GEMM, which
# measured 1.1-1.5x XLA's dot (which widens the weights to float32 first) on the 56M
# Llama's shapes at 64 and 256 rows (AMD EPYC Zen 4, 2 cores).
MATMUL_DPBF16_ISA = "avx512bf16"
# Per attention kernel, the ISA classes on which it measured faster than the XLA path
# (`python benchmarks/attention.py --cpu-choice`), float32 and 16-bit pages alike. The
# AVX2 kernels' register-blocked loops work in
# 8-float vectors: with arrays of the 16-float vectors GCC kept every accumulator on the
# stack, and MLA decode ran at 0.4-0.5x of the XLA path; in 8-float vectors at 1.7x (float32
# pages) and 2.1x (bf16) on an AVX2 build of an Intel Xeon (-march=haswell), paged decode
# at 5-6x and KIVI int4 at 7.9x. The prefill kernel (causal, reading only the keys each
# query block sees) ran at 1.5x (AVX2) and 3.2x (AVX-512) of the XLA path's chunks.
_MEASURED = {
    "paged_decode": ("avx512", "avx2"),
    "paged_prefill": ("avx512", "avx2"),
    "quantized_decode": ("avx512", "avx2"),
    "mla_decode": ("avx512", "avx2"),
}
# Stacked layer weights of at least this many bytes are worth unstacking for the decode
# loop where the matmul kernel does not read them in place (XLA:CPU copies a layer's
# slice out of the stack every step inside a scan; small models keep the scan).
UNSTACK_MIN_BYTES = 32 << 20


class Choice(typing.NamedTuple):
    """Whether "auto" takes the C++ kernel for an op, and why (one line for `kvjax info`)."""

    use_kernel: bool
    reason: str


def _is_16bit_float(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def choose(op: str, *, rows: int | None = None, dtype=None, devices: int | None = None,
           options: options_mod.CpuOptions | None = None) -> Choice:
    """Whether the "auto" implementation of `op` on the CPU backend runs the C++ kernel.

    Static (call it at trace time): it depends on the options in force (or `options`),
    the library they load (built on first call), and for some ops on the call's shape.

    Args:
      op: one of `OPS`: "paged_decode", "quantized_decode", "mla_decode" (attention
        decode kernels), "paged_prefill" (chunked-prefill attention), "matmul" (the
        matmul of `kvjax.backends.linear`), "write_rows" / "copy_pages" (in-place cache
        writes); or an attention registry op name ("paged_decode_attention",
        "paged_prefill_attention", "quantized_attention", "mla_decode_attention"; the
        ones without a kernel, "mla_prefill_attention", "quantized_mla_attention",
        answer the XLA path).
      rows: for "matmul", the activation rows of the call (the product of x's leading
        dims); None: the question is whether the kernel serves decode at all.
      dtype: for "matmul", the dtype x and w share, if they do (bfloat16 on a build with
        AVX512_BF16: the kernel at any row count); otherwise the pages' (pool's) dtype. For
        "write_rows" the kernel serves 16-bit float
        pools (XLA:CPU widens or copies those whole on every write); "copy_pages" serves
        them, and pools of other dtypes on one device (XLA's copy gathers one page per
        slot, of every layer, at every reserve; over several devices the custom call
        would gather a sharded pool whole).
      devices: for "matmul", the devices the computation spans (default: all CPU
        devices); the custom call has no partitioning rule, so with several devices
        "auto" keeps XLA's dot (`CpuOptions.matmul="on"` forces the kernel).
      options: the options to decide for (default: `get_options()`).

    Returns:
      `Choice(use_kernel, reason)`.

    Raises:
      ValueError: an unknown op.
    """
    if op in NO_KERNEL:
        return Choice(False, "XLA: no CPU kernel for this op")
    op = ALIASES.get(op, op)
    if op not in OPS:
        raise ValueError(f"choose: unknown op {op!r}; the ops are {OPS} (or the attention "
                         f"registry's {tuple(ALIASES) + NO_KERNEL}).")
    opts = options or options_mod.get_options()
    if not opts.kernels:
        return Choice(False, "XLA: kernels off (CpuOptions.kernels / KVJAX_CPU_KERNEL=0)")
    if op == "matmul" and opts.matmul == "off":
        return Choice(False, "XLA dot: matmul kernel off (CpuOptions.matmul / KVJAX_CPU_MATMUL)")
    if op == "write_rows" and dtype is not None and not _is_16bit_float(dtype):
        return Choice(False, f"XLA scatter: {jnp.dtype(dtype).name} pools update in place in XLA")
    lib, reason = build._load_for(opts)
    if lib is None:
        return Choice(False, f"XLA: kernels unavailable ({reason.splitlines()[0][:120]})")
    isa = lib.isa_class
    build_name = f"-march={lib.march} build ({isa})"
    # The custom calls have no partitioning rule: over several devices GSPMD would gather
    # sharded operands whole around them. Asked only by the ops that care (it starts the
    # backend when devices is None).
    def n_devices() -> int:
        return jax.device_count() if devices is None else devices
    if op == "write_rows":
        return Choice(True, f"kernel: 16-bit pools written in place ({build_name}); XLA "
                            f"copies the whole pool")
    if op == "take_rows":
        if dtype is not None and not _is_16bit_float(dtype):
            return Choice(False, f"XLA gather: {jnp.dtype(dtype).name} tables gather in place")
        if (n_dev := n_devices()) != 1:
            return Choice(False, f"XLA gather: {n_dev} devices (the kernel has no "
                                 f"partitioning rule)")
        return Choice(True, f"kernel: 16-bit table rows copied ({build_name}); XLA gathers "
                            f"them in float32, converting the whole table")
    if op == "argmax_rows":
        if (n_dev := n_devices()) != 1:
            return Choice(False, f"XLA argmax: {n_dev} devices (the kernel has no "
                                 f"partitioning rule)")
        return Choice(True, f"kernel: one vectorized pass per row ({build_name}); XLA runs "
                            f"several unvectorized reductions")
    if op == "copy_pages":
        if (n_dev := n_devices()) != 1 and dtype is not None and not _is_16bit_float(dtype):
            return Choice(False, f"XLA copy: {n_dev} devices (the kernel has no partitioning "
                                 f"rule: a sharded pool would be gathered whole)")
        return Choice(True, f"kernel: pages copied in place ({build_name}); XLA copies 16-bit "
                            f"pools whole and gathers a page per slot from others")
    if op == "matmul":
        cap = max(MATMUL_MAX_ROWS.values())
        dp = (dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
              and MATMUL_DPBF16_ISA in lib.isa)
        if opts.matmul == "on":
            if rows is not None and rows > cap and not dp:
                return Choice(False, f"XLA dot: {rows} rows > {cap}, the most the kernel "
                                     f"serves")
            return Choice(True, f"kernel: forced by CpuOptions.matmul='on' ({build_name})")
        if (n_dev := n_devices()) != 1:
            return Choice(False, f"XLA dot: {n_dev} devices (the kernel has no partitioning "
                                 f"rule; matmul='on' forces it)")
        if dp and rows is not None and rows > cap:
            return Choice(True, f"kernel: {rows} rows of bfloat16 x and w, the packed GEMM on "
                                f"vdpbf16ps ({build_name}; measured faster than XLA's dot)")
        limit = MATMUL_MAX_ROWS.get(isa)
        if limit is None:
            return Choice(False, f"XLA dot: the kernel is not measured on {build_name}")
        if rows is not None and rows > limit:
            return Choice(False, f"XLA dot: {rows} rows > {limit} (measured on {isa})")
        shown = f"{rows} rows" if rows is not None else "decode"
        return Choice(True, f"kernel: {shown} <= {limit} rows, faster than XLA's dot on "
                            f"{build_name} (measured)")
    if isa not in _MEASURED[op]:
        return Choice(False, f"XLA: the kernel is not measured faster on {build_name}")
    return Choice(True, f"kernel: measured faster than the XLA path on {build_name}")


def unstack_layers_for(layer_weights, rows: int,
                       options: options_mod.CpuOptions | None = None) -> bool:
    """Whether the decode loop should copy stacked layer weights into one array per layer
    for a decode of `rows` rows per step on the CPU backend.

    Inside a `lax.scan` over stacked weights XLA:CPU copies each layer's slice out of the
    stack every step (a read and a write of every layer weight per token). The matmul
    kernel (`kvjax.backends.linear`) reads the stack in place, so nothing is copied when
    it runs; where it does not (no compiler, several devices, more rows than it serves,
    matmul off), stacks of `UNSTACK_MIN_BYTES` or more are worth one copy per call.

    Args:
      layer_weights: the stacked layer params (a pytree of arrays or ShapeDtypeStructs
        with a leading layers axis; matrices are the 3-D leaves).
      rows: sequences (times new tokens) per decode step.
      options: default `get_options()`; `unstack_layers=False` answers False.
    """
    opts = options or options_mod.get_options()
    if not opts.unstack_layers or jax.default_backend() != "cpu":
        return False
    leaves = jax.tree.leaves(layer_weights)
    if sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves) < UNSTACK_MIN_BYTES:
        return False
    mats = [x for x in leaves if len(x.shape) == 3]
    if not mats:
        return True
    w = max(mats, key=lambda x: math.prod(x.shape))
    from kvjax.backends import linear  # the matmul's own test of what it takes

    x = jax.ShapeDtypeStruct((rows, w.shape[1]), w.dtype)
    return not linear.uses_kernel(x, w.shape[1:], w.dtype, options=opts)
