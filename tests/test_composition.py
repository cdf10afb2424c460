"""Every lever through the one decode engine: the composition matrix.

    family   {Llama GQA, Qwen2 (q/k/v bias, tied embeddings), DeepSeek-V2 (MLA + MoE),
              Qwen3-Next (Gated DeltaNet + gated full attention; policies, page kinds and
              sharding act on the full-attention layers, the recurrent state is per slot),
              DeepSeek-V3.2 (MLA + MoE + the lightning indexer: top-k sparse attention),
              Gemma (Gemma 3's two local layers (window 8) to one global, QK-norm, (1 + w)
              RMSNorms, sqrt(hidden) embedding scale, tanh-GELU, tied embeddings, a RoPE
              per layer type; with Gemma 2's attention and output soft caps)}
  x cache    {float32, bfloat16, KIVI int8, int4, int2}
  x policy   {none, StreamingLLM, H2O, SnapKV, PyramidKV, Quest}
  x devices  {1, 8 with heads+sequences, 8 with context}
  x entry    {generate, stream, sample_n, beam_search}

Each cell runs through `kvjax.generate` and must either give the right tokens or raise
its documented refusal (the list `UNDEFINED` below, docs/models.md): DeepSeek-V3.2 with
H2O, SnapKV, PyramidKV or Quest (`UndefinedCombination`: their token scores or page
selections would compete with the indexer's own); Gemma on the 'context' strategy, and
on KIVI pages sharded by 'sequences' (NotImplementedError: a window in positions is not
a prefix of a device's pages).

Gemma's local layers keep window-only pages (`CacheConfig(window_pages=True)`: a ring of
ring_pages(8, 8, 8) = 3 pages a sequence, which every sequence here outgrows) in the
float32 and bf16 cells without a policy on one device, which also check the rings
(`_check_rings`). The other cells pass window_pages=False and keep every page, the local
layers masking their window: KIVI and sharded cells (kvjax now takes window pages there
too, KIVI ones with full-precision rings beside KIVI global layers, which the reference
does not model yet) and StreamingLLM's (generate refuses window pages with a policy; its
20 recent tokens hold the 8-token window). With H2O, SnapKV, PyramidKV and Quest the
cells ask for window pages and expect the refusal (`UndefinedCombination` from generate;
ValueError from `CacheConfig` on the 'context' strategy): on a cache without window
pages, Quest and PyramidKV's
selections meet the local layers' window (full-precision pages: NotImplementedError from
the selected attention; KIVI pages: the window is dropped), and H2O and SnapKV score
tokens with attention probabilities that know neither the window nor Gemma's query scale
and soft cap, so they keep other tokens than the model's attention would weigh.

What is right comes from tests/composition_reference.py, which runs none of the code
under test (no kvjax cache, policy, attention, sharding plan, decode loop or model
forward; each family is written again in NumPy float64):

  * lossless cells (float32 pages, no policy; any sharding): the greedy tokens of the
    family's dense causal forward re-run on the growing sequence (no cache, no loop);
  * lossy page kinds and policies: the same model fed as the engine feeds it, its keys
    and values stored as the page kind stores them (bf16-rounded; KIVI fake-quantized
    with a full-precision tail) and attention restricted to what the policy keeps, that
    keep set computed from the attention scores as the policy's paper and docstring
    define it (never from kvjax's policy code);
  * sharded cells: the same expectation as the single-device cell (which is checked
    against the reference), plus the cache's pools laid out on the 8 devices as the
    plan says (heads over `model`, pages over `data` and `context`);
  * sample_n: greedy, so each sample is its prompt's greedy generation; beam_search: an
    independent beam search over the reference's log-probabilities (tokens and scores).

Besides the tokens, each cell checks the final cache (kept with free_finished=False /
keep_cache=True) against the reference's final state: the tokens each sequence holds
(and, KIVI, how many are quantized), and the cached keys and values of the held tokens
(full-precision and bf16 pages; KIVI: the pages' scales and zeros and the tail), so an
eviction that keeps the wrong tokens fails even where greedy tokens happen to agree.

Prompts are drawn per case until the reference's every discrete decision (greedy
tokens, the cut of a budget, page selections, expert routing, indexer top-k) has a clear
margin (`composition_reference.Conditioning`): on a near-tie a float32 engine and a
float64 reference may both be right and still differ.

The cells are one `slow` sweep: by default a sample that covers every value of every axis
runs, the same for every run of one commit (tests/conftest.py); `--slow` (or
KVJAX_SLOW=1) runs all 2160 cells.
"""

