"""Llama-family models against HuggingFace transformers (PyTorch CPU), on tiny random configs.

Each variant is built with a fixed torch seed, saved with `save_pretrained`
into a temporary directory and loaded back through `kvjax.models.load`.
Float32 throughout: logits agree to ~2e-6 here, and the bar is 1e-4 max-abs.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kv_cache
import kvjax.generate as gen
import kvjax.models as models
from kvjax.backends import cpu as cpu_kernels
from kvjax.backends.cpu import options as cpu_options
from kvjax.backends.cpu import policy as cpu_policy
from kvjax.models import llama
from kvjax.rope import RopeConfig, attention_factor, rope_inv_freq
from tests.models import hf_tiny

torch = hf_tiny.torch

PAGE = 8
PROMPT_LENS = (5, 13, 21)  # inside one page, across one boundary, across two
NEW = 32


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant -> (HF torch model, saved directory); built on first use, shared by the module."""
    built = {}

    def get(name):
        if name not in built:
            m = hf_tiny.build(name)
            d = tmp_path_factory.mktemp(name)
            m.save_pretrained(d)
            built[name] = (m, str(d))
        return built[name]

    return get


def _hf_logits(m, prompt):
    with torch.no_grad():
        return m(torch.tensor([prompt], dtype=torch.long)).logits[0].numpy()


def _hf_greedy(m, prompt, n):
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt], dtype=torch.long), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(m, prompt, ours, ref, tie_tol=1e-4):
    """Greedy tokens must match; a divergence is accepted only at a true near-tie.

    Prompts are fresh random draws, so HF's own top-2 logits can be closer than
    float32 rounding (~2e-6 here) at some step; there either choice is correct.
    """
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
    logits = _hf_logits(m, prompt + ref[:i])[-1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < tie_tol, (
        f"greedy tokens differ at step {i} (ours {ours[i]}, HF {ref[i]}) although HF's top-2 "
        f"gap is {top2[1] - top2[0]:.2e}\nours {ours}\nHF   {ref}")


@pytest.mark.rotate(3)
@pytest.mark.parametrize("name", list(hf_tiny.VARIANTS))
def test_matches_transformers(name, hf_dirs, rng):
    """Logits at every position (batch of 3 prompt lengths crossing pages) and 32 greedy tokens."""
    m, path = hf_dirs(name)
    model, params = models.load(path)
    assert model.family == "llama"
    prompts = [rng.integers(3, m.config.vocab_size, n).tolist() for n in PROMPT_LENS]
    tokens, lengths, chunk = gen.pad_prompts(prompts, chunk_size=PAGE)
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=3,
                                                max_tokens=max(PROMPT_LENS) + NEW)
    cache, last, status, logits, _ = gen.prefill(
        model, params, kv_cache.init_cache(spec), jnp.asarray(tokens), jnp.asarray(lengths),
        jnp.arange(3, dtype=jnp.int32), chunk_size=chunk, return_logits=True)
    status.raise_if_error()
    logits = np.asarray(logits)
    for b, p in enumerate(prompts):
        ref = _hf_logits(m, p)
        np.testing.assert_allclose(logits[b, : len(p)], ref, rtol=0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(last[b]), ref[-1], rtol=0, atol=1e-4)

    # Greedy decoding of the whole batch, continuing from that prefill's cache.
    ids = jnp.arange(3, dtype=jnp.int32)
    state = gen.start(cache, ids, last, jnp.asarray(lengths), gen.as_keys(jax.random.key(0), 3),
                      jnp.full((3,), NEW, jnp.int32), status, sampling=gen.GREEDY, max_len=NEW)
    state = gen.decode_loop(model, params, state, sampling=gen.GREEDY)
    state.status.raise_if_error()
    assert (np.asarray(state.num_generated) == NEW).all()
    for b, p in enumerate(prompts):
        ours = np.asarray(state.tokens[b]).tolist()
        assert_greedy_equal(m, p, ours, _hf_greedy(m, p, NEW))


