"""Compiles, caches and registers the CPU attention kernels (XLA FFI custom calls).

The C++ sources next to this file are compiled on first use with the system C++
compiler (`$CXX`, default `g++`) into one shared library, cached under
`$KVJAX_CACHE_DIR` (default `~/.cache/kvjax`) by a hash of the sources, the
jaxlib version, the compiler and its flags and the CPU's feature flags
(`-march=native` code must not run on another CPU). The sources compile in
parallel; the library is linked under a temporary name and renamed into place,
and a lock file makes a second process wait for the first one's build instead
of repeating it. It is loaded with ctypes and its handlers are registered with
`jax.ffi.register_ffi_target` for the CPU platform.

Nothing here raises at import: when there is no compiler, the build fails, or
`KVJAX_CPU_KERNEL=0` is set, `available()` is False and `unavailable_reason()`
says why; `kvjax.attention`'s `impl="auto"` then uses the XLA path.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jaxlib

__all__ = ["available", "unavailable_reason", "load", "TARGETS", "library_path"]

_SOURCES = ("paged_decode.cc", "quantized_decode.cc", "mla_decode.cc", "matmul.cc",
            "write_rows.cc")
_HEADERS = ("common.h", "attend.h")
# FFI symbol in the library -> target name registered with XLA.
TARGETS = {
    "KvjaxPagedDecode": "kvjax_paged_decode",
    "KvjaxQuantizedDecode": "kvjax_quantized_decode",
    "KvjaxMlaDecode": "kvjax_mla_decode",
    "KvjaxMatmul": "kvjax_matmul",
    "KvjaxWriteRows": "kvjax_write_rows",
    "KvjaxCopyPages": "kvjax_copy_pages",
}
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c++17")
_HERE = Path(__file__).parent


def _cache_dir() -> Path:
    return Path(os.environ.get("KVJAX_CACHE_DIR", Path.home() / ".cache" / "kvjax"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path() -> Path:
    """Where the library for these sources, this jaxlib, compiler and CPU is cached."""
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    cxx = _compiler() or "none"
    h.update(f"{jaxlib.__version__}|{cxx}|{' '.join(_FLAGS)}|{platform.machine()}".encode())
    h.update(_cpu_flags().encode())
    return _cache_dir() / f"kvjax_cpu_kernels-{h.hexdigest()[:20]}.so"


def _build(path: Path) -> None:
    """Compiles the sources (in parallel, one compiler per file) and links the library."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')!r} not on PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Once per machine and source version; say so, a first call otherwise just stalls.
    print(f"kvjax: compiling the CPU attention kernels into {path} (once; ~10-30 s)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objs, procs = [], []
        for src in _SOURCES:
            obj = os.path.join(tmp, src + ".o")
            cmd = [cxx, *_FLAGS, "-c", "-isystem", jax.ffi.include_dir(), str(_HERE / src),
                   "-o", obj]
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)))
            objs.append(obj)
        for cmd, proc in procs:
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-4000:]}")
        lib = os.path.join(tmp, "lib.so")
        cmd = [cxx, *_FLAGS, *objs, "-o", lib]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
        os.replace(lib, path)  # atomic: a racing process sees no file or the whole file


def _build_once(path: Path) -> None:
    """Builds unless another process holds the build lock and builds it meanwhile."""
    if _compiler() is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')!r} not on PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): racing builds are still safe, only wasteful
        _build(path)
        return
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            _build(path)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("KVJAX_CPU_KERNEL", "1") == "0":
        return None, "disabled by KVJAX_CPU_KERNEL=0"
    try:
        path = library_path()
        if not path.exists():
            _build_once(path)
        lib = ctypes.CDLL(str(path))
        for symbol, target in TARGETS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # any failure means "fall back to XLA", with the reason kept
        return None, f"{type(e).__name__}: {e}"
    return lib, ""


def load() -> ctypes.CDLL:
    """The loaded library (building it if needed); raises RuntimeError if unavailable."""
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"kvjax CPU kernels are unavailable: {reason}")
    return lib


def available() -> bool:
    """Whether the CPU kernels are built and registered (builds them on first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return _load()[1]
