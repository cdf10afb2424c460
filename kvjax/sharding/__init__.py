"""Sharded decoding: meshes, cache and param shardings, attention merged across devices.

    import kvjax as kvx
    from kvjax import sharding as kvs

    mesh = kvs.make_mesh((2, 4), ("data", "model"))
    plan = kvs.ShardingPlan(mesh=mesh, strategies=("sequences", "heads"))
    cache = kvs.init_sharded_cache(spec, plan)          # pools born sharded
    out, lse = kvx.attention.paged_decode_attention(..., impl=kvs.ShardedAttention(plan))
"""

from kvjax.cache.sharded_table import ShardedPageTable, check_invariants
from kvjax.sharding.attention import (
    ShardedAttention,
    sharded_mla_decode_attention,
    sharded_mla_prefill_attention,
    sharded_paged_decode_attention,
    sharded_paged_prefill_attention,
)
from kvjax.sharding.cache import (
    cache_shardings,
    init_sharded_cache,
    kv_heads_sharded,
    pool_spec,
)
from kvjax.sharding.mesh import AXES, STRATEGIES, ShardingPlan, make_mesh
from kvjax.sharding.params import param_shardings, shard_params

__all__ = [
    "AXES",
    "STRATEGIES",
    "ShardedAttention",
    "ShardedPageTable",
    "ShardingPlan",
    "cache_shardings",
    "check_invariants",
    "init_sharded_cache",
    "kv_heads_sharded",
    "make_mesh",
    "param_shardings",
    "pool_spec",
    "shard_params",
    "sharded_mla_decode_attention",
    "sharded_mla_prefill_attention",
    "sharded_paged_decode_attention",
    "sharded_paged_prefill_attention",
]
