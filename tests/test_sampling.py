"""The default run's sampling of sweeps and rotations (tests/conftest.py)."""

import importlib.util
import itertools
import math
import pathlib
import random

_spec = importlib.util.spec_from_file_location(
    "kvjax_tests_conftest", pathlib.Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_rotation_runs_every_point_within_its_period():
    rng = random.Random()
    for n, k in [(6, 2), (7, 3), (5, 1), (3, 3), (2, 5)]:
        period = math.ceil(n / k)
        start = rng.randrange(700_000, 800_000)
        for first in range(start, start + 3 * n):
            days = [conftest.rotation(n, k, d) for d in range(first, first + period)]
            assert all(len(d) == min(n, k) and len(set(d)) == len(d) for d in days)
            assert set(itertools.chain(*days)) == set(range(n)), (n, k, first)


def test_covering_sample_holds_every_value_of_every_axis():
    rng = random.Random()
    axes = {"a": range(rng.randint(1, 5)), "b": "xyz", "c": range(rng.randint(2, 6))}
    points = [dict(zip(axes, p, strict=True)) for p in itertools.product(*axes.values())]
    keep = conftest.covering_sample(points, rng.randrange(2**31))
    assert len(set(keep)) == len(keep) and len(keep) < len(points)
    for axis, values in axes.items():
        assert {points[i][axis] for i in keep} == set(values)
