"""What the Mosaic GPU kernels share: jax version shims, interpret mode, lowering from CPU.

The Mosaic GPU API (`jax.experimental.pallas.mosaic_gpu`, imported here as
`plgpu`) moves between the jax versions kvjax supports (0.10.2, 0.11.2,
0.12.1); every version branch of the Mosaic GPU kernels lives in this module.

Interpret mode: `resolve_interpret(interpret)` turns a kernel's `interpret=`
argument (a bool, or interpreter parameters from `interpret_params`) into what
`plgpu.kernel(interpret=...)` takes. The interpreter runs a kernel on CPU and
simulates shared memory, barriers, TMA copies and warpgroup matmuls; with
`detect_races=True` it records unsynchronised accesses, which
`interpreter_races_found()` reports. Its parameters live in a private jax
module before 0.11; if they move, `interpret_params` raises an error naming
the jax version instead of failing somewhere inside a kernel.

Lowering from CPU: Mosaic GPU lowers in Python, so
`lower_for_cuda(fn, *args)` on a machine without a GPU runs the whole kernel
lowering (layouts, `wgmma` shapes, shared-memory transforms) for an H100 and
returns the `jax.stages.Lowered`. What only a GPU shows: PTX and SASS
compilation, register and shared-memory limits, timings.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "plgpu",
    "JAX_VERSION",
    "H100_DEVICE_KIND",
    "H100_NUM_SMS",
    "interpret_params",
    "resolve_interpret",
    "interpreter_races_found",
    "reset_interpreter",
    "abstract_gpu",
    "lower_for_cuda",
    "transpose_ref",
    "load",
    "wgmma_a_from_smem",
    "wgmma_acc_in_place",
    "layout_cast",
    "broadcasted_iota",
    "dot_transposed_b",
]

JAX_VERSION: tuple[int, ...] = tuple(
    int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()
)
# The device kind an H100 SXM reports, and its SM count (H200: the same SM count).
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
H100_NUM_SMS = 132


def _interpret_params_class() -> type:
    # Public as plgpu.InterpretGPUParams from jax 0.11; a private module before.
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is not None:
        return cls
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise RuntimeError(
            f"Mosaic GPU interpret mode: jax {jax.__version__} has neither "
            "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams nor "
            "jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams; kvjax knows jax "
            "0.10.2 to 0.12.1. Update kernels_pallas/_mosaic_gpu.py for this jax."
        ) from e
    return InterpretGPUParams


def _interpreter_module():
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    except ImportError as e:
        raise RuntimeError(
            f"Mosaic GPU interpret mode: jax {jax.__version__} has no "
            "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call (its race detector); "
            "kvjax knows jax 0.10.2 to 0.12.1. Update kernels_pallas/_mosaic_gpu.py for this jax."
        ) from e
    return interpret_pallas_call


def interpret_params(*, detect_races: bool = False, **kwargs: Any) -> Any:
    """Parameters for Mosaic GPU's interpreter (an `InterpretGPUParams`).

    Args:
      detect_races: record unsynchronised shared/global memory accesses (slower);
        read the result with `interpreter_races_found()`.
      **kwargs: further `InterpretGPUParams` fields of this jax version
        (e.g. `uninitialized_memory="nan"`, `out_of_bounds_reads="raise"`).
    """
    return _interpret_params_class()(detect_races=detect_races, **kwargs)


def resolve_interpret(interpret: Any) -> Any:
    """A kernel's `interpret=` argument as `plgpu.kernel(interpret=...)` takes it.

    False or None: compile for the GPU (returns None). True: the interpreter
    with default parameters. An `InterpretGPUParams` (from `interpret_params`)
    is passed through, e.g. with race detection on.
    """
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return interpret_params()
    cls = _interpret_params_class()
    if isinstance(interpret, cls):
        return interpret
    raise TypeError(
        f"interpret must be a bool or kernels_pallas._mosaic_gpu.interpret_params(...), got "
        f"{type(interpret).__name__}."
    )


def interpreter_races_found() -> bool:
    """Whether a kernel interpreted with `detect_races=True` since the last reset raced."""
    return bool(_interpreter_module().get_races().races_found)


def reset_interpreter() -> None:
    """Clears the interpreter's state (race records, simulated memory); jax requires it after
    an interpreted kernel raised."""
    _interpreter_module().reset_gpu_interpret_mode_state()


@contextlib.contextmanager
def abstract_gpu(
    device_kind: str = H100_DEVICE_KIND, num_cores: int = H100_NUM_SMS
) -> Iterator[None]:
    """Makes jax treat the current device as a `device_kind` GPU (an abstract mesh of no axes),
    for lowering GPU kernels on a machine without one. Mosaic GPU targets sm_90a for it."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        yield


