"""Peak KV pages in use while a tiny model decodes far past its cache budget, per policy.

The model is a tiny Llama with random weights (kvjax.models, GQA 8:2, SwiGLU MLP; this
measures memory, not quality), decoded by `kvjax.generate.stream` with the policy passed
as `policy=`. For each policy the script prefills `--batch` prompts in one chunk, decodes
`--steps` tokens greedily, and records the pages held (pool size minus free pages): during
prefill (the whole prompt is cached before a prefill-time policy compresses it), after
prefill, after every step, and inside every step right after `reserve` (the true decode
peak: one new token per running sequence before eviction runs; derived from the lengths
before the step, as nothing is shared). Quest evicts nothing; it is listed with the pages
it reads per step instead.

Each run is checked in the same process: allocator invariants hold after every step, the
pages held are exactly those the block tables cover (evicted pages are back in the pool),
and no sequence exceeds its policy's budget.

    PYTHONPATH=$PWD python benchmarks/eviction.py --steps 200
"""

import argparse
import json
import math
import sys

import jax
import numpy as np
from tqdm import tqdm

from kvjax.cache import check_invariants, init_cache
from kvjax.cache.policies import H2O, NoPolicy, PyramidKV, Quest, SnapKV, StreamingLLM
from kvjax.specs import CacheSpec


def _parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=2, help="sequences decoded together")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=160, help="tokens generated per sequence")
    p.add_argument("--budget", type=int, default=32,
                   help="tokens per sequence each eviction policy keeps (SnapKV/PyramidKV: of "
                        "the prompt; PyramidKV: the per-layer average)")
    p.add_argument("--window", type=int, default=8,
                   help="recent / observation window of the policies")
    p.add_argument("--page-size", type=int, default=8, help="tokens per page")
    p.add_argument("--layers", type=int, default=2, help="attention layers")
    p.add_argument("--quest-pages", type=int, default=4,
                   help="pages Quest reads per step and KV head (current page included)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and prompts")
    p.add_argument("--model", choices=("llama",), default="llama",
                   help="the model decoded: a tiny random kvjax Llama (GQA 8:2) run by "
                        "kvjax.generate")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def _tiny_llama(a):
    from kvjax.models import get_family
    from kvjax.models.layers import RopeConfig
    from kvjax.models.llama import LlamaConfig

    family = get_family("llama")
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_layers=a.layers, q_heads=8, kv_heads=2, head_dim=8,
                         rope=RopeConfig(theta=10000.0, dim=8))
    return family.model(config), family.init_params(config, jax.random.key(a.seed))


def _pages(lengths, page_size: int) -> int:
    return int(np.sum(-(-np.asarray(lengths) // page_size)))


def _run_llama(policy, model, params, spec, prompts, steps, budget_of):
    import kvjax.generate as gen

    chunk = -(-prompts.shape[1] // 8) * 8  # one prefill chunk: prompt compressors see it all
    after, in_step = [], []
    prev = None
    events = gen.stream(model, params, prompts.tolist(), key=jax.random.key(0),
                        max_new_tokens=steps, cache=init_cache(spec), chunk_size=chunk,
                        policy=None if isinstance(policy, NoPolicy) else policy,
                        free_finished=False)
    for i, event in enumerate(tqdm(events, total=steps, desc=type(policy).__name__,
                                   leave=False)):
        cache = event.state.cache
        check_invariants(cache)
        lengths = np.asarray(cache.lengths)
        held = spec.num_pages - int(cache.num_free_pages)
        if held != _pages(lengths, spec.page_size):
            raise AssertionError(f"{policy}: {held} pages held after step {i} but the block "
                                 f"tables cover {_pages(lengths, spec.page_size)}")
        if prev is not None:  # this step reserved one token per running sequence first
            in_step.append(_pages(prev + event.emitted, spec.page_size))
        after.append(held)
        prev = lengths
        limit = budget_of(i)
        if limit is not None and int(lengths.max()) > limit:
            raise AssertionError(f"{policy} holds more than {limit} tokens after step {i}")
    event.state.status.raise_if_error()
    batch, plen = prompts.shape
    return dict(prefill_peak_pages=batch * math.ceil(plen / spec.page_size),
                after_prefill_pages=after[0], peak_pages_in_step=max(in_step),
                peak_pages_after_step=max(after), final_pages=after[-1],
                final_tokens=np.asarray(cache.lengths)[:batch].tolist())


def main(argv=None):
    a = _parse(argv)
    total = a.prompt_len + a.steps
    max_pages = math.ceil(total / a.page_size) + 1
    model, params = _tiny_llama(a)
    spec = CacheSpec(attention=model.config.attention, num_layers=a.layers,
                     page_size=a.page_size, num_pages=a.batch * max_pages + 1,
                     max_seqs=a.batch, max_pages_per_seq=max_pages)
    prompts = np.random.default_rng(a.seed).integers(3, 64, (a.batch, a.prompt_len))
    b, w = a.budget, a.window
    pyramid = PyramidKV(budget=b, beta=2.0, window=w, kernel=3)
    b_max = pyramid.layer_budgets(a.layers, a.page_size)[0]
    cases = [
        ("none", NoPolicy(), lambda i: None),
        ("streaming_llm", StreamingLLM(n_sink=4, window=b - 4), lambda i: b),
        ("h2o", H2O(budget=b, recent=w), lambda i: b),
        ("snapkv", SnapKV(budget=b, window=w, kernel=3), lambda i: b + i),
        ("pyramidkv", pyramid, lambda i: b_max + i),
        ("quest", Quest(top_k=a.quest_pages, dense_layers=0), lambda i: None),
    ]
    results = {}
    for name, policy, budget_of in tqdm(cases, desc="policies"):
        # stream's first event is after prefill (step 0): lengths there are budget_of(0).
        results[name] = _run_llama(policy, model, params, spec, prompts, a.steps, budget_of)
        results[name]["policy"] = repr(policy)
    results["quest"]["pages_read_per_step_per_head"] = a.quest_pages
    what = ("tiny random Llama (kvjax.models + kvjax.generate): "
            f"{a.layers} layers, 8 q / 2 kv heads, head_dim 8")
    print(f"\n{what}; "
          f"{a.batch} sequences, prompt {a.prompt_len}, {a.steps} new tokens, "
          f"page_size {a.page_size}, budget {b}, backend {jax.default_backend()}")
    print("pages in use (all sequences): during prefill (whole prompt, before eviction), after "
          "prefill, decode peak inside a step (after reserve, before eviction), decode peak "
          "between steps, at the end")
    print(f"{'policy':<15}{'prefill':>9}{'after prefill':>15}{'decode in-step':>16}"
          f"{'decode between':>16}{'final':>7}  final tokens/seq")
    for name, r in results.items():
        print(f"{name:<15}{r['prefill_peak_pages']:>9}{r['after_prefill_pages']:>15}"
              f"{r['peak_pages_in_step']:>16}{r['peak_pages_after_step']:>16}"
              f"{r['final_pages']:>7}  {r['final_tokens']}")
    print("quest evicts nothing: it reads "
          f"{a.quest_pages} pages per KV head per step instead of all.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), results=results), f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
