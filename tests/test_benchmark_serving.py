"""benchmarks/serving.py: the work ceiling its --breakdown reports (the fewest decode steps
first-come first-served rows need, and the fitted costs of a lane and a step)."""

import benchmark_cli
import numpy as np
import pytest


@pytest.fixture
def script(monkeypatch):
    return benchmark_cli.load(monkeypatch, "serving")


def _stepwise(max_new, rows):
    """Reference: step the rows one decode step at a time; a free row takes the next
    request (its first token comes from prefill, so it needs n - 1 steps)."""
    waiting = [max(n - 1, 0) for n in max_new]
    left = [0] * rows
    steps = 0
    while True:
        for r in range(rows):
            while left[r] == 0 and waiting:
                left[r] = waiting.pop(0)
        if not any(left):
            return steps
        left = [max(x - 1, 0) for x in left]
        steps += 1


def test_fcfs_steps_equal_a_step_by_step_schedule(script):
    rng = np.random.default_rng()
    for _ in range(20):
        rows = int(rng.integers(1, 9))
        max_new = rng.integers(1, 60, int(rng.integers(1, 40))).tolist()
        assert script.fcfs_decode_steps(max_new, rows) == _stepwise(max_new, rows)
    # One row runs everything back to back; enough rows run only the longest.
    assert script.fcfs_decode_steps([5, 7, 2], 1) == 4 + 6 + 1
    assert script.fcfs_decode_steps([5, 7, 2], 3) == 6


def test_call_costs_recover_the_lane_and_step_cost(script):
    rng = np.random.default_rng()
    lane, step = rng.uniform(3e-3, 9e-3), rng.uniform(0.5e-3, 1.5e-3)
    calls = [(int(k), int(s), k * lane + s * step + rng.normal(0, 1e-5))
             for k, s in zip(rng.integers(0, 5, 200), rng.integers(1, 64, 200), strict=True)]
    got_lane, got_step = script.call_costs(calls)
    np.testing.assert_allclose([got_lane, got_step], [lane, step], rtol=0.02)
