"""The builds of the C++ CPU kernels that the suite checks a claim on (conftest.py's
`cpu_build` fixture), and which of them this host can run.

`-march=native` compiles different code on each kind of x86 CPU the project meets (an
Intel Xeon with AVX-512 FP16 and AMX, an AMD Zen 4 with AVX-512 but no FP16, an AVX2-only
AMD): a bit-identity or a tolerance checked on one kind can be false on another. So the
kernels are also built for each x86 instruction-set class the host can execute and the
same claims are checked on each build:

  native     the build users get (`-march=native`, -O3);
  x86-64-v4  AVX-512 F/BW/CD/DQ/VL, no FP16 (the Zen 4 class; -O3, generic tuning);
  x86-64-v3  AVX2, FMA, F16C (the AVX2-only class; -O3, generic tuning);
  x86-64     portable: no AVX, FMA or F16C, every intrinsic branch off (the code an
             aarch64 build compiles; -O0, see below).

The v3 and v4 builds are what `CpuOptions(march="x86-64-v3")` builds for a user, cached
like the native one. The portable build is compiled at -O0 (about 18 CPU-seconds; -O3
takes about 100) into its own folder of the cache: it checks what the source computes on
those branches, not what an optimizer makes of it ("auto" keeps the XLA path there).

A build this host cannot run is skipped with the flags it lacks, so a run on another kind
of machine says which claims it did not check; KVJAX_TEST_BUILDS=native,x86-64-v3 (say)
leaves the others out, also saying so.
"""

import contextlib
import dataclasses
import os
import platform
import tempfile
from pathlib import Path

import pytest

NATIVE, V4, V3, PORTABLE = "native", "x86-64-v4", "x86-64-v3", "x86-64"
BUILDS = (NATIVE, V4, V3, PORTABLE)

# The /proc/cpuinfo flags each x86 level needs (lzcnt is "abm" there).
_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_NEEDS = {
    PORTABLE: set(),
    V3: _V3_FLAGS,
    V4: _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def why_not(build: str) -> str | None:
    """Why `build` is not checked in this run (None: it is): this host cannot run its
    code, or KVJAX_TEST_BUILDS (a comma-separated list of builds; CI's Python 3.12 job
    sets it to "native") leaves it out."""
    chosen = os.environ.get("KVJAX_TEST_BUILDS")
    if chosen and build not in chosen.split(","):
        return f"-march={build} left out by KVJAX_TEST_BUILDS={chosen}"
    if build == NATIVE:
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"-march={build} is x86-64 code; this host is {platform.machine()}"
    missing = sorted(_NEEDS[build] - cpu_flags())
    if missing:
        return f"this CPU cannot run -march={build} code: no {', '.join(missing)}"
    return None


def _portable_cache(cpu) -> str:
    """The folder the -O0 portable build is cached in (beside the -O3 builds, apart from
    them: the library's file name hashes the -O3 flags)."""
    return str(cpu.get_options().cache_path / "tests-O0")


def _build_portable(build_mod, opts) -> None:
    """Builds the portable library at -O0 unless it is cached; the build lock keeps two
    test workers from building it twice."""
    path = build_mod.library_path(opts)
    if path.exists():
        return
    if build_mod._resolve(opts.compiler) is None:
        pytest.skip(f"no C++ compiler {opts.compiler!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            lib = build_mod.compile_sources(opts.compiler, opts.march, Path(tmp), opt="-O0")
            os.replace(lib, path)


@contextlib.contextmanager
def selected(build: str):
    """The CPU options of `build` in force (built first if needed); skips where this host
    cannot run it. Yields the loaded library."""
    from kvjax.backends import cpu
    from kvjax.backends.cpu import build as build_mod

    reason = why_not(build)
    if reason:
        pytest.skip(reason)
    fields = dict(march=build)
    if build == PORTABLE:
        fields["cache_dir"] = _portable_cache(cpu)
        _build_portable(build_mod, dataclasses.replace(cpu.get_options(), **fields))
    with cpu.override(**fields):  # the native, v4 and v3 builds: built here at -O3 if need be
        if not cpu.available():
            if build == NATIVE:
                pytest.skip(f"-march=native build unavailable: {cpu.unavailable_reason()}")
            raise AssertionError(f"-march={build}: {cpu.unavailable_reason()}")
        lib = cpu.library()
        if build == NATIVE and platform.machine() in ("x86_64", "AMD64"):
            # The matmul's vdpbf16ps tiles are compiled where this CPU has AVX512_BF16.
            assert ("avx512bf16" in lib.isa) == ("avx512_bf16" in cpu_flags()), lib.isa
        if build == V3:
            assert lib.isa_class == "avx2" and "avx512f" not in lib.isa, lib.isa
        if build == V4:
            assert lib.isa_class == "avx512" and not {"avx512fp16", "avx512bf16"} & lib.isa, \
                lib.isa
        if build == PORTABLE:
            assert lib.isa_class == "portable" and not lib.isa, lib.isa
        yield lib
