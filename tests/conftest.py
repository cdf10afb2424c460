"""Test setup: 8 simulated CPU devices, strict dtype promotion, full-precision f32 matmuls.

One selection per commit: every test of the default run runs on every run, except
the points of two kinds of list, of which a sample runs:

Sweeps: a test marked `slow` is one point of a product of parametrize axes. The
default run takes a sample of each sweep that holds every value of every axis at
least once, drawn with a seed taken from the commit under test (`git rev-parse
HEAD`; outside a git checkout, a hash of the sources), so two runs of one commit run
the same tests on any day and a failure replays with `--sweep-seed`.

Rotations: a test marked `rotate(k)` is one of a list of long end-to-end runs (the
notebooks, say) of which the default run takes `k`, consecutive in the list from a
place the same seed chooses.

`--slow` (or `KVJAX_SLOW=1`) runs the full product of every sweep and every
rotation. The header of the run states the seed.
"""

import gc
import os
import shutil
import tempfile
import threading

# Must happen before any JAX backend starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile hundreds of small programs and run each a few times, so compiling
# is nine tenths of their time. These XLA:CPU settings cut the compile time by
# about two thirds: no LLVM backend optimisations, the classic elemental emitters
# for fusions instead of the MLIR fusion emitters (the same HLO and fusion decisions,
# compiled in less than half the time), one LLVM module per program.
# HLO passes (fusion, layout, the HLO the tests inspect) are unaffected.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1",
                   "--xla_llvm_disable_expensive_passes=true")


def _known_xla_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The flags of `flags` this jaxlib's XLA accepts.

    A flag XLA does not know in XLA_FLAGS ends the process when the first backend starts
    (exit status 1, nothing printed: under pytest, a run that reports nothing). XLA drops
    flags as it retires code paths (jaxlib 0.11 no longer knows some of these), so from
    0.11 on each is tried in a child process once per run (the answer is passed on to
    workers and child processes in KVJAX_TEST_XLA_FLAGS).
    """
    import importlib.metadata
    import subprocess
    import sys

    if "KVJAX_TEST_XLA_FLAGS" in os.environ:
        known = set(os.environ["KVJAX_TEST_XLA_FLAGS"].split())
        return tuple(f for f in flags if f in known)
    major, minor = (int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    if (major, minor) < (0, 11):  # the versions these flags were chosen on
        return flags

    def starts(fs):
        env = dict(os.environ, XLA_FLAGS=" ".join(fs), JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True).returncode == 0

    known = flags if starts(flags) else tuple(f for f in flags if starts([f]))
    os.environ["KVJAX_TEST_XLA_FLAGS"] = " ".join(known)
    return known


_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in _known_xla_flags(_TEST_XLA_FLAGS)
                if f.split("=")[0] not in _given]).strip()

# One persistent compilation cache for the session's child processes (the README, demo,
# notebook, benchmark and CLI runs): they compile many of the same programs (the tiny
# models' decode loops). The test processes themselves do not use it (below): they rarely
# compile a program another process compiled, and serializing every program they compile
# cost more than the hits saved (a clean run took 5% longer with it). A fresh folder per run:
# nothing carries over between runs. The process that makes the folder (the controller;
# workers inherit the variable) removes it.
_OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="kvjax-test-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)  # this process only (above)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

import cpu_builds  # noqa: E402
import hypothesis  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from sweep_sampling import commit_seed, covering_sample, longest_first, rotation  # noqa: E402

# Hypothesis draws the same examples on every run and every machine (a seed from each
# test's own code), and keeps no example database: a failure another run found in a
# local .hypothesis/ folder would otherwise be replayed here and not in CI's clean clone.
# HYPOTHESIS_PROFILE=explore draws fresh examples each run, saving failures locally.
hypothesis.settings.register_profile("kvjax", derandomize=True, database=None, print_blob=True)
hypothesis.settings.register_profile("explore")
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvjax"))


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


_tests_run = 0
_last_module = None


@pytest.fixture(autouse=True)
def _release_compiled_programs(request):
    """Drops every compiled program once the process holds many memory mappings.

    Each XLA:CPU executable holds a few memory mappings of JIT code (about 8 for a small
    program); a worker that runs half the suite, or one long sweep file, compiles enough
    programs to reach the kernel's limit of 65530 mappings per process
    (vm.max_map_count), after which XLA crashes with a segfault inside its next compile
    or executable serialization. Clearing after every file would recompile the programs
    files share (the tiny models' decode loops), so it happens when a new file starts
    past half the limit, or inside a file (checked every 8 tests) past 70% of it.
    """
    global _tests_run, _last_module
    module = request.node.module.__name__ if request.node.module else None
    new_file, _last_module = module != _last_module, module
    if new_file and _memory_mappings() > 32768:
        jax.clear_caches()
        gc.collect()
    yield
    _tests_run += 1
    if _tests_run % 8 == 0 and _memory_mappings() > 46000:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def child_env():
    """os.environ for a child Python process: this suite's compile settings (XLA_FLAGS
    without any forced device count: a child sees the devices a user's process would)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return dict(os.environ, XLA_FLAGS=" ".join(flags))


@pytest.fixture(params=cpu_builds.BUILDS)
def cpu_build(request):
    """Each build of the CPU kernels (tests/cpu_builds.py: native, x86-64-v4, x86-64-v3,
    portable) in force for one test: built on first use, skipped with the reason where
    this CPU cannot run it. The value is the build's -march."""
    with cpu_builds.selected(request.param):
        yield request.param


@pytest.fixture
def rng(request):
    """A fresh NumPy generator per test, from a random seed.

    The seed is printed on failure (pytest shows captured stdout), so a failing
    draw can be replayed with KVJAX_TEST_SEED.
    """
    seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"test seed: KVJAX_TEST_SEED={seed}")
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- sweeps


