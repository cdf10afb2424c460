"""Pure-functional generation on the paged cache: chunked prefill, one decode step, the loop.

    result = generate(model, params, [[1, 5, 9], [1, 7]], key=jax.random.key(0),
                      max_new_tokens=32, sampling=SamplingConfig(temperature=0.8, top_p=0.9),
                      cache=CacheConfig(dtype="bfloat16", quant=QuantSpec(bits=2)),
                      policy=H2O(budget=512))

This is kvjax's one decode engine: every page kind (full-precision K/V, MLA latents,
KIVI-quantized pages with their tail), every cache policy and every sharding plan go
through the same step function, for every model family.

Pieces, each usable alone:
  * `prefill`: runs prompts through the model chunk by chunk (a `lax.scan`
    over chunks, so a long prompt never needs one giant activation), reserving
    pages as it goes and calling the policy's `after_prefill` after each chunk;
    returns each row's last-token logits.
  * `start`: samples the first new token from those logits into a `DecodeState`.
  * `decode_step`: one token for every unfinished row: reserve one slot per
    row (pages are allocated as sequences grow), run the model (the policy picks
    the pages each layer reads), hand the cache to the policy (eviction), sample
    (or take the forced token: teacher forcing), apply the per-row EOS and length
    stops, and free the pages of rows that just finished.
  * `decode_loop`: `decode_step` in a `lax.while_loop`: one compiled program,
    the state (and the cache in it) donated.
  * `generate` / `stream` / `score`: host drivers over the same step function
    (`stream` yields each step's tokens; `score` feeds given continuations and
    returns their log-probabilities, all in one compiled loop).

Running out of pages is not an exception inside jit: `DecodeState.status`
keeps the first failed `AllocStatus`, every row stops, and the host drivers
raise `CacheFullError` (unless `check=False`) with the final cache attached as
`err.cache`, so no sequence is lost.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import backends
from kvjax import cache as kv_cache
from kvjax.cache.page_table import AllocStatus, CacheFullError
from kvjax.cache.policies.base import CachePolicy, to_slots
from kvjax.generate import setup
from kvjax.generate.sampling import RowSampling, SamplingConfig, as_keys, sample, sample_rows
from kvjax.generate.setup import CacheConfig
from kvjax.models.base import Model, Packing
from kvjax.sharding import ShardedAttention, cache_shardings

__all__ = [
    "CacheConfig",
    "CachePolicy",
    "GREEDY",
    "DecodeState",
    "GenerateResult",
    "ScoreResult",
    "StreamEvent",
    "prefill",
    "prefill_packed",
    "start",
    "decode_step",
    "decode_params",
    "decode_loop",
    "generate",
    "stream",
    "score",
    "pad_prompts",
    "ok_status",
    "first_error",
    "is_eos",
    "StepLogprobs",
    "step_logprobs",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities of one step's tokens under the model (`step_logprobs`).

    Attributes:
      chosen: float32[batch], log p(the token each row took).
      top_ids: int32[batch, k], the k most likely tokens, most likely first.
      top: float32[batch, k], their log-probabilities (descending).
    """

    chosen: Float[Array, " batch"]
    top_ids: Int[Array, "batch k"]
    top: Float[Array, "batch k"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (a pytree; the jitted entry points donate it).

    Attributes:
      cache: the paged cache (any page kind).
      seq_ids: int32[batch], cache slot of each row.
      last: int32[batch], the last token of each row (not yet in the cache).
      position: int32[batch], RoPE position of `last`.
      tokens: int32[batch, max_new], the rows' tokens; entries past `num_generated` are -1.
      num_generated: int32[batch], tokens produced so far (an EOS counts).
      max_new: int32[batch], per-row limit on produced tokens.
      done: bool[batch], row finished (EOS, its limit, or an allocation failure).
      keys: typed PRNG keys [batch]; step i of a row samples with fold_in(key, i).
      status: the first failed allocation, or OK.
      step: int32[], decode steps run.
      policy_state: the cache policy's state (None without a policy).
      forced: int32[batch, max_new] or None: token i of a row is `forced[:, i]` where it
        is >= 0 instead of a sample (teacher forcing; an EOS there does not stop the row).
      logprobs: float32[batch, max_new] or None: log-probability of each row's token i
        under the model (filled when `forced` is set).
      row_sampling: per-row sampling settings (`RowSampling`), used instead of the step's
        static `sampling` when set (the serving engine's rows each sample their own way).
      step_logprobs: a `StepLogprobs` or None: when set, each decode step replaces it with
        the log-probabilities of the tokens it took and the k most likely ones (k: its
        width), from the step's raw logits (before temperature, top-k or top-p).
    """

    cache: kv_cache.PagedKVCache
    seq_ids: Int[Array, " batch"]
    last: Int[Array, " batch"]
    position: Int[Array, " batch"]
    tokens: Int[Array, "batch max_new"]
    num_generated: Int[Array, " batch"]
    max_new: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    keys: jax.Array
    status: AllocStatus
    step: Int[Array, ""]
    policy_state: Any = None
    forced: Int[Array, "batch max_new"] | None = None
    logprobs: Float[Array, "batch max_new"] | None = None
    row_sampling: RowSampling | None = None
    step_logprobs: StepLogprobs | None = None


def step_logprobs(logits: Float[Array, "batch vocab"], tokens: Int[Array, " batch"],
                  k: int) -> StepLogprobs:
    """The log-softmax (in float32) of raw `logits` at `tokens` and its top `k` (static)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(lp, k)
    chosen = jnp.take_along_axis(lp, tokens[:, None].astype(jnp.int32), axis=1)[:, 0]
    return StepLogprobs(chosen=chosen, top_ids=top_ids.astype(jnp.int32), top=top)


def ok_status(cache) -> AllocStatus:
    """A success status for `cache` (its free count summed over a sharded pool's shards)."""
    return AllocStatus(code=jnp.int32(0), pages_needed=jnp.int32(0),
                       pages_free=jnp.sum(cache.table.num_free, dtype=jnp.int32))


def first_error(old: AllocStatus, new: AllocStatus) -> AllocStatus:
    """`old` if it records an error, else `new`: the first failure of a sequence of ops."""
    keep = old.code != 0
    return jax.tree.map(lambda a, b: jnp.where(keep, a, b), old, new)


def _slot_vector(cache, seq_ids, values):
    """Scatters per-row values into a max_seqs vector (zeros elsewhere)."""
    return jnp.zeros((cache.spec.max_seqs,), values.dtype).at[seq_ids].set(values)


def _selector(policy: CachePolicy | None, pstate, seq_ids) -> Callable | None:
    """The models' `select` hook: the policy's page selection, queries given in slot order."""
    if policy is None:
        return None

    def select(cache, layer, q):
        return policy.before_attention(cache, pstate, layer, to_slots(cache, seq_ids, q))

    return select


def run_model(model: Model, params, cache, tokens, positions, *, q_lengths, seq_ids, impl,
              policy, pstate, logits_at=None):
    """One forward with the policy's selection; returns (logits, cache, queries or None);
    logits at every token, or at the tokens `logits_at` names ([batch, k])."""
    out = model.apply(params, tokens, positions, cache, q_lengths=q_lengths, seq_ids=seq_ids,
                      impl=impl, select=_selector(policy, pstate, seq_ids),
                      observe=policy is not None, logits_at=logits_at)
    return out if policy is not None else (*out, None)


@functools.partial(jax.jit, static_argnames=("model", "chunk_size", "impl", "return_logits",
                                             "policy"),
                   donate_argnames="cache")
def prefill(
    model: Model,
    params,
    cache: kv_cache.PagedKVCache,
    tokens: Int[Array, "batch prompt_len"],
    prompt_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"],
    *,
    chunk_size: int,
    impl="auto",
    return_logits: bool = False,
    policy: CachePolicy | None = None,
    policy_state=None,
    start_positions: Int[Array, " batch"] | None = None,
):
    """Appends prompts to sequences `seq_ids`, `chunk_size` tokens at a time.

    Rows continue their sequences: a row whose slot already holds L tokens gets
    positions L, L+1, ... (empty slots start at 0), or `start_positions`, ... when given.

    Args:
      model: the model bundle (static).
      params: its params.
      cache: the paged cache, any page kind (donated).
      tokens: int32[batch, prompt_len], prompts padded on the right; prompt_len
        must be a multiple of chunk_size.
      prompt_lengths: int32[batch], real tokens per row (>= 1).
      seq_ids: int32[batch], distinct cache slots of the rows.
      chunk_size: tokens per chunk (static).
      impl: attention implementation (static).
      return_logits: also return the logits at every prompt position (static).
      policy: optional cache policy (static); its `after_prefill` runs after
        each chunk, so prompt compressors (SnapKV, PyramidKV) see the whole
        prompt only when it fits one chunk.
      policy_state: the policy's state (from `policy.init_state(cache)`).
      start_positions: int32[batch], position of each row's first token (default: the
        tokens its slot holds; a driver that prefills a prompt over several calls
        passes the tokens fed so far, which eviction may have made more than held).

    Returns:
      (cache, last_logits float32[batch, vocab], status, all_logits or None, policy_state):
      `last_logits[b]` predicts the token after row b's prompt; `all_logits` is
      float32[batch, prompt_len, vocab] when asked for. On an allocation failure the
      remaining chunks are skipped and `status` says why.
    """
    batch, prompt_len = tokens.shape
    if prompt_len % chunk_size:
        raise ValueError(f"prefill: prompt_len {prompt_len} must be a multiple of chunk_size "
                         f"{chunk_size}; pad the prompts (see pad_prompts).")
    n_chunks = prompt_len // chunk_size
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    base = (cache.lengths[seq_ids] if start_positions is None
            else jnp.asarray(start_positions, jnp.int32))
    chunks = tokens.reshape(batch, n_chunks, chunk_size).transpose(1, 0, 2)
    offsets = jnp.arange(chunk_size, dtype=jnp.int32)
    rows = jnp.arange(batch)

    def body(carry, xs):
        cache, last_logits, status, ok, pstate = carry
        c, chunk = xs
        start_tok = c * chunk_size
        q_lengths = jnp.where(ok, jnp.clip(prompt_lengths - start_tok, 0, chunk_size), 0)
        positions = base[:, None] + start_tok + offsets[None, :]
        if policy is not None:  # rotary positions may count cache slots (before reserve)
            positions = policy.rope_positions(
                cache, pstate, to_slots(cache, seq_ids, positions))[seq_ids]
        cache, st = kv_cache.reserve(cache, _slot_vector(cache, seq_ids, q_lengths))
        status = first_error(status, st)
        q_lengths = jnp.where(st.ok, q_lengths, 0)
        idx = prompt_lengths - 1 - start_tok
        here = (idx >= 0) & (idx < chunk_size) & st.ok
        last = jnp.clip(idx, 0, chunk_size - 1)
        # Only each row's last prompt token needs the LM head, unless all logits are asked.
        logits, cache, queries = run_model(model, params, cache, chunk, positions,
                                           q_lengths=q_lengths, seq_ids=seq_ids, impl=impl,
                                           policy=policy, pstate=pstate,
                                           logits_at=None if return_logits else last[:, None])
        if policy is not None:
            cache, pstate, pst = policy.after_prefill(
                cache, pstate, to_slots(cache, seq_ids, queries, axis=1),
                _slot_vector(cache, seq_ids, q_lengths))
            status = first_error(status, pst)
        row = logits[rows, last] if return_logits else logits[:, 0]
        last_logits = jnp.where(here[:, None], row, last_logits)
        ok = ok & st.ok & (status.code == 0)
        return (cache, last_logits, status, ok, pstate), (logits if return_logits else None)

    init = (cache, jnp.zeros((batch, model.vocab_size), jnp.float32), ok_status(cache),
            jnp.bool_(True), policy_state)
    (cache, last_logits, status, _, policy_state), all_logits = jax.lax.scan(
        body, init, (jnp.arange(n_chunks, dtype=jnp.int32), chunks))
    if return_logits:
        all_logits = all_logits.transpose(1, 0, 2, 3).reshape(batch, prompt_len, -1)
    return cache, last_logits, status, all_logits, policy_state


@functools.partial(jax.jit, static_argnames=("model", "impl"), donate_argnames="cache")
def prefill_packed(
    model: Model,
    params,
    cache: kv_cache.PagedKVCache,
    tokens: Int[Array, "1 tokens"],
    packing: Packing,
    lengths: Int[Array, " sequences"],
    seq_ids: Int[Array, " sequences"],
    start_positions: Int[Array, " sequences"],
    *,
    impl="auto",
):
    """Appends the next tokens of several sequences, packed end to end in one row, in one
    forward: the matmuls run on the row's tokens (no lane padded to a common width), the
    cache's writes and attention on one row per sequence (`Packing`). For a model whose
    forward packs (`Model.packs`), without a cache policy.

    Args:
      model, params: the model (static) and its params.
      cache: the paged cache (donated).
      tokens: int32[1, tokens]: sequence i's tokens at the packing's offsets.
      packing: where each sequence's tokens lie in the row (`Packing.of`).
      lengths: int32[sequences], the tokens of each (0: an idle sequence, writes nothing).
      seq_ids: int32[sequences], distinct cache slots.
      start_positions: int32[sequences], the position of each one's first token (the
        tokens its slot holds).

    Returns:
      (cache, last_logits float32[sequences, vocab], status): `last_logits[i]` predicts
      the token after sequence i's last token here; on an allocation failure nothing is
      written and `status` says why.
    """
    n, w = packing.gather.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    cache, status = kv_cache.reserve(cache, _slot_vector(cache, seq_ids, lengths))
    lengths = jnp.where(status.ok, lengths, 0)
    row, t = packing.scatter // w, packing.scatter % w
    positions = (jnp.asarray(start_positions, jnp.int32)[row] + t)[None]
    last = packing.gather[jnp.arange(n), jnp.maximum(lengths - 1, 0)]
    logits, cache = model.apply(params, tokens, positions, cache, q_lengths=lengths,
                                seq_ids=seq_ids, impl=impl, logits_at=last[None],
                                packing=packing)
    return cache, logits[0], status


def is_eos(tok, eos_ids: tuple[int, ...]):
    """Whether each token of `tok` [n] is one of `eos_ids` (static), bool[n]."""
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=1)


def _free_rows(cache, seq_ids, rows_mask):
    mask = _slot_vector(cache, seq_ids, rows_mask)
    return jax.lax.cond(jnp.any(rows_mask), lambda c: kv_cache.free(c, mask), lambda c: c, cache)


def _pick(logits, keys, count, sampling, forced, logprobs, row_sampling=None):
    """The next token of each row: sampled (with the step's settings, or each row's own
    when `row_sampling` is set), or forced (teacher forcing, with its log-prob)."""
    step_keys = jax.vmap(jax.random.fold_in)(keys, count)
    if row_sampling is None:
        tok = sample(logits, step_keys, sampling)
    else:
        tok = sample_rows(logits, step_keys, row_sampling)
    if forced is None:
        return tok, jnp.zeros(tok.shape, bool), logprobs
    col = jnp.clip(count, 0, forced.shape[1] - 1)
    f = forced[jnp.arange(tok.shape[0]), col]
    is_forced = f >= 0
    tok = jnp.where(is_forced, f, tok)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=1)[:, 0]
    return tok, is_forced, lp


