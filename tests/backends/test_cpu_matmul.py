"""The CPU small-M matmul kernel (kvjax/backends/cpu/matmul.cc) and its dispatch in `linear`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.backends import cpu as cpu_kernels
from kvjax.backends.cpu import matmul as cpu_matmul
from kvjax.backends.linear import LayerSlice, linear

needs_kernel = pytest.mark.cpu_kernels

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def _check(got, x, w):
    """got against float64 x @ w: float32 sums of K products err by at most ~K * 2^-24 of
    sum |x||w| (bound 1e-5 relative to it for K <= 1000 with margin); a bf16 result adds
    its own rounding, half a bf16 ulp (2^-9) of |y|."""
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    want = xf @ wf
    scale = np.abs(xf) @ np.abs(wf)
    assert got.dtype == x.dtype and got.shape == want.shape
    tol = 1e-5 * scale + (2.0**-8 * np.abs(want) if x.dtype == BF16 else 0.0)
    err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)
    assert np.all(err <= tol), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F32, BF16), (BF16, F32),
                                             (BF16, BF16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("k,n", [(64, 48), (100, 77), (37, 1000), (24, 5)])
def test_matmul_matches_float64(rng, rows, k, n, x_dtype, w_dtype):
    x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    _check(jax.jit(cpu_matmul.matmul)(x, w), x, w)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("tile_vectors,block,panel,ahead",
                         [(1, 16, 5, 0), (2, 64, 7, 3), (3, 96, 0, 40), (3, 0, 1, 1),
                          (0, 48, 13, 2)])
@pytest.mark.parametrize("rows", [1, 11])
def test_matmul_tuning_settings(rng, w_dtype, tile_vectors, block, panel, ahead, rows):
    # Narrow blocks and short panels: many work items, partial sums carried through y; one
    # row without the sweep takes the tile walk too.
    x = jnp.asarray(rng.standard_normal((rows, 150)), F32)
    w = jnp.asarray(rng.standard_normal((150, 333)), w_dtype)
    got = cpu_matmul.matmul(x, w, tile_vectors=tile_vectors, block=block, panel=panel,
                            ahead=ahead, sweep=False)
    _check(got, x, w)


@needs_kernel
@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("k,n", [(40, 1000), (37, 2 * 16 * 4 * 2 + 5), (300, 77), (5, 9)])
def test_matmul_one_row_sweep(rng, w_dtype, k, n):
    """One row sweeps whole column ranges: sweeps of 16 rows and a shorter last one, column
    ranges of whole unrolled steps, single vectors and a scalar tail."""
    x = jnp.asarray(rng.standard_normal((1, k)), F32)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    _check(cpu_matmul.matmul(x, w, sweep=True), x, w)


@needs_kernel
@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16)])
@pytest.mark.parametrize("rows,k,n,packed", [(70, 301, 77, 64), (200, 96, 1000, 256),
                                             (97, 33, 64, 7), (150, 130, 70, 32)])
def test_matmul_packed_many_rows(rng, rows, k, n, packed, x_dtype, w_dtype):
    """The many-row GEMM: row blocks with a remainder, blocks of k (odd ones: a last
    pair with a zero partner in the bf16 pair path; with k even the bf16 pair path reads
    whole groups of rows in place at each block's offset, and stages the last, shorter
    group), column panels with a remainder."""
    x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    _check(cpu_matmul.matmul(x, w, packed=packed), x, w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("x_dtype", [F32, BF16])
def test_matmul_widen_equals_the_rounded_result(rng, rows, x_dtype):
    """`widen` returns float32 holding exactly the result in x's dtype: the kernel's own
    bfloat16 rounding against XLA's convert of the same sums. Small integers make many
    sums ties between two bfloat16 values (ties to even); an infinity meets zeros (NaN)."""
    k, n = 64, 300
    x = rng.integers(-8, 9, (rows, k)).astype(np.float32)
    w = rng.integers(-8, 9, (k, n)).astype(np.float32)
    w[0, :7] = 0.0
    if rows > 1:
        x[-1, 0] = np.inf
    x, w = jnp.asarray(x, x_dtype), jnp.asarray(w, BF16)
    got = cpu_matmul.matmul(x, w, widen=True)
    want = cpu_matmul.matmul(x, w).astype(F32)
    assert got.dtype == F32
    got, want = np.asarray(got), np.asarray(want)
    assert np.isnan(want[-1, :7]).all() == (rows > 1)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
    if x_dtype == BF16:  # the rounding was exercised: some exact sums are not bfloat16
        sums = np.asarray(x.astype(F32), np.float64) @ np.asarray(w.astype(F32), np.float64)
        fin = np.isfinite(sums)
        assert np.any(sums[fin] != got[fin]), "no sum needed rounding"


@needs_kernel
def test_matmul_leading_dims_and_vmap(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 40)), F32)
    w = jnp.asarray(rng.standard_normal((40, 70)), F32)
    got = cpu_matmul.matmul(x, w)
    assert got.shape == (2, 3, 70)
    _check(got.reshape(6, 70), x.reshape(6, 40), w)
    ws = jnp.asarray(rng.standard_normal((2, 40, 70)), F32)
    mapped = jax.vmap(cpu_matmul.matmul)(x, ws)
    for i in range(2):
        _check(mapped[i], x[i], ws[i])


@needs_kernel
@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_matmul_stacked_layer_in_place(rng, w_dtype):
    x = jnp.asarray(rng.standard_normal((5, 48)), F32)
    stack = jnp.asarray(rng.standard_normal((3, 48, 80)), w_dtype)
    f = jax.jit(lambda x, s, i: cpu_matmul.matmul(x, s, layer=i))
    for i in range(3):
        _check(f(x, stack, jnp.int32(i)), x, stack[i])
    _check(cpu_matmul.matmul(x, stack, layer=2), x, stack[2])


def test_matmul_rejects_bad_inputs():
    x = jnp.ones((2, 8), F32)
    with pytest.raises(ValueError, match="d_in"):
        cpu_matmul.matmul(x, jnp.ones((9, 4), F32))
    with pytest.raises(ValueError, match="d_in"):
        cpu_matmul.matmul(x, jnp.ones((2, 8, 4), F32))
    with pytest.raises(TypeError, match="float16"):
        cpu_matmul.matmul(x, jnp.ones((8, 4), jnp.float16))
    with pytest.raises(ValueError, match="layers"):
        cpu_matmul.matmul(x, jnp.ones((8, 4), F32), layer=0)
    with pytest.raises(ValueError, match="outside"):
        cpu_matmul.matmul(x, jnp.ones((2, 8, 4), F32), layer=2)
    with pytest.raises(ValueError, match="tile_vectors"):
        cpu_matmul.matmul(x, jnp.ones((8, 4), F32), tile_vectors=4)


def _hlo(x, w, b):
    return jax.jit(linear).lower(x, w, b).as_text()


@needs_kernel
def test_linear_dispatch(rng, cpu_options):
    # Tests run on 8 simulated CPU devices, where "auto" keeps XLA's dot; "on" forces.
    cpu_options(matmul="auto")
    jax.clear_caches()
    assert jax.device_count() == 1 or "kvjax_matmul" not in _hlo(
        jnp.ones((2, 32), F32), jnp.ones((32, 48), F32), None)
    cpu_options(matmul="on")
    jax.clear_caches()
    w = jnp.asarray(rng.standard_normal((32, 48)), F32)
    b = jnp.asarray(rng.standard_normal((48,)), F32)
    small = jnp.asarray(rng.standard_normal((2, 4, 32)), F32)
    large = jnp.asarray(rng.standard_normal((4, cpu_matmul.MAX_ROWS, 32)), F32)
    assert "kvjax_matmul" in _hlo(small, w, b)
    assert "kvjax_matmul" in _hlo(small.astype(BF16), w.astype(BF16), b)
    assert "kvjax_matmul" not in _hlo(large, w, b)
    dp = "avx512bf16" in cpu_kernels.library().isa
    assert ("kvjax_matmul" in _hlo(large.astype(BF16), w.astype(BF16), b)) == dp
    cpu_options(matmul="off")
    jax.clear_caches()  # the switch is read at trace time; earlier traces are cached
    assert "kvjax_matmul" not in _hlo(small, w, b)
    cpu_options(matmul="on")
    jax.clear_caches()
    # The kernel path and the einsum agree (float32 sums in both).
    got = jax.jit(linear)(small, w, b)
    want = jnp.einsum("...i,io->...o", small, w) + b
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_linear_grad_matches_einsum(rng, dtype, cpu_options):
    cpu_options(matmul="on")
    jax.clear_caches()
    x = jnp.asarray(rng.standard_normal((3, 24)), dtype)
    w = jnp.asarray(rng.standard_normal((24, 40)), dtype)
    b = jnp.asarray(rng.standard_normal((40,)), dtype)
    r = jnp.asarray(rng.standard_normal((3, 40)), F32)

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b).astype(F32) * r)

    def einsum_linear(x, w, b):
        return jnp.einsum("...i,io->...o", x, w.astype(x.dtype)) + b.astype(x.dtype)

    # The forward runs the kernel (the gradients alone do not need it: it is linear).
    assert "kvjax_matmul" in jax.jit(jax.value_and_grad(loss(linear))).lower(x, w, b).as_text()
    got = jax.jit(jax.grad(loss(linear), argnums=(0, 1, 2)))(x, w, b)
    want = jax.jit(jax.grad(loss(einsum_linear), argnums=(0, 1, 2)))(x, w, b)
    # The backward pass is the einsum's own: identical up to float32 summation order
    # (bf16: the primal's rounding of y may differ by an ulp, which r's gradient ignores).
    tol = 1e-5 if dtype == F32 else 1e-2
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g.astype(F32)), np.asarray(e.astype(F32)),
                                   rtol=tol, atol=tol)


@needs_kernel
def test_linear_layer_slice_reads_the_stack(rng, cpu_options):
    # A LayerSlice reaches the kernel as the whole stack (no dynamic-slice feeds the call),
    # and value and gradients match the einsum on the sliced weight.
    x = jnp.asarray(rng.standard_normal((2, 1, 32)), F32)
    stack = jnp.asarray(rng.standard_normal((4, 32, 48)), F32)
    b = jnp.asarray(rng.standard_normal((48,)), F32)
    r = jnp.asarray(rng.standard_normal((2, 1, 48)), F32)
    cpu_options(matmul="on")
    jax.clear_caches()

    def loss(x, stack, b, i):
        return jnp.sum(linear(x, LayerSlice(stack, i), b) * r)

    def ref_loss(x, stack, b, i):
        return jnp.sum((jnp.einsum("...i,io->...o", x, stack[i]) + b) * r)

    hlo = jax.jit(loss).lower(x, stack, b, jnp.int32(1)).as_text()
    assert "tensor<4x32x48xf32>, tensor<i32>) -> tensor<2x48xf32>" in hlo
    for i in (0, 3):
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, stack, b, jnp.int32(i))
        want = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))(x, stack, b, i)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_llama_decode_with_kernel_matches_xla(rng, cpu_options, dtype="float32"):
    # One decode step and a 5-token prefill of a tiny Llama (LM head untied, biases):
    # the kernel path (layers as LayerSlices) gives XLA's logits.
    from kvjax.cache import init_cache, reserve
    from kvjax.models import llama
    from kvjax.models.layers import RopeConfig

    config = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80,
                               num_layers=2, q_heads=4, kv_heads=2, head_dim=16,
                               rope=RopeConfig(theta=1e4, dim=16), qkv_bias=True,
                               tie_word_embeddings=False, dtype=dtype)
    params = llama.init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    spec = llama.cache_spec(config, page_size=4, num_pages=16, max_seqs=2,
                            max_pages_per_seq=4, dtype=dtype)
    tokens = jnp.asarray(rng.integers(0, 96, (2, 6)), jnp.int32)

    def run():
        # A new function each time: the switch is read when `linear` is traced.
        fwd = jax.jit(functools.partial(llama.forward), static_argnames="config")
        cache, _ = reserve(init_cache(spec), jnp.full((2,), 5, jnp.int32))
        pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        prefill, cache = fwd(params, config, tokens[:, :5], pos, cache,
                             q_lengths=jnp.full((2,), 5, jnp.int32))
        cache, _ = reserve(cache, jnp.ones((2,), jnp.int32))
        step, _ = fwd(params, config, tokens[:, 5:], jnp.full((2, 1), 5, jnp.int32), cache,
                      q_lengths=jnp.ones((2,), jnp.int32))
        hlo = fwd.lower(params, config, tokens[:, 5:], jnp.full((2, 1), 5, jnp.int32), cache,
                        q_lengths=jnp.ones((2,), jnp.int32)).as_text()
        return np.asarray(prefill), np.asarray(step), hlo

    cpu_options(matmul="on")
    pre_k, step_k, hlo = run()
    assert hlo.count("kvjax_matmul") >= 2  # the layer scan's projections and the LM head
    cpu_options(matmul="off")
    pre_x, step_x, _ = run()
    # float32: the same sums in another order (bf16 weights: the op-level tests above).
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pre_k, pre_x, **tol)
    np.testing.assert_allclose(step_k, step_x, **tol)


_SPIN_SCRIPT = """
import sys
import jax, numpy as np
from kvjax.backends.cpu import matmul as m
r = np.random.default_rng(int(sys.argv[1]))  # drawn on the host: no programs but f
x = jax.device_put(r.standard_normal((4, 1024), np.float32))
w = jax.device_put(r.standard_normal((1024, 8192), np.float32))
# The next op reads the product at once: a caller that returned before the helpers'
# last items were written would hand it a partial result.
f = jax.jit(lambda x, w: m.matmul(x, w) * 2.0)
want = 2.0 * (np.asarray(x, np.float64) @ np.asarray(w, np.float64))
for _ in range(30):  # calls back to back (helpers spinning) and after a pause (parked)
    np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=1e-4, atol=1e-3)
