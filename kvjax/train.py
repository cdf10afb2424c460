"""Train the tiny byte-level demo models: `python -m kvjax.train --model gqa`.

Reproducible from `--seed`: parameter init, the data order and the mixture of
code crops and retrieval sequences all derive from it (the code bytes depend
on the Python version's standard library). The loop is one jitted optax step
(AdamW, warmup + cosine decay, gradient clipping) on the models' cache-free
`forward_dense`; it logs to stdout, checkpoints every `--ckpt-every` steps
(`--resume` continues), and at the end writes float16 safetensors plus a JSON
record (losses, time, a stored greedy continuation) to `--out`.
"""

import argparse
import json
import os
import pickle
import time

__all__ = ["RECIPES", "recipe_commands", "run_recipe", "build_parser", "make_optimizer",
           "make_train_step", "evaluate_loss", "train",
           "reference_continuation", "REFERENCE_PROMPT", "main"]

REFERENCE_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"

# How the shipped models were made: stages run in order, each starting from the
# previous stage's exported weights (`--recipe NAME` runs them all). The first stage
# learns code (and sees retrieval sequences it does not yet solve); the later ones
# teach the copy circuit with retrieval drills (every buried value asked for), first
# on short sequences, then at 256 bytes with code mixed back in, then with two drills
# per sequence so questions also come at shorter contexts.
RECIPES = {
    "gqa": (
        "--steps 1600 --seq-len 512 --retrieval-fraction 0.5 --stop-after 1250",
        "--steps 1200 --seq-len 96 --batch 32 --retrieval-fraction 1.0 --retrieval-query repeat "
        "--answer-weight 8 --lr 3e-3 --warmup 30",
        "--steps 2400 --stop-after 1000 --seq-len 128 --batch 32 --retrieval-fraction 1.0 "
        "--retrieval-query repeat --drill --answer-weight 8 --lr 3e-3 --warmup 30",
        "--steps 800 --seq-len 256 --batch 16 --retrieval-fraction 0.5 --retrieval-query repeat "
        "--drill --answer-weight 8 --lr 2e-3 --warmup 20",
        "--steps 300 --seq-len 256 --batch 16 --retrieval-fraction 0.5 --retrieval-query repeat "
        "--drill --drill-split 0.5 --answer-weight 8 --lr 1e-3 --warmup 10",
    ),
    "mla": (
        "--steps 1600 --seq-len 512 --retrieval-fraction 0.5 --stop-after 1150",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvjax.train",
        description="Train a tiny byte-level demo model (GQA, MLA or MHA) on the Python "
                    "standard library plus synthetic retrieval sequences.")
    p.add_argument("--model", choices=("gqa", "mla", "mha"), default="gqa",
                   help="preset to train (see kvjax.models.tiny)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="run every stage that made the shipped model of this preset "
                        "(kvjax.train.RECIPES; intermediate weights go to WORK_DIR/stages, "
                        "the last stage exports to --out); other training flags are ignored")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per training sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--retrieval-fraction", type=float, default=0.35,
                   help="fraction of sequences that are synthetic key/value retrieval")
    p.add_argument("--retrieval-query", choices=("assert", "repeat"), default="assert",
                   help="how retrieval sequences ask for the value (see kvjax.data)")
    p.add_argument("--drill", action="store_true",
                   help="retrieval sequences ask for every buried value (data.retrieval_drill)")
    p.add_argument("--drill-split", type=float, default=0.0,
                   help="with --drill: fraction of retrieval sequences made of two drills "
                        "back to back (questions at shorter contexts too)")
    p.add_argument("--answer-weight", type=float, default=4.0,
                   help="loss weight of retrieval answer bytes (1 elsewhere)")
    p.add_argument("--seed", type=int, default=0, help="seed of init and data order")
    p.add_argument("--out", default=None,
                   help="directory for the exported weights (default kvjax/assets)")
    p.add_argument("--work-dir", default="train_runs",
                   help="checkpoints and logs go to WORK_DIR/<model>")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint interval (steps)")
    p.add_argument("--log-every", type=int, default=10, help="log interval (steps)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--init-from", default=None,
                   help="start from these safetensors weights (uptraining) instead of init")
    p.add_argument("--init-from-mha", default=None,
                   help="GQA uptraining: mean-pool the K/V heads of these MHA weights "
                        "(tiny 'mha' preset safetensors) into --model's KV heads, then train")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches for the final loss")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop early (and export) after this much training time")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and export) after this many steps, the learning-rate schedule "
                        "still planned over --steps (replays a run cut short by --max-minutes)")
    p.add_argument("--no-export", action="store_true", help="skip writing the weights")
    p.add_argument("--light-export", action="store_true",
                   help="export weights and held-out loss only (no retrieval accuracy, no "
                        "stored reference continuation)")
    return p


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                               end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=weight_decay))


