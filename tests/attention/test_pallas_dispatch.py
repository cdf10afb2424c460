"""`kvjax.attention` dispatch to the Pallas kernels.

The kernels themselves are tested in tests/kernels; here: "auto" picks the
kernel on TPU/GPU and the XLA path on CPU, "pallas" runs the backend's kernel
(interpreted on CPU); chunked prefill and mixed steps run the ragged kernel on
TPU and the XLA path on a GPU. Whole models decoded through the kernels are in
test_pallas_models.py.
"""

import itertools

import jax
import numpy as np
import pytest

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import gpu as paged_gpu
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.paged_attention.block_sizes import GPU_HEAD_DIMS
from kernels_pallas.ragged_attention import tpu as ragged_tpu
from kvjax.attention import ops, pallas_impls, registry
from kvjax.attention import paged_decode_attention as decode_op
from kvjax.backends.cpu import options as cpu_options

# The oracles, jitted: run eagerly, each of their ops compiles a program of its own.
_paged_ref = jax.jit(paged_ref.paged_decode_attention)
_mla_ref = jax.jit(mla_ref.mla_decode_attention, static_argnames="scale")
_prefill_ref = jax.jit(paged_ref.paged_prefill_attention)
_mla_prefill_ref = jax.jit(mla_ref.mla_prefill_attention, static_argnames="scale")


def _dev(x, dtype=np.float32):
    """A device array of host `x` cast to `dtype` on the host (no conversion program)."""
    return jax.device_put(np.asarray(x).astype(dtype))


def _gqa_inputs(rng, batch=3, q_heads=4, kv_heads=2, head_dim=64, page_size=8, max_pages=3):
    num_pages = batch * max_pages + 2
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    lengths = rng.integers(1, max_pages * page_size + 1, size=batch)

    def draw(*shape):
        return _dev(rng.standard_normal(shape))

    return (draw(batch, q_heads, head_dim), draw(kv_heads, num_pages, page_size, head_dim),
            draw(kv_heads, num_pages, page_size, head_dim), _dev(lengths, np.int32),
            _dev(tables, np.int32))


def _pretend(monkeypatch, platform):
    """The default backend reads as `platform`; a "gpu" is one Pallas' Triton lowering
    knows (from jax 0.11 on, `get_gpu_info` raises where no such GPU is attached, as
    here)."""
    from jax.experimental.pallas import triton as plgpu

    monkeypatch.setattr(pallas_impls, "platform", lambda: platform)
    if platform == "gpu":
        monkeypatch.setattr(plgpu, "get_gpu_info", lambda: object(), raising=False)


@pytest.mark.parametrize("platform,want", [("cpu", "xla"), ("tpu", "pallas"), ("gpu", "pallas")])
def test_auto_picks_kernel_on_accelerators_and_xla_on_cpu(monkeypatch, platform, want):
    _pretend(monkeypatch, platform)
    # Without the C++ CPU kernels (tests/backends covers what "auto" picks with them).
    with cpu_options.override(kernels=False):
        assert registry.auto_impl("paged_decode_attention") == want
        assert registry.auto_impl("mla_decode_attention") == want
        # Chunked prefill and mixed steps: the ragged kernel on TPU; a GPU has no prefill
        # kernel yet, and the C++ CPU kernels are off here: the XLA path there.
        prefill = "pallas" if platform == "tpu" else "xla"
        assert registry.auto_impl("paged_prefill_attention") == prefill
        assert registry.auto_impl("mla_prefill_attention") == prefill
        if platform != "gpu":  # (a Hopper's KIVI routing: test_kivi_decode_on_hopper_...)
            # KIVI pages, decode and prefill rows alike: the TPU kernel on TPU.
            assert registry.auto_impl("quantized_attention") == prefill


