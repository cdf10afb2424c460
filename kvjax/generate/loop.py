"""Pure-functional generation on the paged cache: chunked prefill, one decode step, the loop.

    result = generate(model, params, [[1, 5, 9], [1, 7]], key=jax.random.key(0),
                      max_new_tokens=32, sampling=SamplingConfig(temperature=0.8, top_p=0.9))

Pieces, each usable alone:
  * `prefill`: runs prompts through the model chunk by chunk (a `lax.scan`
    over chunks, so a long prompt never needs one giant activation), reserving
    pages as it goes; returns each row's last-token logits.
  * `start`: samples the first new token from those logits into a `DecodeState`.
  * `decode_step`: one token for every unfinished row: reserve one slot per
    row (pages are allocated as sequences grow), run the model, hand the cache
    to an optional cache `policy` (eviction/selection hooks in here), sample,
    apply the per-row EOS and length stops, and free the pages of rows that
    just finished.
  * `decode_loop`: `decode_step` in a `lax.while_loop`: one compiled program,
    the state (and the cache in it) donated.
  * `stream`: a Python generator around the jitted `decode_step` - the same
    step function as the loop.

Running out of pages is not an exception inside jit: `DecodeState.status`
keeps the first failed `AllocStatus`, every row stops, and the host wrappers
raise `CacheFullError` (unless `check=False`).
"""

import dataclasses
import functools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import cache as kv_cache
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.policies.base import CachePolicy, to_slots
from kvjax.generate.sampling import SamplingConfig, as_keys, sample
from kvjax.models.base import Model

__all__ = [
    "CachePolicy",
    "GREEDY",
    "DecodeState",
    "GenerateResult",
    "StreamEvent",
    "prefill",
    "start",
    "decode_step",
    "decode_params",
    "decode_loop",
    "generate",
    "stream",
    "pad_prompts",
    "default_cache_spec",
]


# Cache policies (eviction / page selection) are `kvjax.cache.policies.CachePolicy`
# objects: hashable, static here. Their state rides in `DecodeState.policy_state`; the
# loop calls the same hooks for all of them (see kvjax/cache/policies/base.py).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (a pytree; the jitted entry points donate it).

    Attributes:
      cache: the paged cache.
      seq_ids: int32[batch], cache slot of each row.
      last: int32[batch], the last sampled token of each row (not yet in the cache).
      position: int32[batch], RoPE position of `last`.
      tokens: int32[batch, max_new], sampled tokens; entries past `num_generated` are -1.
      num_generated: int32[batch], tokens sampled so far (an EOS counts).
      max_new: int32[batch], per-row limit on sampled tokens.
      done: bool[batch], row finished (EOS, its limit, or an allocation failure).
      keys: typed PRNG keys [batch]; step i of a row samples with fold_in(key, i).
      status: the first failed allocation, or OK.
      step: int32[], decode steps run.
      policy_state: the cache policy's state (None without a policy).
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


def _ok_status(cache) -> AllocStatus:
    # A sharded allocator keeps one free count per shard: report the total.
    return AllocStatus(code=jnp.int32(0), pages_needed=jnp.int32(0),
                       pages_free=jnp.sum(cache.table.num_free, dtype=jnp.int32))


def _first_error(old: AllocStatus, new: AllocStatus) -> AllocStatus:
    keep = old.code != 0
    return jax.tree.map(lambda a, b: jnp.where(keep, a, b), old, new)


