"""DeepSeek-V2/V3 MLA models against transformers (PyTorch CPU) on tiny random configs.

Every config is built and saved with transformers (no download), loaded through
`params_from_hf` from the saved safetensors, and checked for: float32 prefill
logits within 1e-4 of transformers at every position for a batch of two prompts
of different lengths that cross page boundaries; 32 greedy tokens identical to
`generate(do_sample=False)`; and every decode step's logits against
transformers' full forward over the generated sequence.
"""

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
torch.set_num_threads(1)  # tiny models: see tests/models/hf_tiny.py

from kvjax import cache as kcache  # noqa: E402
from kvjax.attention import mla_decode_attention, mla_prefill_attention  # noqa: E402
from kvjax.models import deepseek as ds  # noqa: E402
from kvjax.models.deepseek import mla, moe  # noqa: E402
from kvjax.rope import RopeConfig, attention_factor, rope_inv_freq  # noqa: E402

PAGE_SIZE = 8
PROMPT_LENS = (13, 21)  # both cross page boundaries; different lengths in one batch
NEW_TOKENS = 32
# f32 end to end; HF and kvjax sum in different orders, so agreement is to ~1e-6, bound 1e-4.
LOGIT_ATOL = 1e-4

_BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
    pad_token_id=0, rms_norm_eps=1e-5,
)
# 8 experts, top 2: decode of two rows dispatches by "gather", prefill by "dense" ("auto").
_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
         "beta_fast": 32, "beta_slow": 1}

CASES = {
    # (a) V2-Lite style: plain q_proj, dense MLP in every layer.
    "v2_dense": ("v2", dict(num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=2,
                            **_MOE)),
    # (b) low-rank query path.
    "v2_qlora": ("v2", dict(num_hidden_layers=2, q_lora_rank=24, first_k_dense_replace=2,
                            **_MOE)),
    # (c) one dense layer then MoE layers, greedy softmax routing.
    "v2_moe": ("v2", dict(num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1,
                          topk_method="greedy", routed_scaling_factor=1.5, **_MOE)),
    # (c') group-limited routing with YaRN and q_lora (DeepSeek-V2 proper).
    "v2_moe_group_yarn": ("v2", dict(num_hidden_layers=3, q_lora_rank=24,
                                     first_k_dense_replace=1, topk_method="group_limited_greedy",
                                     n_group=2, topk_group=1, rope_parameters=_YARN, **_MOE)),
    # (d) V3: sigmoid + noaux_tc with a correction bias, normalised weights, YaRN.
    "v3": ("v3", dict(num_hidden_layers=3, q_lora_rank=24, first_k_dense_replace=1, n_group=4,
                      topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                      rope_parameters=_YARN, **_MOE)),
    # V3 with the rotate-half rope layout (prefill only; see the rotate_half test).
    "v3_no_interleave": ("v3", dict(num_hidden_layers=2, q_lora_rank=None,
                                    first_k_dense_replace=1, n_group=1, topk_group=1,
                                    rope_interleave=False, **_MOE)),
}


@functools.cache
def _hf_case(name: str, tmp_root: str):
    """(hf_model, config_dict, model_dir) for a case, built once per session."""
    family, kw = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    cls_cfg, cls_model = {
        "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[family]
    cfg = cls_cfg(**{**_BASE, **kw})
    model = cls_model(cfg).eval()
    with torch.no_grad():
        # Non-trivial norm weights and correction biases, so their mapping is tested.
        for pname, prm in model.named_parameters():
            if "norm" in pname:
                prm.mul_(1 + 0.2 * torch.rand_like(prm))
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))
    path = f"{tmp_root}/{name}"
    model.save_pretrained(path)
    with open(f"{path}/config.json") as f:
        import json
        hf_config = json.load(f)
    return model, hf_config, path


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepseek_hf"))


def _getter(path: str):
    tensors = safetensors_torch.load_file(f"{path}/model.safetensors")
    return lambda name: tensors[name].numpy()


