"""Compiles, caches and registers the CPU kernels (XLA FFI custom calls).

The C++ sources next to this file are compiled on first use with the compiler of
`CpuOptions.compiler` for `-march=CpuOptions.march` into one shared library, cached
under `CpuOptions.cache_dir` by a hash of the sources, the jaxlib version, the
compiler, its flags, the machine and the CPU's feature flags (`-march=native` code
must not run on another CPU). The sources compile in parallel; the library is linked
under a temporary name and renamed into place, and a lock file makes a second process
wait for the first one's build instead of repeating it. It is loaded with ctypes and
its handlers are registered with `jax.ffi.register_ffi_target` for the CPU platform,
under target names that carry the library's hash: builds for several `-march` values
can be loaded side by side in one process (benchmarks compare them in one run).

Nothing here raises at import or on a failed build: when there is no compiler, the
build fails or `CpuOptions.kernels` is False, `available()` is False,
`unavailable_reason()` says why, a failed build warns once with the compiler's message,
and the kernel choices (`kvjax.backends.cpu.choose`) fall back to the XLA path.

On an ARM host (aarch64 / arm64) "native" becomes `-mcpu=native`, which GCC and Clang
both take there (Clang before 15, Apple's included, rejects `-march=native` on ARM);
x86 hosts get `-march=native` as before. `compile_sources` also takes a command with
arguments and no `-march` at all: tests/backends/test_cpu_cross_compile.py compiles the
sources for aarch64 with zig's Clang (`python -m ziglang c++ -target aarch64-linux-gnu`),
and `python -m kvjax.backends.cpu --compiler aarch64-linux-gnu-g++ --march armv8-a`
does the same with any cross compiler, without loading the result.
"""

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

from kvjax.backends.cpu import options as options_mod

__all__ = ["Library", "available", "unavailable_reason", "load", "library", "library_path",
           "TARGETS", "SOURCES", "compile_sources", "compile_flags"]

# Largest first: one compiler process per file, so the longest ones start first.
SOURCES = ("quantized_decode_f32.cc", "quantized_decode_bf16.cc", "quantized_decode_f16.cc",
           "paged_decode.cc", "paged_prefill.cc", "mla_decode.cc", "matmul.cc",
           "quantized_decode.cc",
           "write_rows.cc", "argmax.cc", "config.cc")
_HEADERS = ("common.h", "native.h", "attend.h", "quantized_decode.h", "quantized_kernel.h")
# FFI symbol in the library -> the op's name (its target is "kvjax_<name>_<library hash>").
TARGETS = {
    "KvjaxPagedDecode": "paged_decode",
    "KvjaxPagedPrefill": "paged_prefill",
    "KvjaxQuantizedPrefill": "quantized_prefill",
    "KvjaxQuantizedDecode": "quantized_decode",
    "KvjaxMlaDecode": "mla_decode",
    "KvjaxMatmul": "matmul",
    "KvjaxWriteRows": "write_rows",
    "KvjaxReadRows": "read_rows",
    "KvjaxTakeRows": "take_rows",
    "KvjaxCopyPages": "copy_pages",
    "KvjaxArgmaxRows": "argmax_rows",
}
_COMMON_FLAGS = ("-ffp-contract=fast", "-fPIC", "-std=c++17")
_ARM_MACHINES = ("aarch64", "arm64")
_HERE = Path(__file__).parent
_ISA_BITS = {0: "avx2", 1: "fma", 2: "f16c", 3: "avx512f", 4: "avx512bw", 5: "avx512vl",
             6: "avx512vnni", 7: "avx512vbmi", 8: "avx512fp16",
             9: "avx512bf16", 16: "neon", 17: "fp16"}
_POOL_CODES = {"own": 0, "xla": 1, "std": 2}


def _target_flags(march: str | None, machine: str) -> tuple[str, ...]:
    if march is None:  # the compiler's default target (generic x86-64, armv8-a, ...)
        return ()
    if march == "native" and machine.lower() in _ARM_MACHINES:
        # GCC and Clang take -mcpu=native on ARM; Clang < 15 (Apple clang 14) rejects
        # -march=native there ("the clang compiler does not support '-march=native'").
        return ("-mcpu=native",)
    return (f"-march={march}",)


def compile_flags(march: str | None, *, opt: str = "-O3",
                  machine: str | None = None) -> tuple[str, ...]:
    """The flags each source is compiled with (the link adds `-shared`).

    Args:
      march: the `-march=` value (None: no target flag, the compiler's default target).
        "native" on an ARM `machine` is passed as `-mcpu=native`.
      opt: the optimization flag (builds use -O3; the cross-compile check -O0).
      machine: the host's `platform.machine()` (default: this one's).
    """
    return (opt, *_COMMON_FLAGS, *_target_flags(march, machine or platform.machine()))


