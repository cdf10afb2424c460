"""The "pallas" implementations behind `kvjax.attention`'s ops.

Each function has its op's reference signature plus `interpret`. The
backend decides the kernel: on a GPU backend the Mosaic GPU kernel where the
op has one and the GPU is a Hopper (sm_90: its TMA copies and `wgmma`), the
Triton kernel otherwise (`gpu_kernel` says which and why; `python -m kvjax info`
prints it); the TPU kernel on every other backend — natively on TPU, in Pallas'
plain interpret mode on CPU, where it is fastest to interpret (its pools stay in
"HBM" and only the pages a sequence uses are copied).

Chunked prefill and the engine's mixed steps (`paged_prefill_attention`,
`mla_prefill_attention`: rows of 0..q_len new queries) run the ragged paged
attention kernel: `kernels_pallas/ragged_attention/tpu.py` on TPU, and on a Hopper
GPU `kernels_pallas/ragged_attention/mosaic_gpu.py` (GQA) and `mla_mosaic_gpu.py`
(absorbed MLA) where they take the shapes; the XLA path on other GPUs and for
shapes they refuse (`PREFILL_KERNEL_OPS` lists, per backend, the prefill ops with a kernel;
`prefill_kernel` and `gpu_kernel` say which runs and why). KIVI's `quantized_attention`
on a Hopper ("auto" picks "pallas" there) runs decode rows on
`kernels_pallas/quantized_attention/mosaic_gpu.py` and rows of several queries on
`mosaic_gpu_prefill.py`, Triton for the shapes they refuse.
"""

import importlib

import jax
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.mla_decode import gpu as mla_gpu
from kernels_pallas.mla_decode import tpu as mla_tpu
from kernels_pallas.paged_attention import block_sizes
from kernels_pallas.paged_attention import gpu as paged_gpu
from kernels_pallas.paged_attention import tpu as paged_tpu
from kernels_pallas.quantized_attention import gpu as quant_gpu
from kernels_pallas.quantized_attention import tpu as quant_tpu
from kernels_pallas.ragged_attention import tpu as ragged_tpu
from kvjax.attention import xla as xla_path

__all__ = [
    "KERNEL_OPS", "MOSAIC_GPU_OPS", "platform", "gpu_kernel", "gpu_device", "kernel_takes",
    "paged_decode_attention", "mla_decode_attention", "quantized_attention",
    "quantized_mla_attention", "PREFILL_KERNEL_OPS", "kernel_ops", "prefill_kernel",
    "paged_prefill_attention", "mla_prefill_attention", "MOSAIC_GPU_PREFILL_OPS",
]

# Ops that have a kernel of their own ("auto" picks "pallas" for them on TPU/GPU).
KERNEL_OPS = ("paged_decode_attention", "mla_decode_attention")
# Ops with a Mosaic GPU kernel, and its module.
MOSAIC_GPU_OPS = {
    "paged_decode_attention": "kernels_pallas.paged_attention.mosaic_gpu",
    "mla_decode_attention": "kernels_pallas.mla_decode.mosaic_gpu",
    "quantized_attention": "kernels_pallas.quantized_attention.mosaic_gpu",
    "quantized_mla_attention": "kernels_pallas.quantized_attention.mosaic_gpu_mla",
    # KIVI rows of several queries (chunked prefill, mixed steps) through `quantized_attention`.
    "quantized_prefill_attention": "kernels_pallas.quantized_attention.mosaic_gpu_prefill",
}
# Prefill ops with a Mosaic GPU kernel (Hopper), and its module; the XLA path elsewhere.
MOSAIC_GPU_PREFILL_OPS = {
    "paged_prefill_attention": "kernels_pallas.ragged_attention.mosaic_gpu",
    "mla_prefill_attention": "kernels_pallas.ragged_attention.mla_mosaic_gpu",
}
# Prefill ops (rows of several new queries, mixed with decode rows) with a kernel, per
# backend (on GPU: where `gpu_kernel` finds a Hopper).
PREFILL_KERNEL_OPS = {
    "tpu": ("paged_prefill_attention", "mla_prefill_attention"),
    "gpu": tuple(MOSAIC_GPU_PREFILL_OPS),
}
_PREFILL_OPS = ("paged_prefill_attention", "mla_prefill_attention")
# Mosaic GPU kernels run where the GPU has Hopper's TMA and warpgroup MMA (sm_90).
_MOSAIC_CAPABILITIES = ("9.0",)


