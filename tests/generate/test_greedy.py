"""`sampling.greedy`, the decode loop's greedy pick (directly and through `sample_rows`,
the serving engine's per-row sampling): NumPy's argmax on every row, ties to the first
index, NaN counted largest (as `jnp.argmax`), rows of -inf."""

import jax
import numpy as np
import pytest

from kvjax.backends import cpu
from kvjax.generate import sampling


def _hard_rows(rng, vocab):
    """Rows with ties, an infinity, -inf everywhere, NaNs after the largest number, a
    constant row, and the maximum or a NaN in the last columns (past the last whole
    vector of any width when vocab is not a multiple of 16)."""
    logits = rng.standard_normal((12, vocab)).astype(np.float32)
    top = logits.max(axis=1)
    for r in (1, 2):  # ties: the first of two (or three) equal maxima wins
        cols = np.sort(rng.choice(vocab, 1 + r, replace=False))
        logits[r, cols] = top[r] + 1
    logits[3, rng.integers(vocab)] = np.inf
    logits[4, :] = -np.inf
    # NaN rows whose largest number comes first (XLA:CPU's max skips NaNs: a pick by the
    # maximum alone would return it).
    for r, n in ((5, 2), (6, 1)):
        big, *nans = np.sort(rng.choice(vocab, 1 + n, replace=False))
        logits[r, big] = 10.0
        logits[r, nans] = np.nan
    logits[7, :] = np.float32(rng.standard_normal())  # a constant row: index 0
    logits[8, -1] = top[8] + 1
    logits[9, -3] = np.nan
    return logits


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("vocab", [1000, 32, 5])
def test_cpu_argmax_rows_kernel(rng, vocab):
    """The CPU kernel greedy takes on one device: NumPy's argmax on the hard rows, with
    leading batch dims and a vocabulary with and without a partial last vector."""
    logits = _hard_rows(rng, vocab)
    got = cpu.argmax_rows(jax.numpy.asarray(logits.reshape(2, 6, vocab)))
    assert got.dtype == np.int32 and got.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.argmax(logits, axis=1))


def test_greedy_is_argmax_with_its_ties_nans_and_infinities():
    rng = np.random.default_rng()
    vocab = 1000
    logits = _hard_rows(rng, vocab)
    # bfloat16 too (the sampled dtype of a bf16 model's logits), and the serving engine's
    # per-row sampling (all rows greedy; every other row greedy), in the same program.
    halves = logits.astype(jax.numpy.bfloat16)
    rows = len(logits)
    temps = np.where(np.arange(rows) % 2, rng.uniform(0.5, 2, rows), 0).astype(np.float32)

    def settings(t):
        return sampling.RowSampling(temperature=t, top_k=np.zeros(rows, np.int32),
                                    top_p=np.ones(rows, np.float32))

    def picks(a, b, keys):
        return (sampling.greedy(a), sampling.greedy(b),
                sampling.sample_rows(a, keys, settings(np.zeros(rows, np.float32))),
                sampling.sample_rows(a, keys, settings(temps)))

    got, got_half, rows_all, rows_mixed = jax.jit(picks)(
        jax.device_put(logits), jax.device_put(halves),
        jax.random.split(jax.random.key(int(rng.integers(1 << 30))), rows))
    want = np.argmax(logits, axis=1)  # NumPy: the first NaN, else the first maximum
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got_half),
                                  np.argmax(halves.astype(np.float32), axis=1))
    np.testing.assert_array_equal(np.asarray(rows_all), want)
    np.testing.assert_array_equal(np.asarray(rows_mixed)[temps == 0], want[temps == 0])
    assert got.dtype == rows_all.dtype == np.int32


@pytest.mark.cpu_kernels
def test_greedy_takes_the_kernel_on_one_cpu_device_and_the_reductions_without(rng, monkeypatch):
    """float32 greedy on one CPU device lowers to the argmax custom call; with the kernel
    declined it lowers to XLA's reductions, and both give NumPy's argmax on the hard rows.
    (The suite runs with several CPU devices, where `choose` declines: the choice is
    asked for one device here.)"""
    logits = _hard_rows(rng, 1000)
    want = np.argmax(logits, axis=1)
    target = cpu.load().target("argmax_rows")
    choose = cpu.choose
    for use in (True, False):
        monkeypatch.setattr(cpu, "choose", lambda op, use=use, **k: (
            choose(op, **{**k, "devices": 1}) if use else cpu.Choice(False, "declined")))
        fn = jax.jit(lambda x: sampling.greedy(x))  # a new function: traced afresh
        assert (target in fn.lower(logits).as_text()) == use
        np.testing.assert_array_equal(np.asarray(fn(logits)), want)