def _slot_vector(cache, seq_ids, values):
    """Scatters per-row values into a max_seqs vector (zeros elsewhere)."""
    return jnp.zeros((cache.spec.max_seqs,), values.dtype).at[seq_ids].set(values)


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
    impl: str = "auto",
    return_logits: bool = False,
    policy: CachePolicy | None = None,
    policy_state=None,
):
    """Appends prompts to sequences `seq_ids`, `chunk_size` tokens at a time.

    Rows continue their sequences: a row whose slot already holds L tokens gets
    positions L, L+1, ... (empty slots start at 0).

    Args:
      model: the model bundle (static).
      params: its params.
      cache: the paged cache (donated).
      tokens: int32[batch, prompt_len], prompts padded on the right; prompt_len
        must be a multiple of chunk_size.
      prompt_lengths: int32[batch], real tokens per row (>= 1).
      seq_ids: int32[batch], distinct cache slots of the rows.
      chunk_size: tokens per chunk (static).
      impl: attention implementation.
      return_logits: also return the logits at every prompt position (static).
      policy: optional cache policy (static); its `after_prefill` runs after
        each chunk, so prompt compressors (SnapKV, PyramidKV) see the whole
        prompt only when it fits one chunk.
      policy_state: the policy's state (from `policy.init_state(cache)`).

    Returns:
      (cache, last_logits float32[batch, vocab], status, all_logits or None),
      plus the new policy state as a fifth element when a policy is given:
      `last_logits[b]` predicts the token after row b's prompt; `all_logits` is
      float32[batch, prompt_len, vocab] when asked for. On an allocation
      failure the remaining chunks are skipped and `status` says why.
    """
    batch, prompt_len = tokens.shape
    if prompt_len % chunk_size:
        raise ValueError(f"prefill: prompt_len {prompt_len} must be a multiple of chunk_size "
                         f"{chunk_size}; pad the prompts (see pad_prompts).")
    n_chunks = prompt_len // chunk_size
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    base = cache.lengths[seq_ids]
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
        status = _first_error(status, st)
        q_lengths = jnp.where(st.ok, q_lengths, 0)
        if policy is None:
            logits, cache = model.apply(params, chunk, positions, cache, q_lengths=q_lengths,
                                        seq_ids=seq_ids, impl=impl)
        else:
            logits, cache, queries = model.apply(
                params, chunk, positions, cache, q_lengths=q_lengths, seq_ids=seq_ids,
                impl=impl, policy=policy, policy_state=pstate)
            cache, pstate, pst = policy.after_prefill(
                cache, pstate, to_slots(cache, seq_ids, queries, axis=1),
                _slot_vector(cache, seq_ids, q_lengths))
            status = _first_error(status, pst)
        idx = prompt_lengths - 1 - start_tok
        here = (idx >= 0) & (idx < chunk_size) & st.ok
        row = logits[rows, jnp.clip(idx, 0, chunk_size - 1)]
        last_logits = jnp.where(here[:, None], row, last_logits)
        ok = ok & st.ok & (status.code == 0)
        return (cache, last_logits, status, ok, pstate), (logits if return_logits else None)

    init = (cache, jnp.zeros((batch, model.vocab_size), jnp.float32), _ok_status(cache),
            jnp.bool_(True), policy_state)
    (cache, last_logits, status, _, policy_state), all_logits = jax.lax.scan(
        body, init, (jnp.arange(n_chunks, dtype=jnp.int32), chunks))
    if return_logits:
        all_logits = all_logits.transpose(1, 0, 2, 3).reshape(batch, prompt_len, -1)
    if policy is not None:
        return cache, last_logits, status, all_logits, policy_state
    return cache, last_logits, status, all_logits


def _is_eos(tok, eos_ids: tuple[int, ...]):
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=1)


def _free_rows(cache, seq_ids, rows_mask):
    mask = _slot_vector(cache, seq_ids, rows_mask)
    return jax.lax.cond(jnp.any(rows_mask), lambda c: kv_cache.free(c, mask), lambda c: c, cache)


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
) -> DecodeState:
    """Samples each row's first new token from its prompt logits; returns the loop state.

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
    """
    batch = seq_ids.shape[0]
    ok = status.code == 0
    step_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros((batch,), jnp.int32))
    tok = sample(last_logits, step_keys, sampling)
    tokens = jnp.full((batch, max_len), -1, jnp.int32).at[:, 0].set(jnp.where(ok, tok, -1))
    num = jnp.where(ok, 1, 0).astype(jnp.int32) * jnp.ones((batch,), jnp.int32)
    finished = ok & (_is_eos(tok, eos_ids) | (num >= max_new))
    if free_finished:
        cache = _free_rows(cache, seq_ids, finished)
    return DecodeState(
        cache=cache, seq_ids=jnp.asarray(seq_ids, jnp.int32), last=tok,
        position=jnp.asarray(positions, jnp.int32), tokens=tokens, num_generated=num,
        max_new=jnp.asarray(max_new, jnp.int32), done=finished | ~ok, keys=keys, status=status,
        step=jnp.int32(0), policy_state=policy_state,
    )


