"""Several continuations of one prompt on shared pages: parallel sampling and beam search.

Both prefill a prompt once and `kvjax.cache.fork` its sequence: the forks
point at the prompt's pages (reference counts go up, nothing is copied). When
a fork first writes into the shared, partly filled last page, `reserve`
copies that one page (copy-on-write); full prompt pages stay shared for the
whole generation.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache.page_table import AllocStatus
from kvjax.generate.loop import (
    GREEDY,
    GenerateResult,
    _first_error,
    _ok_status,
    _slot_vector,
    decode_loop,
    default_cache_spec,
    pad_prompts,
    prefill,
    start,
)
from kvjax.generate.sampling import SamplingConfig, as_keys
from kvjax.models.base import Model

__all__ = ["fork_samples", "sample_n", "sample_keys", "BeamResult", "beam_search"]


def fork_samples(cache: kv_cache.PagedKVCache, prompt_slots: Sequence[int], n: int
                 ) -> tuple[kv_cache.PagedKVCache, AllocStatus]:
    """Forks sequence `prompt_slots[p]` into slots `prompt_slots[p] + 1 .. + n - 1`.

    Args:
      cache: the cache holding the prefilled prompts (donated).
      prompt_slots: slot of each prompt; the n - 1 slots after each must be empty.
      n: sequences per prompt, the original included.
    """
    slots = np.asarray(prompt_slots, np.int32)
    if n == 1:
        return cache, _ok_status(cache)
    src = np.repeat(slots, n - 1)
    dst = (slots[:, None] + np.arange(1, n, dtype=np.int32)[None, :]).reshape(-1)
    return kv_cache.fork(cache, jnp.asarray(src), jnp.asarray(dst))


def sample_keys(key, num_prompts: int, n: int) -> jax.Array:
    """Row keys of `sample_n`: sample j of prompt p uses fold_in(as_keys(key, P)[p], j).

    Generating prompt p alone with `key=sample_keys(...)[p * n + j][None]`
    reproduces that sample.
    """
    per_prompt = as_keys(key, num_prompts)
    return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(n)))(
        per_prompt).reshape(-1)


def sample_n(
    model: Model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    key,
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    eos_ids: Sequence[int] = (),
    page_size: int = 16,
    num_pages: int | None = None,
    cache_dtype="float32",
    chunk_size: int = 256,
    free_finished: bool = True,
    impl: str = "auto",
    check: bool = True,
) -> GenerateResult:
    """`n` samples per prompt; each prompt is prefilled once and its pages shared by all n.

    Rows of the result are prompt-major: row p * n + j is sample j of prompt p,
    drawn with key `sample_keys(key, len(prompts), n)[p * n + j]`.

    Args: as in `kvjax.generate.generate`, plus `n` (samples per prompt). The
    default cache has `len(prompts) * n` slots and pages for every row's full
    length (an upper bound; sharing leaves part of it unused).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}.")
    tokens, lengths, chunk = pad_prompts(prompts, chunk_size)
    num_prompts = tokens.shape[0]
    rows = num_prompts * n
    spec = default_cache_spec(model, num_seqs=rows, max_tokens=int(lengths.max()) +
                              max_new_tokens, page_size=page_size, num_pages=num_pages,
                              dtype=cache_dtype)
    cache = kv_cache.init_cache(spec)
    prompt_slots = np.arange(num_prompts, dtype=np.int32) * n
    cache, last_logits, status, _ = prefill(
        model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
        jnp.asarray(prompt_slots), chunk_size=chunk, impl=impl)
    if check:
        status.raise_if_error()
    cache, fork_status = fork_samples(cache, prompt_slots, n)
    fork_status.raise_if_error()
    eos_ids = tuple(int(e) for e in eos_ids)
    state = start(
        cache, jnp.arange(rows, dtype=jnp.int32), jnp.repeat(last_logits, n, axis=0),
        jnp.asarray(np.repeat(lengths, n)), sample_keys(key, num_prompts, n),
        jnp.full((rows,), max_new_tokens, jnp.int32), status, sampling=sampling,
        eos_ids=eos_ids, max_len=max_new_tokens, free_finished=free_finished)
    state = decode_loop(model, params, state, sampling=sampling, eos_ids=eos_ids,
                        free_finished=free_finished, impl=impl)
    if check:
        state.status.raise_if_error()
    return GenerateResult(tokens=np.asarray(state.tokens),
                          num_generated=np.asarray(state.num_generated), cache=state.cache,
                          status=state.status, state=state)


@dataclasses.dataclass(frozen=True)
class BeamResult:
    """What `beam_search` returns.

    Attributes:
      tokens: int32[beam_width, max_new_tokens] (NumPy), best beam first.
      scores: float32[beam_width], summed log-probabilities, descending.
      cache: the final cache (the beams' pages freed unless keep_cache).
      status: the first allocation failure or OK.
    """

    tokens: np.ndarray
    scores: np.ndarray
    cache: kv_cache.PagedKVCache
    status: AllocStatus

    @property
    def best(self) -> list[int]:
        return self.tokens[0].tolist()


