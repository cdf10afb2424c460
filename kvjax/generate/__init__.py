"""Generation on the paged cache: chunked prefill, the jitted decode loop, sampling,
streaming, parallel sampling (forked prompt pages) and beam search (copy-on-write)."""

from kvjax.generate.loop import (
    CachePolicy,
    DecodeState,
    GenerateResult,
    StreamEvent,
    decode_loop,
    decode_step,
    decode_step_jit,
    default_cache_spec,
    generate,
    pad_prompts,
    prefill,
    start,
    stream,
)
from kvjax.generate.parallel import BeamResult, beam_search, fork_samples, sample_keys, sample_n
from kvjax.generate.sampling import SamplingConfig, as_keys, sample

__all__ = [
    "BeamResult",
    "beam_search",
    "fork_samples",
    "sample_keys",
    "sample_n",
    "CachePolicy",
    "DecodeState",
    "GenerateResult",
    "SamplingConfig",
    "StreamEvent",
    "as_keys",
    "decode_loop",
    "decode_step",
    "decode_step_jit",
    "default_cache_spec",
    "generate",
    "pad_prompts",
    "prefill",
    "sample",
    "start",
    "stream",
]
