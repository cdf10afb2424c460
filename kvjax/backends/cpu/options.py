"""The CPU backend's options: one typed, frozen object; the environment only overrides.

Every knob of the C++ CPU kernels, their build and the Python choices around them
lives in `CpuOptions`. The options in force are, field by field: a value set in code
(`set_options`, or `override` for a block), else the field's environment variable
(the table in docs/cpu-backend.md), else the default. This module is the only place
in kvjax that reads those variables; the C++ code reads none (per-call settings reach
it as custom-call attributes, the thread settings through one configuration call).

Options are read when a function is traced: a function jitted before a change keeps
the choices it was traced with (the kernel wrappers take them as static arguments, so
a function traced after the change gets its own compilation; `jax.clear_caches()`
retraces everything). The thread settings (`threads`, `thread_pool`, `spin_us`) are
pushed to the loaded libraries at once and apply to compiled functions too.
"""

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CpuOptions", "ENV", "get_options", "set_options", "override", "Tuning"]

_MATMUL = ("auto", "on", "off")
_POOLS = ("own", "xla", "std")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuOptions:
    """Options of the C++ CPU backend (hashable: usable as a static argument).

    Attributes:
      kernels: build and use the C++ kernels at all (False: every op takes the XLA path).
      matmul: the small-M matmul kernel in `kvjax.backends.linear`: "auto" (where
        `choose("matmul")` says it is faster than XLA's dot), "on" (whenever it takes the
        inputs, even with several devices), "off".
      unstack_layers: let the decode loop copy stacked layer weights into one array per
        layer where the matmul kernel does not read them in place (`unstack_layers_for`).
      threads: threads per kernel call, the caller included (0: one per core).
      thread_pool: where the helper threads come from: "own" (a persistent pool owned by
        the library), "xla" (XLA's intra-op pool), "std" (fresh threads per call).
      spin_us: microseconds an idle helper, and a caller waiting for the last work items,
        spin before parking (0: park at once).
      prefetch: 16-token chunks of K/V prefetched ahead by the attention kernels (0: none).
      touch: chunks ahead whose pages the attention kernels touch early (0: none).
      rows: f32/bf16 rows and KIVI codes read in place by the register-blocked core
        (False: every chunk staged into a float32 buffer first; for comparisons).
      share: decode attention over f32/bf16 pages: sequences whose block tables begin
        with the same pages (prefix caching, fork) read those pages once per call, all
        their query rows together, when they share at least this many tokens (0: never;
        the results are the same bits either way).
      int_logits: KIVI keys' logits in 16-bit integers where the CPU has AVX512-VNNI
        (False: float32 FMAs).
      int_values: KIVI values' weights in 16-bit integers on builds with AVX512-VNNI and
        VBMI, or with AVX2 without AVX-512 (False: float32 FMAs).
      cache_dir: where built libraries are cached (None: ~/.cache/kvjax).
      compiler: the C++ compiler (a name on PATH or a path).
      march: the `-march=` target of the build ("native": this CPU; e.g. "haswell" to
        build and measure the AVX2 code on an AVX-512 machine). Each value is a separate
        library; several can be loaded in one process.
    """

    kernels: bool = True
    matmul: str = "auto"
    unstack_layers: bool = True
    threads: int = 0
    thread_pool: str = "own"
    spin_us: int = 200
    prefetch: int = 1
    touch: int = 4
    rows: bool = True
    share: int = 512
    int_logits: bool = True
    int_values: bool = True
    cache_dir: str | None = None
    compiler: str = "g++"
    march: str = "native"

    def __post_init__(self):
        if self.matmul not in _MATMUL:
            raise ValueError(f"CpuOptions.matmul must be one of {_MATMUL}, got {self.matmul!r}.")
        if self.thread_pool not in _POOLS:
            raise ValueError(
                f"CpuOptions.thread_pool must be one of {_POOLS}, got {self.thread_pool!r}.")
        for name in ("threads", "spin_us", "prefetch", "touch", "share"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CpuOptions.{name} must be an int >= 0, got {v!r}.")
        if not self.march or any(c.isspace() for c in self.march):
            raise ValueError(f"CpuOptions.march must be one word (e.g. 'native', 'haswell'), "
                             f"got {self.march!r}.")
        if not self.compiler:
            raise ValueError("CpuOptions.compiler must name a C++ compiler.")

    @property
    def cache_path(self) -> Path:
        """The library cache directory, resolved."""
        if self.cache_dir is None:
            return Path.home() / ".cache" / "kvjax"
        return Path(self.cache_dir).expanduser()

    @property
    def tuning(self) -> "Tuning":
        """The per-call settings the kernels take as attributes."""
        return Tuning(prefetch=self.prefetch, touch=self.touch, rows=self.rows,
                      share=self.share, int_logits=self.int_logits, int_values=self.int_values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """The per-call kernel settings (a static argument of the kernel wrappers)."""

    prefetch: int = 1
    touch: int = 4
    rows: bool = True
    share: int = 512
    int_logits: bool = True
    int_values: bool = True


def _flag(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"expected 0/1 (or true/false, on/off), got {s!r}")


def _matmul(s: str) -> str:
    v = s.strip().lower()
    return {"1": "on", "0": "off"}.get(v, v)


def _threads(s: str) -> int:
    v = s.strip().lower()
    return 0 if v in ("", "all") else int(v)


def _pool(s: str) -> str:
    v = s.strip().lower()
    return "xla" if v == "pool" else v


# Field -> (environment variable, parser).
ENV = {
    "kernels": ("KVJAX_CPU_KERNEL", _flag),
    "matmul": ("KVJAX_CPU_MATMUL", _matmul),
    "unstack_layers": ("KVJAX_UNSTACK_LAYERS", _flag),
    "threads": ("KVJAX_CPU_THREADS", _threads),
    "thread_pool": ("KVJAX_CPU_THREAD_POOL", _pool),
    "spin_us": ("KVJAX_CPU_SPIN_US", int),
    "prefetch": ("KVJAX_CPU_PREFETCH", int),
    "touch": ("KVJAX_CPU_TOUCH", int),
    "rows": ("KVJAX_CPU_ROWS", _flag),
    "share": ("KVJAX_CPU_SHARE", int),
    "int_logits": ("KVJAX_CPU_INT_LOGITS", _flag),
    "int_values": ("KVJAX_CPU_INT_VALUES", _flag),
    "cache_dir": ("KVJAX_CACHE_DIR", str),
    "compiler": ("CXX", str),
    "march": ("KVJAX_CPU_MARCH", str),
}

_lock = threading.Lock()
_set: dict[str, object] = {}  # fields set in code (set_options / override)
_listeners = []  # called with the new options after a change in code (build.py's config push)


def _from_env() -> dict[str, object]:
    found = {}
    for field, (var, parse) in ENV.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            found[field] = parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {var}={raw!r}: {e}") from None
    return found


def get_options() -> CpuOptions:
    """The options in force: set in code, else from the environment, else the defaults.

    Raises:
      ValueError: an environment variable's value is not valid for its field.
    """
    with _lock:
        explicit = dict(_set)
    return CpuOptions(**{**_from_env(), **explicit})


def _notify() -> None:
    opts = get_options()
    for fn in list(_listeners):
        fn(opts)


def set_options(**changes) -> CpuOptions:
    """Sets options for the process (keyword per field; None for a field clears what code
    set, so the environment or default applies again). Returns the options now in force.

    Raises:
      TypeError: an unknown field; ValueError: an invalid value (nothing is changed then).
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(CpuOptions)}
    if unknown:
        raise TypeError(f"set_options: unknown option(s) {sorted(unknown)}; the options are "
                        f"{[f.name for f in dataclasses.fields(CpuOptions)]}.")
    with _lock:
        new = dict(_set)
        for k, v in changes.items():
            if v is None:
                new.pop(k, None)
            else:
                new[k] = v
    CpuOptions(**{**_from_env(), **new})  # validate before committing
    with _lock:
        _set.clear()
        _set.update(new)
    _notify()
    return get_options()


@contextlib.contextmanager
def override(**changes) -> Iterator[CpuOptions]:
    """Sets options for the duration of a `with` block (process-wide, like `set_options`),
    then restores what code had set before."""
    with _lock:
        before = dict(_set)
    try:
        yield set_options(**changes)
    finally:
        with _lock:
            _set.clear()
            _set.update(before)
        _notify()
