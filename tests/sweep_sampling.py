"""The default run's samples of `slow` sweeps and `rotate(k)` lists (used by conftest.py)."""

import random


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


def rotation(n: int, k: int, day: int) -> list[int]:
    """The `k` of `n` points (indices) that run on `day`: consecutive, wrapping, so each
    point runs at least once in any ceil(n / k) consecutive days."""
    if k >= n:
        return list(range(n))
    return sorted({(day * k + j) % n for j in range(k)})


def day_share(units: list[str], share: int, day: int) -> set[str]:
    """The units (names) of a `share`-way split that run on `day`: the sorted units dealt
    round-robin into `share` parts, part `day % share` today, so each unit runs exactly
    once in any `share` consecutive days and every day holds about 1/share of them."""
    return {u for i, u in enumerate(sorted(set(units))) if i % share == day % share}