def pytest_addoption(parser):
    group = parser.getgroup("kvjax sweeps")
    group.addoption("--slow", action="store_true", default=False,
                    help="run the full product of every `slow` sweep (also KVJAX_SLOW=1); "
                         "default: a sample covering every value of every axis")
    group.addoption("--sweep-seed", type=int, default=None,
                    help="seed of the sweep and rotation samples (default: from the commit "
                         "under test; the run's header prints it)")


def pytest_unconfigure(config):
    if _build_thread is not None:  # a short run: the build finishes (no orphaned compilers)
        _build_thread.join()
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def pytest_configure(config):
    # scripts/mutation_check.py: a semantic mutation of kvjax, applied in every process
    # before any test module is imported (tests/mutations.py).
    import mutations

    config._kvjax_mutation = mutations.apply_from_env()
    config.addinivalue_line(
        "markers", "slow: one point of a sweep; a covering sample runs unless --slow")
    config.addinivalue_line(
        "markers", "rotate(k): one of a list of long runs; k of them a run, chosen by the "
                   "sweep seed, unless --slow")
    config.addinivalue_line(
        "markers", "cpu_kernels: needs the C++ CPU kernels; skipped (with the reason) where "
                   "they are unavailable")
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None) \
            or config.getoption("collectonly"):
        return
    # The controller of a parallel run builds the CPU kernels (once per machine and source
    # version: ~40 s of a 2-core machine) while its workers start and collect, instead of
    # the first worker that needs them; the others wait on the build's lock file.
    global _build_thread
    _build_thread = threading.Thread(target=_build_cpu_kernels, daemon=True)
    _build_thread.start()


_build_thread = None