@dataclasses.dataclass(frozen=True, eq=False)
class Library:
    """A loaded build of the kernels.

    Attributes:
      path: the shared library file.
      march: the `-march` it was built for.
      isa: the instruction-set extensions its code uses ("avx2", "avx512f", "avx512vnni",
        "neon", ...: what the compiler targeted, not what the CPU has).
    """

    path: Path
    march: str
    isa: frozenset
    cdll: ctypes.CDLL = dataclasses.field(repr=False)

    @property
    def tag(self) -> str:
        return self.path.stem.rsplit("-", 1)[-1]

    def target(self, op: str) -> str:
        """The registered FFI target name of `op` ("paged_decode", "matmul", ...)."""
        return f"kvjax_{op}_{self.tag}"

    @property
    def isa_class(self) -> str:
        """"avx512" (AVX-512 F/BW/VL), "avx2" (AVX2 + FMA + F16C), "neon" or "portable"."""
        if {"avx512f", "avx512bw", "avx512vl"} <= self.isa:
            return "avx512"
        if {"avx2", "fma", "f16c"} <= self.isa:
            return "avx2"
        if "neon" in self.isa:
            return "neon"
        return "portable"

    def configure(self, opts: options_mod.CpuOptions) -> None:
        """Pushes the thread settings of `opts` into the library (the one configuration call)."""
        self.cdll.KvjaxConfigure(ctypes.c_int64(opts.threads),
                                 ctypes.c_int64(_POOL_CODES[opts.thread_pool]),
                                 ctypes.c_int64(opts.spin_us))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _resolve(compiler: str) -> str | None:
    return shutil.which(compiler)


def library_path(opts: options_mod.CpuOptions | None = None) -> Path:
    """Where the library for these sources, this jaxlib, compiler, flags and CPU is cached."""
    opts = opts or options_mod.get_options()
    h = hashlib.sha256()
    for name in (*SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    cxx = _resolve(opts.compiler) or opts.compiler
    h.update(f"{jaxlib.__version__}|{cxx}|{' '.join(compile_flags(opts.march))}|"
             f"{platform.machine()}".encode())
    h.update(_cpu_flags().encode())
    return opts.cache_path / f"kvjax_cpu_kernels-{h.hexdigest()[:20]}.so"


def compile_sources(compiler: str | Sequence[str], march: str | None, out_dir: Path, *,
                    link: bool = True, opt: str = "-O3",
                    sources: Sequence[str] = SOURCES) -> Path:
    """Compiles the sources (in parallel, one compiler process per file) into `out_dir`
    and, with `link`, links `out_dir/lib.so`; returns the library's (or last object's) path.

    Args:
      compiler: a compiler's name or path, or a command with leading arguments
        (`[sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu"]`).
      march, opt: as in `compile_flags` (for this host's machine).
      sources: the files to compile, among `SOURCES` (all of them to link a library).

    Raises:
      ValueError: `sources` not a non-empty subset of `SOURCES` (all of them with `link`).
      RuntimeError: no such compiler, or a compile / link step failed (its stderr tail).
    """
    unknown = [src for src in sources if src not in SOURCES]
    if unknown or not sources or (link and set(sources) != set(SOURCES)):
        raise ValueError(f"sources must be a non-empty subset of {SOURCES} (all of them to "
                         f"link), got {tuple(sources)}")
    argv = [compiler] if isinstance(compiler, str) else list(compiler)
    cxx = _resolve(argv[0]) if argv else None
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH; set "
                           f"CpuOptions.compiler or CXX)")
    flags = (*argv[1:], *compile_flags(march, opt=opt))
    objs, procs = [], []
    for src in sources:
        obj = os.path.join(out_dir, src + ".o")
        cmd = [cxx, *flags, "-c", "-isystem", jax.ffi.include_dir(), str(_HERE / src), "-o", obj]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)))
        objs.append(obj)
    errors = []
    for cmd, proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            errors.append(f"{' '.join(cmd)} failed:\n{err[-4000:]}")
    if errors:
        raise RuntimeError("\n".join(errors))
    if not link:
        return Path(objs[-1])
    lib = os.path.join(out_dir, "lib.so")
    cmd = [cxx, *flags, "-shared", *objs, "-o", lib]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return Path(lib)


