"""Teacher-forcable decoding of the Llama / DeepSeek families on any kvjax cache.

`kvjax.generate` drives a model's own `forward` on a plain paged cache. The
evaluation and the demo need more: the same model on a KIVI-quantized cache
(`kvjax.cache.quantized`), under a cache policy that evicts tokens or selects
pages (`kvjax.cache.policies`, called through its hooks exactly as
`kvjax.cache.policies.base` describes), and fed the true next token rather
than its own sample (so that perplexity is measured through the cache, token
by token, after a prefill). `CacheDecoder` runs one model + one
`CacheConfig` for a batch of equal-length prompts:

    dec = CacheDecoder(model, params, CacheConfig(name="int4", bits=4), batch=4, max_len=320)
    logits = dec.prefill(prompts)      # [batch, vocab], predicts the next token
    logits = dec.step(next_tokens)     # one decode step

The layer math reuses the families' own functions (`kvjax.models.layers`,
the MLA helpers of `kvjax.models.deepseek`), so a `CacheConfig` with a float32
paged cache reproduces `forward`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention as kattn
from kvjax.attention.quantized_selected import quantized_selected_decode_attention
from kvjax.cache import paged, quantized
from kvjax.cache.policies import (
    KIVIH2O,
    CachePolicy,
    KIVIPolicy,
    KIVIQuest,
    NoPolicy,
    selected_decode_attention,
)
from kvjax.specs import QuantSpec

__all__ = ["CacheConfig", "CacheDecoder", "kv_bytes_per_token", "greedy_generate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """One cache configuration: storage dtype, optional KIVI bits, optional policy.

    Attributes:
      name: label for tables.
      dtype: full-precision storage ("bfloat16", "float32"); the quantized tail's dtype.
      bits: 8, 4 or 2 for a KIVI-quantized cache (None: full precision).
      group_size: KIVI group G.
      residual: KIVI full-precision recent tokens R (a multiple of the page size).
      policy: an eviction / selection policy. Full-precision caches take any
        `CachePolicy`; KIVI caches (bits set) take `KIVIQuest` or `KIVIH2O`
        (`kvjax.cache.policies.kivi`), which act on the packed pages.
      read_budget: tokens a step reads when the policy selects pages (Quest), for accounting.
    """

    name: str
    dtype: str = "bfloat16"
    bits: int | None = None
    group_size: int = 32
    residual: int = 128
    policy: CachePolicy | None = None
    read_budget: int | None = None

    def __post_init__(self):
        quant_policy = isinstance(self.policy, KIVIPolicy)
        if self.bits is not None and self.policy is not None and not quant_policy:
            raise ValueError(
                f"CacheConfig {self.name!r}: a KIVI cache (bits={self.bits}) supports the "
                f"policies KIVIQuest and KIVIH2O (kvjax.cache.policies.kivi), got "
                f"{type(self.policy).__name__}; full-precision policies act on KVPages only.")
        if self.bits is None and quant_policy:
            raise ValueError(
                f"CacheConfig {self.name!r}: {type(self.policy).__name__} acts on KIVI caches; "
                f"set bits (2, 4 or 8) or use the full-precision Quest / H2O.")


def _slice_layer(tree, i: int):
    return jax.tree.map(lambda p: p[i], tree)


def _llama_layer(config, lp, x, cos, sin):
    from kvjax.models.layers import apply_rope, linear, rms_norm

    c = config
    b, t, _ = x.shape
    h = rms_norm(x, lp.attn_norm, c.rms_norm_eps)
    q = linear(h, lp.wq, lp.bq).reshape(b, t, c.q_heads, c.head_dim)
    k = linear(h, lp.wk, lp.bk).reshape(b, t, c.kv_heads, c.head_dim)
    v = linear(h, lp.wv, lp.bv).reshape(b, t, c.kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, lp.q_norm, c.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, c.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _llama_mlp(config, lp, x, attn_out):
    from kvjax.models.layers import linear, rms_norm, swiglu

    b, t = x.shape[:2]
    x = x + linear(attn_out.astype(x.dtype).reshape(b, t, -1), lp.wo, lp.bo)
    h = rms_norm(x, lp.mlp_norm, config.rms_norm_eps)
    return x + swiglu(h, lp.w_gate, lp.w_up, lp.w_down, lp.b_gate, lp.b_up, lp.b_down)


@functools.partial(jax.jit, static_argnames=("model", "policy"), donate_argnames=("cache",))
def _run(params, cache, state, tokens, q_lengths, text_pos, *, model, policy):
    """One forward through the cache. Returns (logits of each row's last real token, cache,
    state, reserve status, policy status)."""
    config = model.config
    is_quant = isinstance(cache, quantized.QuantizedKVCache)
    kivi = is_quant and isinstance(policy, KIVIPolicy)  # a policy acting on quantized pages
    is_mla = model.family == "deepseek"
    b, t = tokens.shape
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = steps < q_lengths[:, None]
    rope_pos = text_pos if is_quant else policy.rope_positions(cache, state, text_pos)
    if is_quant:
        cache, r_status = quantized.reserve(cache, q_lengths)
        slots = None
    else:
        cache, r_status = paged.reserve(cache, q_lengths)
        cache_pos = cache.lengths[:, None] - q_lengths[:, None] + steps
        slots = paged.token_slots(cache, jnp.maximum(cache_pos, 0), valid)
    dt = cache.spec.dtype
    queries = []
    if is_mla:
        from kvjax.models.deepseek import mla, moe
        from kvjax.models.layers import rms_norm

        cos, sin = mla.rope_tables(config, rope_pos)
        x = params.embed[tokens]
        for layer in range(config.num_layers):
            p = _slice_layer(params.dense_layers, layer)
            h = rms_norm(x, p.input_norm, config.rms_norm_eps)
            q_nope, q_rope, c_kv, k_rope = mla.mla_inputs(p, config, h, cos, sin)
            q_lat = mla.absorb_query(p, q_nope)
            scale = config.softmax_scale
            if is_quant:
                cache = quantized.write_layer(cache, layer, c_kv.astype(dt), k_rope.astype(dt))
                view = quantized.layer_view(cache, layer, whole_pools=True)
                out, _ = kattn.quantized_mla_prefill_attention(q_lat, q_rope, view, q_lengths,
                                                               scale=scale)
            else:
                cache = paged.write_layer(cache, layer, slots, c_kv.astype(dt),
                                          k_rope.astype(dt))
                view = paged.layer_view(cache, layer)
                out, _ = kattn.mla_prefill_attention(q_lat, q_rope, view.k, view.v,
                                                     view.lengths, view.block_tables, q_lengths,
                                                     scale=scale)
            x = x + mla.output(p, config, out.astype(x.dtype))
            x = x + moe.swiglu(rms_norm(x, p.post_norm, config.rms_norm_eps), p.mlp)
        x = rms_norm(x, params.final_norm, config.rms_norm_eps)
        head = params.embed.T if config.tie_word_embeddings else params.lm_head
    else:
        from kvjax.models.layers import rms_norm, rope_cos_sin

        cos, sin = rope_cos_sin(rope_pos, config.rope, jnp.float32)
        x = params.embed[tokens]
        scale = config.head_dim ** -0.5
        for layer in range(config.num_layers):
            lp = _slice_layer(params.layers, layer)
            q, k, v = _llama_layer(config, lp, x, cos, sin)
            if is_quant:
                cache = quantized.write_layer(cache, layer, k.astype(dt), v.astype(dt))
                view = quantized.layer_view(cache, layer, whole_pools=True)
                sel = policy.before_attention(cache, state, layer, q[:, 0]) if (
                    kivi and t == 1) else None
                if sel is None:
                    out, _ = kattn.quantized_prefill_attention(q, view, q_lengths, scale=scale)
                else:
                    out, _ = quantized_selected_decode_attention(q[:, 0], view.one_layer(), sel,
                                                                 scale=scale)
                    out = out[:, None]
            else:
                cache = paged.write_layer(cache, layer, slots, k.astype(dt), v.astype(dt))
                view = paged.layer_view(cache, layer)
                if t == 1:
                    sel = policy.before_attention(cache, state, layer, q[:, 0])
                    out, _ = selected_decode_attention(q[:, 0], view.k, view.v, sel, scale=scale)
                    out = out[:, None]
                else:
                    out, _ = kattn.paged_prefill_attention(q, view.k, view.v, view.lengths,
                                                           view.block_tables, q_lengths,
                                                           scale=scale)
            queries.append(q)
            x = _llama_mlp(config, lp, x, out)
        x = rms_norm(x, params.final_norm, config.rms_norm_eps)
        head = params.embed.T if params.lm_head is None else params.lm_head
    last = jnp.take_along_axis(x, jnp.maximum(q_lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = (last @ head).astype(jnp.float32)
    p_status = r_status
    if queries and (kivi or not is_quant):
        qs = jnp.stack(queries)
        if t == 1:
            cache, state, p_status = policy.after_step(cache, state, qs[:, :, 0])
        else:
            cache, state, p_status = policy.after_prefill(cache, state, qs, q_lengths)
    return logits, cache, state, r_status, p_status


class CacheDecoder:
    """A batch of sequences decoded by one model through one cache configuration.

    Args:
      model: a `kvjax.models.Model` (llama or deepseek family, dense MLP layers).
      params: its params (float32).
      cache_config: the cache to decode through.
      batch: sequences (cache slots).
      max_len: longest sequence (prompt + generated tokens).
      page_size: tokens per page (must be a multiple of the KIVI group size).
    """

    def __init__(self, model, params, cache_config: CacheConfig, *, batch: int, max_len: int,
                 page_size: int = 32):
        if model.family == "deepseek" and model.config.num_moe_layers:
            raise ValueError("CacheDecoder supports dense DeepSeek layers only (no MoE).")
        self.model, self.params, self.cc = model, params, cache_config
        pages_per_seq = math.ceil(max_len / page_size) + 1
        spec = model.make_cache_spec(page_size=page_size, num_pages=batch * pages_per_seq,
                                     max_seqs=batch, max_pages_per_seq=pages_per_seq,
                                     dtype=cache_config.dtype)
        if cache_config.bits is not None:
            spec = dataclasses.replace(spec, quant=QuantSpec(
                bits=cache_config.bits, group_size=cache_config.group_size,
                residual=cache_config.residual))
            self.cache = quantized.init_quantized_cache(spec)
        else:
            self.cache = paged.init_cache(spec)
        self.spec = spec
        self.policy = cache_config.policy or NoPolicy()
        quant_plain = cache_config.bits is not None and not isinstance(self.policy, KIVIPolicy)
        self.state = None if quant_plain else self.policy.init_state(self.cache)
        self.batch = batch
        self.position = np.zeros((batch,), np.int64)
        self._compiled = {}  # tokens per row -> compiled `_run` (see `lower`)

    def _args(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple:
        t = tokens.shape[1]
        text_pos = jnp.asarray(self.position[:, None] + np.arange(t)[None, :], jnp.int32)
        return (self.params, self.cache, self.state, jnp.asarray(tokens, jnp.int32),
                jnp.asarray(lengths, jnp.int32), text_pos)

    def lower(self, prompt_len: int) -> dict:
        """Traces and lowers the prefill (`prompt_len` tokens per row) and decode-step programs.

        Returns `{tokens per row: jax.stages.Lowered}`. Compile them with
        `install_compiled` — XLA compiles release the GIL, so a thread pool can
        compile several decoders' programs at once (the demo does; compilation is
        most of its time on a small machine). Calls with other shapes still go
        through the ordinary jit.
        """
        out = {}
        for t in sorted({prompt_len, 1}):
            tokens = np.zeros((self.batch, t), np.int32)
            lengths = np.full((self.batch,), t, np.int32)
            out[t] = _run.trace(*self._args(tokens, lengths), model=self.model,
                                policy=self.policy).lower()
        return out

    def install_compiled(self, compiled: dict) -> "CacheDecoder":
        """Uses `{tokens per row: jax.stages.Compiled}` (from `lower(...)[t].compile()`)."""
        self._compiled.update(compiled)
        return self

    def _call(self, tokens: np.ndarray, lengths: np.ndarray) -> jax.Array:
        args = self._args(tokens, lengths)
        fn = self._compiled.get(tokens.shape[1])
        if fn is None:
            fn = functools.partial(_run, model=self.model, policy=self.policy)
        logits, self.cache, self.state, rs, ps = fn(*args)
        rs.raise_if_error()
        ps.raise_if_error()
        self.position = self.position + lengths
        return logits

    def prefill(self, prompts: np.ndarray, lengths: np.ndarray | None = None) -> jax.Array:
        """Caches the prompts; returns float32 logits [batch, vocab] after each row's last token.

        Args:
          prompts: int[batch, prompt_len]; row b's tokens past lengths[b] are padding
            (pad to one length to reuse one compiled prefill for prompts of any length).
          lengths: int[batch] real prompt tokens per row (default all of prompt_len).
        """
        prompts = np.asarray(prompts)
        if prompts.ndim != 2 or prompts.shape[0] != self.batch:
            raise ValueError(f"prefill: prompts must be [batch={self.batch}, prompt_len], got "
                             f"{prompts.shape}.")
        if lengths is None:
            lengths = np.full((self.batch,), prompts.shape[1], np.int64)
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != (self.batch,) or lengths.min() < 1 or lengths.max() > prompts.shape[1]:
            raise ValueError(f"prefill: lengths must be [batch={self.batch}] in [1, "
                             f"{prompts.shape[1]}], got {lengths}.")
        return self._call(prompts, lengths)

    def step(self, tokens: np.ndarray) -> jax.Array:
        """Feeds int[batch] tokens (one each); returns float32 logits [batch, vocab]."""
        return self._call(np.asarray(tokens).reshape(self.batch, 1),
                          np.ones((self.batch,), np.int64))

    def cached_tokens(self) -> np.ndarray:
        """int[batch]: tokens each sequence holds in the cache now (after any eviction)."""
        return np.asarray(self.cache.lengths)


def greedy_generate(decoder: CacheDecoder, prompts: np.ndarray, n: int,
                    lengths: np.ndarray | None = None) -> np.ndarray:
    """Greedy continuation int32[batch, n] of (padded) `prompts` through a fresh `decoder`."""
    logits = decoder.prefill(prompts, lengths)
    out = []
    for i in range(n):
        nxt = np.asarray(jnp.argmax(logits, -1), np.int32)
        out.append(nxt)
        if i + 1 < n:
            logits = decoder.step(nxt)
    return np.stack(out, 1)


def kv_bytes_per_token(model, cc: CacheConfig, context: int, *, page_size: int = 32,
                       kept_tokens: float | None = None) -> dict:
    """KV bytes per context token held (and read per decode step) for one configuration.

    Full-precision tokens cost the dtype's bytes per element; KIVI-quantized
    tokens `bits / 8` plus a float16 scale and zero per group of G elements
    (MLA: the latent is quantized, the rope key stays full precision). The
    first `page_size * floor((L - R) / page_size)` of L tokens are quantized,
    the rest is the full-precision tail. Eviction keeps `kept_tokens` of L;
    on a KIVI cache (`KIVIH2O`) it frees whole quantized pages and never the
    tail, so with a tail of T tokens the whole pages of `kept_tokens` - T stay
    quantized; as T cycles through [R, R + page_size - 1] while decoding, the
    held bytes are averaged over those T (steady state once over budget).
    `KIVIQuest` reads its `top_k` quantized pages, the whole tail and the key
    scales and zeros of every quantized page (its bounds); its `dense_layers`
    read everything.

    Returns:
      dict(held=bytes per context token stored, read=bytes per context token a step reads).
    """
    spec = model.make_cache_spec(page_size=page_size, num_pages=1, max_seqs=1,
                                 max_pages_per_seq=1, dtype=cc.dtype)
    layers = spec.num_layers
    fp = jnp.dtype(cc.dtype).itemsize
    a = spec.attention
    if model.family == "deepseek":
        q_elems, fp_elems = a.kv_lora_rank, a.qk_rope_head_dim
    else:
        q_elems, fp_elems = 2 * a.kv_heads * a.head_dim, 0
    full = layers * (q_elems + fp_elems) * fp
    kept = context if kept_tokens is None else min(kept_tokens, context)
    if cc.bits is None:
        held = kept * full
        read = held if cc.read_budget is None else min(cc.read_budget, context) * full
    else:
        n_q = page_size * (max(context - cc.residual, 0) // page_size)
        n_t = context - n_q
        per_q = layers * (q_elems * (cc.bits / 8 + 4 / cc.group_size) + fp_elems * fp)
        held = n_q * per_q + n_t * full
        if isinstance(cc.policy, KIVIH2O) and context > kept:
            tails = range(cc.residual, cc.residual + page_size)
            held = sum(min(n_q, page_size * (max(kept - t, 0) // page_size)) * per_q
                       + t * full for t in tails) / page_size
        read = held
        if isinstance(cc.policy, KIVIQuest):
            bounds = layers * (q_elems // 2) * 4 / cc.group_size  # key scale + zero, f16
            sparse = (min(cc.policy.top_k * page_size, n_q) * per_q + n_t * full
                      + n_q * bounds)
            dense = min(cc.policy.dense_layers, layers) / layers  # these layers read all
            read = dense * held + (1 - dense) * sparse
    return dict(held=held / context, read=read / context)
