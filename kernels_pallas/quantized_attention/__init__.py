"""Attention over KIVI-quantized pages (packed 2/4/8-bit codes) plus a full-precision tail.

`layout.py`: the bit layout; `reference.py`: the plain-jnp oracle; `tpu.py`
and `gpu.py`: Pallas kernels (Mosaic TPU, Triton GPU) for GQA/MQA/MHA and
MLA that read the packed pages and dequantize in VMEM/registers, with
drop-ins for the reference's `quantized_attention` / `quantized_mla_attention`.
"""
