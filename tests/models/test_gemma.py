"""Gemma 2 and Gemma 3 against transformers (PyTorch CPU), on tiny random configs.

Two configs (`hf_tiny.GEMMA_VARIANTS`): "gemma2" (local/global alternating, attention and
final soft caps) and "gemma3" (two local layers to one global, QK-norm, local RoPE base
10k and global base 1M with linear scaling), both with an 8-token window on 4-token pages
and prompts and generations more than 3x the window, built and saved with transformers
and loaded with `kvjax.models.load`. The local layers keep only their window's pages (the
Gemma config's default) on every decoding path. Checked for both configs: float32
last-position logits within 1e-4; 32 greedy tokens identical to transformers' through
`kvjax.generate.generate`, through `sample_n` and `python -m kvjax generate --n 2` (each
prompt prefilled once and its pages forked into two samples) and on a `ShardingPlan` over
4 CPU devices; `beam_search` against transformers' beams. Also: bf16 params and cache
against float32 within transformers' own bf16 error; a `Gemma3ForConditionalGeneration`
checkpoint's text model loads to the same params.
"""

import copy
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models import hf_tiny

torch = hf_tiny.torch
T = hf_tiny.T

import kvjax.generate as gen  # noqa: E402
import kvjax.models as models  # noqa: E402
import kvjax.sharding as kvs  # noqa: E402
from kvjax.__main__ import main  # noqa: E402
from kvjax.cache import window  # noqa: E402
from kvjax.models import gemma  # noqa: E402
from kvjax.specs import ring_pages  # noqa: E402

PAGE = 4
WINDOW = 8  # hf_tiny's Gemma windows
LENS = (26, 31)  # both > 3 windows; the longer one prefills in two chunks of 16
# The greedy paths' prompts: 28 tokens fill 7 pages, the others end inside a page. The
# forked, CLI and sharded paths take the first two; plain `generate` takes all four, so
# that its decode loop (4 rows, same cache spec) is `sample_n`'s with n=2, one program.
REF_LENS = (28, 31, 26, 29)
CHUNK = 16
NEW = 32
LOGIT_ATOL = 1e-4  # float32 on both sides; they sum in different orders (~1e-6 here)
CC = gen.CacheConfig(page_size=PAGE)
FAMILIES = ["gemma2", "gemma3"]


@functools.cache
def _case(name: str, root: str):
    """(hf_model, kvjax model, params, directory) of a variant, built once per session.

    transformers' init gives these tiny models a hidden state dominated by the last
    token's own embedding, so greedy decoding tends to repeat one token; larger norm
    weights and a smaller embedding make the tokens vary (and the window's contents
    matter) for most draws.
    """
    seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"{name} weights: KVJAX_TEST_SEED={seed}")
    m = hf_tiny.build(name, seed=seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p))
            elif "embed" in n:
                p.mul_(0.3)
    d = f"{root}/{name}"
    m.save_pretrained(d)
    model, params = models.load(d)
    return m, model, params, d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gemma"))