def _load(path: str, hf_config: dict, **overrides):
    config = ds.DeepseekConfig.from_hf(hf_config, **overrides)
    return config, ds.params_from_hf(config, _getter(path))


_forward = jax.jit(ds.forward, static_argnames=("config", "impl"), donate_argnames="cache")


def _prompts(rng, vocab):
    return [rng.integers(1, vocab, size=n).astype(np.int32) for n in PROMPT_LENS]


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None].long()).logits[0].float().numpy()


def _new_cache(config, max_seqs=3):
    spec = ds.cache_spec(config, page_size=PAGE_SIZE, num_pages=24, max_seqs=max_seqs,
                         max_pages_per_seq=8)
    return kcache.init_cache(spec)


def _reserve(cache, seq_ids, counts):
    if seq_ids is None:
        seq_ids = np.arange(cache.spec.max_seqs)
    num_new = np.zeros(cache.spec.max_seqs, np.int32)
    num_new[np.asarray(seq_ids)] = counts
    cache, status = kcache.reserve(cache, jnp.asarray(num_new))
    status.raise_if_error()
    return cache


def _prefill(params, config, cache, prompts, seq_ids):
    t = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    q_lengths = np.array([len(p) for p in prompts], np.int32)
    cache = _reserve(cache, seq_ids, q_lengths)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    logits, cache = _forward(params, config, jnp.asarray(tokens), jnp.asarray(positions), cache,
                             q_lengths=jnp.asarray(q_lengths), seq_ids=_ids(seq_ids))
    return np.asarray(logits), cache


def _ids(seq_ids):
    return None if seq_ids is None else jnp.asarray(seq_ids)


def _greedy(params, config, cache, prompts, seq_ids, first_logits):
    """Test-local greedy loop: reserve one token per row, forward q_len=1, argmax."""
    b = len(prompts)
    pos = np.array([len(p) for p in prompts], np.int32)
    nxt = np.array([first_logits[i, len(p) - 1].argmax() for i, p in enumerate(prompts)],
                   np.int32)
    out, step_logits = [nxt], []
    ones = jnp.ones((b,), jnp.int32)
    for _ in range(NEW_TOKENS - 1):
        cache = _reserve(cache, seq_ids, 1)
        logits, cache = _forward(params, config, jnp.asarray(nxt[:, None]),
                                 jnp.asarray(pos[:, None]), cache, q_lengths=ones,
                                 seq_ids=_ids(seq_ids))
        logits = np.asarray(logits)[:, 0]
        step_logits.append(logits)
        nxt = logits.argmax(-1).astype(np.int32)
        out.append(nxt)
        pos = pos + 1
    return np.stack(out, 1), np.stack(step_logits, 1), cache


FULL_CASES = [n for n in CASES if n != "v3_no_interleave"]


@pytest.mark.rotate(2)
@pytest.mark.parametrize("name", FULL_CASES)
def test_matches_transformers(name, tmp_root, rng):
    model, hf_config, path = _hf_case(name, tmp_root)
    config, params = _load(path, hf_config)
    prompts = _prompts(rng, config.vocab_size)
    if name == "v2_dense":  # rows are all the cache's slots, in order (seq_ids=None)
        seq_ids, cache = None, _new_cache(config, max_seqs=2)
    else:  # rows live in non-trivial cache slots
        seq_ids, cache = np.array([2, 0], np.int32), _new_cache(config)

    logits, cache = _prefill(params, config, cache, prompts, seq_ids)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(p)], _hf_logits(model, p), atol=LOGIT_ATOL,
                                   rtol=0, err_msg=f"prefill logits, prompt {i}")

    tokens, step_logits, cache = _greedy(params, config, cache, prompts, seq_ids, logits)
    for i, p in enumerate(prompts):
        hf_new = _hf_greedy(model, p)
        np.testing.assert_array_equal(tokens[i], hf_new, err_msg=f"greedy tokens, prompt {i}")
        # Every absorbed-decode step against transformers' full forward over the sequence.
        full = _hf_logits(model, np.concatenate([p, hf_new]))
        np.testing.assert_allclose(step_logits[i], full[len(p): len(p) + NEW_TOKENS - 1],
                                   atol=LOGIT_ATOL, rtol=0, err_msg=f"decode logits, prompt {i}")
    lengths = np.asarray(cache.lengths)
    rows = np.arange(2) if seq_ids is None else seq_ids
    assert lengths[rows].tolist() == [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
    kcache.check_invariants(cache.table)


def _hf_greedy(model, prompt) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt)[None].long(), max_new_tokens=NEW_TOKENS,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt)).long())
    new = out[0, len(prompt):].numpy()
    assert len(new) == NEW_TOKENS
    return new


