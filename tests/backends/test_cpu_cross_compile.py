"""The kernels' sources compile for ARM64 (aarch64), checked by a cross-compile here.

No ARM machine runs the suite. Every source is compiled (in turns: below) for
`aarch64-linux-gnu` with zig's Clang (the `ziglang` wheel of the `test` extra) by
`build.compile_sources`, so with the flags and the XLA FFI include directory
(`jax.ffi.include_dir()`) of a real build,
except the target flag (none: the baseline armv8-a) and -O0 instead of -O3. -O0 still
parses, instantiates and code-generates every template the library uses (an x86
intrinsic outside its `#if` guard is an undeclared name there, x86 inline assembly an
assembler error), in about half the time of -O1; `-fsyntax-only` is not an option with
zig 0.17 (it fails renaming the object it did not write). That the portable branches
these objects hold compute the right results is tested on x86 by the generic x86-64
build (test_cpu_builds.py), which compiles the same branches.
"""

import importlib.util
import sys

import pytest

from kvjax.backends.cpu import build

EM_AARCH64 = 183  # the ELF header's e_machine of an ARM64 object


def _zig_cxx(target: str) -> list[str]:
    if importlib.util.find_spec("ziglang") is None:
        pytest.fail("the aarch64 cross-compile check needs the `ziglang` package (zig's "
                    "Clang), which the `test` extra installs: pip install -e '.[test]'")
    return [sys.executable, "-m", "ziglang", "c++", "-target", target]


# A rotation over the sources: compiling all of them takes about 40 CPU-seconds of a 2-core
# machine (zig's Clang, cold cache), so the default run compiles two, chosen by the
# commit's seed (tests/conftest.py); `--slow` compiles every one.
@pytest.mark.rotate(2)
@pytest.mark.parametrize("src", build.SOURCES)
def test_sources_compile_for_aarch64(tmp_path, src):
    build.compile_sources(_zig_cxx("aarch64-linux-gnu"), None, tmp_path, link=False,
                          opt="-O0", sources=[src])
    objects = sorted(tmp_path.glob("*.o"))
    assert [o.name for o in objects] == [f"{src}.o"]
    for obj in objects:
        header = obj.read_bytes()[:20]
        assert header[:4] == b"\x7fELF", obj.name
        assert int.from_bytes(header[18:20], "little") == EM_AARCH64, obj.name


def test_compile_sources_refuses_unknown_or_partial_link(tmp_path):
    with pytest.raises(ValueError, match="subset"):
        build.compile_sources("no-such-c++", None, tmp_path, link=False, sources=["nope.cc"])
    with pytest.raises(ValueError, match="all of them to link"):
        build.compile_sources("no-such-c++", None, tmp_path, sources=build.SOURCES[:1])


def test_build_flags_on_arm_hosts():
    """An ARM host's native build asks for -mcpu=native (GCC and Clang both take it there;
    Clang before 15 rejects -march=native on ARM) and gets no x86 flag; x86 hosts keep
    -march=native; an explicit -march is passed as given."""
    for machine in ("aarch64", "arm64"):
        flags = build.compile_flags("native", machine=machine)
        assert flags[-1] == "-mcpu=native"
        assert [f for f in flags if f.startswith("-m")] == ["-mcpu=native"]
        assert build.compile_flags("armv8.2-a+fp16", machine=machine)[-1] == "-march=armv8.2-a+fp16"
    assert build.compile_flags("native", machine="x86_64")[-1] == "-march=native"
    assert build.compile_flags("haswell", machine="x86_64")[-1] == "-march=haswell"
    assert not [f for f in build.compile_flags(None) if f.startswith("-m")]
    assert build.compile_flags("native")[0] == "-O3"