def test_variant_switches_are_read(hf_dirs):
    """The configs really exercise what the variants differ in."""
    cfg = {n: llama.LlamaConfig.from_hf(models.read_hf_config(hf_dirs(n)[1]))
           for n in ("llama_gqa", "llama_mqa", "llama31", "mistral", "qwen2", "qwen2_swa",
                     "qwen3", "qwen2_yarn")}
    assert cfg["llama_gqa"].attention.group_size == 4 and cfg["llama_gqa"].tie_word_embeddings
    assert cfg["llama_mqa"].attention.kind == "MQA"
    assert cfg["mistral"].sliding_windows == (8, 8)
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and not cfg["qwen2"].sliding_windows
    assert cfg["qwen2_swa"].sliding_windows == (None, 6)
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim * 4 != cfg["qwen3"].hidden_size
    r = cfg["llama31"].rope
    assert r.rope_type == "llama3"
    plain = RopeConfig(theta=r.theta, dim=r.dim)
    scaled, base = rope_inv_freq(r), rope_inv_freq(plain)
    # Long wavelengths divided by the factor, the shortest one smoothed in between.
    assert np.isclose(scaled, base / 8).any()
    assert ((scaled > base / 8 * 1.01) & (scaled < base)).any()
    y = cfg["qwen2_yarn"].rope
    assert y.rope_type == "yarn" and y.factor == 4 and y.original_max_position_embeddings == 64
    assert attention_factor(y) == pytest.approx(0.1 * np.log(4) + 1)


def test_chunked_prefill_equals_one_shot(hf_dirs, rng):
    """Chunks of 8 (and a second call continuing the sequence) == one 32-token prefill."""
    _, path = hf_dirs("llama_gqa")
    model, params = models.load(path)
    lens = np.array([29, 17], np.int32)
    tokens = rng.integers(3, model.vocab_size, (2, 32)).astype(np.int32)
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=2, max_tokens=32)
    ids = jnp.arange(2, dtype=jnp.int32)

    def run(chunk):
        cache, last, st, logits, _ = gen.prefill(
            model, params, kv_cache.init_cache(spec), jnp.asarray(tokens), jnp.asarray(lens),
            ids, chunk_size=chunk, return_logits=True)
        st.raise_if_error()
        return cache, np.asarray(last), np.asarray(logits)

    c1, last1, l1 = run(32)
    c8, last8, l8 = run(8)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(l8[b, :n], l1[b, :n], rtol=0, atol=1e-5)
    np.testing.assert_allclose(last8, last1, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c8.lengths), lens)

    # Two calls (same shapes, so no new compile): the second continues each sequence.
    split = np.array([11, 9], np.int32)
    first = np.where(np.arange(32)[None] < split[:, None], tokens, 0)
    second = np.zeros((2, 32), np.int32)
    for b in range(2):
        second[b, : lens[b] - split[b]] = tokens[b, split[b]: lens[b]]
    cache = kv_cache.init_cache(spec)
    cache, _, st, _, _ = gen.prefill(model, params, cache, jnp.asarray(first), jnp.asarray(split),
                                  ids, chunk_size=8, return_logits=True)
    cache, last2, st, l2, _ = gen.prefill(model, params, cache, jnp.asarray(second),
                                       jnp.asarray(lens - split), ids, chunk_size=8,
                                       return_logits=True)
    st.raise_if_error()
    np.testing.assert_allclose(np.asarray(last2), last1, rtol=0, atol=1e-5)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(l2)[b, : lens[b] - split[b]],
                                   l1[b, split[b]: lens[b]], rtol=0, atol=1e-5)


def test_forward_decode_path_matches_prefill(hf_dirs, rng):
    """q_len == 1 (decode op) on seq_ids subsets gives the prefill's logits."""
    m, path = hf_dirs("qwen3")
    model, params = models.load(path)
    p = rng.integers(3, model.vocab_size, 10).tolist()
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=3, max_tokens=16)
    cache = kv_cache.init_cache(spec)
    fwd = jax.jit(model.apply, donate_argnames="cache")
    seq = jnp.array([2], jnp.int32)
    out = []
    for t, tok in enumerate(p):
        cache, st = kv_cache.reserve(cache, jnp.array([0, 0, 1], jnp.int32))
        st.raise_if_error()
        logits, cache = fwd(params, jnp.array([[tok]], jnp.int32), jnp.array([[t]], jnp.int32),
                            cache, q_lengths=jnp.array([1], jnp.int32), seq_ids=seq)
        out.append(np.asarray(logits[0, 0]))
    np.testing.assert_allclose(np.stack(out), _hf_logits(m, p), rtol=0, atol=1e-4)