def _prompts(rng, lens=LENS):
    return [rng.integers(3, 96, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def reference(root):
    """name -> (prompts of lengths REF_LENS, transformers' NEW greedy tokens after each).

    Drawn and decoded once per variant: the greedy paths (plain, forked, CLI, sharded)
    all compare against the same transformers run.
    """
    refs = {}

    def get(name):
        if name not in refs:
            seed = int(os.environ.get("KVJAX_TEST_SEED",
                                      np.random.SeedSequence().entropy % 2**31))
            m = _case(name, root)[0]
            prompts = _prompts(np.random.default_rng(seed), REF_LENS)
            refs[name] = seed, prompts, [hf_tiny.hf_greedy(m, p, NEW) for p in prompts]
        seed, prompts, greedy = refs[name]
        print(f"{name} prompts: KVJAX_TEST_SEED={seed}")  # in each test's captured output
        return prompts, greedy

    return get


# ------------------------------------------------------------------- transformers parity


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers(name, root, reference):
    """Last-position logits of each prompt and 32 greedy tokens through `generate`, the
    local layers holding only their rings at the end."""
    m, model, params, _ = _case(name, root)
    assert model.family == "gemma"
    c = model.config
    assert c.sliding_window == WINDOW and gemma.LOCAL in c.layer_types
    assert gemma.GLOBAL in c.layer_types
    prompts, ref = reference(name)
    # The prefill `generate` runs (same cache spec, shapes, chunk and keyword arguments:
    # one program).
    tokens, lengths, chunk = gen.pad_prompts(prompts, CHUNK)
    cache = CC.build(model, num_seqs=len(prompts), max_tokens=max(REF_LENS) + NEW,
                     chunk=chunk)
    _, last, status, _, _ = gen.prefill(model, params, cache, jax.device_put(tokens),
                                        jax.device_put(lengths),
                                        jax.device_put(np.arange(len(prompts),
                                                                 dtype=np.int32)),
                                        chunk_size=chunk, impl="auto", policy=None,
                                        policy_state=None)
    status.raise_if_error()
    last = np.asarray(last)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(last[i], hf_tiny.hf_logits(m, p)[-1], atol=LOGIT_ATOL,
                                   rtol=0, err_msg=f"last-position logits, prompt {i}")
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                       cache=CC, chunk_size=CHUNK, free_finished=False)
    # Every row is past its ring: the prompt's older pages went back to the local pool.
    assert window.pages_in_use(res.cache) == (len(prompts) * ring_pages(WINDOW, CHUNK, PAGE),)
    for i, p in enumerate(prompts):
        hf_tiny.assert_greedy(m, p, res.tokens[i].tolist(), ref[i])


@pytest.mark.parametrize("name", FAMILIES)
def test_sample_n_forks_match_transformers(name, root, reference):
    """Each prompt prefilled once and forked into two greedy samples (`sample_n`, with the
    arguments `python -m kvjax generate --n 2` passes: the same programs): every sample's
    32 tokens are transformers'. The two samples of a prompt share its full pages in the
    global layers and own disjoint pages past them (a partly filled last page is copied
    on write); in the local layers each holds a ring of its own."""
    m, model, params, _ = _case(name, root)
    prompts, ref = (x[:2] for x in reference(name))
    res = gen.sample_n(model, params, prompts, n=2, key=jax.random.key(0),
                       max_new_tokens=NEW, eos_ids=[], cache=CC, chunk_size=CHUNK,
                       free_finished=False)
    assert window.pages_in_use(res.cache) == (4 * ring_pages(WINDOW, CHUNK, PAGE),)
    table = np.asarray(res.cache.block_tables)
    for i, p in enumerate(prompts):
        full = len(p) // PAGE
        a, b = table[2 * i], table[2 * i + 1]
        np.testing.assert_array_equal(a[:full], b[:full], err_msg=f"prompt {i}'s full pages")
        own = [set(r[full:][r[full:] >= 0].tolist()) for r in (a, b)]
        assert own[0] and own[1] and not own[0] & own[1], (i, a, b)
        for j in range(2):
            hf_tiny.assert_greedy(m, p, res.tokens[2 * i + j].tolist(), ref[i])


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_generate_matches_transformers(name, root, reference, capsys):
    """`python -m kvjax generate --n 2` on the saved checkpoint: both greedy samples of each
    prompt (its pages forked after its prefill) are transformers' greedy tokens."""
    m, _, _, d = _case(name, root)
    prompts, ref = (x[:2] for x in reference(name))
    capsys.readouterr()  # the case's seed lines, when this test built them
    args = ["generate", "--model", d, "--max-new-tokens", str(NEW), "--page-size", str(PAGE),
            "--eos-id", "none", "--chunk-size", str(CHUNK), "--n", "2"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    assert main(args) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 2 * len(prompts)
    for j, line in enumerate(lines):
        p = prompts[j // 2]
        head, ids = line.split(" ", 1)
        ids = [int(t) for t in ids.split(",")]
        assert head == f"[{j}]" and ids[:len(p)] == p
        hf_tiny.assert_greedy(m, p, ids[len(p):], ref[j // 2])
    assert f"loaded {m.config.architectures[0]} (gemma" in out.err


@pytest.mark.parametrize("name", FAMILIES)
def test_beam_search_matches_transformers(name, root, rng):
    """Beams sharing forked pages, the local layers keeping only their window's pages
    (`CacheConfig(window_pages=True)`): transformers' best beam, and its summed
    log-probability."""
    m, model, params, _ = _case(name, root)
    prompt = _prompts(rng, (26,))[0]
    new = 3 * WINDOW
    beams = gen.beam_search(model, params, prompt, beam_width=3, max_new_tokens=new,
                            cache=gen.CacheConfig(page_size=PAGE, window_pages=True),
                            chunk_size=CHUNK, keep_cache=True)
    assert len(beams.cache.groups) == 1  # the local layers' ring pages
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), num_beams=3, do_sample=False,
                         max_new_tokens=new, eos_token_id=None, pad_token_id=0,
                         length_penalty=1.0, early_stopping=False)[0, len(prompt):].tolist()
    logp = torch.log_softmax(torch.tensor(hf_tiny.hf_logits(m, prompt + ref)), -1).numpy()
    want = sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(ref))
    if beams.best != ref:  # a tie between beams' sums is the only excuse
        assert abs(beams.scores[0] - want) < 1e-4, (beams.best, ref)
    np.testing.assert_allclose(beams.scores[0], want, rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_plan_matches_transformers(name, root, reference):
    """Params and KV heads tensor-parallel over `model` (2 KV heads, one per device), the
    two sequences over `data` (the 'context' strategy refuses windows), the local layers
    keeping only their window's pages: transformers' greedy tokens, and every page of the
    global layers and the local rings back in the pools once the rows finish."""
    m, model, params, _ = _case(name, root)
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((2, 2), ("data", "model")),
                            strategies=("sequences", "heads"))
    prompts, ref = (x[:2] for x in reference(name))
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                       cache=gen.CacheConfig(page_size=PAGE, plan=plan), chunk_size=CHUNK)
    pool = jax.tree.leaves(res.cache.pages)[0]
    assert len(pool.sharding.device_set) == 4
    assert window.pages_in_use(res.cache) == (0,)  # one window group, its rings freed
    assert int(np.sum(res.cache.num_free_pages)) == res.cache.spec.num_pages
    for i, p in enumerate(prompts):
        hf_tiny.assert_greedy(m, p, res.tokens[i].tolist(), ref[i])


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bfloat16_params_and_cache(name, root, rng):
    """bf16 params, activations and pages through `generate`, the local layers keeping only
    their window's pages: every token is float32 transformers' argmax up to bf16's error,
    which transformers' own bf16 model bounds. (Not the same tokens as transformers' bf16
    model: its own eager and sdpa attention disagree on most prompts' greedy tokens in
    bf16, `scripts/hf_bf16_greedy.py`.)"""
    m, model, _, d = _case(name, root)
    model16, params16 = models.load(d, dtype="bfloat16")
    assert params16.embed.dtype == jnp.bfloat16 and model16.config.dtype == "bfloat16"
    prompts = _prompts(rng)
    res = gen.generate(model16, params16, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                       cache=gen.CacheConfig(page_size=PAGE, dtype="bfloat16",
                                             window_pages=True),
                       chunk_size=CHUNK, free_finished=False)
    assert res.cache.pages.k.dtype == jnp.bfloat16
    # Both rows are past their rings: the two local layers hold ring_pages each per row.
    assert window.pages_in_use(res.cache) == (2 * ring_pages(WINDOW, CHUNK, PAGE),)
    m16 = copy.deepcopy(m).to(torch.bfloat16)
    for i, p in enumerate(prompts):
        toks = res.tokens[i].tolist()
        ref = hf_tiny.hf_logits(m, p + toks)[len(p) - 1:-1]  # float32, predicting each token
        with torch.no_grad():
            hf16 = m16(torch.tensor([p + toks])).logits[0].float().numpy()[len(p) - 1:-1]
        hf_err = np.abs(hf16 - ref).max()  # bf16 rounding is the only error on both sides
        gaps = ref.max(-1, keepdims=True) - ref  # every token's distance below the best
        # The bound below must tell tokens apart: most tokens sit further below the best
        # than twice transformers' bf16 error (else this check could pass any token).
        assert 0 < 2 * hf_err < np.median(gaps) / 2, (hf_err, np.median(gaps))
        gap = gaps[np.arange(NEW), toks]
        # A wrong window, RoPE or scale picks tokens far below the best: each choice must
        # be within twice transformers' bf16 error.
        assert (gap <= 2 * hf_err).all(), (gap.max(), hf_err)


def test_unstacked_layers_give_every_position_of_transformers(root, rng):
    """Per-layer weights (`unstack_layers`, the CPU decode loop's form for big models) and
    stacked ones: transformers' logits at every position of 3-window prompts."""
    m, model, params, _ = _case("gemma3", root)
    prompts = _prompts(rng, (24, 24))
    flat = jax.jit(gemma.unstack_layers)(params)  # one program, not one per slice
    assert isinstance(flat.layers, tuple) and len(flat.layers) == model.config.num_layers
    tokens = jax.device_put(np.asarray(prompts, np.int32))
    lengths = jax.device_put(np.asarray([24, 24], np.int32))
    rows = jax.device_put(np.arange(2, dtype=np.int32))
    out = []
    for p in (params, flat):
        cache = CC.build(model, num_seqs=2, max_tokens=max(LENS) + NEW, chunk=24)
        _, _, status, logits, _ = gen.prefill(model, p, cache, tokens, lengths, rows,
                                              chunk_size=24, return_logits=True)
        status.raise_if_error()
        out.append(np.asarray(logits))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(out[0][i], hf_tiny.hf_logits(m, p), atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_allclose(out[1], out[0], atol=1e-6, rtol=0)


# ------------------------------------------------------------------------ checkpoints


def test_conditional_generation_checkpoint_loads_its_text_model(root, tmp_path):
    """`Gemma3ForConditionalGeneration` saved by transformers (text under
    `language_model.model.`) and with transformers 5's module names (`model.language_model.`)
    load to the causal LM's config and params; the vision tower is not read."""
    m, model, params, _ = _case("gemma3", root)
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, image_size=28, patch_size=14)
    mm = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=m.config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4))
    missing, unexpected = mm.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in m.state_dict().items()
         if k.startswith("model.")}, strict=False)
    assert not missing and not unexpected
    mm.save_pretrained(tmp_path)
    mm_model, mm_params = models.load(str(tmp_path))
    assert mm_model.family == "gemma" and mm_model.config.architecture == (
        "Gemma3ForConditionalGeneration")
    assert mm_model.config == gemma.GemmaConfig(**{
        **{f: getattr(model.config, f) for f in model.config.__dataclass_fields__},
        "architecture": "Gemma3ForConditionalGeneration"})
    jax.tree.map(np.testing.assert_array_equal, mm_params, params)

    reader = models.CheckpointReader(str(tmp_path))
    assert any(k.startswith("language_model.model.") for k in reader.keys())
    renamed = {k.replace("language_model.model.", "model.language_model.", 1): k
               for k in reader.keys()}
    _, p2 = models.load(str(tmp_path), get_tensor=lambda n: reader(renamed[n]))
    jax.tree.map(np.testing.assert_array_equal, p2, params)


