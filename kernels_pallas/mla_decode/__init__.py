"""Paged MLA attention in absorbed form over the latent cache.

`reference.py` is the jnp oracle (decode and prefill); `tpu.py` and `gpu.py`
are decode kernels: the paged GQA kernels with one latent KV head, a
two-part key [c_KV, k_rope] and c_KV as the value.
"""