def test_load_and_generate_end_to_end(tmp_root, rng):
    """kvjax.models.load on the saved directory + kvjax.generate's jitted loop == HF greedy."""
    import kvjax.generate as kgen
    import kvjax.models as kmodels

    model, _, path = _hf_case("v3", tmp_root)
    kv_model, params = kmodels.load(path)
    assert kv_model.family == "deepseek" and isinstance(kv_model.config, ds.DeepseekConfig)
    prompts = _prompts(rng, kv_model.vocab_size)
    result = kgen.generate(kv_model, params, [p.tolist() for p in prompts],
                           key=jax.random.key(0), max_new_tokens=NEW_TOKENS,
                           cache=kgen.CacheConfig(page_size=PAGE_SIZE),
                           chunk_size=16)  # the 21-token prompt prefills in two chunks
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(result.tokens[i], _hf_greedy(model, p))


def test_chunked_prefill_equals_whole(tmp_root, rng):
    """Two padded chunks (the second attending to the first through the cache) == one prefill."""
    _, hf_config, path = _hf_case("v2_moe", tmp_root)
    config, params = _load(path, hf_config)
    prompts = _prompts(rng, config.vocab_size)
    seq_ids = np.array([2, 0], np.int32)
    whole, _ = _prefill(params, config, _new_cache(config), prompts, seq_ids)
    cuts = (8, 10)  # chunk 2 starts at a page boundary (row 0) and mid-page (row 1)
    cache = _new_cache(config)
    heads = [p[:c] for p, c in zip(prompts, cuts, strict=True)]
    first, cache = _prefill(params, config, cache, heads, seq_ids)
    rest = [p[c:] for p, c in zip(prompts, cuts, strict=True)]
    t = max(len(r) for r in rest)
    tokens = np.zeros((2, t), np.int32)
    positions = np.zeros((2, t), np.int32)
    for i, (r, c) in enumerate(zip(rest, cuts, strict=True)):
        tokens[i, : len(r)] = r
        positions[i] = c + np.arange(t)
    q_lengths = np.array([len(r) for r in rest], np.int32)
    cache = _reserve(cache, seq_ids, q_lengths)
    second, _ = _forward(params, config, jnp.asarray(tokens), jnp.asarray(positions), cache,
                         q_lengths=jnp.asarray(q_lengths), seq_ids=jnp.asarray(seq_ids))
    second = np.asarray(second)
    # Other padded shapes change XLA's f32 summation order: agreement is ~1e-5, not bitwise;
    # bounded like the HF comparison.
    for i, (p, c) in enumerate(zip(prompts, cuts, strict=True)):
        np.testing.assert_allclose(first[i, :c], whole[i, :c], atol=LOGIT_ATOL, rtol=0)
        np.testing.assert_allclose(second[i, : len(p) - c], whole[i, c: len(p)],
                                   atol=LOGIT_ATOL, rtol=0)


