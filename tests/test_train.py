"""Training loop and data of the tiny demo models (kvjax.train, kvjax.data)."""

import jax
import numpy as np
import pytest

from kvjax import data
from kvjax.models.deepseek import DeepseekConfig
from kvjax.models.layers import RopeConfig
from kvjax.models.llama import LlamaConfig
from kvjax.models.tiny import init_tiny
from kvjax.train import _loss, make_optimizer, make_train_step

SMALL = {
    "llama": LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                         q_heads=2, kv_heads=1, head_dim=16, rope=RopeConfig(theta=1e4, dim=16),
                         tie_word_embeddings=True),
    "mla": DeepseekConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                          v_head_dim=8, tie_word_embeddings=True),
}
CORPUS = np.frombuffer(b"def add(x, y):\n    return x + y\n\n\nclass A:\n    pass\n" * 200,
                       np.uint8)


def test_a_few_training_steps_lower_the_loss(rng):
    # The init, the optimizer's state and the first loss each as one program (run eagerly,
    # each compiled a program per op and tensor shape).
    loss_fn = jax.jit(_loss, static_argnums=1)
    for name, config in SMALL.items():
        key = jax.random.key(int(rng.integers(1 << 30)))
        # The Llama init draws with jax.random (traceable); DeepSeek's on the host.
        params = (jax.jit(init_tiny, static_argnums=0)(config, key) if name == "llama"
                  else init_tiny(config, key))
        opt = make_optimizer(1e-2, 10, 1, 0.0)
        state = jax.jit(opt.init)(params)
        step = make_train_step(config, opt)
        toks, w = data.training_batch(rng, CORPUS, 4, 128, retrieval_fraction=0.25,
                                      answer_weight=2.0)
        first = float(loss_fn(params, config, toks, w))
        for _ in range(8):
            params, state, loss = step(params, state, toks, w)
        # Random init sits near ln(256) = 5.5; 8 Adam steps on one repetitive batch
        # must take a large bite out of it.
        assert float(loss) < first - 1.0, (name, first, float(loss))


@pytest.mark.parametrize("query,ask", [("assert", b'\nassert key_%s == "'),
                                       ("repeat", b'\nkey_%s = "')])
def test_retrieval_example_buries_the_queried_value(rng, query, ask):
    ex = data.retrieval_example(rng, CORPUS, 300, num_pairs=3, query=query)
    text = ex.tokens.tobytes()
    assert len(text) == 300
    assert text[ex.answer_start:] == ex.value + b'"'
    prompt = text[:ex.answer_start]
    key = prompt[prompt.rindex(b"key_") + 4:].split(b" ")[0]
    assert prompt.endswith(ask % key)
    line = b"key_" + key + b' = "' + ex.value + b'"'
    assert prompt.count(line) == 1 and prompt.index(line) == ex.depth
    assert ex.value.isdigit() and len(ex.value) == data.VALUE_DIGITS


def test_stdlib_split_is_deterministic_and_disjoint():
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    held = [f for f in files if data.is_heldout(f)]
    assert 0.01 < len(held) / len(files) < 0.15
    assert [f for f in files if data.is_heldout(f)] == held


def test_max_pairs_is_the_most_that_fit(rng):
    for length in range(62, 140, 3):
        most = data.max_pairs(length)
        for query in data.QUERY_STYLES:
            data.retrieval_example(rng, CORPUS, length, num_pairs=most, query=query)
        if most < 4:  # one more pair leaves under 16 bytes of filler for the longer query
            with pytest.raises(ValueError, match="too short"):
                data.retrieval_example(rng, CORPUS, length, num_pairs=most + 1, query="assert")


