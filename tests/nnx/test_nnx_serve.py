"""A model written as an NNX module with `kvjax.nnx.PagedAttention` serves through
`kvjax.serve.Engine`, the engine behind `python -m kvjax serve`, taken as the engine takes
the built-in families: `kvjax.nnx.as_model` gives the (model, params) pair it expects.

(`python -m kvjax serve --model DIR` loads HuggingFace checkpoints of the built-in
families; an NNX module has no checkpoint format there, so the engine is what it serves on.)

Requests of ragged prompts (one to four pages, prefilled in several chunks) arrive while
others decode; every request's greedy tokens equal `kvjax.generate` on the same model,
and the engine's invariants (`Engine.check`) hold after every step.
"""

import jax
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax import generate as kvg
from kvjax import nnx as kvnnx
from kvjax.rope import RopeConfig
from kvjax.serve import Engine
from tests.serve.engine_helpers import _drive

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 53, 32, 4, 2, 8, 2
PAGE, CHUNK, MAX_NEW = 8, 16, 12


class TinyDecoder(nnx.Module):
    """A pre-norm decoder written for kvjax: RMSNorm, PagedAttention (GQA 4:2, RoPE), a
    gated MLP, tied nothing. Positions come from the driver (RoPE reads them)."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.cache = kvnnx.PagedCache()
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        rope = RopeConfig(theta=10_000.0, dim=HEAD_DIM)
        self.norms = nnx.List([nnx.RMSNorm(HIDDEN, rngs=rngs) for _ in range(2 * LAYERS)])
        self.attn = nnx.List([
            kvnnx.PagedAttention(self.cache, i, in_features=HIDDEN, num_heads=HEADS,
                                 num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope=rope, rngs=rngs)
            for i in range(LAYERS)])
        self.up = nnx.List([nnx.Linear(HIDDEN, 4 * HIDDEN, rngs=rngs) for _ in range(LAYERS)])
        self.down = nnx.List([nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs) for _ in range(LAYERS)])
        self.norm_f = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, rngs=rngs)

    def __call__(self, tokens: Int[Array, "batch q_len"], positions: Int[Array, "batch q_len"]
                 ) -> Float[Array, "batch q_len vocab"]:
        x = self.embed(tokens)
        for i in range(LAYERS):
            x = x + self.attn[i](self.norms[2 * i](x))
            gate, up = jax.numpy.split(self.up[i](self.norms[2 * i + 1](x)), 2, axis=-1)
            x = x + self.down[i](jax.nn.silu(gate) * up)
        return self.head(self.norm_f(x))


def test_nnx_paged_attention_model_serves_through_the_engine(rng):
    model, params = kvnnx.as_model(TinyDecoder(seed=int(rng.integers(2**31))), vocab_size=VOCAB)
    assert model.family == "nnx" and model.vocab_size == VOCAB
    # Six requests of 5 to 31 tokens: ragged, one to four pages, one or two chunks each.
    lens = rng.integers(5, 32, 6)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in lens]
    max_new = [int(m) for m in rng.integers(4, MAX_NEW + 1, len(prompts))]
    cfg = kvg.CacheConfig(page_size=PAGE)
    # Three rows for six requests: later ones wait for a row and join mid-decode. One
    # prefill lane: the engine compiles two step programs (with and without a lane).
    engine = Engine(model, params, max_seqs=3, max_seq_len=48, chunk_size=CHUNK,
                    prefill_rows=1, cache=cfg, prefix_caching=False)
    got, reasons = _drive(engine, prompts, max_new, first=3)  # check() after every step
    assert reasons == ["length"] * len(prompts)
    assert engine.stats["prefill_chunks"] > len(prompts), engine.stats  # some took two chunks

    ref = kvg.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=MAX_NEW,
                       cache=cfg, chunk_size=CHUNK)
    assert ref.status.code == 0
    for b, (g, m) in enumerate(zip(got, max_new, strict=True)):
        assert g == ref.tokens[b, :m].tolist(), (b, g, ref.tokens[b, :m])