@functools.partial(jax.jit, static_argnames=("model", "beam_width", "steps", "impl"),
                   donate_argnames="cache")
def _beam_loop(model, params, cache, last_logits, prompt_len, *, beam_width: int, steps: int,
               impl: str):
    """The beam loop; beams live in slots [0, W) and [W, 2W), alternating every step."""
    w = beam_width
    vocab = last_logits.shape[-1]
    lane = jnp.arange(w, dtype=jnp.int32)

    def body(t, carry):
        cache, base, scores, hist, logits, status = carry
        cand = scores[:, None] + jax.nn.log_softmax(logits, axis=-1)
        top, idx = jax.lax.top_k(cand.reshape(-1), w)
        parent, tok = idx // vocab, (idx % vocab).astype(jnp.int32)
        old, new = base + lane, (w - base) + lane
        # New beam i shares every page of its parent; dropping the old beams
        # releases the pages of parents nobody chose.
        cache, st = kv_cache.fork(cache, old[parent], new)
        status = _first_error(status, st)
        cache = kv_cache.free(cache, _slot_vector(cache, old, jnp.ones((w,), bool)))
        hist = hist[parent].at[:, t].set(tok)
        # A shared partly filled last page is copied here (copy-on-write).
        cache, st = kv_cache.reserve(cache, _slot_vector(cache, new, jnp.ones((w,), jnp.int32)))
        status = _first_error(status, st)
        ok = jnp.broadcast_to(st.ok, (w,))
        logits, cache = model.apply(
            params, tok[:, None], jnp.broadcast_to(prompt_len + t, (w, 1)).astype(jnp.int32),
            cache, q_lengths=ok.astype(jnp.int32), seq_ids=new, impl=impl)
        return cache, w - base, top, hist, logits[:, 0], status

    scores = jnp.full((w,), -1e9, jnp.float32).at[0].set(0.0)  # all beams start as one
    hist = jnp.full((w, steps), -1, jnp.int32)
    init = (cache, jnp.int32(0), scores, hist, jnp.repeat(last_logits, w, axis=0),
            _ok_status(cache))
    cache, base, scores, hist, _, status = jax.lax.fori_loop(0, steps, body, init)
    return cache, base, scores, hist, status


def beam_search(
    model: Model,
    params,
    prompt: Sequence[int],
    *,
    beam_width: int,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int | None = None,
    cache_dtype="float32",
    chunk_size: int = 256,
    impl: str = "auto",
    keep_cache: bool = False,
    check: bool = True,
) -> BeamResult:
    """Beam search over summed log-probabilities, with beams sharing pages.

    Every step each beam forks its parent (no page is copied), the old beams are
    freed, and the one shared partly filled last page is copied on the next
    write. All beams run exactly `max_new_tokens` steps (no EOS handling), so
    ranking by summed log-probability equals transformers' ranking at any
    length penalty.

    Args:
      model, params: the model and its params.
      prompt: token ids of one prompt.
      beam_width: beams kept per step.
      max_new_tokens: tokens to generate.
      page_size, num_pages, cache_dtype, chunk_size, impl: as in `generate`.
      keep_cache: keep the final beams' sequences in the returned cache (their
        slots are not reordered like `tokens`); by default they are freed.
      check: raise `CacheFullError` on an allocation failure.
    """
    if not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive int, got {beam_width!r}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    tokens, lengths, chunk = pad_prompts([prompt], chunk_size)
    total = len(prompt) + max_new_tokens
    pages_per_seq = -(-total // page_size)
    spec = default_cache_spec(
        model, num_seqs=2 * beam_width, max_tokens=total, page_size=page_size,
        num_pages=num_pages or pages_per_seq + 2 * beam_width * (pages_per_seq + 1),
        dtype=cache_dtype)
    cache = kv_cache.init_cache(spec)
    cache, last_logits, status, _ = prefill(
        model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
        jnp.zeros((1,), jnp.int32), chunk_size=chunk, impl=impl)
    if check:
        status.raise_if_error()
    cache, base, scores, hist, status = _beam_loop(
        model, params, cache, last_logits, jnp.int32(len(prompt)), beam_width=beam_width,
        steps=max_new_tokens, impl=impl)
    if check:
        status.raise_if_error()
    if not keep_cache:
        slots = jnp.zeros((spec.max_seqs,), bool).at[base + jnp.arange(beam_width)].set(True)
        cache = kv_cache.free(cache, slots)
    order = np.argsort(-np.asarray(scores), kind="stable")
    return BeamResult(tokens=np.asarray(hist)[order], scores=np.asarray(scores)[order],
                      cache=cache, status=status)