def test_bfloat16_params_and_cache(tmp_root, rng):
    """bf16 params, compute and cache: as close to float32 as transformers' own bf16 model is."""
    model, hf_config, path = _hf_case("v2_qlora", tmp_root)
    config16 = ds.DeepseekConfig.from_hf(hf_config, dtype="bfloat16")
    params16 = ds.params_from_hf(config16, _getter(path))
    assert params16.embed.dtype == jnp.bfloat16
    spec = ds.cache_spec(config16, page_size=PAGE_SIZE, num_pages=24, max_seqs=3,
                         max_pages_per_seq=8, dtype="bfloat16")
    prompts = _prompts(rng, config16.vocab_size)
    got, cache = _prefill(params16, config16, kcache.init_cache(spec), prompts,
                          np.array([2, 0], np.int32))
    assert cache.pages.c_kv.dtype == jnp.bfloat16 and got.dtype == np.float32
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    for i, p in enumerate(prompts):
        ref = _hf_logits(model, p)
        with torch.no_grad():
            hf16 = model16(torch.tensor(p)[None].long()).logits[0].float().numpy()
        # bf16 rounding (8 mantissa bits) is the only error source on both sides.
        hf_err = np.abs(hf16 - ref).max()
        assert 0 < np.abs(got[i, : len(p)] - ref).max() <= 2 * hf_err + 1e-3


def test_decode_with_pallas_kernel_matches_xla(rng):
    """forward(impl="pallas") (the MLA decode kernel, interpreted on CPU) == impl="xla"."""
    config = ds.DeepseekConfig(  # kernel-supported latent widths (d_c, d_rope multiples of 64)
        vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        kv_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
    )
    params = ds.init_params(config, jax.random.key(int(rng.integers(2**31))), std=0.2)
    prompts = _prompts(rng, config.vocab_size)
    seq_ids = np.array([2, 0], np.int32)
    logits, cache = _prefill(params, config, _new_cache(config), prompts, seq_ids)
    cache = _reserve(cache, seq_ids, 1)
    tokens = jnp.asarray(logits[[0, 1], [len(p) - 1 for p in prompts]].argmax(-1)[:, None],
                         jnp.int32)
    positions = jnp.asarray([[len(p)] for p in prompts], jnp.int32)
    step = jax.jit(ds.forward, static_argnames=("config", "impl"))
    out = {impl: np.asarray(step(params, config, tokens, positions, cache,
                                 q_lengths=jnp.ones(2, jnp.int32), seq_ids=jnp.asarray(seq_ids),
                                 impl=impl)[0]) for impl in ("xla", "pallas")}
    # f32 summation-order noise (the kernel's online softmax over page blocks against one
    # pass), carried through two layers and the LM head: relative to the logits' scale, as
    # the file's other f32 checks. A wrong page or mask moves logits by O(0.1).
    want = out["xla"]
    np.testing.assert_allclose(out["pallas"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_prefill_matches_transformers_rotate_half(tmp_root, rng):
    model, hf_config, path = _hf_case("v3_no_interleave", tmp_root)
    config, params = _load(path, hf_config)
    assert not config.rope.interleaved
    prompts = _prompts(rng, config.vocab_size)
    logits, _ = _prefill(params, config, _new_cache(config), prompts, np.array([2, 0]))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i, : len(p)], _hf_logits(model, p), atol=LOGIT_ATOL,
                                   rtol=0)