def test_released_configs_read_as_transformers_reads_them():
    """The released checkpoints' config formats (`test_gemma_config`) give the config
    that transformers' own normalised config (its `to_dict()`, transformers 5's format)
    gives, and the RoPE frequencies of transformers' rotary module per layer type."""
    from kvjax.rope import rope_inv_freq
    from tests.models.test_gemma_config import GEMMA2_9B, GEMMA3_1B, GEMMA3_27B

    hf_configs = {"gemma3_27b": T.Gemma3Config(text_config=GEMMA3_27B["text_config"]),
                  "gemma3_1b": T.Gemma3TextConfig(**GEMMA3_1B), "gemma2_9b":
                  T.Gemma2Config(**GEMMA2_9B)}
    for (name, hf), raw in zip(hf_configs.items(), (GEMMA3_27B, GEMMA3_1B, GEMMA2_9B),
                               strict=True):
        ours = gemma.GemmaConfig.from_hf(raw)
        theirs = gemma.GemmaConfig.from_hf({**hf.to_dict(), "architectures":
                                            raw["architectures"]}, dtype=ours.dtype)
        assert ours == theirs, name
        text = hf.get_text_config()
        if name == "gemma2_9b":
            rotary = {gemma.LOCAL: T.models.gemma2.modeling_gemma2.Gemma2RotaryEmbedding(
                text).inv_freq}
            rotary[gemma.GLOBAL] = rotary[gemma.LOCAL]
        else:
            module = T.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(text)
            rotary = {t: getattr(module, f"{t}_inv_freq") for t in (gemma.LOCAL, gemma.GLOBAL)}
        assert ours.layer_types == tuple(text.layer_types), name
        for kind, rope in ((gemma.LOCAL, ours.rope_local), (gemma.GLOBAL, ours.rope_global)):
            # kvjax.rope's float32 pow (NumPy's) and torch's round apart by up to 2 ulp on
            # some exponents (9 of 64 at base 10k, dim 128); a wrong base or scale is far off.
            np.testing.assert_array_max_ulp(rope_inv_freq(rope), rotary[kind].numpy(), 2)
