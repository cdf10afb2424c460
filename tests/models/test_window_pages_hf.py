"""Window-only pages against HuggingFace: Mistral's sliding window (every layer windowed,
8 tokens) with `CacheConfig(window_pages=True)`, greedy tokens of two prompts (21 and 9
tokens, 20 new: up to 41 tokens, more than 3 windows) against transformers' (float32)."""

import jax
import numpy as np
import pytest

import kvjax.generate as gen
import kvjax.models as models
from kvjax.cache import window
from tests.models import hf_tiny

NEW, PAGE, CHUNK = 20, 4, 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    m = hf_tiny.build("mistral")
    d = tmp_path_factory.mktemp("mistral_window")
    m.save_pretrained(d)
    return m, str(d)


def test_mistral_window_pages_match_transformers(mistral, rng):
    m, path = mistral
    model, params = models.load(path)
    assert model.config.sliding_windows == (8, 8)
    prompts = [rng.integers(3, m.config.vocab_size, n).tolist() for n in (21, 9)]
    out = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                       chunk_size=CHUNK, free_finished=False,
                       cache=gen.CacheConfig(page_size=PAGE, window_pages=True))
    for b, p in enumerate(prompts):
        hf_tiny.assert_greedy(m, p, np.asarray(out.tokens[b]).tolist(),
                              hf_tiny.hf_greedy(m, p, NEW))
    ring = -(-(8 + CHUNK - 2) // PAGE) + 1
    assert window.pages_in_use(out.cache) == (2 * ring,)  # both rows past their rings