import dataclasses
import functools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax import generate as gen
from kvjax import sharding as kvs
from kvjax.cache import window
from kvjax.cache.policies import H2O, PyramidKV, Quest, SnapKV, StreamingLLM, UndefinedCombination
from kvjax.cache.policies.base import to_slots
from kvjax.models import deepseek as ds
from kvjax.models import deepseek_v32 as v32
from kvjax.models import gemma, llama
from kvjax.models import qwen3_next as q3n
from kvjax.models.base import get_family
from kvjax.rope import RopeConfig
from kvjax.specs import QuantSpec, ring_pages
from tests import composition_reference as cref

PAGE = 8
PROMPT_LENS = (27, 19)
NEW = 6
CHUNK = 16
# Gemma's local layers: an 8-token window, prefill chunks of 8, so window-only pages keep a
# ring of ring_pages(8, 8, 8) = 3 pages a sequence, which every prompt + generation (25
# and 33 tokens) outgrows.
GEMMA_WINDOW = 8
GEMMA_CHUNK = 8
BEAMS = 2
ATTEMPTS = 40  # prompt draws per case before giving up on a clear-margin one

FAMILIES = ("llama", "qwen2", "deepseek", "qwen3_next", "deepseek_v32", "gemma")
CACHES = ("float32", "bfloat16", "int8", "int4", "int2")
POLICIES = ("none", "streaming_llm", "h2o", "snapkv", "pyramidkv", "quest")
DEVICES = ("1", "8:heads+sequences", "8:context")
ENTRIES = ("generate", "stream", "sample_n", "beam_search")
# Fresh weights and prompts per session (the compiled programs do not depend on them);
# a failing cell replays with KVJAX_TEST_SEED.
SEED = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
# Gemma with the policies that score or select tokens by attention: they ask for window-only
# pages (`_window_pages`), which kvjax refuses with a policy, KIVI pages or a plan.
SCORING = ("h2o", "snapkv", "pyramidkv", "quest")
# Cells whose combination is undefined: each raises (exception, message pattern).
UNDEFINED: dict[tuple[str, ...], tuple[type[Exception], str]] = {
    **{("deepseek_v32", c, p, d, e): (UndefinedCombination, "DeepSeek Sparse Attention")
       for c in CACHES for p in SCORING for d in DEVICES for e in ENTRIES},
    **{("gemma", c, p, d, e): (UndefinedCombination, "window-only pages")
       for c in CACHES for p in SCORING for d in ("1", "8:heads+sequences") for e in ENTRIES},
    **{("gemma", c, p, "8:context", e): (ValueError, "window_pages does not combine with the "
                                                     "'context'")
       for c in CACHES for p in SCORING for e in ENTRIES},
    **{("gemma", c, p, "8:context", e): (NotImplementedError, "sliding_window is not "
                                                              "supported with the 'context'")
       for c in CACHES for p in ("none", "streaming_llm") for e in ENTRIES},
    **{("gemma", c, p, "8:heads+sequences", e): (NotImplementedError, "a sliding window over "
                                                                      "KIVI pages needs key")
       for c in ("int8", "int4", "int2") for p in ("none", "streaming_llm") for e in ENTRIES},
}

# Budgets that make every policy act on these prompts (27 + 6 tokens at most), and that
# a KIVI cache (page 8, tail of up to R + 7 = 15 tokens) can hold. PyramidKV's layer
# budgets are 24 and 8 tokens with two cache layers, 16 with one (Qwen3-Next).
POLICY = {
    "none": None,
    "streaming_llm": StreamingLLM(n_sink=4, window=20),
    "h2o": H2O(budget=24),
    "snapkv": SnapKV(budget=20, window=4, kernel=3),
    "pyramidkv": PyramidKV(budget=16, window=4, kernel=3, beta=2.0),
    "quest": Quest(top_k=2, dense_layers=0),
}


