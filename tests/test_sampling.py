"""The default run's sampling of sweeps and rotations (tests/sweep_sampling.py)."""

import itertools
import math
import random

from sweep_sampling import covering_sample, day_share, rotation


def test_rotation_runs_every_point_within_its_period():
    rng = random.Random()
    for n, k in [(6, 2), (7, 3), (5, 1), (3, 3), (2, 5)]:
        period = math.ceil(n / k)
        start = rng.randrange(700_000, 800_000)
        for first in range(start, start + 3 * n):
            days = [rotation(n, k, d) for d in range(first, first + period)]
            assert all(len(d) == min(n, k) and len(set(d)) == len(d) for d in days)
            assert set(itertools.chain(*days)) == set(range(n)), (n, k, first)


def test_covering_sample_holds_every_value_of_every_axis():
    rng = random.Random()
    axes = {"a": range(rng.randint(1, 5)), "b": "xyz", "c": range(rng.randint(2, 6))}
    points = [dict(zip(axes, p, strict=True)) for p in itertools.product(*axes.values())]
    keep = covering_sample(points, rng.randrange(2**31))
    assert len(set(keep)) == len(keep) and len(keep) < len(points)
    for axis, values in axes.items():
        assert {points[i][axis] for i in keep} == set(values)


def test_day_share_runs_each_unit_once_in_share_days_and_splits_evenly():
    rng = random.Random()
    for share in (1, 2, 3):
        units = [f"tests/t.py::test_{rng.randrange(10**6)}" for _ in range(rng.randint(1, 40))]
        first = rng.randrange(700_000, 800_000)
        days = [day_share(units, share, d) for d in range(first, first + share)]
        assert set().union(*days) == set(units)
        assert sum(map(len, days)) == len(set(units))  # no unit twice in `share` days
        assert max(map(len, days)) - min(map(len, days)) <= 1
        assert day_share(units, share, first + share) == days[0]  # the period is `share`