__import__("time").sleep(0.01)
np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=1e-4, atol=1e-3)
print("ok")
"""


@needs_kernel
@pytest.mark.parametrize("spin_us", ["0", "1000000"])
def test_helpers_park_or_spin(spin_us, rng, child_env):
    """The helper threads and the waiting caller park at once (spin_us 0, here set through
    its environment variable) or spin a second before parking: the same products either
    way, and no call hangs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(child_env, KVJAX_CPU_SPIN_US=spin_us, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SPIN_SCRIPT, str(rng.integers(1 << 30))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_unstack_layers_for(cpu_options):
    """The decode loop's unstacking decision: only where the matmul kernel does not read
    the stack in place (matmul off, more rows than it serves), for stacks of 32 MiB or
    more, and never with unstack_layers off."""
    big = {"w_qkv": jax.ShapeDtypeStruct((8, 512, 1536), F32),
           "w_down": jax.ShapeDtypeStruct((8, 1408, 1024), F32),
           "norm": jax.ShapeDtypeStruct((8, 512), F32)}
    small = {"w": jax.ShapeDtypeStruct((2, 16, 16), F32)}
    cpu_options(matmul="off")
    assert cpu_kernels.unstack_layers_for(big, 8)
    assert not cpu_kernels.unstack_layers_for(small, 8)
    cpu_options(unstack_layers=False)
    assert not cpu_kernels.unstack_layers_for(big, 8)
    cpu_options(unstack_layers=True, matmul="on")
    assert cpu_kernels.unstack_layers_for(big, 64)  # more rows than the kernel serves
    if cpu_kernels.available():
        assert not cpu_kernels.unstack_layers_for(big, 8)  # read in place by the kernel
