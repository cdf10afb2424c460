"""Semantic mutations of kvjax, each with the tests that claim to catch it.

A mutation breaks one feature the way a plausible bug would (eviction that evicts
nothing, a swap-in that copies nothing, sampling that ignores the temperature...), by
monkeypatching kvjax at the start of a test process. `scripts/mutation_check.py` runs
each mutation's tests with it applied (the environment variable KVJAX_MUTATION names
it; tests/conftest.py applies it in the controller and in every worker before any test
module is imported) and requires them to fail: a mutation its tests do not catch is a
feature that can break unnoticed.

Each `apply(mp)` takes a `pytest.MonkeyPatch` and patches the place the behaviour lives
(a function that other modules call through its module, a method of a class), so every
caller sees the mutant. The `tests` are pytest node ids or files, relative to the repo.
"""

import dataclasses
import os
from collections.abc import Callable

import pytest


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the break, in words
    tests: tuple[str, ...]  # the tests that claim to catch it
    apply: Callable[[pytest.MonkeyPatch], None]


MUTATIONS: dict[str, Mutation] = {}


def mutation(name: str, what: str, tests: tuple[str, ...]):
    """Registers the decorated `apply(mp)` as mutation `name`."""

    def register(apply):
        if name in MUTATIONS:
            raise ValueError(f"mutation {name!r} registered twice")
        MUTATIONS[name] = Mutation(name, what, tuple(tests), apply)
        return apply

    return register


def apply_from_env() -> pytest.MonkeyPatch | None:
    """Applies the mutation KVJAX_MUTATION names (None when unset); the returned
    MonkeyPatch undoes it."""
    name = os.environ.get("KVJAX_MUTATION")
    if not name:
        return None
    if name not in MUTATIONS:
        raise ValueError(f"KVJAX_MUTATION={name!r} is not a mutation; expected one of "
                         f"{sorted(MUTATIONS)}")
    mp = pytest.MonkeyPatch()
    MUTATIONS[name].apply(mp)
    return mp


# ----------------------------------------------------------------------------- the list


@mutation("eviction_noop", "StreamingLLM evicts nothing (its eviction returns the cache as it is)",
          ("tests/cache/policies/test_streaming_llm.py",
           "tests/test_composition.py::test_cell[llama-int4-streaming_llm-1-generate]",
           "tests/test_composition.py::test_cell[qwen2-bfloat16-streaming_llm-8:context-generate]",
           "tests/test_composition.py::test_cell[deepseek-float32-streaming_llm-1-beam_search]"))
def _eviction_noop(mp):
    from kvjax.cache.policies.base import ok_status
    from kvjax.cache.policies.streaming_llm import StreamingLLM

    mp.setattr(StreamingLLM, "_evict", lambda self, cache, rows: (cache, ok_status(cache)))


@mutation("kivi_round_down", "KIVI quantization rounds codes down instead of to nearest",
          ("tests/cache/test_quant.py",))
def _kivi_round_down(mp):
    import types

    import jax.numpy as jnp

    from kvjax.cache import quant

    floor_jnp = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp)
                                         if not k.startswith("__")})
    floor_jnp.round = jnp.floor
    mp.setattr(quant, "jnp", floor_jnp)


@mutation("tail_never_flushed", "a KIVI tail's full pages are never written into the "
                                "quantized pages (the flush writes nothing)",
          ("tests/cache/test_quant_cache.py::test_tail_state_machine_random_prefill_then_decode",))
def _tail_never_flushed(mp):
    import types

    from kvjax.cache import paged, quantized

    no_writes = types.SimpleNamespace(**{k: getattr(paged, k) for k in dir(paged)
                                         if not k.startswith("__")})
    no_writes.set_pages = lambda pool, layer, ids, values: pool
    mp.setattr(quantized, "paged", no_writes)


@mutation("cow_skipped", "reserve's copy-on-write copies nothing: a write into a shared "
                         "partly filled page lands in the page its sharers read",
          ("tests/cache/test_allocator.py::test_fork_shares_and_copy_on_write_isolates",))
