"""The C++ CPU kernels (`kvjax.backends.cpu`) as attention implementations.

Each function has the signature of the op's reference and runs the kernel when it
takes the inputs (`kvjax.backends.cpu.quantized_supported` / `mla_supported`: static
shapes and dtypes), the XLA path otherwise (MLA prefill chunks, mixed dtypes).
"""

from kvjax.attention import xla as xla_path
from kvjax.attention import xla_quantized
from kvjax.backends import cpu

__all__ = ["paged_decode_attention", "paged_prefill_attention", "quantized_attention",
           "mla_decode_attention"]

paged_decode_attention = cpu.paged_decode_attention
paged_prefill_attention = cpu.paged_prefill_attention


def quantized_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v,
                        *args, **kwargs):
    """`reference.quantized_attention` by the CPU kernels (decode, prefill) or the XLA path."""
    if cpu.quantized_supported(q, k_scale, k_zero, v_scale, v_zero, tail_k, tail_v):
        fn = cpu.quantized_attention
    else:
        fn = xla_quantized.quantized_attention
    return fn(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v, *args,
              **kwargs)


def mla_decode_attention(q_latent, q_rope, latent_pages, rope_pages, *args, **kwargs):
    """`reference.mla_decode_attention` by the CPU kernel or (mixed dtypes) the XLA path."""
    fn = cpu.mla_decode_attention if cpu.mla_supported(latent_pages, rope_pages) else (
        xla_path.mla_decode_attention)
    return fn(q_latent, q_rope, latent_pages, rope_pages, *args, **kwargs)