def lower_for_cuda(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`jax.jit(fn)` lowered for CUDA on an abstract H100, from any machine.

    Args:
      fn: the function (jitted or not); bind static arguments with
        `functools.partial` or pass them as keyword `kwargs`.
      *args: arrays or `jax.ShapeDtypeStruct`s.

    Returns:
      The `jax.stages.Lowered`; `.as_text()` holds one `mosaic_gpu` custom call per
      Mosaic GPU kernel, with the kernel's lowered module serialised inside it.
    """
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    with abstract_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


# jax 0.10's spelling of a transposed ref view (deprecated in 0.11.2, removed in 0.12.1).
_TRANSPOSE_REF = getattr(plgpu, "transpose_ref", None)


def transpose_ref(ref: Any, permutation: tuple[int, ...]) -> Any:
    """A transposed view of a shared-memory ref (e.g. K^T as a `wgmma` operand)."""
    if JAX_VERSION < (0, 11):
        return _TRANSPOSE_REF(ref, permutation)
    return ref.transpose(permutation)


def load(ref: Any, layout: Any = None, *, interpret: Any = None) -> Any:
    """The whole of a shared-memory ref in registers, in `layout` (a `plgpu.Layout`), in a
    kernel compiled or interpreted as `interpret` says (jax 0.10's interpreter runs no
    `plgpu.load`; layouts mean nothing there, so it is a plain read)."""
    if _interpreter_lacks_layouts(interpret):
        return ref[...]
    if JAX_VERSION < (0, 11):
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def wgmma_a_from_smem(interpret: Any) -> bool:
    """Whether a kernel must stage a register `wgmma` A operand in shared memory.

    Compiled kernels take A from registers. The interpreter of jax before 0.12 reads A only
    from shared memory (0.12 takes either), so interpreted kernels there stage it.
    """
    return resolve_interpret(interpret) is not None and JAX_VERSION < (0, 12)


def wgmma_acc_in_place(interpret: Any) -> bool:
    """Whether a kernel may carry a `wgmma` accumulator through `pl.run_state(...)(
    plgpu.ACC.init(x))` (wgmma accumulating into x's own registers).

    Compiled kernels may. The interpreter of jax before 0.12 runs no `pl.run_state` and
    stores into no accumulator, so interpreted kernels there take the product in a fresh
    accumulator and add it.
    """
    return resolve_interpret(interpret) is None or JAX_VERSION >= (0, 12)


def _interpreter_lacks_layouts(interpret: Any) -> bool:
    # jax 0.10's interpreter has no rule for plgpu.layout_cast; layouts mean nothing there.
    return resolve_interpret(interpret) is not None and JAX_VERSION < (0, 11)


def layout_cast(x: jax.Array, layout: Any, *, interpret: Any) -> jax.Array:
    """`plgpu.layout_cast(x, layout)` in a kernel compiled or interpreted as `interpret` says."""
    if _interpreter_lacks_layouts(interpret):
        return x
    return plgpu.layout_cast(x, layout)


def broadcasted_iota(
    dtype: Any, shape: tuple[int, ...], dimension: int, *, layout: Any, interpret: Any
) -> jax.Array:
    """`plgpu.broadcasted_iota` in a kernel compiled or interpreted as `interpret` says."""
    if _interpreter_lacks_layouts(interpret):
        return jax.lax.broadcasted_iota(dtype, shape, dimension)
    return plgpu.broadcasted_iota(dtype, shape, dimension, layout=layout)


def dot_transposed_b(a_ref: Any, b_ref: Any, *, interpret: Any) -> jax.Array:
    """`a @ b.T` in float32 for shared-memory refs a [m, k] and b [n, k] (e.g. Q K^T): one
    `wgmma` with b's transposed view.

    a_ref and b_ref may also be equal-length tuples of refs, parts of K (e.g. MLA's latent
    and rope parts): their products accumulate in one accumulator, awaited once.

    m must be a multiple of 64 and n of 8. jax 0.10's interpreter cannot read a transposed
    `wgmma` operand, so there (interpreting only) the product is a plain `jnp.dot`.
    """
    a_refs = a_ref if isinstance(a_ref, tuple) else (a_ref,)
    b_refs = b_ref if isinstance(b_ref, tuple) else (b_ref,)
    m, n = a_refs[0].shape[0], b_refs[0].shape[0]
    if resolve_interpret(interpret) is not None and JAX_VERSION < (0, 11):
        return sum(jnp.dot(a[...], b[...].T, preferred_element_type=jnp.float32)
                   for a, b in zip(a_refs, b_refs, strict=True))

    def product(acc_ref):
        for a, b in zip(a_refs, b_refs, strict=True):
            plgpu.wgmma(acc_ref, a, transpose_ref(b, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((m, n), jnp.float32))