def _cow_skipped(mp):
    from kvjax.cache import paged

    mp.setattr(paged, "copy_pages", lambda pages, src, dst: pages)


@mutation("page_freed_twice", "releasing two references to one page in one call (a fork "
                              "family freed together) pushes the page onto the free stack twice",
          ("tests/cache/test_allocator.py::test_random_interleavings_keep_invariants",))
def _page_freed_twice(mp):
    import dataclasses

    import jax.numpy as jnp

    from kvjax.cache import page_table as pt

    def release(table, drop):  # page_table._release without its once-per-page rule
        sink = table.num_pages
        refs = jnp.where(drop, table.block_tables, sink).reshape(-1)
        refcounts = table.refcounts.at[refs].add(-1, mode="drop")
        hit = refs < sink
        released_mask = hit & (refcounts[jnp.clip(refs, 0, sink - 1)] == 0)
        released = jnp.where(released_mask, refs, sink)
        pos = table.num_free + jnp.cumsum(released_mask, dtype=jnp.int32) - 1
        free_stack = table.free_stack.at[jnp.where(released_mask, pos, sink)].set(
            released, mode="drop")
        return dataclasses.replace(
            table, refcounts=refcounts, free_stack=free_stack,
            num_free=table.num_free + jnp.sum(released_mask, dtype=jnp.int32)), released

    mp.setattr(pt, "_release", release)


@mutation("swap_in_copies_nothing", "the host tier's copies back to the device (a move's pages "
                                    "coming back, a swap-in's pages and KIVI ring) write nothing",
          ("tests/cache/test_host_tier.py::"
           "test_a_swapped_out_sequence_resumes_in_another_slot[int4]",
           "tests/cache/test_host_tier.py::"
           "test_page_at_a_time_moves_keep_both_tiers_and_every_byte[bf16]"))
def _swap_in_copies_nothing(mp):
    from kvjax.cache import host

    # Every host -> device copy (host._copy_in and the ring's unparking) goes through it.
    mp.setattr(host, "_read_host_pages", lambda dev, dst, pool, src: dev)


@mutation("host_move_fails", "host.move and host.swap_out always answer OUT_OF_PAGES and "
                             "change nothing",
          ("tests/cache/test_host_tier.py::"
           "test_page_at_a_time_moves_keep_both_tiers_and_every_byte[bf16]",
           "tests/cache/test_host_tier.py::"
           "test_a_swapped_out_sequence_resumes_in_another_slot[bf16]"))
def _host_move_fails(mp):
    import jax.numpy as jnp

    from kvjax.cache import host
    from kvjax.cache import page_table as pt

    def refused(cache, *args):
        return cache, pt.AllocStatus(code=jnp.int32(pt.OUT_OF_PAGES), pages_needed=jnp.int32(1),
                                     pages_free=cache.host.table.num_free)

    mp.setattr(host, "move", refused)
    mp.setattr(host, "swap_out", refused)


# ------------------------------------------------------------- the serving engine (tests/serve)


@mutation("sampling_ignored", "the serving path samples greedily whatever a request's "
                              "temperature, top_p and top_k (its per-row draw is an argmax)",
          ("tests/serve/test_engine.py::test_sampled_rows_equal_generate_with_the_same_key",
           "tests/serve/test_server.py::test_sampled_completions_equal_generate_with_their_seed"))
def _sampling_ignored(mp):
    import jax.numpy as jnp

    from kvjax.generate import sampling

    # sample_rows (the engine's admission and decode steps) draws its sampled rows here.
    mp.setattr(sampling, "_draw_rows",
               lambda logits, keys, rows: jnp.argmax(logits, axis=-1).astype(jnp.int32))


@mutation("eos_ignored", "generation runs on past an EOS id: the device-side EOS test of "
                         "generate and the engine never fires, and the engine's host side "
                         "forgets its eos_ids",
          ("tests/serve/test_engine_scheduling.py::test_stop_ids_eos_and_cancel",))