def platform() -> str:
    """The default backend's platform ("cpu", "gpu" or "tpu"); one place to stub in tests."""
    return jax.default_backend()


def kernel_ops(backend: str) -> tuple[str, ...]:
    """The ops with a Pallas kernel of their own on `backend` ("tpu" or "gpu"): "auto" picks
    "pallas" for them there (on GPU the prefill ops only where `prefill_kernel` finds the
    Mosaic GPU kernel runs on the default device; there KIVI's `quantized_attention` too, its
    decode and prefill rows on their Mosaic GPU kernels). On TPU KIVI's `quantized_attention`
    runs its TPU kernel, which takes decode, chunked-prefill and mixed rows alike."""
    prefill = PREFILL_KERNEL_OPS.get(backend, ())
    if backend == "tpu":
        prefill += ("quantized_attention",)
    if backend == "gpu":
        prefill = tuple(op for op in prefill if prefill_kernel(op, "gpu")[0] != "xla")
        if platform() == "gpu" and gpu_kernel("quantized_prefill_attention")[0] == "mosaic":
            prefill += ("quantized_attention",)
    return KERNEL_OPS + prefill


def prefill_kernel(op: str, backend: str, *arrays) -> tuple[str, str]:
    """What impl="pallas" runs for prefill op `op` on `backend` ("tpu" or "gpu"), and why:
    ("ragged", reason) for the TPU ragged kernel, ("mosaic", reason) for the Mosaic GPU
    ragged kernel, ("xla", reason) for the XLA path. On a GPU backend the answer is the
    default device's (`gpu_kernel`, for `arrays`: the op's query and page arrays, or none:
    any shapes); asked about "gpu" elsewhere, it says what a GPU runs. For KIVI pages
    (`quantized_attention`, whose prefill rows go through the same op as its decode rows):
    ("kivi", reason) for the TPU kernel, ("mosaic", reason) for the Hopper kernel."""
    if op == "quantized_attention":
        if backend == "gpu":
            if platform() == "gpu":
                return gpu_kernel("quantized_prefill_attention", *arrays)
            return "mosaic", ("kernels_pallas/quantized_attention/mosaic_gpu_prefill on a Hopper "
                              "GPU (sm_90) where it takes the shapes; the XLA path on other GPUs")
        return "kivi", ("kernels_pallas/quantized_attention/tpu: KIVI pages, decode, "
                        "chunked-prefill and mixed rows in one kernel")
    if backend == "gpu":
        if platform() == "gpu":
            return gpu_kernel(op, *arrays)
        if op in MOSAIC_GPU_PREFILL_OPS:
            module = MOSAIC_GPU_PREFILL_OPS[op].rsplit(".", 1)[1]
            return "mosaic", (f"kernels_pallas/ragged_attention/{module} on a Hopper GPU (sm_90) "
                              "where it takes the shapes; the XLA path on other GPUs")
        return "xla", f"no GPU kernel for {op}: the XLA path"
    if op in PREFILL_KERNEL_OPS.get(backend, ()):
        return "ragged", ("kernels_pallas/ragged_attention: decode, chunked-prefill and mixed "
                          "rows in one kernel")
    return "xla", f"no {backend.upper()} prefill kernel yet: the XLA path"


def kernel_takes(pages=None) -> bool:
    """Whether the default backend's kernel takes one layer's `pages` (a tuple of pools
    `[..., page_size, width]`: K and V, or MLA's latent and rope pages; None: any pages):
    on GPU, Triton knows the GPU (`_triton_knows_this_gpu`) and the page size is a power of
    two; every width is one the kernel supports. "auto" runs the XLA path where it is not
    (impl="pallas" raises, naming the shape)."""
    backend = "gpu" if platform() == "gpu" else "tpu"
    if backend == "gpu" and not _triton_knows_this_gpu():
        return False
    if pages is None:
        return True
    try:  # the kernels' own shape checks
        for p in pages:
            block_sizes.check_head_dim("auto", "width", p.shape[-1], backend)
        if backend == "gpu":
            paged_gpu.check_page_size("auto", pages[0].shape[-2])
    except ValueError:
        return False
    return True


