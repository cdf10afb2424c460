"""A published Flax NNX LLM on kvjax's cache: tunix's Gemma 3, adapted in place.

The model is tunix's own (`tunix.models.gemma3.model`, google-tunix 0.1.7), tiny and
random: five sliding-window layers and a global one, QK-norm, two RoPE bases. The
reference is tunix's own greedy decoding on its dense cache (tests/nnx/tunix_gemma3.py),
run before `kvjax.nnx.tunix.adapt_gemma3` swaps its attention layers for paged ones that
share their weights. Ragged prompts longer than a page (page 8, prefill chunks of 8) and
generations that run past the window.

google-tunix is installed in the Python 3.12 CI job (`pip install --no-deps`, see
tests/nnx/tunix_gemma3.py); where it is not installed these tests skip, saying so.
"""

import contextlib
import io
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax import generate as kvg
from kvjax import sharding as kvs
from kvjax.cache.policies import H2O
from kvjax.nnx import tunix as kvtunix
from kvjax.specs import QuantSpec
from tests.nnx.paged_logits import assert_paged_logits_equal
from tests.nnx.tunix_gemma3 import CONFIG, dense_decode, load_gemma3, tiny_gemma3
from tests.test_readme import apply_replacements, blocks

gemma3 = load_gemma3()
pytestmark = pytest.mark.skipif(
    gemma3 is None, reason="google-tunix is not installed (the Python 3.12 CI job installs "
    "it: pip install --no-deps google-tunix==0.1.7 einops)")

MAX_NEW, PAGE = 32, 8
PROMPT_LENS = (13, 5, 21)
VOCAB = CONFIG["num_embed"]
# float32 on both sides; the paged path sums attention in another order.
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    module = tiny_gemma3(gemma3, seed=5)
    ref_tokens, ref_logits = dense_decode(module, prompts, MAX_NEW)
    originals = [layer.attn for layer in module.layers]
    holder = kvtunix.adapt_gemma3(module)
    model, params = kvtunix.as_model(module)
    result = kvg.generate(model, params, prompts, key=jax.random.key(0),
                          max_new_tokens=MAX_NEW, cache=kvg.CacheConfig(page_size=PAGE),
                          chunk_size=PAGE)
    return dict(prompts=prompts, module=module, holder=holder, model=model, params=params,
                originals=originals, ref_tokens=ref_tokens, ref_logits=ref_logits,
                result=result)


def test_adapt_swaps_every_layer_and_shares_the_weights(setup):
    module, originals = setup["module"], setup["originals"]
    windows = []
    for i, (layer, orig) in enumerate(zip(module.layers, originals, strict=True)):
        attn = layer.attn
        assert isinstance(attn, kvtunix.Gemma3Attention) and attn.layer == i
        assert attn.cache is setup["holder"]
        assert attn.q_einsum is orig.q_einsum and attn.query_norm is orig._query_norm
        windows.append(attn.sliding_window)
    assert windows == [CONFIG["sliding_window_size"]] * 5 + [None]
    assert setup["model"].config.num_layers == CONFIG["num_layers"]
    with pytest.raises(ValueError, match="no tunix Gemma 3 attention"):
        kvtunix.adapt_gemma3(module)  # nothing left to adapt


def test_greedy_tokens_and_logits_equal_tunix_dense_decoding(setup):
    prompts, result = setup["prompts"], setup["result"]
    # Each row runs past the window (8) by several windows.
    assert min(PROMPT_LENS) + MAX_NEW >= 3 * CONFIG["sliding_window_size"]
    np.testing.assert_array_equal(result.tokens, setup["ref_tokens"])
    assert result.status.code == 0
    assert_paged_logits_equal(setup["model"], setup["params"], prompts, setup["ref_tokens"],
                              setup["ref_logits"], page=PAGE, max_new=MAX_NEW, tol=LOGIT_TOL)


def test_kivi_int4_pages_with_h2o_eviction(setup):
    """KIVI int4 pages and H2O through tunix's Gemma 3: every row decodes its tokens,
    each sequence is held to the budget, and the first token (from the prompt's logits
    over int4 pages) is the float one."""
    budget = 24
    result = kvg.generate(
        setup["model"], setup["params"], setup["prompts"], key=jax.random.key(0),
        max_new_tokens=MAX_NEW, chunk_size=PAGE, free_finished=False, policy=H2O(budget=budget),
        cache=kvg.CacheConfig(page_size=PAGE, quant=QuantSpec(bits=4, group_size=PAGE,
                                                              residual=PAGE)))
    assert result.status.code == 0 and result.cache.is_quantized
    np.testing.assert_array_equal(result.num_generated, MAX_NEW)
    held = np.asarray(result.cache.lengths)[: len(PROMPT_LENS)]
    grown = np.array(PROMPT_LENS) + MAX_NEW
    assert (held <= budget + PAGE).all() and (held < grown).all(), (held, grown)
    np.testing.assert_array_equal(result.tokens[:, 0], setup["ref_tokens"][:, 0])


def test_sharding_plan_on_8_devices_equals_unsharded(setup):
    # Sequences over 4 devices, KV heads over 2 ('context' takes no sliding window).
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((4, 2), ("data", "model")),
                            strategies=("sequences", "heads"))
    result = kvg.generate(setup["model"], setup["params"], setup["prompts"],
                          key=jax.random.key(0), max_new_tokens=MAX_NEW, chunk_size=PAGE,
                          cache=kvg.CacheConfig(page_size=PAGE, plan=plan))
    assert len(result.cache.pages.k.sharding.device_set) == 8
    np.testing.assert_array_equal(result.tokens, setup["result"].tokens)



def test_flax_doc_tunix_block_runs():
    """docs/flax.md's blocks that need tunix (`needs: tunix`), with their directives, as
    tests/nnx/test_flax_doc.py runs the others."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "flax.md"
    code = [(body, d, line) for lang, body, d, line in blocks(doc.read_text())
            if lang == "python" and "tunix" in d["needs"]]
    assert code, "docs/flax.md has no block that needs tunix"
    for body, directives, line in code:
        where = f"docs/flax.md, the block at line {line}"
        source = "\n".join([*directives["setup"], apply_replacements(body, directives, where),
                            *directives["after"]])
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, where, "exec"), {"__name__": "flax_doc"})  # noqa: S102


def test_notebook_07_runs_with_tunix(tmp_path, monkeypatch):
    """notebooks/07_flax_nnx.py end to end where tunix is installed, its tunix section
    included (tests/notebooks runs the notebook in the job without tunix), as a script:
    the percent-format source is plain Python. Its own asserts check the tunix tokens."""
    src = Path(__file__).resolve().parents[2] / "notebooks" / "07_flax_nnx.py"
    assert "adapt_gemma3" in src.read_text()
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()) as out, \
            jax.numpy_dtype_promotion("standard"):  # a notebook runs with jax's default
        exec(compile(src.read_text(), str(src), "exec"), namespace)  # noqa: S102
    assert namespace["gemma3"] is not None, out.getvalue()
    assert "all tokens equal tunix's: True" in out.getvalue()
