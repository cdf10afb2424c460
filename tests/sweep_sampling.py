"""The default run's samples of `slow` sweeps and `rotate(k)` lists (used by conftest.py)."""

import hashlib
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