def test_shipped_gqa_model_retrieves_and_an_untrained_one_does_not(rng):
    # The trained demo model retrieves buried values from held-out code at a short length
    # (96 bytes: one that used to crash): on the shipped weights "repeat" queries scored
    # 81-100% and "assert" queries 19-38% over six draws of 32 examples. The thresholds sit
    # several standard deviations below those; an untrained model scores 0 on both.
    from kvjax.models.tiny import load_tiny, tiny_config
    from kvjax.train import retrieval_accuracy

    config = tiny_config("gqa")
    _, trained = load_tiny("gqa")
    untrained = jax.jit(init_tiny, static_argnums=0)(  # one program, not one per tensor shape
        config, jax.random.key(int(rng.integers(1 << 30))))
    heldout = data.load_corpus("heldout", max_bytes=200_000)
    seed = int(rng.integers(1 << 30))
    acc = {(name, query): retrieval_accuracy(params, config, heldout, n=32, seq_len=96,
                                             seed=seed, query=query)
           for name, params in (("trained", trained), ("untrained", untrained))
           for query in data.QUERY_STYLES}
    assert acc["trained", "repeat"] >= 0.6, acc
    assert acc["trained", "assert"] >= 1 / 32, acc
    assert acc["untrained", "repeat"] < 0.1 and acc["untrained", "assert"] < 0.1, acc


@pytest.mark.parametrize("query", data.QUERY_STYLES)
def test_retrieval_drill_asks_for_every_buried_value(rng, query):
    n = int(rng.integers(1, 5))
    tokens, answer = data.retrieval_drill(rng, CORPUS, 400, num_pairs=n, query=query)
    text = tokens.tobytes()
    assert len(text) == 400 and answer.shape == (400,)
    lines = dict(m for m in _buried(text))
    assert len(lines) == n
    # The answers are exactly the queried values and their closing quotes, once per key,
    # each right after its question.
    spans = np.flatnonzero(np.diff(np.concatenate([[0], answer, [0]])))
    starts, ends = spans[::2], spans[1::2]
    assert len(starts) == n
    asked = set()
    ask = b'\nkey_%s = "' if query == "repeat" else b'\nassert key_%s == "'
    for s, e in zip(starts, ends, strict=True):
        got = text[s:e]
        key = next(k for k, v in lines.items() if text[:s].endswith(ask % k))
        assert got == lines[key] + b'"'
        asked.add(key)
    assert asked == set(lines)
    # ... and the weights of a drill batch mark those bytes as targets, also when each
    # sequence is two drills back to back (the second one's questions end the sequence).
    for split in (0.0, 1.0):
        toks, w = data.training_batch(rng, CORPUS, 3, 200, retrieval_fraction=1.0,
                                      answer_weight=5.0, query=query, drill=True,
                                      drill_split=split)
        for b in range(3):
            tb = toks[b].astype(np.uint8).tobytes()
            assert np.sum(w[b] == 5.0) == 6 * len(dict(_buried(tb)))
            assert tb.endswith(b'"') and w[b, -1] == 5.0
            if split:  # a question and its answer also end inside the sequence
                assert np.any(w[b, 55:-40] == 5.0)


def _buried(text):
    """(key, value) of the `key_xxxx = "ddddd"` lines, in order, each key once."""
    import re

    return re.findall(rb'key_([a-z0-9]{4}) = "([0-9]{5})"\n', text)


def test_max_drill_pairs_is_the_most_that_fit(rng):
    for length in range(62, 220, 7):
        most = data.max_drill_pairs(length)
        data.retrieval_drill(rng, CORPUS, length, num_pairs=most, query="repeat")
        if most < 4:
            with pytest.raises(ValueError, match="too short"):
                data.retrieval_drill(rng, CORPUS, length, num_pairs=most + 1, query="assert")


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_recipe_stages_chain_and_parse(name, tmp_path):
    from kvjax.train import RECIPES, build_parser, recipe_commands

    cmds = recipe_commands(name, str(tmp_path / "final"), str(tmp_path / "work"))
    assert len(cmds) == len(RECIPES[name])
    prev_out = None
    for i, cmd in enumerate(cmds):
        args = build_parser().parse_args(cmd)
        assert args.model == name and args.recipe is None
        # Each stage starts from the weights the previous one exported.
        want = None if prev_out is None else f"{prev_out}/tiny_{name}.safetensors"
        assert args.init_from == want
        assert args.light_export == (i < len(cmds) - 1)
        prev_out = args.out
    assert prev_out == str(tmp_path / "final")