@pytest.mark.parametrize("platform,head_dim,page_size", [
    ("gpu", 8, 8),     # a width the GPU kernel lacks
    ("gpu", 64, 12),   # a page size that is not a power of two
    ("tpu", 32, 8),    # the TPU kernel's widths start at 64
])
def test_auto_runs_xla_where_the_kernel_does_not_take_the_pages(monkeypatch, rng, platform,
                                                               head_dim, page_size):
    _pretend(monkeypatch, platform)
    args = _gqa_inputs(rng, head_dim=head_dim, page_size=page_size)
    pages = args[1:3]
    assert not pallas_impls.kernel_takes(pages)
    assert registry.auto_impl("paged_decode_attention", pages=pages) == "xla"
    with pytest.raises(ValueError, match=r"head_dim|page_size"):
        decode_op(*args, impl="pallas", interpret=True)
    got = decode_op(*args)  # "auto": the XLA path, not the kernel's error
    want = _paged_ref(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # Pages the kernel takes still go to it.
    good = _gqa_inputs(rng, head_dim=64, page_size=8)[1:3]
    assert pallas_impls.kernel_takes(good)
    assert registry.auto_impl("paged_decode_attention", pages=good) == "pallas"


def test_auto_runs_xla_on_a_gpu_triton_does_not_know(monkeypatch, rng):
    """jax >= 0.11 lowers Triton kernels only for the GPU kinds it lists."""
    from jax.experimental.pallas import triton as plgpu

    def unknown():
        raise ValueError("Unsupported GPU device kind: NVIDIA L40S")

    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(plgpu, "get_gpu_info", unknown, raising=False)
    pages = _gqa_inputs(rng, head_dim=64, page_size=8)[1:3]
    assert registry.auto_impl("paged_decode_attention", pages=pages) == "xla"
    assert registry.auto_impl("mla_decode_attention") == "xla"
    monkeypatch.setattr(plgpu, "get_gpu_info", lambda: object(), raising=False)
    assert registry.auto_impl("paged_decode_attention", pages=pages) == "pallas"
    assert registry.auto_impl("mla_decode_attention") == "pallas"


def test_pallas_on_cpu_interprets_by_default(rng):
    args = _gqa_inputs(rng)
    got = decode_op(*args, impl="pallas")
    want = _paged_ref(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_pallas_on_cpu_without_interpret_raises(rng):
    with pytest.raises(ValueError, match="needs a TPU or GPU backend"):
        decode_op(*_gqa_inputs(rng), impl="pallas", interpret=False)


def test_pallas_on_gpu_platform_runs_the_gpu_kernel(rng, monkeypatch):
    calls = []
    real = paged_gpu.paged_decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["interpret"])
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(paged_gpu, "paged_decode_attention", spy)
    args = _gqa_inputs(rng)
    out, lse = decode_op(*args, impl="pallas", interpret=True)
    assert calls == [True]
    want_out, want_lse = _paged_ref(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


def test_mla_and_prefill_through_pallas(rng):
    batch, heads, d_c, d_rope, page_size, max_pages = 2, 4, 128, 64, 8, 2
    num_pages = batch * max_pages
    tables = _dev(rng.permutation(num_pages).reshape(batch, max_pages), np.int32)
    lengths = _dev([5, 16], np.int32)

    def draw(*shape):
        return _dev(rng.standard_normal(shape))

    mla_args = (draw(batch, heads, d_c), draw(batch, heads, d_rope),
                draw(num_pages, page_size, d_c), draw(num_pages, page_size, d_rope),
                lengths, tables)
    got = ops.mla_decode_attention(*mla_args, scale=0.1, impl="pallas")
    want = _mla_ref(*mla_args, scale=0.1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    q = draw(batch, 3, 4, 64)
    k, v = draw(2, num_pages, page_size, 64), draw(2, num_pages, page_size, 64)
    q_lengths = _dev([2, 3], np.int32)
    got = ops.paged_prefill_attention(q, k, v, lengths, tables, q_lengths, impl="pallas")
    want = _prefill_ref(q, k, v, lengths, tables, q_lengths)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _mixed_rows(rng, batch=3, q_len=3, heads=4, page_size=8, max_pages=2):
    """A mixed step: a row with no new query, a decode row and a 3-query chunk from
    mid-page; GQA (4 query heads over 2 KV heads, width 64) and MLA (latent 128, rope 64)
    inputs over the same permuted pages."""
    num_pages = batch * max_pages
    tables = _dev(rng.permutation(num_pages).reshape(batch, max_pages), np.int32)
    lengths, q_lengths = _dev([7, 9, 14], np.int32), _dev([0, 1, 3], np.int32)

    def draw(*shape):
        return _dev(rng.standard_normal(shape))

    gqa = (draw(batch, q_len, heads, 64), draw(2, num_pages, page_size, 64),
           draw(2, num_pages, page_size, 64), lengths, tables, q_lengths)
    mla = (draw(batch, q_len, heads, 128), draw(batch, q_len, heads, 64),
           draw(num_pages, page_size, 128), draw(num_pages, page_size, 64), lengths, tables,
           q_lengths)
    return gqa, mla


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_prefill_runs_the_ragged_kernel_except_on_gpu(rng, monkeypatch, platform):
    """impl="pallas" (and "auto" on TPU) runs chunked prefill and mixed steps through the
    ragged kernel: interpreted on CPU, compiled on TPU (interpreted here); on a GPU the XLA
    path until a GPU prefill kernel exists."""
    calls = []
    for name in ("paged_prefill_attention", "mla_prefill_attention"):
        real = getattr(ragged_tpu, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs["interpret"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(ragged_tpu, name, spy)
    if platform != "cpu":
        _pretend(monkeypatch, platform)
    gqa, mla = _mixed_rows(rng)
    impl = "auto" if platform == "tpu" else "pallas"
    got = ops.paged_prefill_attention(*gqa, impl=impl, interpret=True)
    got_mla = ops.mla_prefill_attention(*mla, scale=0.1, impl=impl, interpret=True)
    if platform == "gpu":
        assert calls == []
        for g, w in zip((*got, *got_mla), (
                *ops.paged_prefill_attention(*gqa, impl="xla"),
                *ops.mla_prefill_attention(*mla, scale=0.1, impl="xla")), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        return
    assert calls == [("paged_prefill_attention", True), ("mla_prefill_attention", True)]
    for g, w in zip((*got, *got_mla), (*_prefill_ref(*gqa), *_mla_prefill_ref(*mla, scale=0.1)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_info_says_what_prefill_runs_on_tpu_and_gpu(monkeypatch):
    """`python -m kvjax info` names the prefill implementation per accelerator, and it is
    what "auto" picks there."""
    from kvjax import info

    report = info._prefill_ops()
    for op in ("paged_prefill_attention", "mla_prefill_attention"):
        assert report[op]["tpu"]["kernel"] == "ragged"
        assert "ragged_attention" in report[op]["tpu"]["reason"]
        # The Mosaic GPU kernels on a Hopper (the XLA path on other GPUs).
        assert report[op]["gpu"]["kernel"] == "mosaic"
        module = pallas_impls.MOSAIC_GPU_PREFILL_OPS[op].rsplit(".", 1)[1]
        assert "Hopper" in report[op]["gpu"]["reason"]
        assert f"ragged_attention/{module} " in report[op]["gpu"]["reason"]
        for platform, want in (("tpu", "pallas"), ("gpu", "xla")):
            _pretend(monkeypatch, platform)  # this machine's device: not a Hopper
            assert registry.auto_impl(op) == want
        monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0"))
        assert registry.auto_impl(op) == "pallas"
        assert pallas_impls.prefill_kernel(op, "gpu")[0] == "mosaic"
        monkeypatch.undo()


class _Gpu:
    """A stand-in for a GPU device: the attributes the kernel choice reads."""

    def __init__(self, device_kind, compute_capability, core_count=132):
        self.device_kind = device_kind
        self.compute_capability = compute_capability
        self.core_count = core_count


def test_gpu_runs_mosaic_kernels_on_hopper_and_triton_elsewhere(monkeypatch):
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100 80GB HBM3", "9.0"))
    for op in pallas_impls.KERNEL_OPS:
        kernel, why = pallas_impls.gpu_kernel(op)
        assert kernel == "mosaic" and "Hopper" in why, (op, why)
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA A100-SXM4-80GB", "8.0"))
    for op in pallas_impls.KERNEL_OPS:
        kernel, why = pallas_impls.gpu_kernel(op)
        assert kernel == "triton" and "A100" in why and "8.0" in why, (op, why)
    # `python -m kvjax info` on a GPU prints the same choice per op.
    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    from kvjax import info

    ops_listed = {*pallas_impls.KERNEL_OPS, "quantized_attention", "quantized_mla_attention",
                  "quantized_prefill_attention"}
    assert {op: c["kernel"] for op, c in info._gpu_ops().items()} == dict.fromkeys(
        ops_listed, "triton")
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H200", "9.0"))
    assert {op: c["kernel"] for op, c in info._gpu_ops().items()} == dict.fromkeys(
        ops_listed, "mosaic")


def test_shapes_the_mosaic_kernel_refuses_go_to_triton_with_its_reason(monkeypatch, rng):
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H200", "9.0"))
    module, _ = pallas_impls._mosaic_module("paged_decode_attention")
    monkeypatch.setattr(module, "unsupported_reason", lambda *a: "page size 3 is not copied")
    q, k, v = _gqa_inputs(rng)[:3]
    kernel, why = pallas_impls.gpu_kernel("paged_decode_attention", q, k, v)
    assert kernel == "triton" and "page size 3 is not copied" in why


def test_hopper_runs_every_triton_geometry_on_mosaic(monkeypatch):
    """On a Hopper every page dtype, query dtype, head width and page size the Triton kernel
    takes runs the Mosaic GPU kernel (on jax 0.10 its TMA lowering sends the copies under
    128 bytes to Triton, saying so); what the Mosaic kernel refuses (a GQA group over one
    64-row wgmma tile) goes to Triton with its reason."""
    S = jax.ShapeDtypeStruct
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0"))
    jax_010 = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
    for dtype, q_dtype, width, page_size in itertools.product(
        (jax.numpy.bfloat16, np.float32), (jax.numpy.bfloat16, np.float32),
        GPU_HEAD_DIMS, (1, 2, 4, 8, 16, 64, 128),
    ):
        pages = S((2, 8, page_size, width), dtype)
        kernel, why = pallas_impls.gpu_kernel("paged_decode_attention",
                                              S((2, 8, width), q_dtype), pages, pages)
        if jax_010 and page_size * width * np.dtype(dtype).itemsize < 128:
            assert kernel == "triton" and "jax 0.10 lowering limit" in why, why
        else:
            assert kernel == "mosaic" and "Hopper" in why, (dtype, q_dtype, width, page_size,
                                                            why)
    pages = S((1, 8, 16, 128), jax.numpy.bfloat16)
    kernel, why = pallas_impls.gpu_kernel("paged_decode_attention",
                                          S((2, 128, 128), jax.numpy.bfloat16), pages, pages)
    assert kernel == "triton" and "at most 64 query heads per KV head" in why, why


@pytest.mark.parametrize("op", ["paged_decode_attention", "mla_decode_attention"])
def test_pallas_on_hopper_runs_the_mosaic_kernel_with_the_sm_count(rng, monkeypatch, op):
    """On a Hopper, impl="pallas" calls the Mosaic GPU kernel (interpreted here) with the
    device's SM count, and its result is the reference's (bf16 pages: the Mosaic kernels'
    MMA operands)."""
    module, why_not = pallas_impls._mosaic_module(op)
    assert module is not None, why_not
    calls = []
    real = getattr(module, op)

    def spy(*args, **kwargs):
        calls.append((kwargs["num_sms"], kwargs["interpret"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0", 114))
    monkeypatch.setattr(module, op, spy)
    bf16 = jax.numpy.bfloat16
    if op == "paged_decode_attention":
        q, k, v, lengths, tables = _gqa_inputs(rng)
        args = (q.astype(bf16), k.astype(bf16), v.astype(bf16), lengths, tables)
        got, want = decode_op(*args, impl="pallas", interpret=True), _paged_ref(*args)
    else:
        batch, heads, d_c, d_rope, page_size, max_pages = 2, 4, 128, 64, 8, 2
        tables = _dev(rng.permutation(batch * max_pages).reshape(batch, max_pages), np.int32)
        args = (_dev(rng.standard_normal((batch, heads, d_c)), bf16),
                _dev(rng.standard_normal((batch, heads, d_rope)), bf16),
                _dev(rng.standard_normal((batch * max_pages, page_size, d_c)), bf16),
                _dev(rng.standard_normal((batch * max_pages, page_size, d_rope)), bf16),
                _dev([5, 16], np.int32), tables)
        got = ops.mla_decode_attention(*args, scale=0.1, impl="pallas", interpret=True)
        want = _mla_ref(*args, scale=0.1)
    assert calls == [(114, True)]
    for g, w in zip(got, want, strict=True):  # bf16 outputs: 8 bits of mantissa
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2)


def test_kivi_decode_on_hopper_runs_the_mosaic_kernel(monkeypatch):
    """KIVI decode rows go to the Mosaic GPU kernel with the SM count (Triton's block sizes
    and table width dropped); chunked-prefill rows to the Mosaic GPU prefill kernel
    (tests/kernels/test_mosaic_gpu_kivi_prefill.py)."""
    from kernels_pallas.quantized_attention import gpu as quant_gpu
    from kernels_pallas.quantized_attention import mosaic_gpu_prefill
    from tests.kernels.test_mosaic_gpu_quantized import _inputs

    module, why_not = pallas_impls._mosaic_module("quantized_attention")
    assert module is not None, why_not
    calls = []
    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0", 114))
    monkeypatch.setattr(module, "quantized_attention",
                        lambda *a, **kw: calls.append(("mosaic", kw)) or "mosaic")
    monkeypatch.setattr(quant_gpu, "quantized_attention",
                        lambda *a, **kw: calls.append(("triton", kw)) or "triton")
    args = _inputs(4)
    kw = dict(k_bits=4, v_bits=4, scale=0.1, block_sizes=None, max_pages=None)
    assert pallas_impls.quantized_attention(*args, interpret=True, **kw) == "mosaic"
    assert calls[-1][1]["num_sms"] == 114 and "block_sizes" not in calls[-1][1]
    monkeypatch.setattr(mosaic_gpu_prefill, "quantized_attention", lambda *a, **kw: "prefill")
    rows = (jax.numpy.repeat(args[0], 2, axis=1), *args[1:])  # two query rows: prefill
    assert pallas_impls.quantized_attention(*rows, interpret=True, **kw) == "prefill"


def test_prefill_on_hopper_runs_the_mosaic_ragged_kernel(rng, monkeypatch):
    """On a Hopper, "auto" and "pallas" hand GQA and MLA chunked prefill / mixed steps to the
    Mosaic GPU ragged kernels with the device's SM count and the op's arguments in order (the
    kernels are stood in for by the references on what they receive: interpreting them costs
    seconds, and tests/kernels/test_mosaic_gpu_ragged.py checks them); float32 MLA pages,
    which the MLA kernel refuses, run the XLA path."""
    calls = []

    def stand_in(ref, **fixed):
        def run(*args, num_sms, interpret, **kw):
            calls.append((ref.__name__, num_sms, interpret, kw))
            return ref(*args, **kw, **fixed)
        return run

    _pretend(monkeypatch, "gpu")
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0", 114))
    for op, ref in (("paged_prefill_attention", _prefill_ref),
                    ("mla_prefill_attention", _mla_prefill_ref)):
        module, why_not = pallas_impls._mosaic_module(op)
        assert module is not None, why_not
        monkeypatch.setattr(module, op, stand_in(ref))
    gqa, mla = _mixed_rows(rng)
    bf16 = jax.numpy.bfloat16
    gqa = (*(_dev(np.asarray(x), bf16) for x in gqa[:3]), *gqa[3:])
    mla_f32, mla = mla, (*(_dev(np.asarray(x), bf16) for x in mla[:4]), *mla[4:])
    for op, args in (("paged_prefill_attention", gqa), ("mla_prefill_attention", mla)):
        kernel, why = pallas_impls.gpu_kernel(op, *args[:3 if op.startswith("paged") else 4])
        assert kernel == "mosaic" and "Hopper" in why
        assert registry.auto_impl(op, pages=args[1:3] if op.startswith("paged") else
                                  args[2:4]) == "pallas"
    got = ops.paged_prefill_attention(*gqa, impl="auto", interpret=True)
    got_mla = ops.mla_prefill_attention(*mla, scale=0.1, impl="auto", interpret=True)
    assert calls == [
        ("paged_prefill_attention", 114, True, dict(scale=None, soft_cap=None,
                                                    sliding_window=None)),
        ("mla_prefill_attention", 114, True, dict(scale=0.1)),
    ]
    for g, w in zip((*got, *got_mla), (*_prefill_ref(*gqa), *_mla_prefill_ref(*mla, scale=0.1)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    kernel, why = pallas_impls.gpu_kernel("mla_prefill_attention", *mla_f32[:4])
    assert kernel == "xla" and "float32" in why
    got_mla = ops.mla_prefill_attention(*mla_f32, scale=0.1, impl="pallas", interpret=True)
    for g, w in zip(got_mla, ops.mla_prefill_attention(*mla_f32, scale=0.1, impl="xla"),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(calls) == 2


def test_prefill_the_mosaic_kernel_refuses_runs_xla_with_its_reason(rng, monkeypatch):
    """Float32 pages on a Hopper, and any pages on an A100, run the XLA path; gpu_kernel
    says why."""
    module, _ = pallas_impls._mosaic_module("paged_prefill_attention")
    monkeypatch.setattr(module, "paged_prefill_attention",
                        lambda *a, **kw: pytest.fail("the Mosaic kernel ran"))
    _pretend(monkeypatch, "gpu")
    gqa, _ = _mixed_rows(rng)
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0"))
    kernel, why = pallas_impls.gpu_kernel("paged_prefill_attention", *gqa[:3])
    assert kernel == "xla" and "does not take these shapes" in why and "float32" in why
    got = ops.paged_prefill_attention(*gqa, impl="pallas", interpret=True)
    for g, w in zip(got, ops.paged_prefill_attention(*gqa, impl="xla"), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA A100-SXM4-80GB", "8.0"))
    kernel, why = pallas_impls.prefill_kernel("paged_prefill_attention", "gpu")
    assert kernel == "xla" and "A100" in why
    assert registry.auto_impl("paged_prefill_attention") == "xla"