@functools.cache
def _model(family: str):
    """(model, params, its independent reference model)."""
    rope = RopeConfig(theta=10000.0, dim=16)
    if family == "llama":
        config = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_layers=2, q_heads=8, kv_heads=4, head_dim=16, rope=rope)
    elif family == "qwen2":
        config = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_layers=2, q_heads=8, kv_heads=4, head_dim=16, rope=rope,
                                   qkv_bias=True, tie_word_embeddings=True,
                                   architecture="Qwen2ForCausalLM")
    elif family == "qwen3_next":
        config = q3n.Qwen3NextConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            layer_types=("linear_attention", "full_attention", "linear_attention"),
            q_heads=8, kv_heads=4, head_dim=16, rope=RopeConfig(theta=10000.0, dim=8),
            linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)
    elif family == "deepseek_v32":
        # index_topk 16 < the prompts (19, 27 tokens): decode reads a selection.
        config = v32.DeepseekV32Config(
            vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=8,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, index_n_heads=4, index_head_dim=8,
            index_topk=16)
    elif family == "gemma":
        # Gemma 3's layout (two local layers to one global, QK-norm, RoPE base 10k local and
        # 1M linearly scaled global, query_pre_attn_scalar != head_dim) with Gemma 2's
        # attention and output soft caps, which GemmaConfig applies on any layout.
        config = gemma.GemmaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, q_heads=8,
            kv_heads=4, head_dim=16, layer_types=(gemma.LOCAL, gemma.LOCAL, gemma.GLOBAL),
            sliding_window=GEMMA_WINDOW, rope_local=RopeConfig(theta=10000.0, dim=16),
            rope_global=RopeConfig(theta=1e6, dim=16, rope_type="linear", factor=8.0),
            query_pre_attn_scalar=24.0, attn_softcap=2.0, final_softcap=10.0, qk_norm=True)
    else:
        config = ds.DeepseekConfig(vocab_size=96, hidden_size=48, intermediate_size=64,
                                   num_layers=2, num_heads=8, kv_lora_rank=16,
                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                   first_k_dense_replace=1, n_routed_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1)
    fam = get_family(family if family in ("deepseek", "qwen3_next", "deepseek_v32", "gemma")
                     else "llama")
    params = fam.init_params(config, jax.random.key(SEED))
    # Larger weights than init's spread the logits (greedy ties unlikely).
    params = jax.tree.map(
        lambda x: x * 3 if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if family == "gemma":
        # Gemma's tied head on the (1 + w)-normed state: init's embedding, times sqrt(64)
        # at the input, outweighs the layers (greedy repeats the last token) and gives
        # logits of spread ~0.5; init's embedding with 1 + w ~ 8 in the final norm gives
        # varied tokens and a spread of ~1.3 (every draw of 8 clear in a scratch run).
        params = dataclasses.replace(params, embed=params.embed / 3,
                                     final_norm=params.final_norm + 7)
    return fam.model(config), params, cref.family_reference(family, config, params)


@functools.cache
def _plan(devices: str):
    if devices == "1":
        return None
    if devices == "8:heads+sequences":
        return kvs.ShardingPlan(mesh=kvs.make_mesh((2, 4), ("data", "model")),
                                strategies=("sequences", "heads"))
    return kvs.ShardingPlan(mesh=kvs.make_mesh((8,), ("context",)), strategies=("context",))


def _quant(cache: str) -> QuantSpec | None:
    return (QuantSpec(bits=int(cache[3:]), group_size=8, residual=PAGE)
            if cache.startswith("int") else None)


def _chunk(family: str) -> int:
    return GEMMA_CHUNK if family == "gemma" else CHUNK


def _window_pages(family: str, cache: str, policy: str, devices: str) -> bool:
    """Whether a Gemma cell asks for window-only pages for its local layers.

    Without a policy, on full-precision pages on one device; KIVI and sharded caches keep
    every page (the local layers mask their window): the reference's KIVI simulation
    quantizes every layer, where window pages would keep the local layers in
    full-precision rings. StreamingLLM, which `generate` refuses them with, runs on every
    page too: its recent window (20 tokens) holds the local window (8), so the local layers
    read the same tokens with or without eviction. The policies that score or select by
    attention (SCORING) ask for them and are refused (UNDEFINED): on a cache without window
    pages they would score or select tokens as if the local layers saw every token.
    """
    if family != "gemma" or policy == "streaming_llm":
        return False
    return policy in SCORING or (cache in ("float32", "bfloat16") and devices == "1")


def _config(cache: str, devices: str, window_pages: bool = False) -> gen.CacheConfig:
    dtype = cache if cache in ("float32", "bfloat16") else "float32"
    return gen.CacheConfig(dtype=dtype, quant=_quant(cache), page_size=PAGE, plan=_plan(devices),
                           window_pages=window_pages)


# ----------------------------------------------------------------------------- expectations


@dataclasses.dataclass(frozen=True)
class Case:
    """Prompts and what the reference says of them.

    Attributes:
      prompts: the prompts (one for beam search).
      tokens: int32[rows, NEW] greedy tokens (beam search: the beams, best first).
      scores: the beams' summed log-probabilities (beam search), else None.
      finals: per prompt, the reference's state after the last token fed (greedy), for
        the cache checks; per beam for beam search.
    """

    prompts: list
    tokens: np.ndarray
    scores: np.ndarray | None
    finals: list


def _setup(cache: str, policy: str, chunk: int = CHUNK) -> cref.Setup:
    quant = _quant(cache)
    # A cache built for the request holds ceil((27 + 6) / page) pages a sequence (one more
    # for a KIVI tail).
    pages = -(-(max(PROMPT_LENS) + NEW) // PAGE) + (quant is not None)
    return cref.Setup(cache=cache, policy=POLICY[policy], page_size=PAGE, group_size=8,
                      residual=PAGE, chunk=chunk, max_len=max(PROMPT_LENS) + NEW + 1,
                      max_tokens=pages * PAGE)


def _draw(family, cache, policy, beams, attempt):
    model, _, ref = _model(family)
    name = f"{family}/{cache}/{policy}/{beams}".encode()
    rng = np.random.default_rng([SEED, attempt, zlib.crc32(name)])
    lens = PROMPT_LENS[:1] if beams else PROMPT_LENS
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in lens]
    cond = cref.Conditioning()
    setup = _setup(cache, policy, _chunk(family))
    lossless = cache == "float32" and policy == "none"
    scores = None
    if beams:
        if lossless:
            tokens, scores = cref.dense_beams(ref, prompts[0], BEAMS, NEW, cond)
        else:
            tokens, scores = cref.simulate_beams(ref, setup, prompts[0], BEAMS, NEW, cond)
        # The beams' final states, for the held-token counts: the beam loop feeds every
        # token, the last one too.
        finals = [_fed(ref, setup, prompts[0], row) for row in tokens]
    else:
        runs = [cref.simulate_greedy(ref, setup, p, NEW, cond) for p in prompts]
        finals = [sim for _, sim in runs]
        tokens = np.stack([t for t, _ in runs])
        if lossless:  # the dense forward's tokens (no cache, no loop); the simulation, whose
            # final states the cache checks read, must agree with it
            dense = np.stack([cref.dense_greedy(ref, p, NEW, cond) for p in prompts])
            np.testing.assert_array_equal(tokens, dense, err_msg="the reference's two forms")
            tokens = dense
    return Case(prompts, tokens, scores, finals), cond


def _fed(ref, setup, prompt, row):
    """The reference state after `prompt` and the tokens of `row`."""
    sim = cref.Simulation(ref, setup, cref.Conditioning())
    for a in range(0, len(prompt), setup.chunk):
        sim.feed(prompt[a:a + setup.chunk], decode=False)
    for tok in row:
        sim.feed([int(tok)], decode=True)
    return sim


@functools.cache
def _case(family, cache, policy, beams: bool) -> Case:
    """The first draw of prompts whose reference has clear margins everywhere."""
    failures = []
    for attempt in range(ATTEMPTS):
        case, cond = _draw(family, cache, policy, beams, attempt)
        if cond.ok:
            return case
        failures.append(cond.failures[0])
    raise AssertionError(f"no prompts with clear margins in {ATTEMPTS} draws for "
                         f"{(family, cache, policy, beams)}, KVJAX_TEST_SEED={SEED}: "
                         f"{failures[:5]}")


# ----------------------------------------------------------------------------- the engine


@dataclasses.dataclass(frozen=True)
class Run:
    tokens: np.ndarray
    cache: object
    slots: list  # the cache slot of each row of `tokens`
    scores: np.ndarray | None = None


def _engine(family, cache_name, policy_name, devices, entry, prompts) -> Run:
    model, params, _ = _model(family)
    kw = dict(cache=_config(cache_name, devices,
                            _window_pages(family, cache_name, policy_name, devices)),
              policy=POLICY[policy_name], chunk_size=_chunk(family))
    if entry == "generate":
        res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                           free_finished=False, **kw)
        return Run(res.tokens, res.cache, [0, 1])
    if entry == "stream":
        out = [[] for _ in prompts]
        for event in gen.stream(model, params, prompts, key=jax.random.key(0),
                                max_new_tokens=NEW, free_finished=False, **kw):
            for r in np.nonzero(event.emitted)[0]:
                out[r].append(int(event.tokens[r]))
        return Run(np.asarray(out), event.state.cache, [0, 1])
    if entry == "sample_n":
        res = gen.sample_n(model, params, prompts, n=2, key=jax.random.key(0),
                           max_new_tokens=NEW, free_finished=False, **kw)
        return Run(res.tokens, res.cache, [0, 1, 2, 3])  # row p * 2 + j: slot p * 2 + j
    res = gen.beam_search(model, params, prompts[0], beam_width=BEAMS, max_new_tokens=NEW,
                          keep_cache=True, **kw)
    slots = np.nonzero(np.asarray(res.cache.lengths))[0].tolist()
    return Run(res.tokens, res.cache, slots, res.scores)