@pytest.mark.parametrize("scoring", ["softmax_greedy", "softmax_group", "sigmoid_noaux"])
def test_moe_dispatch_impls_agree(scoring, rng):
    """dense, gather and ragged dispatch give the same MoE output (HF parity uses dense+gather)."""
    topk_method, scoring_func = {
        "softmax_greedy": ("greedy", "softmax"), "softmax_group": ("group_limited_greedy",
                                                                   "softmax"),
        "sigmoid_noaux": ("noaux_tc", "sigmoid")}[scoring]
    base = ds.DeepseekConfig(
        vocab_size=16, hidden_size=24, intermediate_size=32, num_layers=2, num_heads=2,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=12, n_shared_experts=2, scoring_func=scoring_func,
        topk_method=topk_method, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=1.7,
    )
    params = ds.init_params(base, jax.random.key(int(rng.integers(2**31))), std=0.3)
    p = jax.tree.map(lambda x: x[0], params.moe_layers.moe)
    if p.bias is not None:
        p = dataclasses.replace(p, bias=jnp.asarray(rng.standard_normal(p.bias.shape),
                                                     jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 5, base.hidden_size)), jnp.float32)
    impls = ("dense", "gather", "ragged")

    @jax.jit
    def all_impls(p, x):  # one compile for the three dispatches
        return {i: moe.moe(p, dataclasses.replace(base, moe_impl=i, dtype=x.dtype.name), x)
                for i in impls}

    outs = jax.tree.map(np.asarray, all_impls(p, x))
    # A per-token loop over the chosen experts in float64 as the reference.
    xf = np.asarray(x, np.float64).reshape(-1, base.hidden_size)
    logits = xf @ np.asarray(p.router, np.float64).T
    w, idx = jax.jit(moe.route, static_argnums=0)(base, jnp.asarray(logits, jnp.float32),
                                                  p.bias)
    w, idx = np.asarray(w, np.float64), np.asarray(idx)
    ex = jax.tree.map(lambda a: np.asarray(a, np.float64), p.experts)
    sh = jax.tree.map(lambda a: np.asarray(a, np.float64), p.shared)

    def swiglu(v, g, u, d):
        a = v @ g
        return (a / (1 + np.exp(-a)) * (v @ u)) @ d

    want = np.stack([
        sum(w[n, j] * swiglu(xf[n], ex.gate[e], ex.up[e], ex.down[e])
            for j, e in enumerate(idx[n])) + swiglu(xf[n], sh.gate, sh.up, sh.down)
        for n in range(xf.shape[0])]).reshape(x.shape)
    assert len(np.unique(idx)) > 2  # routing actually spreads over experts
    for impl, got in outs.items():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=impl)  # f32 vs a float64 reference

    if scoring != "sigmoid_noaux":
        return
    # bf16 experts (router still float32): inputs and weights rounded to bf16 route exactly as
    # their float32 copies, so only bf16 rounding of the expert math separates the two.
    p16 = dataclasses.replace(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p),
                              router=p.router, bias=p.bias)
    x16 = x.astype(jnp.bfloat16)
    ref16 = all_impls(jax.tree.map(lambda a: a.astype(jnp.float32), p16),
                      x16.astype(jnp.float32))["dense"]
    for impl, got16 in all_impls(p16, x16).items():
        assert got16.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got16, np.float32), np.asarray(ref16), rtol=0,
                                   atol=3e-2 * np.abs(ref16).max(), err_msg=impl)


def test_latent_cache_holds_hf_latents(tmp_root, rng):
    """The cache stores exactly transformers' normalised c_KV and rotated k_rope (V2 layout)."""
    model, hf_config, path = _hf_case("v2_qlora", tmp_root)
    config, params = _load(path, hf_config)
    prompts = _prompts(rng, config.vocab_size)
    seq_ids = np.array([2, 0], np.int32)
    _, cache = _prefill(params, config, _new_cache(config), prompts, seq_ids)
    prompt = prompts[1]  # in slot 0
    with torch.no_grad():
        out = model(torch.tensor(prompt)[None].long(), use_cache=True)
    hf_cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    for layer in range(config.num_layers):
        hf_c = hf_cache.layers[layer].keys[0, 0].numpy()
        hf_r = hf_cache.layers[layer].values[0, 0].numpy()
        view = kcache.layer_view(cache, layer)
        bt = np.asarray(cache.block_tables)[seq_ids[1]]
        pos = np.arange(len(prompt))
        pages = bt[pos // PAGE_SIZE]
        got_c = np.asarray(view.k)[pages, pos % PAGE_SIZE]
        got_r = np.asarray(view.v)[pages, pos % PAGE_SIZE]
        np.testing.assert_allclose(got_c, hf_c, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_r, hf_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 4])
