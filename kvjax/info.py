"""`python -m kvjax info`: the environment kvjax runs in, and what it would run.

Prints the jax / jaxlib versions, the default backend and its devices with their
memory kinds, the CPU backend's options (and which came from the environment), whether
the C++ CPU kernels built (or the compiler's reason why not), for each CPU op which
implementation "auto" takes and why, the Pallas backend (on a GPU, for each kernel op whether
the Mosaic GPU or the Triton kernel runs, and why), what chunked prefill and the engine's mixed
steps run on TPU and on GPU, and the kernel cache directory.
"""

import argparse
import json
import platform

__all__ = ["add_parser", "collect", "main"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "info", help="versions, devices, CPU kernels and which implementation each op uses",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the text report")
    p.add_argument("--no-build", action="store_true",
                   help="do not build the CPU kernels if they are not cached yet (report "
                        "them as not built)")
    p.set_defaults(func=main)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(build: bool = True) -> dict:
    """The report as a dict (what `python -m kvjax info --json` prints).

    Args:
      build: build the CPU kernels if they are not cached (False: report them as not built).
    """
    import dataclasses
    import os

    import jax
    import jaxlib

    from kvjax.backends import cpu
    from kvjax.backends.cpu import build as cpu_build
    from kvjax.backends.cpu import options as cpu_options
    from kvjax.backends.cpu import policy

    backend = jax.default_backend()
    devices = []
    for d in jax.devices():
        try:
            kinds = sorted(m.kind for m in d.addressable_memories())
        except Exception:  # a backend without memory-kind support
            kinds = []
        devices.append(dict(id=d.id, kind=d.device_kind, platform=d.platform,
                            memory_kinds=kinds))
    opts = cpu.get_options()
    from_env = sorted(f for f, (var, _) in cpu_options.ENV.items() if os.environ.get(var))
    path = cpu_build.library_path(opts)
    if not build and opts.kernels and not path.exists():
        lib, reason = None, "not built yet (run without --no-build to build)"
    else:
        lib, reason = cpu_build._load_for(opts)
    ops = {}
    for op in policy.OPS:
        if lib is None and reason.startswith("not built"):
            ops[op] = dict(impl="xla", reason="kernels not built yet")
            continue
        kw = dict(dtype="bfloat16") if op in ("write_rows", "copy_pages") else {}
        choice = cpu.choose(op, options=opts, **kw)
        ops[op] = dict(impl="cpu" if choice.use_kernel else "xla", reason=choice.reason)
    gpu_ops = _gpu_ops()
    if backend == "tpu":
        pallas = "TPU (Mosaic) kernels"
    elif gpu_ops is not None:
        pallas = ("GPU kernels: Mosaic GPU on Hopper (sm_90) where the op has one, Triton "
                  "otherwise")
    else:
        pallas = (f"interpret mode only on {backend} (the kernels run compiled on TPU / GPU; on "
                  f"a Hopper GPU the Mosaic GPU kernels, on other GPUs the Triton kernels)")
    return dict(
        jax=jax.__version__, jaxlib=jaxlib.__version__, python=platform.python_version(),
        machine=platform.machine(), cpu_model=_cpu_model(), backend=backend, devices=devices,
        cpu_options=dataclasses.asdict(opts), cpu_options_from_environment=from_env,
        cpu_kernels=dict(built=lib is not None, reason=reason, library=str(path),
                         march=opts.march,
                         isa=sorted(lib.isa) if lib else [],
                         isa_class=lib.isa_class if lib else None),
        cpu_ops=ops, note_cpu_ops=(
            "the CPU backend's choice per op ('auto' on the CPU backend; other backends run "
            "their Pallas kernels or the XLA path)"),
        pallas=pallas, gpu_ops=gpu_ops, prefill_ops=_prefill_ops(),
        cache_dir=str(opts.cache_path))


def _gpu_ops() -> dict | None:
    """On a GPU backend, per kernel op: the GPU kernel "auto" runs ("mosaic" or "triton")
    and why; None on other backends."""
    from kvjax.attention import pallas_impls

    if pallas_impls.platform() != "gpu":
        return None
    ops = {}
    for op in dict.fromkeys((*pallas_impls.KERNEL_OPS, *pallas_impls.MOSAIC_GPU_OPS)):
        kernel, reason = pallas_impls.gpu_kernel(op)
        ops[op] = dict(kernel=kernel, reason=reason)
    return ops


def _prefill_ops() -> dict:
    """Per prefill op (chunked prefill and mixed decode/prefill steps), for TPU and GPU: the
    kernel "auto" runs there ("ragged": the TPU kernel, "kivi": the TPU KIVI kernel,
    "mosaic": the Mosaic GPU kernel on a Hopper, or "xla") and why."""
    from kvjax.attention import pallas_impls

    ops = {}
    for op in ("paged_prefill_attention", "mla_prefill_attention", "quantized_attention"):
        ops[op] = {}
        for backend in ("tpu", "gpu"):
            kernel, reason = pallas_impls.prefill_kernel(op, backend)
            ops[op][backend] = dict(kernel=kernel, reason=reason)
    return ops


def main(args) -> int:
    report = collect(build=not args.no_build)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"jax {report['jax']}, jaxlib {report['jaxlib']}, Python {report['python']}, "
          f"{report['machine']} ({report['cpu_model']})")
    print(f"backend: {report['backend']}; {len(report['devices'])} device(s)")
    kinds = {}
    for d in report["devices"]:
        kinds.setdefault((d["kind"], tuple(d["memory_kinds"])), []).append(d["id"])
    for (kind, mems), ids in kinds.items():
        print(f"  {kind} x{len(ids)} (ids {ids[0]}..{ids[-1]}): memory kinds "
              f"{', '.join(mems) or 'n/a'}")
    k = report["cpu_kernels"]
    if k["built"]:
        print(f"CPU kernels: built for -march={k['march']} ({k['isa_class']}: "
              f"{' '.join(k['isa'])})")
        print(f"  library: {k['library']}")
    else:
        print(f"CPU kernels: not available: {k['reason']}")
    env = report["cpu_options_from_environment"]
    changed = {f: v for f, v in report["cpu_options"].items()
               if v != _default(f)}
    print(f"CPU options: {', '.join(f'{f}={v!r}' for f, v in changed.items()) or 'defaults'}"
          f"{' (from the environment: ' + ', '.join(env) + ')' if env else ''}")
    print("CPU ops (\"auto\" on the CPU backend):")
    width = max(len(op) for op in report["cpu_ops"])
    for op, c in report["cpu_ops"].items():
        print(f"  {op:<{width}}  {c['impl']:<4} {c['reason']}")
    print(f"Pallas: {report['pallas']}")
    if report["gpu_ops"]:
        width = max(len(op) for op in report["gpu_ops"])
        for op, c in report["gpu_ops"].items():
            print(f"  {op:<{width}}  {c['kernel']:<6} {c['reason']}")
    print("Prefill and mixed steps (\"auto\" on TPU / GPU):")
    width = max(len(op) for op in report["prefill_ops"])
    for op, per_backend in report["prefill_ops"].items():
        for i, (backend, c) in enumerate(per_backend.items()):
            print(f"  {op if i == 0 else '':<{width}}  {backend}: {c['kernel']:<6}  {c['reason']}")
    print(f"kernel cache directory: {report['cache_dir']}")
    return 0


def _default(field: str):
    from kvjax.backends.cpu.options import CpuOptions

    return getattr(CpuOptions(), field)
