"""Generation on the paged cache — kvjax's one decode engine: chunked prefill, the jitted
decode loop, sampling, streaming, teacher-forced scoring, parallel sampling (forked
prompt pages) and beam search (copy-on-write), for every cache kind, policy and
sharding plan.

Names load on first use, so `kvjax.generate.cli` (the `python -m kvjax generate`
parser) imports without JAX.
"""

import importlib

# public name -> module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("CacheConfig", "CachePolicy", "DecodeState", "GenerateResult", "ScoreResult",
         "StreamEvent", "GREEDY", "decode_loop", "decode_params", "decode_step",
         "decode_step_jit", "generate", "pad_prompts", "prefill", "score", "start", "stream"),
        "kvjax.generate.loop"),
    **dict.fromkeys(("BeamResult", "beam_search", "fork_samples", "sample_keys", "sample_n"),
                    "kvjax.generate.parallel"),
    **dict.fromkeys(("SamplingConfig", "as_keys", "sample"), "kvjax.generate.sampling"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax.generate' has no attribute {name!r}")
