"""Ragged paged attention: one kernel for decode, chunked prefill and mixed batches.

Every row of a batch brings its own number of new queries (0 up to the chunk
width, 1 for a decode row) at its own position, causal against its cache
pages. The contract is `paged_prefill_attention` / `mla_prefill_attention` of
`kernels_pallas/paged_attention/reference.py` and
`kernels_pallas/mla_decode/reference.py`, which are this op's references.
`tpu.py` is the Pallas TPU kernel (GQA/MQA/MHA and absorbed MLA, bf16 or f32
pages); `block_sizes.py` holds its tiling dataclass. `mosaic_gpu.py` is the
Hopper kernel in Mosaic GPU (GQA/MQA/MHA over bf16/f16 pages: a TMA warpgroup,
two wgmma warpgroups, a persistent grid over the query blocks), and
`mla_mosaic_gpu.py` its absorbed-MLA counterpart (the MLA decode kernel's
warpgroup body on the same persistent schedule).
"""
