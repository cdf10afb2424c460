"""The default run's sampling of sweeps and rotations (tests/sweep_sampling.py)."""

import itertools
import math
import random

from sweep_sampling import LONGEST_FIRST, commit_seed, covering_sample, longest_first, rotation


def test_rotation_runs_every_point_within_its_period():
    rng = random.Random()
    for n, k in [(6, 2), (7, 3), (5, 1), (3, 3), (2, 5)]:
        period = math.ceil(n / k)
        start = rng.randrange(2**31)
        for first in range(start, start + 3 * n):
            runs = [rotation(n, k, s) for s in range(first, first + period)]
            assert all(len(r) == min(n, k) and len(set(r)) == len(r) for r in runs)
            assert set(itertools.chain(*runs)) == set(range(n)), (n, k, first)


def test_covering_sample_holds_every_value_of_every_axis():
    rng = random.Random()
    axes = {"a": range(rng.randint(1, 5)), "b": "xyz", "c": range(rng.randint(2, 6))}
    points = [dict(zip(axes, p, strict=True)) for p in itertools.product(*axes.values())]
    keep = covering_sample(points, rng.randrange(2**31))
    assert len(set(keep)) == len(keep) and len(keep) < len(points)
    for axis, values in axes.items():
        assert {points[i][axis] for i in keep} == set(values)


def test_the_seed_is_the_commits(request):
    """The samples are drawn from the commit under test, not the date: a git checkout's
    seed is the first 8 hex digits of HEAD."""
    import subprocess

    root = str(request.config.rootpath)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    seed, source = commit_seed(root)
    if head:
        assert (seed, source) == (int(head[:8], 16), f"commit {head[:12]}")
    else:
        assert source.startswith("a hash of the sources")


def test_the_longest_files_exist_and_go_out_first(request):
    """LONGEST_FIRST names test files that exist (a renamed file would silently lose its
    place), and the collection order puts them first, in the listed order."""
    here = request.config.rootpath / "tests"
    missing = [name for name in LONGEST_FIRST if not (here / name).is_file()]
    assert not missing, missing

    class Item:
        def __init__(self, rel):
            self.path = here / rel

    items = [Item(n) for n in ["test_rope.py", *reversed(LONGEST_FIRST), "cache/test_quant.py"]]
    longest_first(items, str(here))
    order = [str(it.path.relative_to(here)) for it in items]
    assert order == [*LONGEST_FIRST, "test_rope.py", "cache/test_quant.py"]
