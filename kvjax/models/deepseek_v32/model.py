"""The DeepSeek-V3.2 model on the paged cache: `cache_spec` and `forward`.

DeepSeek's decoder (`kvjax.models.deepseek.model.run_decoder`: embeddings, the dense
and MoE layer groups as `lax.scan`s, the LM head) around DeepSeek Sparse Attention.
Each layer:

  1. computes MLA's query and latents (`deepseek.mla`) and the indexer's query, key
     and head weights (`indexer`), from the same normed hidden states and low-rank
     query;
  2. writes the latents and the indexer key (`kvjax.cache.write(..., index_keys=)`);
  3. has the indexer pick each query's `index_topk` tokens among all it sees
     (`kvjax.cache.indexer_topk`: a `TokenSelection`);
  4. attends in absorbed form over those tokens only (`kvjax.cache.attend(...,
     selection=)`): decode and prefill chunks alike, as transformers masks its
     attention with the selected set.

When no sequence of the cache can exceed `index_topk` tokens (`max_pages_per_seq *
page_size <= index_topk`), every query selects all it sees, and the layer runs MLA's
dense attention over the same tokens without scoring them.
"""

import jax.numpy as jnp
from jaxtyping import Array, Int

from kvjax import cache as kcache
from kvjax.cache import PagedKVCache
from kvjax.models.base import check_logits_at
from kvjax.models.deepseek import mla
from kvjax.models.deepseek import model as ds_model
from kvjax.models.deepseek.params import DeepseekParams
from kvjax.models.deepseek_v32 import indexer
from kvjax.models.deepseek_v32.config import DeepseekV32Config
from kvjax.models.deepseek_v32.params import DeepseekV32LayerParams
from kvjax.specs import CacheSpec, canonical_dtype

__all__ = ["cache_spec", "forward"]


def cache_spec(
    config: DeepseekV32Config, *, page_size: int, num_pages: int, max_seqs: int,
    max_pages_per_seq: int, dtype: object = "float32",
) -> CacheSpec:
    """The latent cache with the indexer's key pool beside it (`CacheSpec.indexer`).

    `dtype` is the latent pages' dtype; the indexer keys keep `config.indexer_cache`'s
    (the params dtype unless `index_cache_dtype` says otherwise).
    """
    return CacheSpec(
        attention=config.attention, num_layers=config.num_layers, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
        dtype=canonical_dtype(dtype), indexer=config.indexer_cache,
    )


def _attention(p: DeepseekV32LayerParams, config: DeepseekV32Config, x, cos, sin,
               cache: PagedKVCache, layer, rows, impl, select):
    """One DSA layer: write latents and indexer key, pick each query's tokens, attend.

    Returns (out, cache, q) with q the absorbed query `[q_latent, q_rope]`.
    """
    q_resid = mla.q_lora(p, x)
    q_nope, q_rope, c_kv, k_rope = mla.mla_inputs(p, config, x, cos, sin, q_resid=q_resid)
    q_index, k_index, weights = indexer.indexer_inputs(p.indexer, config, x, q_resid, cos, sin)
    cache = kcache.write(cache, layer, c_kv, k_rope, index_keys=k_index, **rows)
    selection = kcache.indexer_topk(cache, layer, q_index, weights, topk=config.index_topk,
                                    scale=config.index_scale, impl=impl, **rows)
    q_latent = mla.absorb_query(p, q_nope)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    if select is not None and x.shape[1] == 1 and select(cache, layer, q[:, 0]) is not None:
        from kvjax.cache.policies import UndefinedCombination

        raise UndefinedCombination(
            "DeepSeek-V3.2's lightning indexer selects the tokens each query reads; a cache "
            "policy's page selection would be a second, competing choice of what decode "
            "reads.")
    out, _ = kcache.attend(cache, layer, (q_latent, q_rope), selection=selection,
                           scale=config.softmax_scale, impl=impl, **rows)
    return mla.output(p, config, out.astype(x.dtype)), cache, q


def forward(
    params: DeepseekParams,
    config: DeepseekV32Config,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: PagedKVCache,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl="auto",
    select=None,
    observe: bool = False,
    logits_at: Int[Array, "batch k"] | None = None,
):
    """Runs the model on new tokens, writing their latents and indexer keys into the cache.

    The model contract of `kvjax.models.base` (the caller has reserved the tokens; jit
    it with `config` static and the cache donated); arguments as in
    `kvjax.models.deepseek.forward`.

    Args:
      select: a cache policy's hook (`kvjax.models.base`) may be given, but it must select
        no pages (return None, as StreamingLLM's does): the indexer chooses the tokens
        each layer reads.

    Returns:
      (float32 logits, cache), plus with `observe` the absorbed queries of every layer.

    Raises:
      ValueError: as `deepseek.forward`, and a cache without this model's indexer keys.
      kvjax.cache.policies.UndefinedCombination: the `select` hook returned a page
        selection.
    """
    ds_model.check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids)
    config.check_cache(cache.spec)
    check_logits_at(logits_at, tokens.shape)

    def attention(p, h, cos, sin, cache, layer, rows):
        return _attention(p, config, h, cos, sin, cache, layer, rows, impl, select)

    return ds_model.run_decoder(params, config, tokens, positions, cache, attention,
                                q_lengths=q_lengths, seq_ids=seq_ids, observe=observe,
                                logits_at=logits_at)