def test_absorbed_attention_equals_decompressed(q_len, rng):
    """Absorbed MLA over paged latents == naive per-head K/V decompression on dense latents."""
    config = ds.DeepseekConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=3,
        kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        rope=RopeConfig(theta=10000.0, dim=8, rope_type="yarn", factor=8.0,
                        original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8,
                        interleaved=True),
    )
    params = ds.init_params(config, jax.random.key(int(rng.integers(2**31))), std=0.3)
    p = jax.tree.map(lambda x: x[0], params.dense_layers)
    lengths = np.array([11, 19], np.int32)
    b, s = len(lengths), int(lengths.max())
    spec = ds.cache_spec(config, page_size=4, num_pages=16, max_seqs=2, max_pages_per_seq=6)
    cache = kcache.init_cache(spec)
    # Grow both sequences in random steps so their pages interleave in the pool.
    grown = np.zeros(2, np.int32)
    while (grown < lengths).any():
        step = np.minimum(rng.integers(1, 4, size=2), lengths - grown).astype(np.int32)
        cache = _reserve(cache, [0, 1], step)
        grown += step
    c_kv = rng.standard_normal((b, s, config.kv_lora_rank)).astype(np.float32)
    k_rope = rng.standard_normal((b, s, config.qk_rope_head_dim)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    valid = pos < lengths[:, None]
    h = config.num_heads
    q_nope = rng.standard_normal((b, q_len, h, config.qk_nope_head_dim)).astype(np.float32)
    q_rope = rng.standard_normal((b, q_len, h, config.qk_rope_head_dim)).astype(np.float32)
    q_lengths = np.minimum(q_len, lengths).astype(np.int32)
    q_pos = (lengths[:, None] - q_lengths[:, None] + np.arange(q_len)[None]).astype(np.int32)

    @jax.jit
    def both(p, cache, c_kv, k_rope, q_nope, q_rope, q_lengths, q_pos):
        slots = kcache.paged.token_slots(cache, jnp.asarray(pos), jnp.asarray(valid))
        cache = kcache.paged.write_layer(cache, 0, slots, c_kv, k_rope)
        view = kcache.layer_view(cache, 0)
        q_lat = mla.absorb_query(p, q_nope)
        if q_len == 1:
            out, _ = mla_decode_attention(q_lat[:, 0], q_rope[:, 0], view.k, view.v,
                                          cache.lengths, cache.block_tables,
                                          scale=config.softmax_scale)
            out = out[:, None]
        else:
            out, _ = mla_prefill_attention(q_lat, q_rope, view.k, view.v, cache.lengths,
                                           cache.block_tables, q_lengths,
                                           scale=config.softmax_scale)
        got = mla.output(p, config, out)
        want = ds.mla_attention_naive(p, config, c_kv, k_rope, q_nope, q_rope, q_pos,
                                      cache.lengths)
        return got, want

    got, want = (np.asarray(x) for x in both(p, cache, c_kv, k_rope, q_nope, q_rope, q_lengths,
                                             q_pos))
    for i in range(b):
        n = q_lengths[i]
        # Two f32 evaluation orders of the same sums: a few ulps of the output's scale.
        np.testing.assert_allclose(got[i, :n], want[i, :n], rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
    assert np.abs(want).max() > 1e-2  # a real signal, not zeros


def test_yarn_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.DeepseekV2Config(**{**_BASE, **CASES["v2_moe_group_yarn"][1],
                                           "rope_parameters": dict(_YARN)})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope = ds.DeepseekConfig.from_hf(cfg.to_dict()).rope
    assert rope.rope_type == "yarn" and rope.dim == 16 and rope.theta == 10000.0
    np.testing.assert_allclose(rope_inv_freq(rope), inv_freq.numpy(), rtol=1e-6)
    assert attention_factor(rope) == pytest.approx(factor, rel=1e-12)
    attn = transformers.DeepseekV2ForCausalLM(cfg).model.layers[0].self_attn
    assert ds.DeepseekConfig.from_hf(cfg.to_dict()).softmax_scale == pytest.approx(
        attn.scaling, rel=1e-12)


@pytest.mark.parametrize("v32", [dict(architectures=["DeepseekV32ForCausalLM"]),
                                 dict(model_type="deepseek_v32"),
                                 dict(index_topk=64, index_n_heads=2, index_head_dim=32)],
                         ids=["architecture", "model_type", "indexer_fields"])
def test_a_v32_config_is_refused_with_the_family_to_use(v32):
    cfg = transformers.DeepseekV3Config(**{**_BASE, **CASES["v3"][1]}).to_dict()
    assert ds.DeepseekConfig.from_hf(cfg).num_layers == 3  # the V3 config itself loads
    with pytest.raises(ValueError, match="deepseek_v32 family"):
        ds.DeepseekConfig.from_hf({**cfg, **v32})


def test_params_from_fused_state_dict_equal_saved(tmp_root):
    """transformers 5's in-memory fused expert names load to the same params as the saved ones."""
    model, hf_config, path = _hf_case("v2_moe", tmp_root)
    config, saved = _load(path, hf_config)
    sd = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    fused = ds.params_from_hf(config, lambda n: sd[n].detach().numpy())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 saved, fused)


def test_fp8_block_quantized_checkpoint(tmp_root):
    """DeepSeek-V3's FP8 format (weight + per-tile weight_scale_inv) dequantizes on load."""
    import ml_dtypes

    _, hf_config, path = _hf_case("v3", tmp_root)
    tensors = {k: np.asarray(v) for k, v in safetensors_torch.load_file(
        f"{path}/model.safetensors").items()}
    block = (32, 32)  # 48- and 96-wide weights leave partial edge tiles
    quantized, expected = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if (w.ndim != 2 or not name.endswith("_proj.weight") or "embed" in name):
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        pad = np.zeros((rows * block[0], cols * block[1]), np.float32)
        pad[: w.shape[0], : w.shape[1]] = np.abs(w)
        scale = (pad.reshape(rows, block[0], cols, block[1]).max((1, 3)) / 448.0)
        scale = np.maximum(scale, 1e-12).astype(np.float32)
        full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        expected[name] = q.astype(np.float32) * full
    n_fp8 = sum(v.dtype == ml_dtypes.float8_e4m3fn for v in quantized.values())
    assert n_fp8 > 20
    fp8_config = {**hf_config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}}
    config = ds.DeepseekConfig.from_hf(fp8_config)
    assert config.fp8_block_size == block
    got = ds.params_from_hf(config, quantized.__getitem__)
    want = ds.params_from_hf(config, expected.__getitem__)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, want)
    del quantized["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(KeyError, match="o_proj.weight_scale_inv"):
        ds.params_from_hf(config, quantized.__getitem__)
    with pytest.raises(ValueError, match="quant_method='bitsandbytes'"):
        ds.DeepseekConfig.from_hf({**hf_config, "quantization_config": {
            "quant_method": "bitsandbytes"}})


def test_loading_errors(tmp_root):
    model, hf_config, path = _hf_case("v2_dense", tmp_root)
    config = ds.DeepseekConfig.from_hf(hf_config)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    missing = "model.layers.1.self_attn.kv_b_proj.weight"
    del sd[missing]
    with pytest.raises(KeyError, match=missing.replace(".", r"\.")):
        ds.params_from_hf(config, sd.__getitem__)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ds.DeepseekConfig.from_hf({**hf_config, "model_type": "llama",
                                   "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        ds.DeepseekConfig.from_hf({**hf_config, "rope_parameters": {"rope_type": "dynamic",
                                                                    "factor": 2.0}})
    with pytest.raises(ValueError, match="topk_method"):
        dataclasses.replace(config, first_k_dense_replace=0, topk_method="noaux_tc")


def test_original_checkpoint_config_format():
    """An original DeepSeek-V2-Lite config.json (rope_theta + rope_scaling) is understood."""
    lite = dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax",
        rms_norm_eps=1e-6, rope_theta=10000, max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
    )
    config = ds.DeepseekConfig.from_hf({**lite, "torch_dtype": "bfloat16"})
    assert config.dtype == np.dtype(jnp.bfloat16)
    assert config.q_lora_rank is None and config.num_moe_layers == 26
    assert config.rope.rope_type == "yarn" and config.rope.factor == 40
    assert attention_factor(config.rope) == 1.0
    m = 0.1 * 0.707 * np.log(40) + 1
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    assert config.attention.cache_widths == (512, 64)