def _loss(params, config, tokens, weights):
    import jax.numpy as jnp
    import optax

    from kvjax.models.tiny import forward_dense

    logits = forward_dense(params, config, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * weights) / jnp.sum(weights)


def make_train_step(config, optimizer):
    """A jitted `(params, opt_state, tokens, weights) -> (params, opt_state, loss)`.

    params and opt_state are donated.
    """
    import functools

    import jax
    import optax

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, weights):
        loss, grads = jax.value_and_grad(_loss)(params, config, tokens, weights)
        # optax's schedules mix Python floats with the int32 step count, which strict
        # dtype promotion (the test setting) rejects; the model math above stays strict.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return step


def evaluate_loss(params, config, corpus, *, batches: int, batch: int, seq_len: int,
                  seed: int = 1234) -> float:
    """Mean next-byte cross-entropy (nats) on random crops of `corpus`."""
    import jax
    import numpy as np

    from kvjax import data

    rng = np.random.default_rng(seed)
    loss_fn = jax.jit(_loss, static_argnums=1)
    total = 0.0
    for _ in range(batches):
        toks = np.stack([data.code_crop(rng, corpus, seq_len) for _ in range(batch)])
        total += float(loss_fn(params, config, toks.astype(np.int32),
                               np.ones((batch, seq_len - 1), np.float32)))
    return total / batches


def retrieval_accuracy(params, config, corpus, *, n: int, seq_len: int, seed: int = 99,
                       query: str = "assert") -> float:
    """Greedy exact-match of the 5-digit value (teacher-forced, dense forward), on examples
    with as many key/value pairs as `seq_len` holds (up to 4) and the given query style."""
    import jax
    import numpy as np

    from kvjax import data

    rng = np.random.default_rng(seed)
    exs = [data.retrieval_example(rng, corpus, seq_len, num_pairs=data.max_pairs(seq_len),
                                  query=query) for _ in range(n)]
    toks = np.stack([e.tokens for e in exs]).astype(np.int32)
    from kvjax.models.tiny import forward_dense

    logits = jax.jit(forward_dense, static_argnums=1)(params, config, toks)
    pred = np.asarray(logits.argmax(-1))
    ok = [all(pred[i, e.answer_start - 1 + j] == toks[i, e.answer_start + j]
              for j in range(data.VALUE_DIGITS)) for i, e in enumerate(exs)]
    return float(np.mean(ok))


def reference_continuation(model, params, prompt: str = REFERENCE_PROMPT, n: int = 48) -> str:
    """Greedy continuation through the paged cache (`kvjax.generate`), decoded as latin-1."""
    import jax

    from kvjax.generate import generate

    res = generate(model, params, [list(prompt.encode())], key=jax.random.key(0),
                   max_new_tokens=n)
    return bytes(res.tokens[0, :int(res.num_generated[0])].tolist()).decode("latin-1")


def recipe_commands(name: str, out: str | None = None, work_dir: str = "train_runs"
                    ) -> list[list[str]]:
    """The `python -m kvjax.train` argument lists of a recipe's stages, chained."""
    cmds, prev = [], None
    for i, stage in enumerate(RECIPES[name]):
        last = i == len(RECIPES[name]) - 1
        dest = out if last else os.path.join(work_dir, "stages", f"{name}{i + 1}")
        cmd = ["--model", name, *stage.split(), "--work-dir", work_dir]
        cmd += ["--init-from", os.path.join(prev, f"tiny_{name}.safetensors")] if prev else []
        cmd += (["--out", dest] if dest else []) + ([] if last else ["--light-export"])
        cmds.append(cmd)
        prev = dest
    return cmds


def run_recipe(args) -> dict:
    """Runs every stage of `args.recipe`; the final record lists the stages."""
    cmds = recipe_commands(args.recipe, args.out, args.work_dir)
    stages, record = [], None
    for i, cmd in enumerate(cmds):
        print(f"=== stage {i + 1}/{len(cmds)}: python -m kvjax.train {' '.join(cmd)}", flush=True)
        stage_args = build_parser().parse_args(cmd)
        last = i == len(cmds) - 1
        extra = dict(recipe=args.recipe, stages=stages) if last else None
        record = train(stage_args, extra=extra)
        stages.append(dict(command="python -m kvjax.train " + " ".join(cmd),
                           steps=record["steps"], train_seconds=record["train_seconds"]))
    return record


