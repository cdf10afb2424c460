"""The NNX tests' logits check: a model's logits over its pages equal a dense reference."""

import jax
import numpy as np

from kvjax import generate as kvg


def assert_paged_logits_equal(model, params, prompts, ref_tokens, ref_logits, *, page: int,
                              max_new: int, tol: dict) -> None:
    """Logits at every position of prompt + the first `max_new - 1` reference tokens,
    through chunked prefill over `page`-token pages (each chunk reads the earlier chunks'
    pages), equal `ref_logits[b, :n]` (float32 [batch, steps, vocab]) within `tol`."""
    seqs = [p + ref_tokens[b, : max_new - 1].tolist() for b, p in enumerate(prompts)]
    tokens, lengths, chunk = kvg.pad_prompts(seqs, page)
    cache = kvg.CacheConfig(page_size=page).build(model, num_seqs=len(seqs),
                                                  max_tokens=tokens.shape[1])
    *_, logits, _ = kvg.prefill(model, params, cache, jax.device_put(tokens),
                                jax.device_put(lengths), jax.device_put(np.arange(len(seqs))),
                                chunk_size=chunk, return_logits=True)
    logits = np.asarray(logits)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], ref_logits[b, :n], **tol)