def _eos_ignored(mp):
    import jax.numpy as jnp

    from kvjax.generate import loop
    from kvjax.serve import engine

    mp.setattr(loop, "is_eos", lambda tok, eos_ids: jnp.zeros(tok.shape, bool))
    init = engine.Engine.__init__

    def init_without_eos(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eos_ids = ()

    mp.setattr(engine.Engine, "__init__", init_without_eos)


@mutation("prefix_caching_off", "the engine's prefix cache never hits: every lookup finds no "
                                "cached page, so every prompt is computed in full",
          ("tests/serve/test_engine_scheduling.py::"
           "test_prompts_sharing_a_prefix_wait_for_the_first_to_prefill_it",))
def _prefix_caching_off(mp):
    from kvjax.serve import prefix

    mp.setattr(prefix.PrefixCache, "match", lambda self, hashes, tokens, *, parked=True: 0)


@mutation("cache_salt_ignored", "the prefix cache ignores a request's salt (page hashes are "
                                "unsalted): requests with different salts share pages",
          ("tests/serve/test_engine_scheduling.py::test_salt_separates_tenants",))
def _cache_salt_ignored(mp):
    from kvjax.serve import prefix

    salted = prefix.page_hashes

    def unsalted(tokens, page_size, salt=None):
        return salted(tokens, page_size)

    # The engine's prefix pages (kvjax.serve.prefixes) call it through the module.
    mp.setattr(prefix, "page_hashes", unsalted)


_LIMITS = "tests/serve/test_server_limits.py::"


@mutation("request_bytes_unbounded", "the server reads and parses a request body of any "
                                     "size (--max-request-bytes ignored)",
          (_LIMITS + "test_a_100_mb_body_is_refused_at_once",))
def _request_bytes_unbounded(mp):
    from kvjax.serve import server

    init = server._Gate.__init__

    def unbounded(self, app, **kwargs):
        init(self, app, **kwargs)
        self.max_bytes = 2**62

    mp.setattr(server._Gate, "__init__", unbounded)


@mutation("tokenize_on_event_loop", "the server tokenizes and detokenizes on its event loop, "
                                    "so one slow tokenization holds every request",
          (_LIMITS + "test_tokenizing_does_not_hold_other_requests",))
def _tokenize_on_event_loop(mp):
    from kvjax.serve import server

    async def inline(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    mp.setattr(server._Server, "off_loop", inline)


@mutation("api_key_unchecked", "the server takes requests without its --api-key",
          (_LIMITS + "test_api_key",))
def _api_key_unchecked(mp):
    from kvjax.serve import server

    mp.setattr(server._Gate, "_authorized", lambda self, scope: True)


@mutation("waiting_unbounded", "the server queues any number of requests (--max-waiting "
                               "ignored: no 429)",
          (_LIMITS + "test_waiting_bound_and_timeouts",))
def _waiting_unbounded(mp):
    from kvjax.serve import server

    submit_group = server.EngineWorker.submit_group  # what the endpoints call (and submit)

    async def unbounded(self, prompt_ids, requests, *, capacity=None):
        return await submit_group(self, prompt_ids, requests)

    mp.setattr(server.EngineWorker, "submit_group", unbounded)


@mutation("sigterm_no_drain", "SIGTERM stops the server at once, dropping requests in flight",
          (_LIMITS + "test_sigterm_drains_in_flight_requests",))
def _sigterm_no_drain(mp):
    from kvjax.serve import server

    handle_exit = server.DrainingServer.handle_exit

    def at_once(self, sig, frame):
        handle_exit(self, sig, frame)
        self.force_exit = True

    mp.setattr(server.DrainingServer, "handle_exit", at_once)


@mutation("sharding_plan_ignored", "a ShardingPlan given to generate (CacheConfig.plan) is "
                                   "ignored: cache, params and attention run on one device",
          ("tests/test_composition.py::test_cell[llama-float32-none-8:heads+sequences-generate]",
           "tests/test_composition.py::test_cell[deepseek-int4-h2o-8:context-sample_n]",
           "tests/test_composition.py::test_cell[qwen3_next-bfloat16-quest-8:context-stream]"))
def _sharding_plan_ignored(mp):
    import dataclasses

    from kvjax.generate import setup

    prepare = setup.prepare_cache

    def unsharded(model, cache, impl, **kw):  # every driver builds its cache here
        if isinstance(cache, setup.CacheConfig) and cache.plan is not None:
            cache = dataclasses.replace(cache, plan=None)
        return prepare(model, cache, impl, **kw)

    mp.setattr(setup, "prepare_cache", unsharded)


@mutation("h2o_keeps_lowest", "H2O keeps the lowest-scored tokens: the least attended older "
                              "tokens on full-precision pages, the highest-mass pages go on KIVI",
          ("tests/cache/policies/test_h2o.py",
           "tests/test_composition.py::test_cell[llama-float32-h2o-1-generate]",
           "tests/test_composition.py::test_cell[qwen2-int4-h2o-1-generate]",
           "tests/test_composition.py::test_cell[deepseek-bfloat16-h2o-1-beam_search]"))
def _h2o_keeps_lowest(mp):
    from kvjax.cache.policies import h2o

    keep, evict = h2o.keep_heavy_and_recent, h2o.evict_lowest_pages
    # H2O's own references (SnapKV, PyramidKV and StreamingLLM imported theirs before).
    mp.setattr(h2o, "keep_heavy_and_recent", lambda scores, *a, **k: keep(-scores, *a, **k))
    mp.setattr(h2o, "evict_lowest_pages", lambda cache, mass, *a, **k: evict(cache, -mass, *a,
                                                                              **k))


_GEMMA = "tests/models/test_gemma.py"


@mutation("gemma_window_ignored", "Gemma's local layers attend to every earlier token (their "
                                  "sliding_window is not passed to the cache)",
          (f"{_GEMMA}::test_matches_transformers", f"{_GEMMA}::test_bfloat16_params_and_cache",
           f"{_GEMMA}::test_sharded_plan_matches_transformers"))
def _gemma_window_ignored(mp):
    from kvjax.models.gemma.config import GemmaConfig

    mp.setattr(GemmaConfig, "window", lambda self, layer: None)


@mutation("gemma3_global_rope_is_local", "Gemma 3's global layers rotate with the local "
                                         "layers' RoPE (base 10k, unscaled)",
          (f"{_GEMMA}::test_matches_transformers[gemma3]",
           f"{_GEMMA}::test_cli_generate_matches_transformers[gemma3]",
           f"{_GEMMA}::test_bfloat16_params_and_cache"))
def _gemma3_global_rope_is_local(mp):
    from kvjax.models.gemma import config

    ropes = config._gemma3_ropes
    mp.setattr(config, "_gemma3_ropes", lambda text, dim: (ropes(text, dim)[0],) * 2)


@mutation("gemma_final_softcap_off", "Gemma 2's final logits are not soft-capped",
          (f"{_GEMMA}::test_matches_transformers[gemma2]",
           f"{_GEMMA}::test_beam_search_matches_transformers"))
def _gemma_final_softcap_off(mp):
    from kvjax.models.gemma import model

    mp.setattr(model, "soft_cap", lambda x, cap: x)


@mutation("gemma_attn_softcap_off", "Gemma 2's attention logits are not soft-capped",
          (f"{_GEMMA}::test_matches_transformers[gemma2]",
           f"{_GEMMA}::test_sharded_plan_matches_transformers"))
def _gemma_attn_softcap_off(mp):
    import types

    from kvjax import cache
    from kvjax.models.gemma import model

    uncapped = types.SimpleNamespace(write=cache.write, attend=lambda *a, soft_cap=None, **k:
                                     cache.attend(*a, **k))
    mp.setattr(model, "kv_cache", uncapped)


@mutation("gemma_query_scale_head_dim", "Gemma scales queries by head_dim ** -0.5 instead of "
                                        "query_pre_attn_scalar ** -0.5",
          (f"{_GEMMA}::test_matches_transformers",))
def _gemma_query_scale_head_dim(mp):
    from kvjax.models.gemma.config import GemmaConfig

    mp.setattr(GemmaConfig, "scale", property(lambda self: self.head_dim ** -0.5))


@mutation("gemma3_multimodal_prefix", "a Gemma3ForConditionalGeneration checkpoint's text "
                                      "model is looked up under transformers 5's module names "
                                      "only (model.language_model.)",
          (f"{_GEMMA}::test_conditional_generation_checkpoint_loads_its_text_model",))
def _gemma3_multimodal_prefix(mp):
    from kvjax.models.gemma import checkpoint

    mp.setattr(checkpoint, "_MULTIMODAL_PREFIXES", ("model.language_model.",))


_GPOL = "tests/generate/test_gemma_policies.py"


@mutation("policy_scores_plain_attention", "cache policies score a soft-capped model's tokens "
                                           "with plain logits (no soft cap, head_dim scale)",
          (f"{_GPOL}::test_scores_are_the_models_attention",))
def _policy_scores_plain_attention(mp):
    from kvjax.cache.policies.base import LayerAttention

    mp.setattr(LayerAttention, "of", classmethod(
        lambda cls, config: cls(windows=tuple(config.sliding_windows))))


@mutation("policy_evicts_windowed_layers", "eviction policies choose a windowed layer's tokens "
                                           "by score instead of keeping its newest ones",
          (f"{_GPOL}::test_scores_are_the_models_attention",
           f"{_GPOL}::test_h2o_keeps_the_windowed_layer_exact"))
def _policy_evicts_windowed_layers(mp):
    from kvjax.cache.policies import h2o, pyramidkv, snapkv

    for module in (h2o, pyramidkv, snapkv):
        mp.setattr(module, "keep_windows", lambda keep, lengths, layers: keep)


@mutation("window_rings_not_parked", "host.swap_out leaves the window groups' rings out of "
                                     "the parked row (swap_in brings back stale pages)",
          ("tests/serve/test_engine_window_host.py",))
def _window_rings_not_parked(mp):
    from kvjax.cache import host

    mp.setattr(host, "_park_rings", lambda cache, tier, s, r, ok: (tier.rings,
                                                                   tier.ring_held))


@mutation("live_rows_keep_stale_tokens", "a call that decodes a bucket of the live rows does "
          "not put their last tokens back (the next call feeds each row its old token)",
          ("tests/serve/test_engine_live_rows.py",
           "tests/serve/test_engine_scheduling.py::"
           "test_policy_and_sharding_plan_run_through_the_engine"))
def _live_rows_keep_stale_tokens(mp):
    import dataclasses

    from kvjax.serve import steps

    put = steps._put_rows

    def stale(state, sub, sel):
        return dataclasses.replace(put(state, sub, sel), last=state.last)

    mp.setattr(steps, "_put_rows", stale)


@mutation("packed_lanes_one_early", "a packed prefill row's lanes start one token early "
                                    "(Packing.lanes reads each lane's tokens shifted by one)",
          ("tests/models/test_packing.py::test_packed_calls_equal_each_prompt_alone",
           "tests/serve/test_engine_scheduling.py::"
           "test_packed_prefill_fills_each_row_end_to_end"))
def _packed_lanes_one_early(mp):
    import jax.numpy as jnp

    from kvjax.models.base import Packing

    mp.setattr(Packing, "lanes", lambda self, x: x[0][jnp.maximum(self.gather - 1, 0)])


@mutation("packed_ring_lanes_uncapped", "on window-only rings a packed row's lanes may be "
                                        "wider than a chunk (steps.packed_shapes ignores "
                                        "widest)",
          ("tests/serve/test_engine_window_pages.py::"
           "test_engine_window_pages_equal_generate_and_hits_stop_at_the_rings",
           "tests/serve/test_engine_window_pages.py::"
           "test_gemma_packs_its_prompts_on_window_rings"))
def _packed_ring_lanes_uncapped(mp):
    from kvjax.serve import steps

    shapes = steps.packed_shapes
    mp.setattr(steps, "packed_shapes", lambda *a, widest=None, **k: shapes(*a, **k))