def train(args, extra: dict | None = None) -> dict:
    import jax
    import numpy as np

    from kvjax import data
    from kvjax.models import tiny

    config = tiny.tiny_config(args.model)
    work = os.path.join(args.work_dir, args.model)
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt.pkl")
    corpus = data.load_corpus("train")
    heldout = data.load_corpus("heldout")
    optimizer = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay)
    conversion = None
    if args.init_from_mha:
        from kvjax.models.convert import convert_mha_to_gqa

        _, mha = tiny.load_tiny("mha", path=args.init_from_mha)
        params, _ = convert_mha_to_gqa(mha, tiny.tiny_config("mha"), config.kv_heads)
        kw = dict(batches=args.eval_batches, batch=8, seq_len=args.seq_len)
        conversion = dict(mha_heldout_loss=evaluate_loss(mha, tiny.tiny_config("mha"), heldout,
                                                         **kw),
                          converted_heldout_loss_before_uptraining=evaluate_loss(
                              params, config, heldout, **kw))
        print(f"MHA -> GQA conversion: {conversion}", flush=True)
    elif args.init_from:
        _, params = tiny.load_tiny(args.model, path=args.init_from)
    else:
        params = tiny.init_tiny(config, jax.random.key(args.seed))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(args.seed)
    start, elapsed, history = 0, 0.0, []
    if args.resume and os.path.exists(ckpt):
        with open(ckpt, "rb") as f:
            st = pickle.load(f)
        params = jax.tree.map(jax.numpy.asarray, st["params"])
        opt_state = jax.tree.map(jax.numpy.asarray, st["opt_state"])
        rng.bit_generator.state = st["rng"]
        start, elapsed, history = st["step"], st["elapsed"], st["history"]
        print(f"resumed at step {start}", flush=True)
    step_fn = make_train_step(config, optimizer)
    print(f"{args.model}: {tiny.param_count(params):,} params; {args.steps} steps of "
          f"{args.batch}x{args.seq_len} bytes", flush=True)
    t0 = time.time() - elapsed
    run_loss, steps_done = None, start
    for step in range(start, args.steps):
        if args.stop_after is not None and step >= args.stop_after:
            break  # resumed from a checkpoint at or past --stop-after: export it as it is
        toks, w = data.training_batch(rng, corpus, args.batch, args.seq_len,
                                      retrieval_fraction=args.retrieval_fraction,
                                      answer_weight=args.answer_weight,
                                      query=args.retrieval_query, drill=args.drill,
                                      drill_split=args.drill_split)
        params, opt_state, loss = step_fn(params, opt_state, toks, w)
        steps_done = step + 1
        if (step + 1) % args.log_every == 0 or step == start:
            loss = float(loss)
            run_loss = loss if run_loss is None else 0.7 * run_loss + 0.3 * loss
            history.append((step + 1, loss))
            print(f"step {step + 1:5d}  loss {loss:.4f}  smoothed {run_loss:.4f}  "
                  f"{time.time() - t0:7.1f}s", flush=True)
        out_of_time = ((args.max_minutes is not None
                        and time.time() - t0 > 60 * args.max_minutes)
                       or (args.stop_after is not None and step + 1 >= args.stop_after))
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps or out_of_time:
            with open(ckpt + ".tmp", "wb") as f:
                pickle.dump(dict(params=jax.device_get(params),
                                 opt_state=jax.device_get(opt_state),
                                 rng=rng.bit_generator.state, step=step + 1,
                                 elapsed=time.time() - t0, history=history), f)
            os.replace(ckpt + ".tmp", ckpt)
        if out_of_time:
            print(f"stopping at step {step + 1} (--max-minutes / --stop-after)", flush=True)
            break
    train_seconds = time.time() - t0
    record = dict(preset=args.model, params=tiny.param_count(params), steps=steps_done,
                  planned_steps=args.steps,
                  batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                  retrieval_fraction=args.retrieval_fraction, answer_weight=args.answer_weight,
                  retrieval_query=args.retrieval_query, drill=args.drill,
                  drill_split=args.drill_split, warmup=args.warmup,
                  init_from=args.init_from, train_seconds=train_seconds,
                  final_train_loss=history[-1][1] if history else None, history=history)
    record.update(extra or {})
    if conversion is not None:
        record.update(conversion)
        record["uptrained_heldout_loss"] = evaluate_loss(
            params, config, heldout, batches=args.eval_batches, batch=8, seq_len=args.seq_len)
        print(f"after {steps_done} uptraining steps: held-out loss "
              f"{record['uptrained_heldout_loss']:.4f}", flush=True)
    if not args.no_export:
        # Export, reload the float16 weights, and measure and record everything on them.
        path = tiny.save_tiny(args.model, params, record, args.out)
        model, params16 = tiny.load_tiny(args.model, path=path)
        record["heldout_loss_nats_per_byte"] = evaluate_loss(
            params16, config, heldout, batches=args.eval_batches, batch=8, seq_len=args.seq_len)
        if not args.light_export:
            record["retrieval_accuracy_teacher_forced"] = retrieval_accuracy(
                params16, config, heldout, n=32, seq_len=args.seq_len,
                query=args.retrieval_query)
            record["reference_prompt"] = REFERENCE_PROMPT
            record["reference_continuation"] = reference_continuation(model, params16)
        tiny.save_tiny(args.model, params, record, args.out)
        print(json.dumps({k: v for k, v in record.items() if k != "history"}, indent=1),
              flush=True)
    return record


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.recipe:
        run_recipe(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