@functools.partial(jax.jit, static_argnames=("sampling", "eos_ids", "max_len", "free_finished"),
                   donate_argnames="cache")
def start(
    cache: kv_cache.PagedKVCache,
    seq_ids: Int[Array, " batch"],
    last_logits: Float[Array, "batch vocab"],
    positions: Int[Array, " batch"],
    keys: jax.Array,
    max_new: Int[Array, " batch"],
    status: AllocStatus,
    *,
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...] = (),
    max_len: int,
    free_finished: bool = True,
    policy_state=None,
    forced: Int[Array, "batch max_len"] | None = None,
) -> DecodeState:
    """Takes each row's first new token from its prompt logits; returns the loop state.

    Args:
      cache: the cache after `prefill` (donated).
      seq_ids: int32[batch] slots of the rows.
      last_logits: float32[batch, vocab] from `prefill`.
      positions: int32[batch], RoPE position the first new token will take
        (the prompt's end).
      keys: typed PRNG keys [batch], one per row.
      max_new: int32[batch] per-row token limits (1 <= max_new <= max_len).
      status: the prefill's status; a failure marks every row done.
      sampling, eos_ids: how to sample and which tokens stop a row (static).
      max_len: width of the token buffer (static).
      free_finished: free a row's pages as soon as it finishes (static).
      policy_state: the cache policy's state after prefill (None without a policy).
      forced: int32[batch, max_len] tokens to feed instead of samples where >= 0
        (teacher forcing); their log-probabilities are recorded in `logprobs`.
    """
    batch = seq_ids.shape[0]
    ok = status.code == 0
    zero = jnp.zeros((batch,), jnp.int32)
    logprobs = None if forced is None else jnp.zeros((batch, max_len), jnp.float32)
    tok, is_forced, lp = _pick(last_logits, keys, zero, sampling, forced, logprobs)
    tokens = jnp.full((batch, max_len), -1, jnp.int32).at[:, 0].set(jnp.where(ok, tok, -1))
    if forced is not None:
        logprobs = logprobs.at[:, 0].set(lp)
    num = jnp.where(ok, 1, 0).astype(jnp.int32) * jnp.ones((batch,), jnp.int32)
    finished = ok & ((is_eos(tok, eos_ids) & ~is_forced) | (num >= max_new))
    if free_finished:
        cache = _free_rows(cache, seq_ids, finished)
    return DecodeState(
        cache=cache, seq_ids=jnp.asarray(seq_ids, jnp.int32), last=tok,
        position=jnp.asarray(positions, jnp.int32), tokens=tokens, num_generated=num,
        max_new=jnp.asarray(max_new, jnp.int32), done=finished | ~ok, keys=keys, status=status,
        step=jnp.int32(0), policy_state=policy_state, forced=forced, logprobs=logprobs,
    )