def _build(path: Path, opts: options_mod.CpuOptions) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Once per machine, source version and -march; say so, a first call otherwise just stalls.
    print(f"kvjax: compiling the CPU kernels (-march={opts.march}) into {path} (once; ~30-60 s)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        lib = compile_sources(opts.compiler, opts.march, Path(tmp))
        os.replace(lib, path)  # atomic: a racing process sees no file or the whole file


def _build_once(path: Path, opts: options_mod.CpuOptions) -> None:
    """Builds unless another process holds the build lock and builds it meanwhile."""
    if _resolve(opts.compiler) is None:
        raise RuntimeError(f"no C++ compiler ({opts.compiler!r} is not on PATH; set "
                           f"CpuOptions.compiler or CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): racing builds are still safe, only wasteful
        _build(path, opts)
        return
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            _build(path, opts)


_loaded: dict[Path, Library] = {}
_loaded_lock = threading.Lock()


def _push_threads(opts: options_mod.CpuOptions) -> None:
    with _loaded_lock:
        libs = list(_loaded.values())
    for lib in libs:
        lib.configure(opts)


options_mod._listeners.append(_push_threads)


@functools.cache
def _load(kernels: bool, compiler: str, march: str, cache_dir: str | None
          ) -> tuple[Library | None, str]:
    if not kernels:
        return None, "disabled by CpuOptions.kernels=False (KVJAX_CPU_KERNEL=0)"
    opts = options_mod.CpuOptions(compiler=compiler, march=march, cache_dir=cache_dir)
    try:
        path = library_path(opts)
        if not path.exists():
            _build_once(path, opts)
        cdll = ctypes.CDLL(str(path))
        cdll.KvjaxIsa.restype = ctypes.c_int64
        cdll.KvjaxConfigure.restype = None
        cdll.KvjaxSharedRuns.restype = ctypes.c_int64
        cdll.KvjaxDecodePositionsWalked.restype = ctypes.c_int64
        bits = cdll.KvjaxIsa()
        lib = Library(path=path, march=march, cdll=cdll,
                      isa=frozenset(n for b, n in _ISA_BITS.items() if bits >> b & 1))
        for symbol, op in TARGETS.items():
            jax.ffi.register_ffi_target(lib.target(op), jax.ffi.pycapsule(getattr(cdll, symbol)),
                                        platform="cpu")
        lib.configure(options_mod.get_options())
    except Exception as e:  # any failure means "fall back to XLA", with the reason kept
        reason = f"{type(e).__name__}: {e}"
        warnings.warn(f"kvjax: the C++ CPU kernels are unavailable (-march={march}); every op "
                      f"takes the XLA path. {reason}", RuntimeWarning, stacklevel=3)
        return None, reason
    with _loaded_lock:
        _loaded[path] = lib
    return lib, ""


def _load_for(opts: options_mod.CpuOptions | None) -> tuple[Library | None, str]:
    opts = opts or options_mod.get_options()
    return _load(opts.kernels, opts.compiler, opts.march, opts.cache_dir)


def library(opts: options_mod.CpuOptions | None = None) -> Library | None:
    """The loaded library for `opts` (default: the options in force), building it if
    needed; None when unavailable."""
    return _load_for(opts)[0]


def load(opts: options_mod.CpuOptions | None = None) -> Library:
    """The loaded library (building it if needed).

    Raises:
      RuntimeError: the kernels are unavailable (the message says why).
    """
    lib, reason = _load_for(opts)
    if lib is None:
        raise RuntimeError(f"kvjax CPU kernels are unavailable: {reason}")
    return lib


def available(opts: options_mod.CpuOptions | None = None) -> bool:
    """Whether the CPU kernels are built and registered (builds them on first call)."""
    return _load_for(opts)[0] is not None


def unavailable_reason(opts: options_mod.CpuOptions | None = None) -> str:
    """Why `available()` is False ('' when it is True)."""
    return _load_for(opts)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvjax.backends.cpu",
        description="Compile the CPU kernels' sources with a given compiler and -march "
                    "(without loading them): a cross-compile check.")
    parser.add_argument("--compiler", required=True,
                        help="C++ compiler command, shell-quoted, e.g. aarch64-linux-gnu-g++ "
                             "or 'python -m ziglang c++ -target aarch64-linux-gnu'")
    parser.add_argument("--march", default="native",
                        help="the -march= value (default native; 'none': no target flag, "
                             "the compiler's default target)")
    parser.add_argument("--opt", default="-O3",
                        help="optimization flag, as --opt=-O0 (default -O3)")
    parser.add_argument("--no-link", action="store_true", help="compile objects only")
    args = parser.parse_args(argv)
    march = None if args.march == "none" else args.march
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out = compile_sources(shlex.split(args.compiler), march, Path(tmp),
                                  link=not args.no_link, opt=args.opt)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"compiled {len(SOURCES)} sources with {args.compiler} "
              f"{' '.join(compile_flags(march, opt=args.opt))}: "
              f"{out.name} {out.stat().st_size} bytes")
    return 0

