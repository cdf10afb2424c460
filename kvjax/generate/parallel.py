"""Several continuations of one prompt on shared pages: parallel sampling and beam search.

Both prefill a prompt once and `kvjax.cache.fork` its sequence: the forks
point at the prompt's pages (reference counts go up, nothing is copied). When
a fork first writes into the shared, partly filled last page, `reserve`
copies that one page (copy-on-write); full prompt pages stay shared for the
whole generation. On a KIVI cache the quantized pages stay shared (they are
immutable) and each fork gets its own copy of the full-precision tail. A cache
policy's per-slot state follows the forks (`CachePolicy.fork_state`).

Both take the same `cache` (an existing cache or a `CacheConfig`), `impl` and
`policy` arguments as `kvjax.generate.generate` and run the same step function.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache.page_table import AllocStatus, CacheFullError
from kvjax.cache.policies.base import CachePolicy, to_slots
from kvjax.generate import setup
from kvjax.generate.loop import (
    GREEDY,
    CacheConfig,
    GenerateResult,
    _prefill,
    _request,
    _slot_vector,
    decode_loop,
    decode_params,
    first_error,
    ok_status,
    raise_if_error,
    run_model,
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
    src, dst = _fork_pairs(prompt_slots, n)
    if n == 1:
        return cache, ok_status(cache)
    return kv_cache.fork(cache, jnp.asarray(src), jnp.asarray(dst))


def _fork_pairs(prompt_slots, n: int):
    slots = np.asarray(prompt_slots, np.int32)
    src = np.repeat(slots, n - 1)
    dst = (slots[:, None] + np.arange(1, n, dtype=np.int32)[None, :]).reshape(-1)
    return src, dst


def sample_keys(key, num_prompts: int, n: int) -> jax.Array:
    """Row keys of `sample_n`: sample j of prompt p uses fold_in(as_keys(key, P)[p], j).

    Generating prompt p alone with `key=sample_keys(...)[p * n + j][None]`
    reproduces that sample.
    """
    per_prompt = as_keys(key, num_prompts)
    return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(n)))(
        per_prompt).reshape(-1)


def _data_shards(cache, impl) -> int:
    plan = cache.plan if isinstance(cache, CacheConfig) else getattr(impl, "plan", None)
    return 1 if plan is None else plan.data_shards


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
    cache: kv_cache.PagedKVCache | CacheConfig | None = None,
    chunk_size: int = 256,
    free_finished: bool = True,
    impl="auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> GenerateResult:
    """`n` samples per prompt; each prompt is prefilled once and its pages shared by all n.

    Rows of the result are prompt-major: row p * n + j is sample j of prompt p (slot
    p * n + j of the cache), drawn with key `sample_keys(key, len(prompts), n)[p * n + j]`.

    Args: as in `kvjax.generate.generate`, plus `n` (samples per prompt). A built cache
    has `len(prompts) * n` slots (rounded so that each prompt's samples share a data
    shard) and pages for every row's full length (an upper bound; sharing leaves part
    of it unused); a given cache needs those slots empty.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}.")
    num_prompts = len(prompts)
    setup.check_sampling(sampling)
    eos_ids = setup.check_eos(eos_ids, model.vocab_size)
    keys = sample_keys(key, num_prompts, n)
    d = _data_shards(cache, impl)
    slots = num_prompts * n
    padded = -(-num_prompts // d) * d * n
    prompt_slots = np.arange(num_prompts, dtype=np.int32) * n
    req = _request(model, params, prompts, max_new_tokens=max_new_tokens, cache=cache,
                   seq_ids=prompt_slots, chunk_size=chunk_size, impl=impl, policy=policy,
                   num_seqs=padded)
    policy = req.policy
    if slots > req.cache.spec.max_seqs or np.any(np.asarray(req.cache.lengths)[:slots] > 0):
        raise ValueError(f"sample_n needs {slots} empty slots (0 .. {slots - 1}) in the cache.")
    cache, last_logits, status, pstate, positions = _prefill(model, req, policy=policy,
                                                             check=check)
    if n > 1:
        src, dst = _fork_pairs(prompt_slots, n)
        cache, fork_status = kv_cache.fork(cache, src, dst)
        fork_status.raise_if_error()
        if policy is not None:
            pstate = policy.fork_state(pstate, jnp.asarray(src), jnp.asarray(dst))
    max_new = jnp.full((slots,), req.max_new[0], jnp.int32)
    state = start(
        cache, jnp.arange(slots, dtype=jnp.int32), jnp.repeat(last_logits, n, axis=0),
        jnp.repeat(positions, n), keys, max_new, status,
        sampling=sampling, eos_ids=eos_ids, max_len=int(req.max_new[0]),
        free_finished=free_finished, policy_state=pstate)
    state = decode_loop(model, decode_params(model, req.params, slots), state,
                        sampling=sampling, eos_ids=eos_ids, free_finished=free_finished,
                        impl=req.impl, policy=policy)
    if check:
        raise_if_error(state)
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


@functools.partial(jax.jit, static_argnames=("model", "beam_width", "steps", "impl", "policy"),
                   donate_argnames="cache")
def _beam_loop(model, params, cache, last_logits, prompt_len, pstate, *, beam_width: int,
               steps: int, impl, policy):
    """The beam loop; beams live in slots [0, W) and [W, 2W), alternating every step."""
    w = beam_width
    vocab = last_logits.shape[-1]
    lane = jnp.arange(w, dtype=jnp.int32)

    def body(t, carry):
        cache, base, scores, hist, logits, status, pstate = carry
        cand = scores[:, None] + jax.nn.log_softmax(logits, axis=-1)
        top, idx = jax.lax.top_k(cand.reshape(-1), w)
        parent, tok = idx // vocab, (idx % vocab).astype(jnp.int32)
        old, new = base + lane, (w - base) + lane
        # New beam i shares every page of its parent; dropping the old beams
        # releases the pages of parents nobody chose.
        cache, st = kv_cache.fork(cache, old[parent], new)
        status = first_error(status, st)
        if policy is not None:
            pstate = policy.fork_state(pstate, old[parent], new)
        cache = kv_cache.free(cache, _slot_vector(cache, old, jnp.ones((w,), bool)))
        hist = hist[parent].at[:, t].set(tok)
        positions = jnp.broadcast_to(prompt_len + t, (w, 1)).astype(jnp.int32)
        if policy is not None:  # rotary positions may count cache slots (before reserve)
            positions = policy.rope_positions(cache, pstate,
                                              to_slots(cache, new, positions))[new]
        # A shared partly filled last page is copied here (copy-on-write).
        cache, st = kv_cache.reserve(cache, _slot_vector(cache, new, jnp.ones((w,), jnp.int32)))
        status = first_error(status, st)
        ok = jnp.broadcast_to(st.ok, (w,))
        logits, cache, queries = run_model(model, params, cache, tok[:, None], positions,
                                           q_lengths=ok.astype(jnp.int32), seq_ids=new,
                                           impl=impl, policy=policy, pstate=pstate)
        if policy is not None:
            cache, pstate, pst = policy.after_step(
                cache, pstate, to_slots(cache, new, queries[:, :, 0], axis=1),
                _slot_vector(cache, new, ok))
            status = first_error(status, pst)
        return cache, w - base, top, hist, logits[:, 0], status, pstate

    scores = jnp.full((w,), -1e9, jnp.float32).at[0].set(0.0)  # all beams start as one
    hist = jnp.full((w, steps), -1, jnp.int32)
    init = (cache, jnp.int32(0), scores, hist, jnp.repeat(last_logits, w, axis=0),
            ok_status(cache), pstate)
    cache, base, scores, hist, _, status, _ = jax.lax.fori_loop(0, steps, body, init)
    return cache, base, scores, hist, status


def beam_search(
    model: Model,
    params,
    prompt: Sequence[int],
    *,
    beam_width: int,
    max_new_tokens: int,
    cache: kv_cache.PagedKVCache | CacheConfig | None = None,
    chunk_size: int = 256,
    impl="auto",
    policy: CachePolicy | None = None,
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
      cache: a `CacheConfig` for a fresh cache (default float32), or an existing cache
        whose slots 0 .. 2 * beam_width - 1 are empty (the beams use them).
      chunk_size, impl, policy: as in `generate`.
      keep_cache: keep the final beams' sequences in the returned cache (their
        slots are not reordered like `tokens`); by default they are freed.
      check: raise `CacheFullError` on an allocation failure.
    """
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive int, got {beam_width!r}.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    w = beam_width
    d = _data_shards(cache, impl)
    if isinstance(cache, CacheConfig) or cache is None:
        config = cache or CacheConfig()
        ps = config.page_size
        pages_per_seq = -(-(len(prompt) + max_new_tokens) // ps) + (config.quant is not None)
        if config.num_pages is None:  # the prompt + every beam's pages, with room to fork
            per_group = pages_per_seq + 2 * w * (pages_per_seq + 1)
            cache = dataclasses.replace(config, num_pages=per_group * d)
    req = _request(model, params, [prompt], max_new_tokens=max_new_tokens, cache=cache,
                   seq_ids=[0], chunk_size=chunk_size, impl=impl, policy=policy,
                   num_seqs=2 * w * d)
    policy = req.policy
    if req.cache.spec.max_seqs < 2 * w or np.any(np.asarray(req.cache.lengths)[:2 * w] > 0):
        raise ValueError(f"beam_search needs {2 * w} empty slots (0 .. {2 * w - 1}) in the "
                         f"cache.")
    if d > 1 and req.cache.spec.max_seqs // d < 2 * w:
        raise ValueError(f"beam_search: the beams' {2 * w} slots must share a data shard; the "
                         f"cache's shards hold {req.cache.spec.max_seqs // d} slots each.")
    cache, last_logits, status, pstate, _ = _prefill(model, req, policy=policy, check=check)
    cache, base, scores, hist, status = _beam_loop(
        model, req.params, cache, last_logits, jnp.int32(len(prompt)), pstate, beam_width=w,
        steps=max_new_tokens, impl=req.impl, policy=policy)
    if check:
        try:
            status.raise_if_error()
        except CacheFullError as err:
            err.cache = cache
            raise
    if not keep_cache:
        slots = jnp.zeros((cache.spec.max_seqs,), bool).at[base + jnp.arange(w)].set(True)
        cache = kv_cache.free(cache, slots)
    order = np.argsort(-np.asarray(scores), kind="stable")
    return BeamResult(tokens=np.asarray(hist)[order], scores=np.asarray(scores)[order],
                      cache=cache, status=status)