def test_sharded_checkpoint_and_bf16(hf_dirs, tmp_path, rng):
    """index.json shards load to the same params; bfloat16 tensors read exactly."""
    m, path = hf_dirs("qwen2")
    m.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    _, ref = models.load(path)
    _, sharded = models.load(str(tmp_path / "sharded"))
    jax.tree.map(np.testing.assert_array_equal, ref, sharded)

    m.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    m.float()
    model16, p16 = models.load(str(tmp_path / "bf16"))
    assert model16.config.dtype == "bfloat16"
    want = m.state_dict()["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float()
    np.testing.assert_array_equal(np.asarray(p16.layers.w_down[1], np.float32), want.numpy().T)
    model32, p32 = models.load(str(tmp_path / "bf16"), dtype="float32")
    assert p32.layers.w_down.dtype == jnp.float32


def test_unsupported_architecture_is_named(hf_dirs, tmp_path):
    _, path = hf_dirs("llama_mha")
    cfg = models.read_hf_config(path)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        models.load(str(tmp_path))


def test_missing_tensor_is_named(hf_dirs):
    _, path = hf_dirs("llama_mha")
    reader = models.CheckpointReader(path)

    def get(name):
        if name == "model.layers.1.self_attn.k_proj.weight":
            raise KeyError(f"checkpoint is missing tensor {name!r}.")
        return reader(name)

    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        models.load(path, get_tensor=get)
    with pytest.raises(KeyError, match="no.such.tensor"):
        reader("no.such.tensor")


def test_orbax_roundtrip(hf_dirs, tmp_path):
    _, path = hf_dirs("qwen3")
    model, params = models.load(path)
    models.save_params(str(tmp_path / "ckpt"), params)
    init = models.get_family("llama").init_params
    like = jax.eval_shape(lambda k: init(model.config, k), jax.random.key(1))
    restored = models.restore_params(str(tmp_path / "ckpt"), like)
    assert type(restored) is type(params)
    jax.tree.map(np.testing.assert_array_equal, params, restored)


def test_config_validation():
    rope = RopeConfig(theta=1e4, dim=16)
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_layers=2, q_heads=4,
                kv_heads=2, head_dim=16, rope=rope)
    llama.LlamaConfig(**base)
    with pytest.raises(ValueError, match="kv_heads=3 must divide q_heads=4"):
        llama.LlamaConfig(**{**base, "kv_heads": 3})
    with pytest.raises(ValueError, match="sliding_windows"):
        llama.LlamaConfig(**base, sliding_windows=(4,))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        RopeConfig(theta=1e4, dim=16, rope_type="dynamic")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        llama.LlamaConfig.from_hf(dict(hidden_act="gelu", hidden_size=64))


def test_unstacked_layers_give_the_same_logits_and_tokens(hf_dirs, rng, monkeypatch):
    """Per-layer weights (`unstack_layers`, the CPU decode loop's form for big models) run
    the same model (one with a different window per layer): same dense logits, same
    greedy tokens; `decode_params` picks them on CPU above its size threshold when the
    matmul kernel does not read the stack, unless turned off."""
    m, path = hf_dirs("qwen2_swa")
    model, params = models.load(path)
    flat = llama.unstack_layers(params)
    assert isinstance(flat.layers, tuple) and len(flat.layers) == model.config.num_layers
    assert llama.unstack_layers(flat) is flat
    np.testing.assert_array_equal(np.asarray(flat.layers[1].wq), np.asarray(params.layers.wq[1]))

    tokens = rng.integers(3, model.vocab_size, (2, 12)).astype(np.int32)
    dense = llama.forward_dense(params, model.config, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(llama.forward_dense(flat, model.config,
                                                              jnp.asarray(tokens))),
                               np.asarray(dense), rtol=0, atol=1e-5)

    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in PROMPT_LENS]
    kw = dict(key=jax.random.key(0), max_new_tokens=8, cache=gen.CacheConfig(page_size=PAGE))
    ref = gen.generate(model, params, prompts, **kw).tokens
    monkeypatch.setattr(cpu_policy, "UNSTACK_MIN_BYTES", 0)
    with cpu_options.override(matmul="off"):  # the matmul kernel would read the stack
        assert isinstance(gen.decode_params(model, params, 3).layers, tuple)
        np.testing.assert_array_equal(gen.generate(model, params, prompts, **kw).tokens, ref)
        assert gen.decode_params(model, flat) is flat
        with cpu_options.override(unstack_layers=False):
            assert gen.decode_params(model, params) is params
    if cpu_kernels.available():  # the kernel reads stacked weights in place: no copy
        with cpu_options.override(matmul="on"):
            assert gen.decode_params(model, params, 3) is params
            assert isinstance(gen.decode_params(model, params, 33).layers, tuple)