def decode_step(
    model: Model,
    params,
    state: DecodeState,
    *,
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...] = (),
    free_finished: bool = True,
    impl="auto",
    policy: CachePolicy | None = None,
) -> DecodeState:
    """One new token for every unfinished row (pure; see `decode_loop` for the jitted loop).

    Reserves one cache slot per active row (a failed reservation stops every
    row and is kept in `state.status`), feeds each row's `last` token, lets
    `policy` (if any) pick the pages each layer reads and then act on the cache,
    samples (or takes the forced token), appends, applies the EOS and per-row
    length stops and frees the pages of rows that finished.
    """
    cache = state.cache
    batch = state.seq_ids.shape[0]
    active = ~state.done
    positions = state.position[:, None]
    pstate = state.policy_state
    if policy is not None:  # rotary positions may count cache slots (before reserve)
        positions = policy.rope_positions(
            cache, pstate, to_slots(cache, state.seq_ids, positions))[state.seq_ids]
    cache, st = kv_cache.reserve(
        cache, _slot_vector(cache, state.seq_ids, active.astype(jnp.int32)))
    run = active & st.ok
    logits, cache, queries = run_model(model, params, cache, state.last[:, None], positions,
                                       q_lengths=run.astype(jnp.int32), seq_ids=state.seq_ids,
                                       impl=impl, policy=policy, pstate=pstate)
    if policy is not None:
        cache, pstate, pst = policy.after_step(
            cache, pstate, to_slots(cache, state.seq_ids, queries[:, :, 0], axis=1),
            _slot_vector(cache, state.seq_ids, run))
        st = first_error(st, pst)
        run = run & pst.ok
    tok, is_forced, lp = _pick(logits[:, 0], state.keys, state.num_generated, sampling,
                               state.forced, state.logprobs, state.row_sampling)
    max_len = state.tokens.shape[1]
    col = jnp.where(run, state.num_generated, max_len)  # out of range: dropped
    rows = jnp.arange(batch)
    tokens = state.tokens.at[rows, col].set(tok, mode="drop")
    logprobs = state.logprobs
    if logprobs is not None:
        logprobs = logprobs.at[rows, col].set(lp, mode="drop")
    taken = state.step_logprobs
    if taken is not None:
        taken = step_logprobs(logits[:, 0], tok, taken.top.shape[1])
    num = state.num_generated + run.astype(jnp.int32)
    finished = run & ((is_eos(tok, eos_ids) & ~is_forced) | (num >= state.max_new))
    if free_finished:
        cache = _free_rows(cache, state.seq_ids, finished)
    if isinstance(impl, ShardedAttention):
        # The pools keep the plan's layout: a step compiled alone (`stream`) leaves XLA free
        # to choose its output's, and it replicated an MLA bf16 pool after H2O's compaction.
        cache = dataclasses.replace(cache, pages=jax.lax.with_sharding_constraint(
            cache.pages, cache_shardings(impl.plan, cache.spec).pages))
    return dataclasses.replace(
        state, cache=cache, last=jnp.where(run, tok, state.last),
        position=state.position + run.astype(jnp.int32), tokens=tokens, num_generated=num,
        done=state.done | finished | ~st.ok, status=first_error(state.status, st),
        step=state.step + 1, policy_state=pstate, logprobs=logprobs, step_logprobs=taken,
    )


