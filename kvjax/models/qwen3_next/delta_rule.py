"""The Gated DeltaNet token mixer's two stateful pieces: the causal convolution and the
gated delta rule, each continuing a cached state.

Gated delta rule (Yang et al., "Gated Delta Networks", arXiv 2412.06464), per value
head, with S the [key_dim, value_dim] state, g_t <= 0 a log decay and beta_t in [0, 1]:

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T
    o_t  = S_t^T q_t

`gated_delta_step` applies it to one token (decode). `gated_delta_chunked` gives the same
result for many tokens with matrix products: within a chunk of C tokens, with
G_t = g_1 + ... + g_t, the new values U = (u_1 .. u_C), u_t = beta_t (v_t - S'_t^T k_t),
solve the unit lower-triangular system

    (I + A) U = beta * V - (beta * exp(G) * K) S_0,
    A[t, s] = beta_t exp(G_t - G_s) k_t . k_s   (s < t),

and then

    O   = (exp(G) * Q) S_0 + ((Q K^T) * exp(G_t - G_s) [s <= t]) U
    S_C = exp(G_C) S_0 + (exp(G_C - G) * K)^T U,

one chunk after the other (a `lax.scan` over chunks carries S). A token with beta = 0
and g = 0 leaves the state exactly as it was: padding a row that way makes its state
the one after its real tokens. All of it runs in float32 at full matmul precision, as
transformers does; the state is carried across chunks and calls in float32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["causal_conv", "gated_delta_step", "gated_delta_chunked", "CHUNK"]

CHUNK = 64  # tokens per chunk of the parallel form (transformers' and FLA's default)
_HI = jax.lax.Precision.HIGHEST


def causal_conv(
    x: Float[Array, "batch q_len channels"],
    state: Float[Array, "batch channels width"],
    weight: Float[Array, "channels kernel"],
    q_lengths: Int[Array, " batch"],
) -> tuple[Float[Array, "batch q_len channels"], Float[Array, "batch channels width"]]:
    """Depthwise causal convolution (no bias) then SiLU, continuing from `state`.

    Args:
      x: the new inputs; row b's first `q_lengths[b]` are real, the rest padding.
      state: the last `kernel - 1` inputs before them, oldest first.
      weight: one filter per channel, `weight[:, -1]` applied to the newest input.
      q_lengths: int32[batch] real inputs per row.

    Returns:
      (SiLU(conv) in x's dtype (at padded positions: garbage), the new state: the last
      `kernel - 1` inputs up to and including each row's last real one, float32).
    """
    batch, t, _ = x.shape
    kernel = weight.shape[-1]
    seq = jnp.concatenate([state.astype(jnp.float32).transpose(0, 2, 1),
                           x.astype(jnp.float32)], axis=1)  # [batch, kernel - 1 + t, channels]
    w = weight.astype(jnp.float32)
    out = sum(seq[:, j:j + t] * w[:, j] for j in range(kernel))
    new_state = jax.vmap(
        lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, kernel - 1, axis=0)
    )(seq, jnp.asarray(q_lengths, jnp.int32))
    return jax.nn.silu(out).astype(x.dtype), new_state.transpose(0, 2, 1)


def gated_delta_step(
    q: Float[Array, "batch heads key_dim"],
    k: Float[Array, "batch heads key_dim"],
    v: Float[Array, "batch heads value_dim"],
    g: Float[Array, "batch heads"],
    beta: Float[Array, "batch heads"],
    state: Float[Array, "batch heads key_dim value_dim"],
) -> tuple[Float[Array, "batch heads value_dim"], Float[Array, "batch heads key_dim value_dim"]]:
    """One token of the gated delta rule (the recurrent form; float32 inputs).

    Returns:
      (the output o_t, the new state S_t).
    """
    s = state * jnp.exp(g)[..., None, None]
    recalled = jnp.einsum("bhk,bhkv->bhv", k, s, precision=_HI)
    delta = (v - recalled) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, s, precision=_HI), s


def gated_delta_chunked(
    q: Float[Array, "batch q_len heads key_dim"],
    k: Float[Array, "batch q_len heads key_dim"],
    v: Float[Array, "batch q_len heads value_dim"],
    g: Float[Array, "batch q_len heads"],
    beta: Float[Array, "batch q_len heads"],
    state: Float[Array, "batch heads key_dim value_dim"],
    *,
    chunk: int = CHUNK,
) -> tuple[Float[Array, "batch q_len heads value_dim"],
           Float[Array, "batch heads key_dim value_dim"]]:
    """The gated delta rule over `q_len` tokens in the chunked (parallel) form.

    Equal to `gated_delta_step` applied token by token (float32 rounding aside). Tokens
    are grouped in chunks of `min(chunk, q_len)`, the last one padded with beta = g = 0.

    Args:
      q, k: queries and keys, one per value head (already L2-normalised; q scaled).
      v: values. g: log decays (<= 0). beta: write strengths. All float32.
      state: the state before the first token.
      chunk: chunk length of the parallel form.

    Returns:
      (outputs [batch, q_len, heads, value_dim], the state after the last token).
    """
    batch, t, heads, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [batch, t, heads, ...] -> [n, batch, heads, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, n, c, heads, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # G_t within each chunk
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_s
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    kk = jnp.einsum("...td,...sd->...ts", k, k, precision=_HI)
    a = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * jnp.exp(cum))[..., None]], axis=-1)
    sol = jax.lax.linalg.triangular_solve(a + jnp.eye(c, dtype=a.dtype), rhs, left_side=True,
                                          lower=True, unit_diagonal=True)
    w_new, k_cum = sol[..., :dv], sol[..., dv:]  # U = w_new - k_cum @ S_0
    qk = jnp.einsum("...td,...sd->...ts", q, k, precision=_HI) * decay
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def body(s, xs):
        w_i, kc_i, qk_i, qd_i, kd_i, cd_i = xs
        u = w_i - jnp.einsum("bhtk,bhkv->bhtv", kc_i, s, precision=_HI)
        o = (jnp.einsum("bhtk,bhkv->bhtv", qd_i, s, precision=_HI)
             + jnp.einsum("bhts,bhsv->bhtv", qk_i, u, precision=_HI))
        s = s * cd_i + jnp.einsum("bhtk,bhtv->bhkv", kd_i, u, precision=_HI)
        return s, o

    state, out = jax.lax.scan(body, state, (w_new, k_cum, qk, q_dec, k_dec, chunk_decay))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(batch, n * c, heads, dv)
    return out[:, :t], state