# ----------------------------------------------------------------------------- cache checks


def _rows(pool, slot_pages, offsets, layer, head):
    return np.asarray(pool, np.float64)[layer, head, slot_pages, offsets]


# KIVI caches' pages and tail: a code that a float32 engine and a float64 reference put one
# step apart (a rounding tie) moves later layers' keys and values, and so their pages' zero
# points, by up to 2.2% of the array's largest value (the qwen2 int4 SnapKV cell: 2 of 25
# seeds beyond 1%: a zero point at 1.5% and 2.2%, a tail value at 1.2%; one element each,
# in layer 1).
KIVI_TOL = 3e-2


def _close(got, want, exact: bool, msg: str, tol: float | None = None):
    """Cached values against the reference's: float32 pages to rounding (1e-4); bf16 caches
    to 1e-2 of the array's largest value (a bf16 rounding that the engine and the float64
    reference put one step apart moves later layers' keys by up to ~1e-3), or `tol` of it
    (KIVI_TOL). Another token's key or another page's scales differ by O(1)."""
    want = np.asarray(want, np.float64)
    tol = tol if tol is not None else 1e-4 if exact else 1e-2
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=msg)


def _check_held(cache, slot, sim, err):
    """The final cache's sequence `slot` holds what the reference's `sim` holds: the token
    count (KIVI: and the quantized count), and per layer and KV head the held tokens' keys
    and values (KIVI: the quantized pages' scales and zeros, and the full-precision tail)."""
    n = sim.held_count
    assert int(np.asarray(cache.lengths)[slot]) == n, (
        f"{err}: slot {slot} holds {int(np.asarray(cache.lengths)[slot])} tokens, the "
        f"reference {n}")
    spec = cache.spec
    bt = np.asarray(cache.block_tables)[slot]
    exact = spec.dtype == jnp.float32 and cache.tail is None
    latent = sim.m.latent
    if cache.tail is None:
        j = np.arange(n)
        for layer in range(spec.num_layers):
            g, index = spec.layer_home(layer)
            if g is None:
                pools, rows, pages, offs = cache.pages, j, bt[j // PAGE], j % PAGE
            else:  # a window group holds the last R logical pages, page p in ring slot p % R
                ring = np.asarray(cache.groups[g].table.block_tables)[slot]
                rows = j[j // PAGE >= -(-n // PAGE) - len(ring)]
                pools, pages, offs = (cache.groups[g].pages, ring[(rows // PAGE) % len(ring)],
                                      rows % PAGE)
            for h in range(spec.attention.cache_heads):
                pos = sim.held[layer][h][rows]
                what = f"{err}: slot {slot} layer {layer} head {h}"
                if latent:
                    got = [_rows(pools.c_kv, pages, offs, index, 0),
                           _rows(pools.k_rope, pages, offs, index, 0)]
                    _close(np.concatenate(got, -1), sim.K[layer, pos, h], exact,
                           f"{what}: latents")
                    if cache.pages.index_k is not None:
                        _close(_rows(pools.index_k, pages, offs, index, 0),
                               sim.KI[layer, pos], exact, f"{what}: indexer keys")
                else:
                    _close(_rows(pools.k, pages, offs, index, h), sim.K[layer, pos, h],
                           exact, f"{what}: keys")
                    _close(_rows(pools.v, pages, offs, index, h), sim.V[layer, pos, h],
                           exact, f"{what}: values")
        return
    nq = int(np.asarray(cache.quant_lengths)[slot])
    assert nq == sim.n_quant, f"{err}: slot {slot} quantized {nq} tokens, the reference " \
                              f"{sim.n_quant}"
    ring = cache.tail.a.shape[3]
    tail = np.arange(nq, n)
    for layer in range(spec.num_layers):
        what = f"{err}: slot {slot} layer {layer}"
        pos = sim.held[layer][0]
        for j, page in enumerate(sim.pages):
            pid, meta = bt[j], page[layer]
            if latent:
                pool = cache.pages.c_kv[0]
                for name, got in (("c_scale", pool.scale), ("c_zero", pool.zero)):
                    _close(np.asarray(got, np.float64)[layer, 0, pid], meta[name][:, 0], False,
                           f"{what}: page {j} {name}", KIVI_TOL)
                _close(np.asarray(cache.pages.k_rope, np.float64)[layer, 0, pid],
                       sim.K[layer, page["pos"], 0, latent:], False, f"{what}: page {j} k_rope",
                       KIVI_TOL)
            else:
                for name, pool in (("k", cache.pages.k[0]), ("v", cache.pages.v[0])):
                    for part, got in (("scale", pool.scale), ("zero", pool.zero)):
                        got = np.moveaxis(np.asarray(got, np.float64)[layer, :, pid], 0, 1)
                        _close(got, meta[f"{name}_{part}"], False,
                               f"{what}: page {j} {name} {part}", KIVI_TOL)
        a = np.asarray(cache.tail.a, np.float64)[layer][:, slot][:, tail % ring]  # [heads, T, w]
        b = np.asarray(cache.tail.b, np.float64)[layer][:, slot][:, tail % ring]
        if latent:
            _close(a[0], sim.K[layer, pos[nq:], 0, :latent], False, f"{what}: tail latents",
                   KIVI_TOL)
            _close(b[0], sim.K[layer, pos[nq:], 0, latent:], False, f"{what}: tail k_rope",
                   KIVI_TOL)
        else:
            _close(np.moveaxis(a, 0, 1), sim.K[layer, pos[nq:]], False, f"{what}: tail keys",
                   KIVI_TOL)
            _close(np.moveaxis(b, 0, 1), sim.V[layer, pos[nq:]], False, f"{what}: tail values",
                   KIVI_TOL)


def _check_rings(cache, slots, err):
    """A cache with window-only pages: Gemma's two local layers form one window group whose
    every sequence holds a ring of min(its pages, R) pages, R = ring_pages(window, chunk,
    page), fewer than the full context would take (the pages of the held tokens)."""
    spec = cache.spec
    assert [(g.layers, g.window) for g in spec.window_groups] == [((0, 1), GEMMA_WINDOW)], (
        f"{err}: window groups {spec.window_groups}")
    ring = ring_pages(GEMMA_WINDOW, GEMMA_CHUNK, PAGE)
    rows = np.asarray(cache.groups[0].table.block_tables)
    assert rows.shape[1] == ring, f"{err}: rings of {rows.shape[1]} pages, expected {ring}"
    full = 0
    for slot in slots:
        pages = -(-int(np.asarray(cache.lengths)[slot]) // PAGE)
        full += pages
        held = int(np.sum(rows[slot] >= 0))
        assert held == min(pages, ring), (
            f"{err}: slot {slot} ({pages} pages long) holds {held} ring pages, expected "
            f"{min(pages, ring)}")
    in_use = window.pages_in_use(cache)[0]
    assert in_use <= ring * len(slots) < full, (
        f"{err}: the window group holds {in_use} pages for {len(slots)} sequences of "
        f"{full} pages (ring {ring})")


def _check_layout(cache, devices, err):
    """Every pool of the cache lies on the plan's 8 devices as the plan says: pages split
    over `data` (2) or `context` (8), KV heads over `model` (4) where they divide (MLA's
    one latent head is replicated)."""
    for pool in jax.tree.leaves(cache.pages):
        shape = list(pool.shape)
        if devices == "8:heads+sequences":
            if shape[1] % 4 == 0:
                shape[1] //= 4
            shape[2] //= 2
        else:
            shape[2] //= 8
        assert len(pool.sharding.device_set) == 8, f"{err}: a pool on {pool.sharding}"
        assert pool.sharding.shard_shape(pool.shape) == tuple(shape), (
            f"{err}: a pool {pool.shape} laid out as {pool.sharding}, shards of "
            f"{pool.sharding.shard_shape(pool.shape)} instead of {tuple(shape)}")


# ----------------------------------------------------------------------------- the matrix


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_cell(family, cache, policy, devices, entry):
    cell = (family, cache, policy, devices, entry)
    if cell in UNDEFINED:
        exc, match = UNDEFINED[cell]
        with pytest.raises(exc, match=match):
            _engine(*cell, prompts=[[1] * n for n in PROMPT_LENS])
        return
    beams = entry == "beam_search"
    case = _case(family, cache, policy, beams)
    err = f"cell {cell}, KVJAX_TEST_SEED={SEED}"
    run = _engine(*cell, prompts=case.prompts)
    want = np.repeat(case.tokens, 2, axis=0) if entry == "sample_n" else case.tokens
    np.testing.assert_array_equal(run.tokens, want, err_msg=err)
    if beams:
        # Summed log-probabilities of NEW tokens, float32 against float64: a token's log-prob
        # was seen up to 1.3e-3 apart (a KIVI code one step apart), float32 pages ~1e-6.
        np.testing.assert_allclose(run.scores, case.scores, rtol=0, atol=2e-2, err_msg=err)
        assert len(run.slots) == BEAMS, f"{err}: beams in slots {run.slots}"
        for slot in run.slots:
            held = int(np.asarray(run.cache.lengths)[slot])
            assert held == case.finals[0].held_count, (
                f"{err}: a beam holds {held} tokens, the reference {case.finals[0].held_count}")
    else:
        for row, slot in enumerate(run.slots):
            _check_held(run.cache, slot, case.finals[row * len(case.prompts) // len(run.slots)],
                        err)
    if devices != "1":
        _check_layout(run.cache, devices, err)
    if _window_pages(*cell[:4]):
        _check_rings(run.cache, run.slots, err)
    else:
        assert not run.cache.spec.window_groups, f"{err}: {run.cache.spec.window_groups}"


# ----------------------------------------------------------------------------- kept for others

# tests/generate/test_kivi_policies.py drives the public cache and policy operations step by
# step with this; the matrix above no longer does (its expectations are independent).
@functools.partial(jax.jit, static_argnames=("model", "policy", "impl", "prefill"))
def _ref_step(model, params, cache, pstate, tokens, positions, q_lengths, seq_ids, *, policy,
              impl, prefill):
    """One forward of the public pieces: rope positions, reserve, the model with the
    policy's selection, the policy's hook. Returns (cache, pstate, logits, status)."""
    if policy is not None:
        positions = policy.rope_positions(cache, pstate,
                                          to_slots(cache, seq_ids, positions))[seq_ids]
    num = jnp.zeros((cache.spec.max_seqs,), jnp.int32).at[seq_ids].set(q_lengths)
    cache, status = kvc.reserve(cache, num)
    select = None if policy is None else (
        lambda c, layer, q: policy.before_attention(c, pstate, layer, to_slots(c, seq_ids, q)))
    out = model.apply(params, tokens, positions, cache, q_lengths=q_lengths, seq_ids=seq_ids,
                      impl=impl, select=select, observe=policy is not None)
    logits, cache = out[:2]
    if policy is not None:
        queries = to_slots(cache, seq_ids, out[2], axis=1)
        if prefill:
            cache, pstate, _ = policy.after_prefill(cache, pstate, queries, num)
        else:
            cache, pstate, _ = policy.after_step(cache, pstate, queries[:, :, 0], num > 0)
    return cache, pstate, logits, status


# ----------------------------------------------------------------------------- the reference


def test_fake_quantize_hand_computed():
    """KIVI's rounding on hand-computed groups: an exact grid, a scale rounded up to
    float16, a zero rounded down, a constant group."""
    x_hat, s, z = cref.fake_quantize(np.array([[0.0, 1.0, 2.0, 3.0]]), 2, axis=-1)
    np.testing.assert_array_equal(x_hat, [[0.0, 1.0, 2.0, 3.0]])
    assert (float(s[0, 0]), float(z[0, 0])) == (1.0, 0.0)
    # (1 - 0) / 3 = 0.333..., above float16's 0.33325: rounded up to 0.33350 (2^-12 more);
    # then 0.5 / s = 1.4993 takes code 1 and 1 / s = 2.9985 code 3.
    x_hat, s, z = cref.fake_quantize(np.array([[0.0, 0.5, 1.0]]), 2, axis=-1)
    assert float(s[0, 0]) == float(np.nextafter(np.float16(1 / 3), np.float16(1)))
    np.testing.assert_allclose(x_hat, [[0.0, float(s[0, 0]), 3 * float(s[0, 0])]])
    # 0.1 is not a float16: the zero is the float16 just below it.
    _, _, z = cref.fake_quantize(np.array([[0.1, 0.7]]), 4, axis=-1)
    assert float(z[0, 0]) < 0.1 and float(np.nextafter(z[0, 0], np.float16(1))) > 0.1
    x_hat, s, _ = cref.fake_quantize(np.full((1, 4), 0.25), 2, axis=-1)
    np.testing.assert_array_equal(x_hat, np.full((1, 4), 0.25))
    assert float(s[0, 0]) == 0.0


def test_pyramid_budgets_hand_computed():
    """The matrix's PyramidKV: 16 tokens on average, the top layer 16 / 2 = 8, the bottom
    2 * 16 - 8 = 24; one layer keeps the average."""
    policy = POLICY["pyramidkv"]
    assert cref.pyramid_budgets(policy, 2, PAGE) == [24, 8]
    assert cref.pyramid_budgets(policy, 1, PAGE) == [16]
    # Four layers: 24, 18.67, 13.33, 8, each rounded up to 24 minus whole pages.
    assert cref.pyramid_budgets(policy, 4, PAGE) == [24, 24, 16, 8]


@pytest.mark.parametrize("family", FAMILIES)
def test_simulation_without_policy_is_the_dense_forward(family):
    """The reference's two forms agree where they must: fed chunk by chunk and token by
    token with float32 storage and no policy, the simulation's logits equal the dense
    causal forward of the whole sequence (which has no state at all)."""
    _, _, ref = _model(family)
    rng = np.random.default_rng(SEED)
    seq = rng.integers(0, 96, 30).tolist()
    cond = cref.Conditioning()
    sim = cref.Simulation(ref, _setup("float32", "none"), cond)
    got = [sim.feed(seq[:16], False), sim.feed(seq[16:25], False)]
    got += [sim.feed([t], True) for t in seq[25:]]
    want = cref.dense_logits(ref, seq, cond)
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-9, atol=1e-9)


def test_indexer_ties_on_a_wrapped_kivi_tail_go_to_the_earlier_position():
    """`kvjax.cache.indexer_topk` breaks ties toward the earlier position, also among a
    KIVI tail whose ring has wrapped (positions 8..18 of a 19-token sequence sit in ring
    slots 8..15, 0..2). Found by the matrix: DeepSeek-V3.2's indexer scores are exactly 0
    wherever every head's relu is, and after StreamingLLM dropped a page its KIVI cells
    picked positions 16..18 over 8..10. Here every score ties (zero queries)."""
    model, _, _ = _model("deepseek_v32")
    spec = model.make_cache_spec(page_size=PAGE, num_pages=8, max_seqs=1, max_pages_per_seq=4,
                                 dtype="float32").replace(quant=_quant("int4"))
    cache, status = kvc.reserve(kvc.init_cache(spec), jnp.array([19], jnp.int32))
    status.raise_if_error()
    rng = np.random.default_rng(SEED)
    c = model.config
    for layer in range(c.num_layers):
        cache = kvc.write(
            cache, layer, rng.standard_normal((1, 19, c.kv_lora_rank), np.float32),
            rng.standard_normal((1, 19, c.qk_rope_head_dim), np.float32),
            index_keys=rng.standard_normal((1, 19, c.index_head_dim), np.float32),
            q_lengths=jnp.array([19]))
    assert int(cache.quant_lengths[0]) == PAGE  # the tail holds positions 8..18
    sel = kvc.indexer_topk(cache, 0, jnp.zeros((1, 1, c.index_n_heads, c.index_head_dim)),
                           jnp.ones((1, 1, c.index_n_heads)), topk=16, scale=1.0,
                           q_lengths=jnp.array([1]))
    assert sorted(np.asarray(sel.positions)[0, 0].tolist()) == list(range(16))


def test_quest_bounds_a_latent_page_quantized_in_the_same_step():
    """Quest on a KIVI MLA cache bounds a page by its c_KV scales and its k_rope's min /
    max; a decode step whose write quantizes a page must bound it by that page's k_rope,
    though the policy's summaries of it are refreshed only after the step. Found by the
    matrix (a DeepSeek int2 Quest cell's last token). Pages 0 and 1 were quantized by
    the prompt, page 2 (k_rope all 10) by the step; with the query's latent part 0 and
    rotary part 1, page 2's bound (40) is far above the others', so top_k=2 reads it."""
    model, _, _ = _model("deepseek")
    c = model.config
    spec = model.make_cache_spec(page_size=PAGE, num_pages=8, max_seqs=1, max_pages_per_seq=5,
                                 dtype="float32").replace(quant=_quant("int4"))
    rng = np.random.default_rng(SEED)
    rope = rng.standard_normal((1, 31, c.qk_rope_head_dim)).astype(np.float32)
    rope[:, 16:24] = 10.0
    cache, status = kvc.reserve(kvc.init_cache(spec), jnp.array([31], jnp.int32))
    status.raise_if_error()
    write = functools.partial(kvc.write, q_lengths=jnp.array([31]))
    for layer in range(c.num_layers):
        cache = write(cache, layer, rng.standard_normal((1, 31, c.kv_lora_rank), np.float32),
                      rope)
    policy = Quest(top_k=2, dense_layers=0)
    state = policy.init_state(cache)
    width = c.kv_lora_rank + c.qk_rope_head_dim
    cache, state, _ = policy.after_prefill(
        cache, state, jnp.zeros((c.num_layers, 1, 31, c.num_heads, width)), jnp.array([31]))
    cache, status = kvc.reserve(cache, jnp.array([1], jnp.int32))
    status.raise_if_error()
    cache = kvc.write(cache, 0, rng.standard_normal((1, 1, c.kv_lora_rank), np.float32),
                      rng.standard_normal((1, 1, c.qk_rope_head_dim), np.float32),
                      q_lengths=jnp.array([1]))
    assert int(cache.quant_lengths[0]) == 3 * PAGE  # page 2 quantized by this write
    q = jnp.zeros((1, c.num_heads, width)).at[..., c.kv_lora_rank:].set(1.0)
    sel = policy.before_attention(cache, state, 0, q)
    page2 = int(np.asarray(cache.block_tables)[0, 2])
    assert page2 in np.asarray(sel.block_tables)[0, 0].tolist(), sel