GREEDY = SamplingConfig()

_STEP_STATIC = ("model", "sampling", "eos_ids", "free_finished", "impl", "policy")


@functools.partial(jax.jit, static_argnames=_STEP_STATIC, donate_argnames="state")
def decode_loop(model: Model, params, state: DecodeState, *, sampling: SamplingConfig,
                eos_ids: tuple[int, ...] = (), free_finished: bool = True, impl="auto",
                policy: CachePolicy | None = None) -> DecodeState:
    """Runs `decode_step` until every row is done, as one compiled `lax.while_loop`.

    Args:
      model, params: the model (static) and its params.
      state: from `start` (donated: use the returned state and its cache).
      sampling, eos_ids, free_finished, impl, policy: as in `decode_step` (static).

    Returns:
      The final state: `tokens`, `num_generated`, the cache and `status`.
    """
    step = functools.partial(decode_step, model, params, sampling=sampling, eos_ids=eos_ids,
                             free_finished=free_finished, impl=impl, policy=policy)
    return jax.lax.while_loop(lambda s: jnp.any(~s.done), step, state)


decode_step_jit = jax.jit(decode_step, static_argnames=_STEP_STATIC, donate_argnames="state")


# ----------------------------------------------------------------------------- host drivers


def pad_prompts(prompts: Sequence[Sequence[int]], chunk_size: int) -> tuple[np.ndarray, np.ndarray,
                                                                              int]:
    """Right-pads prompts into int32[batch, T] with T a multiple of the chunk actually used.

    Returns (tokens, lengths, chunk): chunk is `chunk_size`, or less for short
    prompts (the longest prompt rounded up to a multiple of 8), so tiny
    prompts do not pay for a full chunk.
    """
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt.")
    chunk_size = setup.check_chunk(chunk_size)
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths < 1).any():
        raise ValueError(f"every prompt needs at least one token; lengths are {lengths.tolist()}.")
    longest = int(lengths.max())
    chunk = min(chunk_size, -(-longest // 8) * 8)
    width = -(-longest // chunk) * chunk
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return tokens, lengths, chunk


def decode_params(model: Model, params, rows: int = 1):
    """The params the decode loop runs with, for `rows` sequences per step.

    A family's stacked layer weights become one array per layer
    (`Model.unstack_layers`) when the backend's matmul reads per-layer weights faster
    than slices of a stack for this many rows (`kvjax.backends.prefers_unstacked`:
    on CPU, XLA copies each layer's slice out of the stack inside a `lax.scan`);
    otherwise the params are returned as they are.
    """
    if model.unstack_layers is None:
        return params
    layers = getattr(params, "layers", None)
    if layers is None or isinstance(layers, tuple):
        return params
    if not backends.prefers_unstacked(layers, rows):
        return params
    return model.unstack_layers(params)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What `generate` returns.

    Attributes:
      tokens: int32[batch, max_new_tokens] (NumPy) sampled tokens, -1 past each row's end.
      num_generated: int32[batch] tokens per row (an EOS included).
      cache: the final cache (finished rows' pages freed when free_finished).
      status: the first allocation failure or OK.
      state: the final `DecodeState` (its cache is `cache`).
    """

    tokens: np.ndarray
    num_generated: np.ndarray
    cache: kv_cache.PagedKVCache
    status: AllocStatus
    state: DecodeState

    def sequences(self) -> list[list[int]]:
        return [self.tokens[i, : n].tolist() for i, n in enumerate(self.num_generated)]


def raise_if_error(state: DecodeState) -> None:
    """`CacheFullError` for a failed allocation, with the final cache as `err.cache`."""
    try:
        state.status.raise_if_error()
    except CacheFullError as err:
        err.cache, err.state = state.cache, state
        raise


@dataclasses.dataclass(frozen=True)
class _Request:
    """A checked request, ready for prefill (host-side)."""

    cache: kv_cache.PagedKVCache
    impl: Any
    params: Any
    seq_ids: jax.Array
    tokens: np.ndarray
    lengths: np.ndarray
    chunk: int
    max_new: np.ndarray
    forced: np.ndarray | None
    policy_state: Any
    policy: Any = None  # the policy bound to the model (`setup.check_policy_model`)


def _request(model, params, prompts, *, max_new_tokens, cache, seq_ids, chunk_size, impl,
             policy, prefill_mode="chunked", continuations=None, num_seqs=None,
             extra_tokens=0) -> _Request:
    """Checks a request and builds its cache; nothing is donated yet."""
    setup.check_policy(policy)
    if prefill_mode not in ("chunked", "step"):
        raise ValueError(f"prefill must be 'chunked' or 'step', got {prefill_mode!r}.")
    prompts = setup.check_prompts(prompts, model.vocab_size)
    batch = len(prompts)
    if continuations is not None:
        conts = setup.check_prompts(continuations, model.vocab_size, "continuation")
        if len(conts) != batch:
            raise ValueError(f"{batch} prompts but {len(conts)} continuations.")
        max_new = np.array([len(c) for c in conts], np.int32)
    else:
        conts = None
        max_new = setup.max_new_vector(max_new_tokens, batch)
    forced_prompt = [p[1:] for p in prompts] if prefill_mode == "step" else [p[:0] for p in
                                                                             prompts]
    fed = [p[:1] for p in prompts] if prefill_mode == "step" else prompts
    tokens, lengths, chunk = pad_prompts(fed, chunk_size)
    n_forced = np.array([len(f) for f in forced_prompt], np.int32)
    total = lengths + n_forced + max_new
    if (policy is not None and isinstance(cache, setup.CacheConfig)
            and cache.window_pages is None and cache.windows_for(model) is not None):
        # Eviction compacts one length per sequence over every layer, and selection names
        # pages by position: neither is defined on window groups' rings yet.
        setup.log_fallback(f"{type(policy).__name__} runs on full pages: the model's "
                           f"window-only pages do not combine with a cache policy. Pass "
                           f"CacheConfig(window_pages=False) to choose this explicitly.")
        cache = dataclasses.replace(cache, window_pages=False)
    cache, impl, plan = setup.prepare_cache(model, cache, impl, num_seqs=num_seqs or batch,
                                            max_tokens=int(total.max()) + extra_tokens,
                                            chunk=chunk)
    seq_ids = setup.check_slots(seq_ids, batch, cache.spec)
    small = [g.chunk for g in cache.spec.window_groups if g.chunk < chunk]
    if small:
        raise ValueError(f"the cache's window groups take at most {min(small)} tokens per "
                         f"reserve (WindowGroupSpec.chunk) but prefill runs chunks of {chunk}; "
                         f"pass chunk_size={min(small)} or build the cache with a larger chunk.")
    if policy is not None and cache.groups:
        from kvjax.cache.policies import UndefinedCombination

        raise UndefinedCombination(
            f"{type(policy).__name__} selects or scores pages by position; a cache with "
            f"window-only pages (CacheSpec.window_groups) keeps only its windowed layers' "
            f"last pages. Decode without the policy or without window_pages.")
    policy = setup.check_policy_model(policy, model)
    if policy is not None and cache.host is not None and cache.host.stream_pages > 0:
        from kvjax.cache.policies import UndefinedCombination

        raise UndefinedCombination(
            f"{type(policy).__name__} reads and moves each slot's pages by position; a "
            f"cache whose slots keep pages on the host (host tier with stream_pages="
            f"{cache.host.stream_pages}) does not combine with a policy. Attach the tier "
            f"with stream_pages=0 (swaps only) or decode without the policy.")
    if policy is None:
        setup.check_room(cache, seq_ids, lengths, n_forced + max_new)
    forced = None
    if prefill_mode == "step" or conts is not None:
        width = int((n_forced + max_new).max())
        forced = np.full((batch, width), -1, np.int32)
        for i in range(batch):
            forced[i, : n_forced[i]] = forced_prompt[i]
            if conts is not None:
                forced[i, n_forced[i]: n_forced[i] + max_new[i]] = conts[i]
    policy_state = None if policy is None else policy.init_state(cache)
    params = setup.shard_for_plan(model, params, plan)
    return _Request(cache=cache, impl=impl, params=params, seq_ids=jnp.asarray(seq_ids),
                    tokens=tokens, lengths=lengths, chunk=chunk, max_new=n_forced + max_new,
                    forced=forced, policy_state=policy_state, policy=policy)


def _prefill(model, req: _Request, *, policy, check):
    """The request's prompts through `prefill` (its cache donated).

    Returns (cache, last_logits, status, policy_state, positions of the next tokens).
    """
    base = req.cache.lengths[req.seq_ids]
    cache, last_logits, status, _, pstate = prefill(
        model, req.params, req.cache, jnp.asarray(req.tokens), jnp.asarray(req.lengths),
        req.seq_ids, chunk_size=req.chunk, impl=req.impl, policy=policy,
        policy_state=req.policy_state)
    if check:
        try:
            status.raise_if_error()
        except CacheFullError as err:
            err.cache = cache
            raise
    return cache, last_logits, status, pstate, base + jnp.asarray(req.lengths)


def _decoding_args(model, req: _Request, key, sampling, eos_ids):
    """Checks what decoding needs before the request's cache is donated: (keys, eos ids)."""
    setup.check_sampling(sampling)
    eos_ids = setup.check_eos(eos_ids, model.vocab_size)
    return as_keys(key, req.tokens.shape[0]), eos_ids


def _start(model, req: _Request, *, keys, sampling, eos_ids, free_finished, policy, check):
    """Prefill and the starting state of the decode loop (the request's cache donated)."""
    cache, last_logits, status, pstate, positions = _prefill(model, req, policy=policy,
                                                             check=check)
    forced = None if req.forced is None else jnp.asarray(req.forced)
    return start(cache, req.seq_ids, last_logits, positions, keys,
                 jnp.asarray(req.max_new), status, sampling=sampling, eos_ids=eos_ids,
                 max_len=int(req.max_new.max()), free_finished=free_finished,
                 policy_state=pstate, forced=forced)


def _strip_forced(tokens: np.ndarray, num: np.ndarray, n_forced: np.ndarray, width: int):
    """The rows' own tokens, past the forced prompt tokens (prefill='step')."""
    out = np.full((tokens.shape[0], width), -1, np.int32)
    for i in range(tokens.shape[0]):
        own = tokens[i, n_forced[i]: num[i]]
        out[i, : own.size] = own
    return out, np.maximum(num - n_forced, 0)


def generate(
    model: Model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    key,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig = GREEDY,
    eos_ids: Sequence[int] = (),
    cache: kv_cache.PagedKVCache | CacheConfig | None = None,
    seq_ids: Sequence[int] | None = None,
    chunk_size: int = 256,
    prefill: str = "chunked",
    free_finished: bool = True,
    impl="auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> GenerateResult:
    """Generates continuations for a batch of prompts of different lengths.

    Args:
      model, params: from `kvjax.models.load` (or a family's init_params).
      prompts: token-id lists, one per row (lengths may differ); ids in [0, vocab).
      key: one PRNG key (split per row) or typed keys [batch], one per row; row
        i's step s samples with `fold_in(keys[i], s)`, so a row's tokens do not
        depend on the rest of the batch.
      max_new_tokens: token limit, one for all rows or one per row.
      sampling: greedy by default.
      eos_ids: tokens that end a row (the EOS is kept in the output).
      cache: an existing cache of any page kind (donated; rows continue the sequences in
        `seq_ids`), or a `CacheConfig` (dtype, KIVI quantization, page size, pool size,
        sharding plan) for a fresh one sized for the request (default: float32).
      seq_ids: distinct cache slots of the rows; default 0..batch-1.
      chunk_size: prefill chunk length.
      prefill: "chunked" (the prompts through `prefill`, `chunk_size` tokens at a time)
        or "step" (only their first tokens; the rest is fed through the decode step,
        forced: one compiled program, slower for long prompts).
      free_finished: free each row's pages when it finishes.
      impl: attention implementation (`kvjax.attention.IMPLS`, or a `ShardedAttention`).
      policy: optional cache policy (eviction / page selection), on any page kind where it
        is defined (`kvjax.cache.policies.UndefinedCombination` otherwise, raised before
        any work).
      check: raise `CacheFullError` if the cache ran out of pages (the final cache is on
        the error as `err.cache`).

    Raises:
      ValueError / TypeError: a bad request (token ids outside the vocabulary, repeated or
        out-of-range slots, a sequence longer than the cache can hold, ...), before the
        cache is touched.
    """
    req = _request(model, params, prompts, max_new_tokens=max_new_tokens, cache=cache,
                   seq_ids=seq_ids, chunk_size=chunk_size, impl=impl, policy=policy,
                   prefill_mode=prefill)
    policy = req.policy
    keys, eos_ids = _decoding_args(model, req, key, sampling, eos_ids)
    state = _start(model, req, keys=keys, sampling=sampling, eos_ids=eos_ids,
                   free_finished=free_finished, policy=policy, check=check)
    state = decode_loop(model, decode_params(model, req.params, len(req.lengths)), state,
                        sampling=sampling, eos_ids=eos_ids, free_finished=free_finished,
                        impl=req.impl, policy=policy)
    if check:
        raise_if_error(state)
    tokens, num = np.asarray(state.tokens), np.asarray(state.num_generated)
    if prefill == "step":
        n_forced = req.max_new - setup.max_new_vector(max_new_tokens, len(req.lengths))
        tokens, num = _strip_forced(tokens, num, n_forced,
                                    int(np.max(setup.max_new_vector(max_new_tokens,
                                                                    len(req.lengths)))))
    return GenerateResult(tokens=tokens, num_generated=num, cache=state.cache,
                          status=state.status, state=state)


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """What `score` returns.

    Attributes:
      logprobs: float32[batch, max_len] (NumPy): log p(continuation token i | everything
        before it) for each row; entries past a row's continuation are 0.
      lengths: int32[batch] continuation tokens per row.
      cache: the final cache; state: the final `DecodeState`.
    """

    logprobs: np.ndarray
    lengths: np.ndarray
    cache: kv_cache.PagedKVCache
    state: DecodeState

    def nll(self) -> float:
        """Mean negative log-likelihood per continuation token."""
        return float(-self.logprobs.sum() / max(int(self.lengths.sum()), 1))


def score(
    model: Model,
    params,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    cache: kv_cache.PagedKVCache | CacheConfig | None = None,
    seq_ids: Sequence[int] | None = None,
    chunk_size: int = 256,
    free_finished: bool = True,
    impl="auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> ScoreResult:
    """Teacher forcing through the decode loop: log-probabilities of given continuations.

    Each prompt is prefilled, then its continuation is fed one token per decode step
    (the true token, not a sample) through the same step function `generate` runs —
    cache kind, policy and sharding included, so quantization error and eviction show
    after the prompt as they would while generating. One compiled loop, no host
    round trip per step.

    Args: as in `generate`, plus `continuations` (token-id lists, one per prompt).
    """
    req = _request(model, params, prompts, max_new_tokens=None, cache=cache, seq_ids=seq_ids,
                   chunk_size=chunk_size, impl=impl, policy=policy,
                   continuations=continuations)
    policy = req.policy
    keys, _ = _decoding_args(model, req, jax.random.key(0), GREEDY, ())
    state = _start(model, req, keys=keys, sampling=GREEDY, eos_ids=(),
                   free_finished=free_finished, policy=policy, check=check)
    state = decode_loop(model, decode_params(model, req.params, len(req.lengths)), state,
                        sampling=GREEDY, eos_ids=(), free_finished=free_finished, impl=req.impl,
                        policy=policy)
    if check:
        raise_if_error(state)
    n = req.max_new
    lp = np.where(np.arange(state.logprobs.shape[1])[None, :] < n[:, None],
                  np.asarray(state.logprobs), 0.0)
    return ScoreResult(logprobs=lp, lengths=n, cache=state.cache, state=state)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One step of `stream`: the token each row produced (valid where `emitted`)."""

    tokens: np.ndarray  # int32[batch]
    emitted: np.ndarray  # bool[batch]
    state: DecodeState


def stream(
    model: Model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    key,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig = GREEDY,
    eos_ids: Sequence[int] = (),
    cache: kv_cache.PagedKVCache | CacheConfig | None = None,
    seq_ids: Sequence[int] | None = None,
    chunk_size: int = 256,
    free_finished: bool = True,
    impl="auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> Iterator[StreamEvent]:
    """Like `generate`, but yields each step's tokens as they come (same step function).

    Arguments as in `generate`. The first event carries the tokens sampled from
    the prompts; each later one comes from one jitted `decode_step`. The last
    event's `state` holds the final cache.
    """
    req = _request(model, params, prompts, max_new_tokens=max_new_tokens, cache=cache,
                   seq_ids=seq_ids, chunk_size=chunk_size, impl=impl, policy=policy)
    policy = req.policy
    keys, eos_ids = _decoding_args(model, req, key, sampling, eos_ids)
    state = _start(model, req, keys=keys, sampling=sampling, eos_ids=eos_ids,
                   free_finished=free_finished, policy=policy, check=check)
    prev = np.zeros(req.lengths.shape, np.int32)
    params = decode_params(model, req.params, len(req.lengths))
    while True:
        num = np.asarray(state.num_generated)
        emitted = num > prev
        toks = np.asarray(state.tokens)[np.arange(num.shape[0]), np.maximum(num - 1, 0)]
        prev = num
        yield StreamEvent(tokens=np.where(emitted, toks, -1), emitted=emitted, state=state)
        if bool(np.all(np.asarray(state.done))):
            break
        state = decode_step_jit(model, params, state, sampling=sampling, eos_ids=eos_ids,
                                free_finished=free_finished, impl=req.impl, policy=policy)
    if check:
        raise_if_error(state)
