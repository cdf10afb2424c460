"""Independent references for the composition matrix (tests/test_composition.py).

Every expectation of the matrix comes from here, and nothing here runs the code the
matrix tests: no kvjax cache, page table, attention op, cache policy, sharding plan,
decode loop or model forward. Each family is written again from its definition (the
HuggingFace architecture kvjax's model tests compare against) in NumPy float64, reading
only the params pytree and the config's numbers.

  * `dense_greedy` / `dense_beams`: lossless cells (float32 pages, no policy). Greedy
    decoding (or beam search) by re-running the family's dense causal forward on the
    growing sequence: no cache, no state carried between steps.
  * `Simulation`: every other cell. One sequence is fed as the engine feeds it (prompt
    chunks of `chunk` tokens, then one token per step), and each token's keys and values
    are kept by text position in plain arrays, in the form the page kind stores them:
    rounded to bfloat16, or KIVI fake-quantized (keys per channel over a page's tokens,
    values (MLA: the latent) per token in channel groups, the most recent `residual` to
    `residual + page_size - 1` tokens in full precision; the rounding kvjax/cache/quant.py
    documents: zero rounded down and scale rounded up to float16, codes to nearest). A
    policy is its keep set, the tokens each layer (and KV head) may attend to, computed
    from this computation's own attention scores as each policy's paper and docstring
    define it: StreamingLLM (sinks + recent window), H2O (accumulated attention within a
    budget), SnapKV and PyramidKV (pooled observation-window votes at prefill, per-layer
    budgets), Quest (query-aware page bounds at decode); on KIVI pages their
    page-granular forms (whole quantized pages go, the full-precision tail stays).

Conditioning. A float64 reference and the float32 engine agree to rounding, not to the
bit, so a decision taken on a near-tie (two logits, two tokens' scores at a budget's
cut, two experts, ...) could go either way. Every such decision reports its margin to a
`Conditioning`; a case is used only when every margin is clear (`ok`), and the test draws
other prompts otherwise. Exact ties that both sides break the same way (max-pooled votes
sharing one source, indexer scores that are exactly 0) are resolved by the documented
rule (the earlier position first) instead.
"""

import copy
import dataclasses

import ml_dtypes
import numpy as np

__all__ = ["Conditioning", "Setup", "family_reference", "dense_logits", "dense_greedy",
           "dense_beams", "Simulation", "simulate_greedy", "simulate_beams", "fake_quantize",
           "pyramid_budgets"]

# Margins a decision must clear (float32 engine against float64 reference).
TOKEN_MARGIN = 1e-2  # logits and log-probs, absolute: 7x the largest difference seen
# between the engine's log-probabilities and the reference's (1.3e-3, a KIVI int4 cell)
REL_MARGIN = 1e-4  # scores at a cut, relative (float32 sums against float64 ones)
ABS_MARGIN = 1e-12


# ----------------------------------------------------------------------------- conditioning


class Conditioning:
    """Collects the margins of a run's discrete decisions; `ok` when all are clear."""

    def __init__(self):
        self.failures: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.failures

    def cut(self, what: str, values, k: int, ties_ok: bool = False,
            margin: float | None = None) -> None:
        """Keeping the k largest of `values`: the k-th and (k + 1)-th must be apart (or
        exactly equal, where `ties_ok`: the engine breaks such ties as the reference), by
        `margin`, or by default relatively (REL_MARGIN)."""
        v = np.sort(np.asarray(values, np.float64))[::-1]
        if k <= 0 or k >= v.size:
            return
        a, b = v[k - 1], v[k]
        if ties_ok and a == b:
            return
        if margin is None:
            margin = REL_MARGIN * (abs(a) + abs(b)) + ABS_MARGIN
        if a - b <= margin:
            self.failures.append(f"{what}: {a!r} vs {b!r} at the cut {k} of {v.size}")

    def argmax(self, what: str, logits) -> int:
        top = np.sort(np.asarray(logits))[::-1]
        if top[0] - top[1] <= TOKEN_MARGIN:
            self.failures.append(f"{what}: top logits {top[0]:.6f} and {top[1]:.6f}")
        return int(np.argmax(logits))


def top_k(values, k: int) -> np.ndarray:
    """Indices of the k largest values, the lower index first among equal ones."""
    return np.argsort(-np.asarray(values), kind="stable")[:k]


