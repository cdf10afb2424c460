"""The one registry of attention implementations: op name -> impl name -> function.

Every public attention op (`ops.py`, `quantized.py`, `selected.py`) validates its
inputs, then calls `resolve(op, impl)` for the function to run. `impl` is one of
`IMPLS` or an object with a `resolve_attention(op, interpret)` method, which runs
the op its own way (`kvjax.sharding.ShardedAttention`: per device inside
`shard_map`); models and decode loops pass `impl` through unchanged.

Implementations:
  "reference": the plain-jnp oracles in `kernels_pallas/*/reference.py` (gather each
    sequence's pages, then attend);
  "xla": the blocked online-softmax path of `xla.py` / `xla_quantized.py`, which
    never gathers a sequence's whole K/V;
  "pallas": the Pallas kernels (`kernels_pallas/*/{tpu,gpu}.py`): the GPU kernel on a
    GPU backend, the TPU kernel otherwise (interpreted on CPU). Chunked prefill and mixed
    steps run the ragged paged attention kernel (`kernels_pallas/ragged_attention`) on
    TPU and, for GQA, on a Hopper GPU; elsewhere on a GPU their "pallas" entry runs the
    XLA path (`pallas_impls.PREFILL_KERNEL_OPS`, `pallas_impls.prefill_kernel`);
  "cpu": the C++ CPU kernels (`kvjax.backends.cpu`) for GQA decode and chunked prefill,
    MLA and KIVI decode; the other ops' "cpu" entries run the "xla" path, so a model
    given impl="cpu" also prefills on every cache kind;
  "auto": resolved here, in one place, for the default backend (`auto_impl`).

An entry that `takes_layer` is handed a cache's whole pools plus the layer index and
reads the layer inside its gathers; the others get the layer's slice (slicing a pool
before a loop makes XLA copy the layer's whole pool, see `xla.py`).
"""

import dataclasses
import functools
from collections.abc import Callable

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.quantized_attention import reference as quant_ref
from kvjax.attention import cpu_impls, pallas_impls, xla_quantized
from kvjax.attention import xla as xla_path
from kvjax.backends import cpu as cpu_backend

__all__ = ["IMPLS", "Impl", "resolve", "auto_impl", "register", "register_composite", "ops",
           "impl_name"]

IMPLS = ("auto", "reference", "xla", "pallas", "cpu")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of one op: the function and whether it reads whole pools."""

    fn: Callable
    takes_layer: bool = False


_REGISTRY: dict[str, dict[str, Impl]] = {}
# Ops built from other ops (e.g. attention over a page selection): for a string impl
# they run their parts with that impl ("auto" included, resolved by each part).
_COMPOSITE: dict[str, Callable] = {}


def register(op: str, impl: str, fn: Callable, *, takes_layer: bool = False) -> None:
    """Adds (or replaces) `impl` of `op`. `fn` has the op's reference signature."""
    if impl not in IMPLS or impl == "auto":
        raise ValueError(f"register: impl must be one of {IMPLS[1:]}, got {impl!r}.")
    _REGISTRY.setdefault(op, {})[impl] = Impl(fn, takes_layer)


def register_composite(op: str, fn: Callable) -> None:
    """Registers an op built from other ops: `fn(*args, impl=..., interpret=..., **kw)`."""
    _COMPOSITE[op] = fn


def ops() -> tuple[str, ...]:
    """Names of the registered ops (composite ones included)."""
    return (*_REGISTRY, *_COMPOSITE)