def _build_cpu_kernels():
    from kvjax.backends import cpu

    cpu.available()


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_kernels") is not None:
        from kvjax.backends import cpu

        if not cpu.available():  # at run time: collecting never waits for the build
            pytest.skip(f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def _full_sweeps(config) -> bool:
    return config.getoption("--slow") or os.environ.get("KVJAX_SLOW") == "1"


@pytest.fixture
def full_sweeps(request) -> bool:
    """Whether this run takes the full sweeps (--slow or KVJAX_SLOW=1)."""
    return _full_sweeps(request.config)


def _sweep_seed(config) -> int:
    seed = config.getoption("--sweep-seed")
    if seed is not None:
        return seed
    if not hasattr(config, "_kvjax_commit_seed"):
        config._kvjax_commit_seed = commit_seed(str(config.rootpath))
    return config._kvjax_commit_seed[0]


def pytest_collection_modifyitems(config, items):
    longest_first(items, os.path.dirname(os.path.abspath(__file__)))
    if _full_sweeps(config):
        return
    seed = _sweep_seed(config)
    sweeps: dict[str, list] = {}
    rotations: dict[str, list] = {}
    for item in items:
        name = item.nodeid.split("[")[0]
        if item.get_closest_marker("slow") is not None:
            sweeps.setdefault(name, []).append(item)
        elif item.get_closest_marker("rotate") is not None:
            rotations.setdefault(name, []).append(item)
    dropped = []
    for name, group in sweeps.items():
        params = [dict(getattr(getattr(it, "callspec", None), "params", {})) for it in group]
        keep = set(covering_sample(params, seed + sum(map(ord, name))))
        dropped += [it for i, it in enumerate(group) if i not in keep]
    for name, group in rotations.items():
        group = sorted(group, key=lambda it: it.nodeid)
        k = group[0].get_closest_marker("rotate").args[0]
        keep = set(rotation(len(group), k, seed + sum(map(ord, name))))
        dropped += [it for i, it in enumerate(group) if i not in keep]
    if dropped:
        gone = {id(it) for it in dropped}
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if id(it) not in gone]


def pytest_report_header(config):
    lines = []
    if os.environ.get("KVJAX_MUTATION"):
        lines.append(f"MUTATION {os.environ['KVJAX_MUTATION']} applied (tests/mutations.py)")
    if _full_sweeps(config):
        return [*lines, "sweeps and rotations: all of them (--slow)"]
    seed = _sweep_seed(config)
    source = ("--sweep-seed" if config.getoption("--sweep-seed") is not None
              else config._kvjax_commit_seed[1])
    return [*lines, f"sweeps: a covering sample, rotations: k of each list; --sweep-seed {seed} "
                    f"(from {source}; --slow for all of them); hypothesis profile "
                    f"{hypothesis.settings.get_current_profile_name()}"]


# ------------------------------------------------------------------ hangs and crashes


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's `thread` method in an xdist worker, with the stacks shown.

    The plugin's own timer writes its report through the worker's terminal writer, whose
    output xdist drops, so a hung worker would go down without a word. This timer does the
    same (suspends output capture, prints what the test printed and every thread's stack,
    ends the process) on the worker's stderr, which reaches the run's output. Elsewhere,
    or with another method, the plugin's own timer runs.
    """
    if not hasattr(item.config, "workerinput") or settings.method != "thread" \
            or not settings.timeout or settings.timeout <= 0:
        return None
    timer = threading.Timer(settings.timeout, _report_hang_and_exit, (item, settings.timeout))
    timer.name, timer.daemon = "kvjax test timeout", True
    timer.start()
    item.cancel_timeout = timer.cancel  # what pytest-timeout's teardown hook calls
    return True


def _report_hang_and_exit(item, timeout):
    import sys
    import traceback

    try:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        out, err = "", ""
        if capman is not None:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
        worker = item.config.workerinput.get("workerid", "worker")
        lines = [f"\n{'+' * 30} Timeout: {item.nodeid} ran past {timeout:g} s on {worker}"]
        if out:
            lines += ["~~~ its captured stdout", out]
        if err:
            lines += ["~~~ its captured stderr", err]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines += [f"~~~ stack of thread {names.get(ident, '?')} ({ident})",
                      "".join(traceback.format_stack(frame))]
        sys.stderr.write("\n".join(lines) + f"\n{'+' * 30} end of timeout report\n")
    finally:
        sys.stderr.flush()
        os._exit(1)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A test that ended its worker (a timeout above; a segfault) fails once and is not
    run again.

    Under `--dist loadfile` xdist hands the crashed test's file back to the queue with the
    crashed test still pending, so each replacement worker would run it again and crash
    again, up to `--max-worker-restart` times (8 with two workers: 40 minutes for one hung
    test at a 5-minute timeout). Marking it done lets the file's other tests go on.
    """
    queue = getattr(sched, "workqueue", None)  # loadscope / loadfile: scope -> {nodeid: done}
    if not isinstance(queue, dict):
        return
    for scope, unit in list(queue.items()):
        if isinstance(unit, dict) and crashitem in unit:
            unit[crashitem] = True
            if all(unit.values()):
                del queue[scope]
