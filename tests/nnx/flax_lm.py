"""A small decoder LM assembled from Flax's own published NNX modules (not kvjax code).

`nnx.Embed` for tokens and learned positions, `nnx.MultiHeadAttention` (GQA, with its own
dense decoding cache: `init_cache` and `decode=True`), `nnx.LayerNorm`, `nnx.Linear`.
It stands in for "an NNX model kvjax's developers did not write": no published NNX LLM
installs from this package index. `dense_decode` is Flax's own autoregressive decoding,
one token per call on the dense [batch, max_len, kv_heads, head_dim] cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, MAX_POS = 61, 32, 4, 2, 2, 96


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, num_kv_heads=KV_HEADS,
                                           in_features=HIDDEN, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.up = nnx.Linear(HIDDEN, 2 * HIDDEN, rngs=rngs)
        self.down = nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x, *, decode: bool):
        x = x + self.attn(self.ln1(x), decode=decode)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class FlaxLM(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.pos = nnx.Embed(MAX_POS, HIDDEN, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions, *, decode: bool = False):
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, decode=decode)
        return self.head(self.ln_f(x))


def dense_decode(model: FlaxLM, prompts, max_new: int):
    """Flax's own greedy decoding of ragged prompts on its dense cache, one token per call.

    All rows advance in lockstep (Flax's cache keeps one `cache_index`): at step t every
    row feeds its prompt token t, or, past its prompt, its last greedy token. One jitted
    `lax.scan` over the steps, the module split into graphdef and state around each call.

    Returns (tokens int32[batch, max_new], logits float32[batch, steps, vocab]: row b's
    logits after feeding its token t).
    """
    lengths = np.array([len(p) for p in prompts], np.int32)
    steps = int(lengths.max()) + max_new - 1
    padded = np.zeros((len(prompts), steps + 1), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    for block in model.blocks:
        block.attn.init_cache((len(prompts), steps + 1, HIDDEN))
    graphdef, state = nnx.split(model)
    logits, _ = _scan(graphdef, state, jax.device_put(padded), jax.device_put(lengths))
    logits = np.asarray(logits)
    tokens = np.stack([logits[b, lengths[b] - 1: lengths[b] - 1 + max_new].argmax(-1)
                       for b in range(len(prompts))]).astype(np.int32)
    for block in model.blocks:  # drop the dense cache again
        block.attn.cached_key = block.attn.cached_value = block.attn.cache_index = None
    return tokens, logits


@jax.jit
def _scan(graphdef, state, padded, lengths):
    def body(carry, t):
        state, last = carry
        tok = jnp.where(t < lengths, padded[:, t], last)[:, None]
        m = nnx.merge(graphdef, state)
        row = m(tok, jnp.full(tok.shape, t, jnp.int32), decode=True)[:, 0]
        _, state = nnx.split(m)
        return (state, jnp.argmax(row, -1).astype(jnp.int32)), row

    steps = padded.shape[1] - 1
    (state, _), rows = jax.lax.scan(body, (state, jnp.zeros(padded.shape[:1], jnp.int32)),
                                    jnp.arange(steps, dtype=jnp.int32))
    return rows.transpose(1, 0, 2), state