def _triton_knows_this_gpu() -> bool:
    """Whether Pallas' Triton lowering takes the default GPU: from jax 0.11 on it lowers only
    for the GPU kinds it has a table entry for (`plgpu.get_gpu_info` raises on the others,
    e.g. an L40S or an A10G); before, it lowered for any."""
    get = getattr(plgpu, "get_gpu_info", None)
    if get is None:
        return True
    try:
        get()
    except (ValueError, RuntimeError):
        return False
    except TypeError:  # a signature this code does not know: leave the choice as it was
        return True
    return True


def gpu_device():
    """The default backend's first device (one place to stub in tests)."""
    return jax.devices()[0]


def _mosaic_module(op: str):
    """The op's Mosaic GPU kernel module, or the reason it cannot be imported."""
    try:
        return importlib.import_module({**MOSAIC_GPU_OPS, **MOSAIC_GPU_PREFILL_OPS}[op]), None
    except Exception as e:  # an older jax without Mosaic GPU, or an API that moved
        return None, f"the Mosaic GPU kernel does not import on jax {jax.__version__} ({e})"


def gpu_kernel(op: str, *arrays, **static) -> tuple[str, str]:
    """Which GPU kernel runs `op` on the default device, and why: ("mosaic", reason) on a
    Hopper GPU (compute capability 9.0) where the op has a Mosaic GPU kernel that takes
    `arrays` (the op's query and page arrays, in its argument order; none: any shapes),
    ("triton", reason) otherwise; for the prefill ops, which have no Triton kernel, "xla"
    (the XLA path) in place of "triton"."""
    other = "xla" if op in _PREFILL_OPS else "triton"
    if op not in MOSAIC_GPU_OPS and op not in MOSAIC_GPU_PREFILL_OPS:
        return other, f"{op} has no Mosaic GPU kernel"
    device = gpu_device()
    cap = getattr(device, "compute_capability", None)
    if cap not in _MOSAIC_CAPABILITIES:
        return other, (f"{device.device_kind} (compute capability {cap}) is not a Hopper "
                       f"GPU (sm_90), which the Mosaic GPU kernel is built for")
    module, why_not = _mosaic_module(op)
    if module is None:
        return other, why_not
    if arrays:
        why_not = module.unsupported_reason(*arrays, **static)
        if why_not is not None:
            return other, f"the Mosaic GPU kernel does not take these shapes: {why_not}"
    return "mosaic", (f"{device.device_kind} is a Hopper GPU (sm_90): TMA page copies and "
                      f"warpgroup MMA")


def _num_sms(device) -> int:
    """The device's SM count (jax's `core_count` on GPU), passed to the kernels' split-K."""
    count = getattr(device, "core_count", None)
    return int(count) if count else 132


def _backend_and_interpret(interpret: bool | None) -> tuple[str, bool]:
    backend = platform()
    if interpret is None:
        interpret = backend == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError(
            "impl='pallas' with interpret=False needs a TPU or GPU backend; on CPU pass "
            "interpret=True (or None) or use impl='xla'."
        )
    return ("gpu" if backend == "gpu" else "tpu"), interpret


def paged_decode_attention(q, k_pages, v_pages, lengths, block_tables, *, scale=None,
                           soft_cap=None, sliding_window=None, interpret=None):
    """Paged GQA decode through the backend's kernel (see the module docstring)."""
    backend, interpret = _backend_and_interpret(interpret)
    if backend == "gpu" and gpu_kernel("paged_decode_attention", q, k_pages,
                                       v_pages)[0] == "mosaic":
        module, _ = _mosaic_module("paged_decode_attention")
        return module.paged_decode_attention(
            q, k_pages, v_pages, lengths, block_tables, scale=scale, soft_cap=soft_cap,
            sliding_window=sliding_window, num_sms=_num_sms(gpu_device()), interpret=interpret,
        )
    kernel = paged_gpu if backend == "gpu" else paged_tpu
    return kernel.paged_decode_attention(
        q, k_pages, v_pages, lengths, block_tables, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret,
    )


def mla_decode_attention(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, *,
                         scale, interpret=None):
    """Absorbed-MLA decode through the backend's kernel (see the module docstring)."""
    backend, interpret = _backend_and_interpret(interpret)
    if backend == "gpu" and gpu_kernel("mla_decode_attention", q_latent, q_rope, latent_pages,
                                       rope_pages)[0] == "mosaic":
        module, _ = _mosaic_module("mla_decode_attention")
        return module.mla_decode_attention(
            q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, scale=scale,
            num_sms=_num_sms(gpu_device()), interpret=interpret,
        )
    kernel = mla_gpu if backend == "gpu" else mla_tpu
    return kernel.mla_decode_attention(
        q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, scale=scale,
        interpret=interpret,
    )