# ----------------------------------------------------------------------------- math


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _rms_1p(x, w, eps):  # Qwen3-Next's (1 + weight) RMSNorm
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x):
    m = np.max(x, -1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _soft_cap(x, cap):
    return x if cap is None else cap * np.tanh(x / cap)


def _swiglu(x, gate, up, down):
    return (_silu(x @ gate) * (x @ up)) @ down


def _rope(x, positions, rope, interleaved=None):
    """Rotates the first `rope.dim` channels of x [T, heads, D] at `positions` [T]."""
    if rope.rope_type not in ("default", "linear"):
        raise NotImplementedError(f"reference RoPE: {rope.rope_type!r}")
    dim = rope.dim
    half = dim // 2
    inv = float(rope.theta) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rope.rope_type == "linear":  # positions divided by the factor
        inv = inv / float(rope.factor)
    a = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(a)[:, None, :], np.sin(a)[:, None, :]
    xr, rest = x[..., :dim], x[..., dim:]
    if rope.interleaved if interleaved is None else interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return np.concatenate([out, rest], -1)


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _numpy(params):
    import jax

    return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def _at(stack, i):
    return None if stack is None else stack[i]


def _lin(x, w, b=None):
    return x @ w if b is None else x @ w + b


# ----------------------------------------------------------------------------- families
#
# `run(tokens, positions, attend, state, cond)` is one forward over new tokens: `attend(
# layer, q, k, v, scale, index, window, softcap)` is the attention of cache layer `layer`
# for the call's queries q [n, q_heads, dk] over keys k [n, kv_heads, dk] and values v
# [n, kv_heads, dv] of the new tokens (MLA: the absorbed form, one latent head, k = [c_KV,
# k_rope], v None: the values are c_KV); a query at text position p sees only keys at
# positions > p - window when `window` is set (Gemma's local layers), and its logits
# (after the scale) become softcap * tanh(logits / softcap) when `softcap` is set;
# `state` holds recurrent layers' states (Qwen3-Next). Returns float64 logits [n, vocab].


class _Llama:
    """Llama / Qwen2 (q/k/v biases, tied embeddings)."""

    def __init__(self, config, params):
        c = config
        if c.sliding_windows is not None:
            raise NotImplementedError("reference: sliding windows")
        self.c, self.p = c, _numpy(params)
        self.cache_layers, self.kv_heads, self.q_heads = c.num_layers, c.kv_heads, c.q_heads
        self.latent = None
        self.dk = self.dv = c.head_dim

    def run(self, tokens, positions, attend, state, cond):
        c, p, lp = self.c, self.p, self.p.layers
        n, eps = len(tokens), c.rms_norm_eps
        x = p.embed[tokens]
        for i in range(c.num_layers):
            h = _rms(x, lp.attn_norm[i], eps)
            q = _lin(h, lp.wq[i], _at(lp.bq, i)).reshape(n, c.q_heads, c.head_dim)
            k = _lin(h, lp.wk[i], _at(lp.bk, i)).reshape(n, c.kv_heads, c.head_dim)
            v = _lin(h, lp.wv[i], _at(lp.bv, i)).reshape(n, c.kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = _rms(q, lp.q_norm[i], eps), _rms(k, lp.k_norm[i], eps)
            q, k = _rope(q, positions, c.rope), _rope(k, positions, c.rope)
            out = attend(i, q, k, v, c.head_dim ** -0.5, None)
            x = x + _lin(out.reshape(n, -1), lp.wo[i], _at(lp.bo, i))
            h = _rms(x, lp.mlp_norm[i], eps)
            x = x + _lin(_silu(_lin(h, lp.w_gate[i], _at(lp.b_gate, i)))
                         * _lin(h, lp.w_up[i], _at(lp.b_up, i)), lp.w_down[i], _at(lp.b_down, i))
        x = _rms(x, p.final_norm, eps)
        return x @ p.embed.T if p.lm_head is None else x @ p.lm_head


class _DeepSeek:
    """DeepSeek-V2/V3 MLA + MoE; with an indexer config, DeepSeek-V3.2's sparse attention."""

    def __init__(self, config, params):
        c = config
        self.c, self.p = c, _numpy(params)
        self.cache_layers, self.kv_heads, self.q_heads = c.num_layers, 1, c.num_heads
        self.latent = c.kv_lora_rank
        self.dk, self.dv = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
        self.indexer = hasattr(c, "index_topk")
        groups = [(self.p.dense_layers, False)] * c.num_dense_layers
        groups += [(self.p.moe_layers, True)] * c.num_moe_layers
        counts = {False: 0, True: 0}
        self.layers = []
        for g, moe in groups:
            self.layers.append((g, counts[moe], moe))
            counts[moe] += 1
        if c.topk_method == "group_limited_greedy" or (c.topk_method == "noaux_tc"
                                                       and c.n_group > 1):
            raise NotImplementedError("reference: grouped routing")

    def _moe(self, g, i, h, cond):
        c, m = self.c, g.moe
        logits = h @ m.router[i].T
        if c.scoring_func == "softmax":
            scores = _softmax(logits)
            choice = scores
        else:
            scores = _sigmoid(logits)
            choice = scores + (0.0 if m.bias is None else m.bias[i])
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            cond.cut("MoE routing", choice[t], c.num_experts_per_tok)
            idx = top_k(choice[t], c.num_experts_per_tok)
            w = scores[t, idx]
            if c.norm_topk_prob:
                w = w / (w.sum() + 1e-20)
            w = w * c.routed_scaling_factor
            for e, we in zip(idx, w, strict=True):
                out[t] += we * _swiglu(h[t], m.experts.gate[i, e], m.experts.up[i, e],
                                       m.experts.down[i, e])
        if m.shared is not None:
            out = out + _swiglu(h, m.shared.gate[i], m.shared.up[i], m.shared.down[i])
        return out

    def run(self, tokens, positions, attend, state, cond):
        c, p = self.c, self.p
        n, eps = len(tokens), c.rms_norm_eps
        dn, dr, dc = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        x = p.embed[tokens]
        for layer, (g, i, moe) in enumerate(self.layers):
            h = _rms(x, g.input_norm[i], eps)
            if c.q_lora_rank is None:
                q = h @ g.q_proj[i]
            else:
                q_resid = _rms(h @ g.q_a_proj[i], g.q_a_norm[i], 1e-6)
                q = q_resid @ g.q_b_proj[i]
            q = q.reshape(n, c.num_heads, dn + dr)
            kv = h @ g.kv_a_proj[i]
            c_kv = _rms(kv[:, :dc], g.kv_a_norm[i], 1e-6)
            q_rope = _rope(q[..., dn:], positions, c.rope)
            k_rope = _rope(kv[:, None, dc:], positions, c.rope)[:, 0]
            q_lat = np.einsum("thn,hnc->thc", q[..., :dn], g.w_uk[i])
            qq = np.concatenate([q_lat, q_rope], -1)
            kk = np.concatenate([c_kv, k_rope], -1)[:, None]
            index = None
            if self.indexer:
                ix = g.indexer
                hi, di = c.index_n_heads, c.index_head_dim
                qi = (q_resid @ ix.q_b[i]).reshape(n, hi, di)
                ki = _layer_norm(h @ ix.k_proj[i], ix.k_norm[i], ix.k_norm_bias[i], 1e-6)
                qi = np.concatenate([_rope(qi[..., :dr], positions, c.rope, False),
                                     qi[..., dr:]], -1)
                ki = np.concatenate([_rope(ki[:, None, :dr], positions, c.rope, False)[:, 0],
                                     ki[:, dr:]], -1)
                wi = (h @ ix.weights_proj[i]) * hi ** -0.5
                index = (qi, ki, wi, di ** -0.5, c.index_topk)
            scale = (c.qk_nope_head_dim + dr) ** -0.5
            out = attend(layer, qq, kk, None, scale, index)  # [n, heads, dc]
            o = np.einsum("thc,hcv->thv", out, g.w_uv[i]).reshape(n, -1) @ g.o_proj[i]
            x = x + o
            h = _rms(x, g.post_norm[i], eps)
            x = x + (self._moe(g, i, h, cond) if moe
                     else _swiglu(h, g.mlp.gate[i], g.mlp.up[i], g.mlp.down[i]))
        x = _rms(x, p.final_norm, eps)
        return x @ p.embed.T if c.tie_word_embeddings else x @ p.lm_head


class _Qwen3Next:
    """Qwen3-Next: Gated DeltaNet layers (recurrent) and gated full-attention layers."""

    def __init__(self, config, params):
        c = config
        if c.num_experts:
            raise NotImplementedError("reference: Qwen3-Next MoE")
        self.c, self.p = c, _numpy(params)
        self.cache_layers, self.kv_heads, self.q_heads = c.num_layers, c.kv_heads, c.q_heads
        self.latent = None
        self.dk = self.dv = c.head_dim

    def _delta(self, j, h, state):
        c, lp = self.c, self.p.linear
        nk, nv, dk, dv = (c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        kw, width = c.linear_key_width, c.linear_conv_kernel
        n = h.shape[0]
        conv, s = state.get(j, (np.zeros((width - 1, c.conv_dim)), np.zeros((nv, dk, dv))))
        mixed = h @ lp.w_qkvz[j]
        mixed, z = mixed[:, :c.conv_dim], mixed[:, c.conv_dim:]
        ba = h @ lp.w_ba[j]
        b, a = ba[:, :nv], ba[:, nv:]
        seq = np.concatenate([conv, mixed], 0)  # the last width - 1 inputs first
        w = lp.conv[j]  # [channels, width], w[:, -1] on the newest input
        mixed = _silu(sum(seq[m:m + n] * w[:, m] for m in range(width)))
        conv = seq[-(width - 1):]

        def l2(x):
            return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)

        q = np.repeat(l2(mixed[:, :kw].reshape(n, nk, dk)) * dk ** -0.5, nv // nk, axis=1)
        k = np.repeat(l2(mixed[:, kw:2 * kw].reshape(n, nk, dk)), nv // nk, axis=1)
        v = mixed[:, 2 * kw:].reshape(n, nv, dv)
        beta = _sigmoid(b)
        g = -np.exp(lp.a_log[j]) * np.logaddexp(0.0, a + lp.dt_bias[j])
        o = np.zeros((n, nv, dv))
        for t in range(n):  # the gated delta rule, token by token
            s = s * np.exp(g[t])[:, None, None]
            delta = (v[t] - np.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hk,hkv->hv", q[t], s)
        state[j] = (conv, s)
        o = lp.norm[j] * (o / np.sqrt(np.mean(o * o, -1, keepdims=True) + c.rms_norm_eps))
        o = o * _silu(z.reshape(n, nv, dv))
        return o.reshape(n, -1) @ lp.w_out[j]

    def run(self, tokens, positions, attend, state, cond):
        c, p = self.c, self.p
        n, eps = len(tokens), c.rms_norm_eps
        x = p.embed[tokens]
        full = linear = mlp = 0
        for i, kind in enumerate(c.layer_types):
            h = _rms_1p(x, p.input_norm[i], eps)
            if kind == "full_attention":
                a, j = p.full, full
                full += 1
                q = _lin(h, a.wq[j], _at(a.bq, j)).reshape(n, c.q_heads, c.head_dim)
                gate = _lin(h, a.w_gate[j], _at(a.b_gate, j))
                k = _lin(h, a.wk[j], _at(a.bk, j)).reshape(n, c.kv_heads, c.head_dim)
                v = _lin(h, a.wv[j], _at(a.bv, j)).reshape(n, c.kv_heads, c.head_dim)
                q = _rope(_rms_1p(q, a.q_norm[j], eps), positions, c.rope)
                k = _rope(_rms_1p(k, a.k_norm[j], eps), positions, c.rope)
                out = attend(j, q, k, v, c.head_dim ** -0.5, None)
                x = x + _lin(out.reshape(n, -1) * _sigmoid(gate), a.wo[j], _at(a.bo, j))
            else:
                x = x + self._delta(linear, h, state)
                linear += 1
            h = _rms_1p(x, p.post_norm[i], eps)
            x = x + _swiglu(h, p.mlp.gate[mlp], p.mlp.up[mlp], p.mlp.down[mlp])
            mlp += 1
        x = _rms_1p(x, p.final_norm, eps)
        return x @ p.embed.T if p.lm_head is None else x @ p.lm_head


class _Gemma:
    """Gemma 2 / Gemma 3 (transformers' `Gemma3DecoderLayer`): local layers attend to the
    last `sliding_window` positions, global layers to all; (1 + w) RMSNorms before and
    after attention and MLP; q and k normalised per head (Gemma 3); each layer type's
    RoPE; queries scaled by query_pre_attn_scalar^-1/2; the embedding times
    sqrt(hidden_size); a tanh-GELU gated MLP; tied embeddings; optional soft caps on the
    attention logits and the output logits (Gemma 2's)."""

    def __init__(self, config, params):
        c = config
        self.c, self.p = c, _numpy(params)
        self.cache_layers, self.kv_heads, self.q_heads = c.num_layers, c.kv_heads, c.q_heads
        self.latent = None
        self.dk = self.dv = c.head_dim
        local = [t == "sliding_attention" for t in c.layer_types]
        self.windows = [c.sliding_window if is_local else None for is_local in local]
        self.ropes = [c.rope_local if is_local else c.rope_global for is_local in local]

    def run(self, tokens, positions, attend, state, cond):
        c, p, lp = self.c, self.p, self.p.layers
        n, eps = len(tokens), c.rms_norm_eps
        x = p.embed[tokens] * np.sqrt(c.hidden_size)
        for i in range(c.num_layers):
            h = _rms_1p(x, lp.attn_norm[i], eps)
            q = (h @ lp.wq[i]).reshape(n, c.q_heads, c.head_dim)
            k = (h @ lp.wk[i]).reshape(n, c.kv_heads, c.head_dim)
            v = (h @ lp.wv[i]).reshape(n, c.kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = _rms_1p(q, lp.q_norm[i], eps), _rms_1p(k, lp.k_norm[i], eps)
            q, k = _rope(q, positions, self.ropes[i]), _rope(k, positions, self.ropes[i])
            out = attend(i, q, k, v, float(c.query_pre_attn_scalar) ** -0.5, None,
                         self.windows[i], c.attn_softcap)
            x = x + _rms_1p(out.reshape(n, -1) @ lp.wo[i], lp.post_attn_norm[i], eps)
            h = _rms_1p(x, lp.mlp_norm[i], eps)
            h = (_gelu_tanh(h @ lp.w_gate[i]) * (h @ lp.w_up[i])) @ lp.w_down[i]
            x = x + _rms_1p(h, lp.post_mlp_norm[i], eps)
        x = _rms_1p(x, p.final_norm, eps)
        return _soft_cap(x @ p.embed.T if p.lm_head is None else x @ p.lm_head,
                         c.final_softcap)


def family_reference(family: str, config, params):
    """The reference model of a family ("llama" covers Qwen2), from its config and params."""
    if family in ("llama", "qwen2"):
        return _Llama(config, params)
    if family in ("deepseek", "deepseek_v32"):
        return _DeepSeek(config, params)
    if family == "qwen3_next":
        return _Qwen3Next(config, params)
    if family == "gemma":
        return _Gemma(config, params)
    raise ValueError(f"no reference for family {family!r}")


def _indexer_keep(index, i, keys, visible, cond):
    """DeepSeek-V3.2's lightning indexer for query i: the `topk` visible tokens of the
    highest score sum_h w[h] relu(scale q[h] . k) (the earlier position on ties)."""
    qi, _, wi, scale, k = index
    pre = scale * np.einsum("hd,sd->sh", qi[i], keys)
    score = np.maximum(pre, 0.0) @ wi[i]
    seen = np.nonzero(visible)[0]
    if seen.size <= k:
        return visible
    # Exactly-zero relu terms tie on both sides; near-zero ones could differ in sign.
    if np.any(np.abs(pre[seen]) < 1e-5):
        cond.failures.append("indexer: a pre-relu score within 1e-5 of 0")
    cond.cut("indexer top-k", score[seen], k, ties_ok=True)
    keep = seen[top_k(score[seen], k)]
    out = np.zeros_like(visible)
    out[keep] = True
    return out


# ----------------------------------------------------------------------------- dense forward


def _attention(q, keys, values, scale, masks, index, cond, latent, softcap=None):
    """Softmax attention of q [n, q_heads, dk] over keys [s, kv_heads, dk] and values
    [s, kv_heads, dv] (None: MLA, the first `latent` key channels), one bool mask
    [n, s] per KV head, the scaled logits soft-capped by `softcap` (None: not). Returns
    (out [n, q_heads, dv], probs [n, q_heads, s])."""
    n, hq, _ = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    if values is None:
        values = keys[..., :latent]
    out = np.zeros((n, hq, values.shape[-1]))
    probs = np.zeros((n, hq, keys.shape[0]))
    for h in range(hkv):
        mask = masks[h]
        if index is not None:  # DeepSeek-V3.2: each query reads its indexer top-k only
            mask = np.stack([_indexer_keep(index, i, index[1], mask[i], cond)
                             for i in range(n)])
        sl = slice(h * group, (h + 1) * group)
        logits = _soft_cap(np.einsum("ngd,sd->ngs", q[:, sl], keys[:, h]) * scale, softcap)
        p = _softmax(np.where(mask[:, None, :], logits, -np.inf))
        p = np.where(mask[:, None, :], p, 0.0)
        probs[:, sl] = p
        out[:, sl] = np.einsum("ngs,sd->ngd", p, values[:, h])
    return out, probs


def dense_logits(model, tokens, cond):
    """The dense causal forward over a whole sequence: logits [T, vocab]."""
    n = len(tokens)

    def attend(layer, q, k, v, scale, index, window=None, softcap=None):
        mask = np.tril(np.ones((n, n), bool))
        if window is not None:  # key j visible to query i when i - j < window
            mask &= np.triu(np.ones((n, n), bool), 1 - window)
        return _attention(q, k, v, scale, [mask] * k.shape[1], index, cond, model.latent,
                          softcap)[0]

    return model.run(np.asarray(tokens), np.arange(n), attend, {}, cond)


def dense_greedy(model, prompt, new: int, cond: Conditioning):
    """Greedy tokens of `prompt`: the dense forward re-run on the growing sequence."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(cond.argmax("greedy token", dense_logits(model, seq, cond)[-1]))
    return np.asarray(seq[len(prompt):], np.int32)


def _beam_search(start, width: int, new: int, logits_of, cond: Conditioning):
    """Beam search over summed log-probabilities (all beams run `new` steps), from the
    prompt's state `start`; `logits_of(state, token) -> (state, logits)` feeds one token.
    Returns (tokens [width, new] best first, scores [width])."""
    state0, logits0 = start
    states = [state0] * width
    logits = np.repeat(logits0[None], width, 0)
    scores = np.full(width, -1e9)
    scores[0] = 0.0
    hist = np.zeros((width, 0), np.int32)
    for t in range(new):
        cand = (scores[:, None] + _log_softmax(logits)).reshape(-1)
        cond.cut(f"beam step {t}", cand, width, margin=TOKEN_MARGIN)
        best = top_k(cand, width)
        vocab = logits.shape[1]
        parent, tok = best // vocab, best % vocab
        scores = cand[best]
        hist = np.concatenate([hist[parent], tok[:, None].astype(np.int32)], 1)
        if t + 1 < new:
            fed = [logits_of(copy.deepcopy(states[b]), int(x))
                   for b, x in zip(parent, tok, strict=True)]
            states = [s for s, _ in fed]
            logits = np.stack([lg for _, lg in fed])
    cond.cut("beam order", scores, 1, margin=TOKEN_MARGIN)
    order = np.argsort(-scores, kind="stable")
    return hist[order], scores[order]


def dense_beams(model, prompt, width: int, new: int, cond: Conditioning):
    """Beam search with each beam's logits from the dense forward of its whole sequence."""
    def logits_of(seq, tok):
        seq = [*seq, tok]
        return seq, dense_logits(model, seq, cond)[-1]

    return _beam_search((list(prompt), dense_logits(model, prompt, cond)[-1]), width, new,
                        logits_of, cond)


# ----------------------------------------------------------------------------- page kinds


def _f16_down(x32):
    y = x32.astype(np.float16)
    return np.where(y.astype(np.float32) > x32, np.nextafter(y, np.float16(-np.inf)), y)


def _f16_up(x32):
    y = x32.astype(np.float16)
    return np.where(y.astype(np.float32) < x32, np.nextafter(y, np.float16(np.inf)), y)


def fake_quantize(x, bits: int, axis: int):
    """KIVI's asymmetric min/max quantization of the groups of x along `axis` (the rest are
    separate groups), as kvjax/cache/quant.py documents it: float32 arithmetic, zero z =
    the group minimum rounded down to float16, scale s = (max - z) / (2^b - 1) rounded up
    to float16, code = round((x - z) / s) clipped to [0, 2^b - 1] (0 where s = 0).

    Returns (x_hat = code * s + z float64, s, z), s and z float16 with `axis` kept (size 1).
    """
    x32 = np.asarray(x, np.float32)
    levels = np.float32((1 << bits) - 1)
    z = _f16_down(np.min(x32, axis=axis, keepdims=True))
    z32 = z.astype(np.float32)
    s = _f16_up((np.max(x32, axis=axis, keepdims=True) - z32) / levels)
    s32 = s.astype(np.float32)
    code = np.round((x32 - z32) / np.where(s32 > 0, s32, np.float32(1)))
    code = np.where(s32 > 0, np.clip(code, np.float32(0), levels), np.float32(0))
    return (code * s32 + z32).astype(np.float64), s, z


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the engine is asked to run: the page kind and policy (settings only).

    Attributes:
      cache: "float32", "bfloat16", "int8", "int4" or "int2" (KIVI, float32 tail).
      policy: a kvjax policy dataclass (its settings are read, never its methods) or None.
      page_size, group_size, residual: the paging and KIVI settings.
      chunk: prefill chunk length.
      max_len: the longest sequence (sizes the reference's arrays).
      max_tokens: tokens a sequence could hold (max_pages_per_seq * page_size): a policy
        whose budget reaches it never acts.
    """

    cache: str
    policy: object
    page_size: int
    group_size: int
    residual: int
    chunk: int
    max_len: int
    max_tokens: int

    @property
    def bits(self) -> int | None:
        return int(self.cache[3:]) if self.cache.startswith("int") else None

    @property
    def policy_name(self) -> str:
        return "none" if self.policy is None else type(self.policy).__name__


def _pool(x, kernel: int, cond: Conditioning):
    """SnapKV's pooling: centred 1-D max-pooling along the last axis, stride 1, zero
    padding (kernel // 2 before, the rest after)."""
    half = kernel // 2
    pad = [(0, 0)] * (x.ndim - 1) + [(half, kernel - 1 - half)]
    windows = np.stack([np.pad(x, pad)[..., i:i + x.shape[-1]] for i in range(kernel)])
    top2 = np.sort(windows, axis=0)[-2:]
    near = (top2[1] > top2[0]) & (top2[1] - top2[0] <= REL_MARGIN * top2[1])
    if np.any(near & (top2[1] > 0)):
        cond.failures.append("SnapKV pooling: two votes within the margin in one window")
    return windows.max(axis=0)


def pyramid_budgets(policy, layers: int, page_size: int) -> list[int]:
    """PyramidKV's per-layer budgets (its docstring): an arithmetic sequence from the bottom
    layer's 2 * budget - top down to the top layer's budget / beta, each rounded up so that
    the largest budget minus it is whole pages."""
    top = policy.budget / policy.beta
    bottom = 2 * policy.budget - top
    raw = ([float(policy.budget)] if layers == 1
           else [bottom - (bottom - top) * i / (layers - 1) for i in range(layers)])
    b_max = int(raw[0])
    return [b_max - int((b_max - r) // page_size) * page_size for r in raw]


# ----------------------------------------------------------------------------- simulation


class Simulation:
    """One sequence fed through the engine's schedule, stored as its page kind stores it,
    attending only to what its policy keeps (see the module docstring).

    State, all by text position: `K`, `V` per cache layer `[max_len, kv_heads, d]` as
    stored (full precision or bf16-rounded), `Kq`, `Vq` the dequantized KIVI copies once a
    token's page is quantized, `KI` the indexer keys (DeepSeek-V3.2); `held[layer][head]`
    the positions each (layer, KV head) holds, in slot order; `n_quant` the held tokens in
    quantized pages (KIVI); the policy's scores and read restrictions.
    """

    def __init__(self, model, setup: Setup, cond: Conditioning):
        self.m, self.s, self.cond = model, setup, cond
        L, H, n = model.cache_layers, model.kv_heads, setup.max_len
        self.K = np.zeros((L, n, H, model.dk))
        self.V = None if model.latent else np.zeros((L, n, H, model.dv))
        self.Kq, self.Vq = self.K.copy(), None if self.V is None else self.V.copy()
        self.KI = None
        self.pages: list[dict] = []  # quantized pages: positions and per-layer scale/zero
        self.held = [[np.zeros(0, np.int64) for _ in range(H)] for _ in range(L)]
        self.n_quant = 0
        self.length = 0  # tokens fed
        self.rec: dict = {}
        self.scores = (np.zeros(n) if setup.bits else np.zeros((L, H, n)))  # H2O
        self.read_from = [0] * L  # PyramidKV, full-precision pages: first slot read
        self.dropped = [set() for _ in range(L)]  # PyramidKV, KIVI: pages (first pos) unread

    # -- storage

    @property
    def held_count(self) -> int:
        return len(self.held[0][0])

    def _store(self, x):
        return _bf16(x) if self.s.cache == "bfloat16" else x

    def _quantize_page(self, layer, pos):
        """KIVI: the page holding tokens `pos` (page_size of them), layer `layer`."""
        s, m = self.s, self.m
        g = s.group_size
        keys = self.K[layer, pos]  # [ps, heads, dk]
        meta = {}
        if m.latent:  # c_KV per token in channel groups; k_rope stays full precision
            lat = keys[..., :m.latent].reshape(len(pos), 1, m.latent // g, g)
            deq, sc, z = fake_quantize(lat, s.bits, axis=-1)
            self.Kq[layer, pos] = np.concatenate(
                [deq.reshape(len(pos), 1, m.latent), keys[..., m.latent:]], -1)
            meta["c_scale"], meta["c_zero"] = sc[..., 0], z[..., 0]  # [ps, 1, dc / G]
        else:  # keys per channel over G tokens, values per token over G channels
            kg = keys.reshape(len(pos) // g, g, *keys.shape[1:])
            deq, sc, z = fake_quantize(kg, s.bits, axis=1)
            self.Kq[layer, pos] = deq.reshape(keys.shape)
            meta["k_scale"], meta["k_zero"] = sc[:, 0], z[:, 0]  # [ps / G, heads, dk]
            vals = self.V[layer, pos]
            vg = vals.reshape(*vals.shape[:-1], vals.shape[-1] // g, g)
            deq, sc, z = fake_quantize(vg, s.bits, axis=-1)
            self.Vq[layer, pos] = deq.reshape(vals.shape)
            meta["v_scale"], meta["v_zero"] = sc[..., 0], z[..., 0]  # [ps, heads, dv / G]
        return meta

    def _view(self, layer, head, slots_pos, n_quant):
        """Keys and values of slots (positions in slot order) as attention reads them."""
        quant = (np.arange(len(slots_pos)) < n_quant)[:, None]
        k = np.where(quant, self.Kq[layer, slots_pos, head], self.K[layer, slots_pos, head])
        if self.V is None:
            return k, None
        v = np.where(quant, self.Vq[layer, slots_pos, head], self.V[layer, slots_pos, head])
        return k, v

    # -- one call (a prefill chunk or a decode step)

    def feed(self, tokens, decode: bool):
        """Feeds `tokens` (one call of the engine); returns their logits [n, vocab]."""
        s, m = self.s, self.m
        n = len(tokens)
        positions = np.arange(self.length, self.length + n)
        old = self.held_count
        for layer in self.held:
            for h in range(len(layer)):
                layer[h] = np.concatenate([layer[h], positions])
        total = old + n
        new_quant = self.n_quant
        if s.bits:  # Q(L) = page * floor(max(L - R, 0) / page): full pages beyond the tail
            new_quant = max(s.page_size * (max(total - s.residual, 0) // s.page_size),
                            self.n_quant)
        flushed = [self.held[0][0][a:a + s.page_size]
                   for a in range(self.n_quant, new_quant, s.page_size)]
        for pos in flushed:
            self.pages.append({"pos": pos})
        probs, queries = {}, {}

        def attend(layer, q, k, v, scale, index, window=None, softcap=None):
            self.K[layer, positions] = self._store(k)
            if v is not None:
                self.V[layer, positions] = self._store(v)
            if index is not None:
                if self.KI is None:
                    self.KI = np.zeros((m.cache_layers, s.max_len, index[1].shape[-1]))
                self.KI[layer, positions] = index[1]
            for page, pos in zip(self.pages[len(self.pages) - len(flushed):], flushed,
                                 strict=True):
                page[layer] = self._quantize_page(layer, pos)
            masks, keys, values = [], [], []
            for h in range(m.kv_heads):
                slots = self.held[layer][h]
                kh, vh = self._view(layer, h, slots, new_quant)
                keys.append(kh)
                values.append(vh)
                mask = np.arange(total)[None, :] <= old + np.arange(n)[:, None]
                if window is not None:  # by text position: held keys p - k < window
                    mask = mask & (slots[None, :] > positions[:, None] - window)
                if decode:
                    mask = mask & self._read(layer, h, q[0], kh, new_quant)[None]
                masks.append(mask)
            keys = np.stack(keys, 1)
            values = None if self.V is None else np.stack(values, 1)
            idx = None
            if index is not None:
                idx = (index[0], self.KI[layer, self.held[layer][0]], *index[2:])
            out, p = _attention(q, keys, values, scale, masks, idx, self.cond, m.latent,
                                softcap)
            probs[layer], queries[layer] = p, q
            return out

        logits = m.run(np.asarray(tokens), positions, attend, self.rec, self.cond)
        self.length += n
        self.n_quant = new_quant
        self._after(probs, n, decode)
        return logits

    # -- what decode reads (Quest, PyramidKV)

    def _read(self, layer, h, q, keys, n_quant):
        """bool[slots]: the slots decode attention of (layer, head h) reads; q the step's
        query [q_heads, dk], keys the head's keys as read [slots, dk]."""
        s, pol = self.s, self.s.policy
        total = len(keys)
        ps = s.page_size
        read = np.ones(total, bool)
        name = s.policy_name
        if name == "PyramidKV":
            if s.bits:
                for page in self.pages:
                    if int(page["pos"][0]) in self.dropped[layer]:
                        a = self._slot_of(page["pos"][0])
                        read[a:a + ps] = False
            else:
                read[:self.read_from[layer]] = False
        elif name == "Quest" and layer >= pol.dense_layers:
            group = self.m.q_heads // self.m.kv_heads
            qg = q[h * group:(h + 1) * group]
            if s.bits:  # quantized pages only; the tail is always read
                n_pages = n_quant // ps
                if n_pages > pol.top_k:
                    bounds = [self._quest_kivi_bound(layer, h, j, qg) for j in range(n_pages)]
                    self.cond.cut("Quest pages", bounds, pol.top_k)
                    read[:n_quant] = False
                    for j in top_k(bounds, pol.top_k):
                        read[j * ps:(j + 1) * ps] = True
            else:  # the current (last) page plus the top_k - 1 best older pages
                n_pages = -(-total // ps)
                if n_pages > pol.top_k:
                    bounds = []
                    for j in range(n_pages - 1):
                        kp = keys[j * ps:(j + 1) * ps]
                        bounds.append(_quest_bound(qg, kp.min(0), kp.max(0)))
                    self.cond.cut("Quest pages", bounds, pol.top_k - 1)
                    read[:(n_pages - 1) * ps] = False
                    for j in top_k(bounds, pol.top_k - 1):
                        read[j * ps:(j + 1) * ps] = True
        return read

    def _slot_of(self, pos) -> int:
        return int(np.nonzero(self.held[0][0] == pos)[0][0])

    def _quest_kivi_bound(self, layer, h, j, qg):
        """Quest's bound of quantized page j from what the page stores: per key channel the
        dequantized values lie in [z, z + s (2^b - 1)] (MLA: per token group of c_KV; the
        full-precision k_rope by its min / max)."""
        page = self.pages[j][layer]
        levels = (1 << self.s.bits) - 1
        if self.m.latent:
            sc, z = page["c_scale"].astype(np.float64), page["c_zero"].astype(np.float64)
            lo = np.minimum(z, z + sc * levels).min(0)[0]  # [dc / G]
            hi = np.maximum(z, z + sc * levels).max(0)[0]
            g = self.m.latent // lo.shape[-1]
            rope = self.K[layer, self.pages[j]["pos"], 0, self.m.latent:]
            lo = np.concatenate([np.repeat(lo, g), rope.min(0)])
            hi = np.concatenate([np.repeat(hi, g), rope.max(0)])
        else:
            sc = page["k_scale"][:, h].astype(np.float64)
            z = page["k_zero"][:, h].astype(np.float64)
            lo = np.minimum(z, z + sc * levels).min(0)
            hi = np.maximum(z, z + sc * levels).max(0)
        return _quest_bound(qg, lo, hi)

    # -- what the policy keeps

    def _after(self, probs, n, decode):
        s, pol = self.s, self.s.policy
        name = s.policy_name
        if name == "StreamingLLM":
            self._streaming_llm(pol)
        elif name == "H2O":
            self._h2o(pol, probs)
        elif name in ("SnapKV", "PyramidKV") and not decode:
            self._snap(pol, probs, n, pyramid=name == "PyramidKV")

    def _keep_all(self, fn):
        for layer in range(len(self.held)):
            for h in range(len(self.held[layer])):
                self.held[layer][h] = fn(layer, h, self.held[layer][h])

    def _drop_pages(self, drop_cols):
        """KIVI: removes quantized pages (columns of the held slots) from every layer."""
        ps = self.s.page_size
        if not len(drop_cols):
            return
        keep = np.ones(self.held_count, bool)
        for j in drop_cols:
            keep[j * ps:(j + 1) * ps] = False
        gone = {int(self.held[0][0][j * ps]) for j in drop_cols}
        self.pages = [p for p in self.pages if int(p["pos"][0]) not in gone]
        self._keep_all(lambda layer, h, held: held[keep])
        self.n_quant -= ps * len(drop_cols)

    def _streaming_llm(self, pol):
        budget, total = pol.n_sink + pol.window, self.held_count
        if self.s.max_tokens <= budget or total <= budget:
            return
        if self.s.bits:  # the oldest quantized pages after the sink pages go
            ps = self.s.page_size
            sink_pages = -(-pol.n_sink // ps)
            cols = list(range(sink_pages, self.n_quant // ps))
            self._drop_pages(cols[:-(-(total - budget) // ps)])
            return
        self._keep_all(lambda layer, h, held: np.concatenate(
            [held[:pol.n_sink], held[total - pol.window:]]))

    def _h2o(self, pol, probs):
        """Scores add every query's attention; over budget, keep the recent window and the
        highest-scored older tokens (KIVI: the lowest-mass quantized pages go)."""
        s = self.s
        total = self.held_count
        ps = s.page_size
        group = self.m.q_heads // self.m.kv_heads
        for layer, p in probs.items():
            for h in range(self.m.kv_heads):
                mass = p[:, h * group:(h + 1) * group].sum(axis=(0, 1))  # over held slots
                if s.bits:
                    self.scores[self.held[layer][h]] += mass
                else:
                    self.scores[layer, h, self.held[layer][h]] += mass
        if total <= pol.budget:
            return
        if s.bits:
            n_pages = self.n_quant // ps
            mass = [self.scores[self.held[0][0][j * ps:(j + 1) * ps]].sum()
                    for j in range(n_pages)]
            k = min(-(-(total - pol.budget) // ps), n_pages)
            self.cond.cut("H2O pages", -np.asarray(mass), k)
            self._drop_pages(top_k(-np.asarray(mass), k))
            return
        if pol.budget >= s.max_tokens:
            return
        recent = pol.budget // 2 if pol.recent is None else pol.recent

        def keep(layer, h, held):
            older = self.scores[layer, h, held[:total - recent]]
            self.cond.cut("H2O tokens", older, pol.budget - recent)
            top = np.sort(top_k(older, pol.budget - recent))
            return np.concatenate([held[top], held[total - recent:]])

        self._keep_all(keep)

    def _votes(self, pol, probs, n, cond):
        """SnapKV's votes [layers, kv_heads, slots]: the observation window's (the chunk's
        last min(window, n) queries) attention summed per prefix slot, pooled, averaged over
        the KV head's query group; 0 for the window and beyond."""
        total = self.held_count
        w = min(pol.window, n)
        prefix = total - w
        group = self.m.q_heads // self.m.kv_heads
        out = np.zeros((self.m.cache_layers, self.m.kv_heads, total))
        for layer, p in probs.items():
            v = p[n - w:].sum(0)  # [q_heads, slots]
            v[:, prefix:] = 0.0
            v = _pool(v, pol.kernel, cond)
            v = v.reshape(self.m.kv_heads, group, total).mean(1)
            v[:, prefix:] = 0.0
            out[layer] = v
        return out, w

    def _snap(self, pol, probs, n, pyramid):
        """SnapKV / PyramidKV after a prefill chunk: keep each layer's budget (per KV
        head: the top-voted older tokens plus the window; KIVI: the lowest-voted quantized
        pages before the window go, and PyramidKV's smaller layers stop reading their own
        lowest-voted pages)."""
        s, ps = self.s, self.s.page_size
        total = self.held_count
        layers = self.m.cache_layers
        budgets = (pyramid_budgets(pol, layers, ps) if pyramid else [pol.budget] * layers)
        b_max = budgets[0]
        if b_max >= s.max_tokens:
            self.read_from = [0] * layers
            return
        if s.bits:
            n_pages = self.n_quant // ps
            first_window_page = (total - min(pol.window, n)) // ps
            evictable = [j for j in range(n_pages) if j < first_window_page]
            k = int(np.clip(-(-(total - b_max) // ps), 0, len(evictable)))
            if k == 0 and not pyramid:
                return
            votes, _ = self._votes(pol, probs, n, self.cond)

            def page_mass(m_, j):
                return m_[j * ps:(j + 1) * ps].sum()

            pm = np.asarray([page_mass(votes.sum(axis=(0, 1)), j) for j in evictable])
            self.cond.cut("SnapKV pages", -pm, k)
            drop = [evictable[j] for j in top_k(-pm, k)]
            kept_cols = [j for j in range(-(-total // ps)) if j not in drop]
            self._drop_pages(drop)
            if pyramid:  # each layer stops reading its own lowest-voted prompt pages
                total = self.held_count
                n_pages = self.n_quant // ps
                self.dropped = [set() for _ in range(layers)]
                for layer, b in enumerate(budgets):
                    lv = votes[layer].sum(0)
                    cand = [j for j in range(n_pages) if kept_cols[j] < first_window_page]
                    k = int(np.clip(-(-(total - b) // ps), 0, len(cand)))
                    pm = np.asarray([page_mass(lv, kept_cols[j]) for j in cand])
                    self.cond.cut("PyramidKV layer pages", -pm, k)
                    for j in top_k(-pm, k):
                        self.dropped[layer].add(int(self.held[0][0][cand[j] * ps]))
            return
        if total <= b_max:
            self.read_from = [0] * layers
            return
        votes, _ = self._votes(pol, probs, n, self.cond)

        def keep(layer, h, held):
            b = budgets[layer]
            older = votes[layer, h, :total - pol.window]
            self.cond.cut("SnapKV tokens", older, b - pol.window, ties_ok=True)
            top = np.sort(top_k(older, b - pol.window))
            kept = np.concatenate([held[top], held[total - pol.window:]])
            return np.concatenate([held[:b_max - b], kept])  # PyramidKV: unread front slots

        self._keep_all(keep)
        self.read_from = [b_max - b for b in budgets]


def _quest_bound(qg, lo, hi):
    """Quest's criticality summed over a KV head's query group: sum_i max(q_i M_i, q_i m_i)."""
    return float(np.sum(np.maximum(qg * hi[None], qg * lo[None])))


def _prefill(sim, prompt, chunk):
    logits = None
    for a in range(0, len(prompt), chunk):
        logits = sim.feed(prompt[a:a + chunk], decode=False)
    return logits[-1]


def simulate_greedy(model, setup: Setup, prompt, new: int, cond: Conditioning):
    """Greedy tokens of `prompt` through the simulation, and the final `Simulation` (after
    the last token fed: the last one generated is not)."""
    sim = Simulation(model, setup, cond)
    logits = _prefill(sim, list(prompt), setup.chunk)
    out = []
    for t in range(new):
        out.append(cond.argmax("greedy token", logits))
        if t + 1 < new:
            logits = sim.feed([out[-1]], decode=True)[0]
    return np.asarray(out, np.int32), sim


def simulate_beams(model, setup: Setup, prompt, width: int, new: int, cond: Conditioning):
    """Beam search through the simulation: every beam carries its own copy of the state
    (the engine forks the parent's pages and policy state)."""
    sim = Simulation(model, setup, cond)
    logits = _prefill(sim, list(prompt), setup.chunk)

    def logits_of(state, tok):
        return state, state.feed([tok], decode=True)[0]

    return _beam_search((sim, logits), width, new, logits_of, cond)