def decode_step(
    model: Model,
    params,
    state: DecodeState,
    *,
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...] = (),
    free_finished: bool = True,
    impl: str = "auto",
    policy: CachePolicy | None = None,
) -> DecodeState:
    """One new token for every unfinished row (pure; see `decode_loop` for the jitted loop).

    Reserves one cache slot per active row (a failed reservation stops every
    row and is kept in `state.status`), feeds each row's `last` token, lets
    `policy` (if any) act on the cache, samples, appends, applies the EOS and
    per-row length stops and frees the pages of rows that finished.
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
    if policy is None:
        logits, cache = model.apply(
            params, state.last[:, None], positions, cache,
            q_lengths=run.astype(jnp.int32), seq_ids=state.seq_ids, impl=impl)
    else:
        logits, cache, queries = model.apply(
            params, state.last[:, None], positions, cache, q_lengths=run.astype(jnp.int32),
            seq_ids=state.seq_ids, impl=impl, policy=policy, policy_state=pstate)
        cache, pstate, pst = policy.after_step(
            cache, pstate, to_slots(cache, state.seq_ids, queries[:, :, 0], axis=1),
            _slot_vector(cache, state.seq_ids, run))
        st = _first_error(st, pst)
        run = run & pst.ok
    step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.num_generated)
    tok = sample(logits[:, 0], step_keys, sampling)
    max_len = state.tokens.shape[1]
    col = jnp.where(run, state.num_generated, max_len)  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(batch), col].set(tok, mode="drop")
    num = state.num_generated + run.astype(jnp.int32)
    finished = run & (_is_eos(tok, eos_ids) | (num >= state.max_new))
    if free_finished:
        cache = _free_rows(cache, state.seq_ids, finished)
    return dataclasses.replace(
        state, cache=cache, last=jnp.where(run, tok, state.last),
        position=state.position + run.astype(jnp.int32), tokens=tokens, num_generated=num,
        done=state.done | finished | ~st.ok, status=_first_error(state.status, st),
        step=state.step + 1, policy_state=pstate,
    )


GREEDY = SamplingConfig()

_STEP_STATIC = ("model", "sampling", "eos_ids", "free_finished", "impl", "policy")


@functools.partial(jax.jit, static_argnames=_STEP_STATIC, donate_argnames="state")
def decode_loop(model: Model, params, state: DecodeState, *, sampling: SamplingConfig,
                eos_ids: tuple[int, ...] = (), free_finished: bool = True, impl: str = "auto",
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


# ----------------------------------------------------------------------------- host wrappers


def pad_prompts(prompts: Sequence[Sequence[int]], chunk_size: int) -> tuple[np.ndarray, np.ndarray,
                                                                              int]:
    """Right-pads prompts into int32[batch, T] with T a multiple of the chunk actually used.

    Returns (tokens, lengths, chunk): chunk is `chunk_size`, or less for short
    prompts (the longest prompt rounded up to a multiple of 8), so tiny
    prompts do not pay for a full chunk.
    """
    if not prompts:
        raise ValueError("prompts must hold at least one prompt.")
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


def default_cache_spec(model: Model, *, num_seqs: int, max_tokens: int, page_size: int = 16,
                       num_pages: int | None = None, dtype="float32"):
    """A cache with room for `num_seqs` sequences of up to `max_tokens` tokens each."""
    max_pages = math.ceil(max_tokens / page_size)
    return model.make_cache_spec(
        page_size=page_size, num_pages=num_pages or num_seqs * max_pages, max_seqs=num_seqs,
        max_pages_per_seq=max_pages, dtype=dtype)


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


def _max_new_vector(max_new_tokens, batch: int) -> np.ndarray:
    m = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,)).copy()
    if (m < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1 per row, got {m.tolist()}.")
    return m


# Stacked layer weights of at least this many bytes run the CPU decode loop per layer.
_UNSTACK_MIN_BYTES = 32 << 20


def decode_params(model: Model, params, rows: int = 1):
    """The params the decode loop runs with, for `rows` sequences per step.

    Inside the decode's `lax.scan` over stacked layer weights, XLA:CPU copies each
    layer's slice out of the stack every step (a read and a write of all layer weights
    per token; benchmarks/NOTES.md v8). On CPU the small-M matmul kernel reads the
    stacked weights in place (`kvjax.models.layers.LayerSlice`) and nothing changes.
    Where it does not run (no compiler, several devices, more than its 32 rows, or
    `KVJAX_CPU_MATMUL=0`), a family's stacked layer weights of 32 MiB or more become one
    array per layer (`Model.unstack_layers`: a copy of the layer weights for the call).
    Small models keep the scan (their copies are cheap, the unrolled layers compile
    slower); other backends read the slices in place. `KVJAX_UNSTACK_LAYERS=0` turns the
    unstacking off.
    """
    if (model.unstack_layers is None or jax.default_backend() != "cpu"
            or os.environ.get("KVJAX_UNSTACK_LAYERS", "1") == "0"):
        return params
    layers = getattr(params, "layers", None)
    if layers is None or isinstance(layers, tuple):
        return params
    leaves = jax.tree.leaves(layers)
    if sum(x.nbytes for x in leaves) < _UNSTACK_MIN_BYTES:
        return params
    from kvjax.backends.cpu import matmul as cpu_matmul

    w = max(leaves, key=lambda x: x.size)  # a projection [layers, d_in, d_out]
    if w.ndim == 3 and cpu_matmul.use_kernel(jax.ShapeDtypeStruct((rows, w.shape[1]), w.dtype),
                                             w.shape[1:], w.dtype):
        return params
    return model.unstack_layers(params)


def _prepare(model, params, prompts, *, key, max_new_tokens, cache, seq_ids, page_size,
             num_pages, cache_dtype, chunk_size, impl, policy, check):
    """Shared front half of generate/stream: prefill, then the starting state's inputs."""
    tokens, lengths, chunk = pad_prompts(prompts, chunk_size)
    batch = tokens.shape[0]
    max_new = _max_new_vector(max_new_tokens, batch)
    if cache is None:
        spec = default_cache_spec(model, num_seqs=batch, max_tokens=int(lengths.max() +
                                  max_new.max()), page_size=page_size, num_pages=num_pages,
                                  dtype=cache_dtype)
        cache = kv_cache.init_cache(spec)
    if seq_ids is None:
        if batch > cache.spec.max_seqs:
            raise ValueError(f"{batch} prompts but the cache has only {cache.spec.max_seqs} "
                             f"sequence slots (max_seqs).")
        seq_ids = np.arange(batch, dtype=np.int32)
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    base = cache.lengths[seq_ids]
    policy_state = None
    if policy is None:
        cache, last_logits, status, _ = prefill(
            model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), seq_ids,
            chunk_size=chunk, impl=impl)
    else:
        cache, last_logits, status, _, policy_state = prefill(
            model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), seq_ids,
            chunk_size=chunk, impl=impl, policy=policy, policy_state=policy.init_state(cache))
    if check:
        status.raise_if_error()
    keys = as_keys(key, batch)
    positions = base + jnp.asarray(lengths)
    return cache, seq_ids, last_logits, positions, keys, max_new, status, policy_state


