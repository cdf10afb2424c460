"""The default run's samples of `slow` sweeps and `rotate(k)` lists, and the order its files
go out in (used by conftest.py)."""

import hashlib
import os
import random
import subprocess
from pathlib import Path


def covering_sample(points: list[dict], seed: int) -> list[int]:
    """Indices of a small random subset of `points` holding every (axis, value) pair.

    Greedy set cover: repeatedly take the point that adds the most pairs not yet
    covered, ties broken by a seeded shuffle. A sweep of axes with n_1..n_k
    values needs at least max(n_i) points; this gets close to that.
    """
    order = list(range(len(points)))
    random.Random(seed).shuffle(order)
    pairs = [{(k, repr(v)) for k, v in p.items()} for p in points]
    todo = set().union(*pairs) if pairs else set()
    chosen = []
    while todo or not chosen:
        best = max(order, key=lambda i: len(pairs[i] & todo))
        chosen.append(best)
        order.remove(best)
        todo -= pairs[best]
        if not order:
            break
    return sorted(chosen)


def rotation(n: int, k: int, seed: int) -> list[int]:
    """The `k` of `n` points (indices) that run for `seed`: consecutive, wrapping, from
    point (seed * k) % n, so k consecutive seeds' runs take every point at least once
    in ceil(n / k) of them."""
    if k >= n:
        return list(range(n))
    return sorted({(seed * k + j) % n for j in range(k)})


def commit_seed(root: str) -> tuple[int, str]:
    """A seed from the commit under test, and where it came from: the first 8 hex digits of
    `git rev-parse HEAD`; outside a git checkout, of a hash of the package and test sources."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    if len(head) >= 8:
        return int(head[:8], 16), f"commit {head[:12]}"
    h = hashlib.sha256()
    for folder in ("kvjax", "kernels_pallas", "tests"):
        for path in sorted((Path(root) / folder).rglob("*.py")):
            h.update(path.read_bytes())
    return int(h.hexdigest()[:8], 16), "a hash of the sources (not a git checkout)"


# The longest files run first, longest first (their tests' seconds in a clean run of the
# default suite on a 2-core Zen 4: 20-130 s each; the CPU-kernel builds count in the first
# two, the Python 3.12 job's files keep the same relative order). xdist hands out whole
# files (`--dist loadfile`), by default the files with the most tests first, which put the
# longest (few, long tests) last: one worker ran them alone for the last two minutes while
# the other idled. With `--no-loadscope-reorder` (pyproject.toml) files go out in
# collection order: longest first, the short files even out the workers' ends.
LONGEST_FIRST = (
    "backends/test_cpu_builds.py", "backends/test_cpu_kernels.py",
    "models/test_deepseek_v32.py", "cache/test_host_tier.py",
    "kernels/test_quantized_kernels.py", "serve/test_engine_scheduling.py",
    "serve/test_engine_host_tier.py", "test_composition.py", "test_demo_models.py",
    "attention/test_xla_path.py", "models/test_qwen3_next.py",
    "attention/test_xla_quantized.py", "test_readme.py", "serve/test_engine.py",
    "attention/test_invisible_nonfinite.py", "test_benchmark_offload.py",
    "test_benchmarks_quick.py", "reliability/test_fuzz_cache_api.py", "serve/test_server.py",
    "models/test_logits_at.py",
    # Files of one to three long tests (10-40 s) that collection order put near the end of a
    # run, where one of them could leave a worker running alone: the NNX files end job 2's
    # collection order, the benchmark and multi-host files job 1's.
    "generate/test_generate.py", "generate/test_gemma_policies.py",
    "generate/test_window_pages.py", "nnx/test_tunix.py", "generate/test_window_pages_levers.py",
    "nnx/test_nnx.py", "nnx/test_flax_doc.py", "test_benchmark_breakdown.py", "test_multihost.py",
    "nnx/test_nnx_serve.py",
)


def longest_first(items, tests_dir: str) -> None:
    """Sorts `items` (pytest items, or anything with a `.path`) so the files of
    LONGEST_FIRST come first, in its order; the rest keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        rel = os.path.relpath(str(item.path), tests_dir).replace(os.sep, "/")
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the other files, and each file's own tests, keep their order
