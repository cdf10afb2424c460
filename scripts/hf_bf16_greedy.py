"""Are transformers' own bfloat16 greedy tokens one well-defined sequence?

On the tiny random Gemma 3 of the test suite (tests/models/hf_tiny.py, with the
perturbation tests/models/test_gemma.py applies), greedy-decode each prompt with
transformers in bfloat16 twice, once with its "eager" attention and once with "sdpa",
and report how many prompts' tokens differ and where they first differ. Both are
transformers; they only sum in another order. Where they disagree, "the same bf16 tokens
as transformers" names no single sequence, and kvjax's bf16 path is checked against
float32 within transformers' own bf16 error instead (test_gemma.py).

    python scripts/hf_bf16_greedy.py --seeds 8     # 2 prompts (26, 31 tokens) per seed
"""

import argparse
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--seeds", type=int, default=8, help="random models (default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.new_tokens < 1:
        p.error(f"--seeds and --new-tokens must be positive, got {args.seeds}, "
                f"{args.new_tokens}")
    sys.path.insert(0, str(ROOT))
    from tests.models import hf_tiny
    torch, transformers = hf_tiny.torch, hf_tiny.T

    def greedy(model, prompt):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()

    firsts, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            m = hf_tiny.build("gemma3", seed=seed)
            with torch.no_grad():  # as test_gemma.py: tokens that vary
                for name, w in m.named_parameters():
                    if "norm" in name:
                        w.add_(torch.randn_like(w))
                    elif "embed" in name:
                        w.mul_(0.3)
            path = f"{tmp}/{seed}"
            m.save_pretrained(path)
            impls = {impl: transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=impl, dtype=torch.bfloat16)
                for impl in ("eager", "sdpa")}
            rng = np.random.default_rng(seed)
            for n in (26, 31):
                prompt = rng.integers(3, 96, n).tolist()
                a, b = (greedy(impls[i], prompt) for i in ("eager", "sdpa"))
                total += 1
                if a != b:
                    pairs = enumerate(zip(a, b, strict=True))
                    firsts.append(next(i for i, (x, y) in pairs if x != y))
            print(f"seed {seed}: {len(firsts)} of {total} prompts differ so far", flush=True)
    print(f"transformers bf16, eager vs sdpa attention: {len(firsts)} of {total} prompts' "
          f"{args.new_tokens} greedy tokens differ; first differing token index {firsts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