def _register_builtin() -> None:
    xla_ops = {
        "paged_decode_attention": xla_path.paged_decode_attention,
        "paged_prefill_attention": xla_path.paged_prefill_attention,
        "mla_decode_attention": xla_path.mla_decode_attention,
        "mla_prefill_attention": xla_path.mla_prefill_attention,
        "quantized_attention": xla_quantized.quantized_attention,
        "quantized_mla_attention": xla_quantized.quantized_mla_attention,
    }
    ref_ops = {
        "paged_decode_attention": paged_ref.paged_decode_attention,
        "paged_prefill_attention": paged_ref.paged_prefill_attention,
        "mla_decode_attention": mla_ref.mla_decode_attention,
        "mla_prefill_attention": mla_ref.mla_prefill_attention,
        "quantized_attention": quant_ref.quantized_attention,
        "quantized_mla_attention": quant_ref.quantized_mla_attention,
    }
    pallas_ops = {
        "paged_decode_attention": pallas_impls.paged_decode_attention,
        "paged_prefill_attention": pallas_impls.paged_prefill_attention,
        "mla_decode_attention": pallas_impls.mla_decode_attention,
        "mla_prefill_attention": pallas_impls.mla_prefill_attention,
        "quantized_attention": pallas_impls.quantized_attention,
        "quantized_mla_attention": pallas_impls.quantized_mla_attention,
    }
    cpu_ops = {
        "paged_decode_attention": cpu_impls.paged_decode_attention,
        "paged_prefill_attention": cpu_impls.paged_prefill_attention,
        "mla_decode_attention": cpu_impls.mla_decode_attention,
        "mla_prefill_attention": xla_path.mla_prefill_attention,
        "quantized_attention": cpu_impls.quantized_attention,
        "quantized_mla_attention": xla_quantized.quantized_mla_attention,
    }
    for op in xla_ops:
        register(op, "reference", ref_ops[op])
        register(op, "xla", xla_ops[op], takes_layer=True)
        register(op, "pallas", pallas_ops[op])
        register(op, "cpu", cpu_ops[op], takes_layer=True)


_register_builtin()

# Ops with a Pallas kernel of their own: "auto" picks "pallas" for them on TPU and GPU
# (and for the prefill ops where the backend has a prefill kernel: `pallas_impls.kernel_ops`).
PALLAS_KERNEL_OPS = pallas_impls.KERNEL_OPS
# Ops with a C++ CPU kernel: "auto" picks "cpu" for them on CPU when the kernels built.
CPU_KERNEL_OPS = ("paged_decode_attention", "paged_prefill_attention", "mla_decode_attention",
                  "quantized_attention")


def auto_impl(op: str, dtype=None, pages=None) -> str:
    """The implementation "auto" resolves to for `op` (on pages of `dtype`; `pages`, one
    layer's pools, when known) on the default backend: the Pallas kernel on TPU and GPU
    where the op has one there (`pallas_impls.kernel_ops`: decode on both, chunked prefill
    and mixed steps on TPU and a Hopper GPU) that takes these pages
    (`pallas_impls.kernel_takes`); on CPU the C++ kernel where the CPU backend measured it
    faster than the XLA path on this CPU's build (`kvjax.backends.cpu.choose`), the XLA
    path otherwise."""
    platform = pallas_impls.platform()
    if platform in ("tpu", "gpu") and op in pallas_impls.kernel_ops(
            platform) and pallas_impls.kernel_takes(pages):
        return "pallas"
    if platform == "cpu" and op in CPU_KERNEL_OPS and cpu_backend.choose(
            op, dtype=dtype).use_kernel:
        return "cpu"
    return "xla"


def impl_name(op: str, impl, dtype=None, pages=None) -> str | None:
    """The registered impl name `impl` stands for (None for a resolving object)."""
    if hasattr(impl, "resolve_attention"):
        return None
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS} or an object with "
                         f"resolve_attention (e.g. kvjax.sharding.ShardedAttention), "
                         f"got {impl!r}.")
    return auto_impl(op, dtype, pages) if impl == "auto" else impl


def resolve(op: str, impl, interpret: bool | None = None, dtype=None,
            pages=None) -> tuple[Callable, bool]:
    """The function to run for `op` under `impl`, and whether it takes whole pools + layer.

    `dtype` (the pages' dtype) and `pages` (one layer's pools) inform what "auto" picks.

    Raises:
      ValueError: an unknown impl name. NotImplementedError: an impl the op lacks.
    """
    name = impl_name(op, impl, dtype, pages)
    if name is None:
        return (impl.resolve_attention(op, interpret=interpret),
                bool(getattr(impl, "takes_layer", False)))
    if op in _COMPOSITE:
        return functools.partial(_COMPOSITE[op], impl=impl, interpret=interpret), False
    entry = _REGISTRY[op].get(name)
    if entry is None:
        raise NotImplementedError(
            f"{op}: impl={name!r} is not available; choose one of {sorted(_REGISTRY[op])}."
        )
    if name == "pallas":
        return functools.partial(entry.fn, interpret=interpret), entry.takes_layer
    return entry.fn, entry.takes_layer
