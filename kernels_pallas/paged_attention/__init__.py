"""Paged MHA/GQA/MQA attention: decode and chunked prefill.

`reference.py` is the jnp oracle (decode and prefill); `tpu.py` and `gpu.py`
are the decode kernels (Pallas TPU with DMA'd pages; Pallas Triton with
split-K), both with the reference's signature plus `block_sizes`, `max_pages`
and `interpret`; `block_sizes.py` holds their tiling dataclass and shape checks.
"""