def generate(
    model: Model,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    key,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig = GREEDY,
    eos_ids: Sequence[int] = (),
    cache: kv_cache.PagedKVCache | None = None,
    seq_ids: Sequence[int] | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    cache_dtype="float32",
    chunk_size: int = 256,
    free_finished: bool = True,
    impl: str = "auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> GenerateResult:
    """Generates continuations for a batch of prompts of different lengths.

    Args:
      model, params: from `kvjax.models.load` (or a family's init_params).
      prompts: token-id lists, one per row (lengths may differ).
      key: one PRNG key (split per row) or typed keys [batch], one per row; row
        i's step s samples with `fold_in(keys[i], s)`, so a row's tokens do not
        depend on the rest of the batch.
      max_new_tokens: token limit, one for all rows or one per row.
      sampling: greedy by default.
      eos_ids: tokens that end a row (the EOS is kept in the output).
      cache: an existing cache (donated; rows continue the sequences in
        `seq_ids`); default a fresh one sized for the request.
      seq_ids: cache slots of the rows; default 0..batch-1.
      page_size, num_pages, cache_dtype: for the fresh cache.
      chunk_size: prefill chunk length.
      free_finished: free each row's pages when it finishes.
      impl: attention implementation.
      policy: optional cache policy (eviction/selection) run after every forward.
      check: raise `CacheFullError` if the cache ran out of pages.
    """
    cache, seq_ids, last_logits, positions, keys, max_new, status, policy_state = _prepare(
        model, params, prompts, key=key, max_new_tokens=max_new_tokens, cache=cache,
        seq_ids=seq_ids, page_size=page_size, num_pages=num_pages, cache_dtype=cache_dtype,
        chunk_size=chunk_size, impl=impl, policy=policy, check=check)
    eos_ids = tuple(int(e) for e in eos_ids)
    state = start(cache, seq_ids, last_logits, positions, keys, jnp.asarray(max_new), status,
                  sampling=sampling, eos_ids=eos_ids, max_len=int(max_new.max()),
                  free_finished=free_finished, policy_state=policy_state)
    state = decode_loop(model, decode_params(model, params, len(prompts)), state,
                        sampling=sampling, eos_ids=eos_ids, free_finished=free_finished,
                        impl=impl, policy=policy)
    if check:
        state.status.raise_if_error()
    return GenerateResult(tokens=np.asarray(state.tokens),
                          num_generated=np.asarray(state.num_generated), cache=state.cache,
                          status=state.status, state=state)


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
    cache: kv_cache.PagedKVCache | None = None,
    seq_ids: Sequence[int] | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    cache_dtype="float32",
    chunk_size: int = 256,
    free_finished: bool = True,
    impl: str = "auto",
    policy: CachePolicy | None = None,
    check: bool = True,
) -> Iterator[StreamEvent]:
    """Like `generate`, but yields each step's tokens as they come (same step function).

    Arguments as in `generate`. The first event carries the tokens sampled from
    the prompts; each later one comes from one jitted `decode_step`. The last
    event's `state` holds the final cache.
    """
    cache, seq_ids, last_logits, positions, keys, max_new, status, policy_state = _prepare(
        model, params, prompts, key=key, max_new_tokens=max_new_tokens, cache=cache,
        seq_ids=seq_ids, page_size=page_size, num_pages=num_pages, cache_dtype=cache_dtype,
        chunk_size=chunk_size, impl=impl, policy=policy, check=check)
    eos_ids = tuple(int(e) for e in eos_ids)
    state = start(cache, seq_ids, last_logits, positions, keys, jnp.asarray(max_new), status,
                  sampling=sampling, eos_ids=eos_ids, max_len=int(max_new.max()),
                  free_finished=free_finished, policy_state=policy_state)
    prev = np.zeros(seq_ids.shape, np.int32)
    params = decode_params(model, params, len(prompts))
    while True:
        num = np.asarray(state.num_generated)
        emitted = num > prev
        toks = np.asarray(state.tokens)[np.arange(num.shape[0]), np.maximum(num - 1, 0)]
        prev = num
        yield StreamEvent(tokens=np.where(emitted, toks, -1), emitted=emitted, state=state)
        if bool(np.all(np.asarray(state.done))):
            break
        state = decode_step_jit(model, params, state, sampling=sampling, eos_ids=eos_ids,
                                free_finished=free_finished, impl=impl, policy=policy)
    if check:
        state.status.raise_if_error()