def quantized_attention(*args, interpret=None, **kwargs):
    """Attention over quantized pages + tail (`quantized_attention` of
    `kernels_pallas/quantized_attention/reference.py`) through the backend's kernel; decode and
    chunked prefill alike (the kernels fold query rows)."""
    backend, interpret = _backend_and_interpret(interpret)
    # Decode rows run the split-K decode kernel, rows of several queries the prefill kernel.
    op = "quantized_attention" if args[0].shape[1] == 1 else "quantized_prefill_attention"
    if backend == "gpu" and kwargs.get("block_sizes") is None and gpu_kernel(
            op, *args[:7], k_bits=kwargs["k_bits"], v_bits=kwargs["v_bits"])[0] == "mosaic":
        module, _ = _mosaic_module(op)
        kw = {k: v for k, v in kwargs.items() if k not in ("block_sizes", "max_pages")}
        return module.quantized_attention(*args, num_sms=_num_sms(gpu_device()),
                                          interpret=interpret, **kw)
    kernel = quant_gpu if backend == "gpu" else quant_tpu
    return kernel.quantized_attention(*args, interpret=interpret, **kwargs)


def quantized_mla_attention(*args, interpret=None, **kwargs):
    """Absorbed MLA over quantized latent pages + tail through the backend's kernel; decode
    rows on a Hopper run the Mosaic GPU kernel where it takes the shapes."""
    backend, interpret = _backend_and_interpret(interpret)
    if backend == "gpu" and kwargs.get("block_sizes") is None and gpu_kernel(
            "quantized_mla_attention", *args[:6], bits=kwargs["bits"])[0] == "mosaic":
        module, _ = _mosaic_module("quantized_mla_attention")
        kw = {k: v for k, v in kwargs.items() if k not in ("block_sizes", "max_pages")}
        return module.quantized_mla_attention(*args, num_sms=_num_sms(gpu_device()),
                                              interpret=interpret, **kw)
    kernel = quant_gpu if backend == "gpu" else quant_tpu
    return kernel.quantized_mla_attention(*args, interpret=interpret, **kwargs)


def paged_prefill_attention(q, k_pages, v_pages, lengths, block_tables, q_lengths, *,
                            scale=None, soft_cap=None, sliding_window=None, interpret=None):
    """Chunked-prefill / mixed-step attention through the backend's ragged kernel (the XLA
    path where the backend has none; see the module docstring)."""
    backend, interpret = _backend_and_interpret(interpret)
    kw = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if backend == "gpu" and gpu_kernel("paged_prefill_attention", q, k_pages,
                                       v_pages)[0] == "mosaic":
        module, _ = _mosaic_module("paged_prefill_attention")
        return module.paged_prefill_attention(
            q, k_pages, v_pages, lengths, block_tables, q_lengths,
            num_sms=_num_sms(gpu_device()), interpret=interpret, **kw)
    if backend == "gpu" or prefill_kernel("paged_prefill_attention", backend)[0] == "xla":
        return xla_path.paged_prefill_attention(q, k_pages, v_pages, lengths, block_tables,
                                                q_lengths, **kw)
    return ragged_tpu.paged_prefill_attention(q, k_pages, v_pages, lengths, block_tables,
                                              q_lengths, interpret=interpret, **kw)


def mla_prefill_attention(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables,
                          q_lengths, *, scale, interpret=None):
    """Absorbed-MLA chunked prefill / mixed steps through the backend's ragged kernel (the
    XLA path where the backend has none)."""
    backend, interpret = _backend_and_interpret(interpret)
    args = (q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, q_lengths)
    if backend == "gpu" and gpu_kernel("mla_prefill_attention", q_latent, q_rope, latent_pages,
                                       rope_pages)[0] == "mosaic":
        module, _ = _mosaic_module("mla_prefill_attention")
        return module.mla_prefill_attention(*args, scale=scale, num_sms=_num_sms(gpu_device()),
                                            interpret=interpret)
    if backend == "gpu" or prefill_kernel("mla_prefill_attention", backend)[0] == "xla":
        return xla_path.mla_prefill_attention(*args, scale=scale)
    return ragged_tpu.mla_prefill_attention(*args, scale=scale, interpret=interpret)
