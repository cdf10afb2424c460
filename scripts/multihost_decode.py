"""Multi-host sharded decoding with plain JAX multi-controller (`jax.distributed`).

Every host runs this same script. `jax.distributed.initialize` joins the hosts
into one runtime; `jax.devices()` then lists every device of every host, the
mesh spans them all, and each jitted step runs as one SPMD program in which
each host feeds and computes its own devices' shards. Nothing here is specific
to a transport: the collectives are XLA's (ICI/DCN on TPU, NCCL on GPU, gloo
on CPU).

Mesh layout: `data` across hosts (sequences and their pages stay on the host
that serves them: no cross-host traffic for the cache), `model` (tensor
parallel, the chattiest axis) and `context` within a host.

  # TPU pod slice: run on every host (the TPU runtime supplies the coordinator):
  python scripts/multihost_decode.py --model /path/to/hf_model --context 2

  # GPU or CPU cluster: give the coordinator and each process's id:
  python scripts/multihost_decode.py --coordinator host0:1234 --num-processes 2 \
      --process-id $RANK --model /path/to/hf_model

  # Try it on one machine: 2 processes x 4 simulated CPU devices, a tiny random model:
  python scripts/multihost_decode.py --launch-local 2

Without --model a tiny random Llama is used. Prompts are token ids (the same
on every host: in SPMD every process passes identical host inputs).
"""

import argparse
import os
import socket
import subprocess
import sys


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", default=None,
                    help="host:port of process 0's coordinator (omit on TPU pods: auto-detected)")
    ap.add_argument("--num-processes", type=int, default=None,
                    help="total processes (omit on TPU pods)")
    ap.add_argument("--process-id", type=int, default=None,
                    help="this process's id in [0, num_processes) (omit on TPU pods)")
    ap.add_argument("--model", default=None,
                    help="HF model directory for kvjax.models.load; default a tiny random Llama")
    ap.add_argument("--context", type=int, default=1,
                    help="devices per host that split one sequence's pages ('context' axis)")
    ap.add_argument("--prompts", default="1,2,3,4,5;6,7,8",
                    help="token-id prompts: comma-separated ids, prompts separated by ';'")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate per prompt")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--pages-per-device", type=int, default=64,
                    help="KV pages each device's pool shard holds")
    ap.add_argument("--check", action="store_true",
                    help="process 0 also generates on one local device without sharding and "
                         "exits non-zero if the greedy tokens differ")
    ap.add_argument("--launch-local", type=int, default=0, metavar="N",
                    help="spawn N local CPU processes (4 devices each) running this script, "
                         "coordinated on localhost, and exit with their status")
    ap.add_argument("--port", type=int, default=0,
                    help="with --launch-local: the coordinator's localhost port (default: a "
                         "free one)")
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch_local(n: int, port: int, argv: list[str]) -> int:
    rest = []
    skip = False
    for a in argv:  # drop --launch-local / --port and their values
        if skip:
            skip = False
            continue
        if a in ("--launch-local", "--port"):
            skip = True
            continue
        if a.startswith(("--launch-local=", "--port=")):
            continue
        rest.append(a)
    env = dict(os.environ, JAX_PLATFORMS="cpu", KVJAX_CPU_DEVICES="4")
    # A device count forced in XLA_FLAGS would override the 4 per process; other flags stay.
    flags = [f for f in env.pop("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    coordinator = f"localhost:{port or _free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, "--coordinator", coordinator,
                               "--num-processes", str(n), "--process-id", str(i), *rest],
                              env=env) for i in range(n)]
    return max(p.wait() for p in procs)


def tiny_model():
    """The tiny random Llama used without --model (the same weights in every process)."""
    import jax

    from kvjax.models import llama
    from kvjax.models.base import get_family
    from kvjax.models.layers import RopeConfig

    config = llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_layers=2, q_heads=8, kv_heads=4, head_dim=8,
                               rope=RopeConfig(theta=10000.0, dim=8))
    return (get_family("llama").model(config),
            get_family("llama").init_params(config, jax.random.key(0)))


def parse_prompts(text: str) -> list[list[int]]:
    return [[int(t) for t in p.split(",")] for p in text.split(";")]


def cache_spec(model, prompts, *, max_new_tokens, page_size, num_pages, max_seqs):
    pages_per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
    return model.make_cache_spec(page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
                                 max_pages_per_seq=pages_per_seq, dtype="float32")


def greedy_tokens(model, params, cache, prompts, *, max_new_tokens, impl):
    """Prefill + the jitted decode loop, greedy: the state (its tokens int32[batch, new])."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax import generate as kvg

    tokens, lengths, chunk = kvg.pad_prompts(prompts, 16)
    seq_ids = jnp.arange(len(prompts), dtype=jnp.int32)
    cache, last, status = kvg.prefill(model, params, cache, jnp.asarray(tokens),
                                      jnp.asarray(lengths), seq_ids, chunk_size=chunk,
                                      impl=impl)[:3]
    max_new = np.full(len(prompts), max_new_tokens, np.int32)
    state = kvg.start(cache, seq_ids, last, jnp.asarray(lengths), kvg.as_keys(
        jax.random.key(0), len(prompts)), jnp.asarray(max_new), status,
        sampling=kvg.GREEDY, eos_ids=(), max_len=max_new_tokens, free_finished=True)
    return kvg.decode_loop(model, params, state, sampling=kvg.GREEDY, impl=impl)


def main(argv=None):
    args = _parse(argv)
    if args.launch_local:
        sys.exit(_launch_local(args.launch_local, args.port,
                               sys.argv[1:] if argv is None else argv))

    import jax

    if os.environ.get("KVJAX_CPU_DEVICES"):
        jax.config.update("jax_num_cpu_devices", int(os.environ["KVJAX_CPU_DEVICES"]))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # One call joins this process to the others; on TPU pods every argument is found.
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)

    import json

    import numpy as np
    from jax.experimental import multihost_utils

    import kvjax as kvx
    from kvjax import sharding as kvs

    hosts = jax.process_count()
    local = jax.local_device_count()
    if local % args.context:
        raise ValueError(f"--context {args.context} must divide the {local} devices per host.")
    # data across hosts; model and context within a host (devices are ordered host by host).
    shape = (hosts, local // args.context, args.context)
    mesh = kvs.make_mesh(shape, ("data", "model", "context"))
    strategies = ("sequences", "heads") + (("context",) if args.context > 1 else ())
    plan = kvs.ShardingPlan(mesh=mesh, strategies=strategies)

    if args.model:
        from kvjax.models import load
        model, params = load(args.model)
    else:
        model, params = tiny_model()
    prompts = parse_prompts(args.prompts)
    sizes = dict(max_new_tokens=args.max_new_tokens, page_size=args.page_size)
    spec = cache_spec(model, prompts, **sizes,
                      num_pages=args.pages_per_device * hosts * args.context,
                      max_seqs=-(-len(prompts) // hosts) * hosts)
    # Params and cache are created/placed sharded: no host holds a full copy of the pools.
    sharded = kvs.shard_params(params, plan, kv_heads=getattr(spec.attention, "kv_heads", None))
    state = greedy_tokens(model, sharded, kvs.init_sharded_cache(spec, plan), prompts,
                          max_new_tokens=args.max_new_tokens, impl=kvs.ShardedAttention(plan))
    out = np.asarray(multihost_utils.process_allgather(state.tokens, tiled=True))
    code = int(np.asarray(multihost_utils.process_allgather(state.status.code, tiled=True)))
    failed = code != 0
    if jax.process_index() == 0:
        print(f"{hosts} processes x {local} devices, mesh {dict(mesh.shape)}, "
              f"strategies {strategies}, status {code}")
        for p, t in zip(prompts, out, strict=True):
            print(f"prompt {p} -> {t.tolist()}")
        print("tokens:", json.dumps(out[:len(prompts)].tolist()))
        if args.check:
            # The same generation on one local device, unsharded: the sharded run must agree.
            # `params` is this process's own (identical) copy, not a global array.
            dev = jax.local_devices()[0]
            with jax.default_device(dev):
                single = jax.tree.map(lambda x: jax.device_put(np.asarray(x), dev), params)
                spec1 = cache_spec(model, prompts, **sizes, num_pages=args.pages_per_device,
                                   max_seqs=len(prompts))
                ref = greedy_tokens(model, single, kvx.init_cache(spec1), prompts,
                                    max_new_tokens=args.max_new_tokens, impl="auto")
            same = np.array_equal(np.asarray(ref.tokens), out[:len(prompts)])
            failed = failed or not same
            print("single-device check:", "same greedy tokens" if same else "MISMATCH")
    jax.distributed.shutdown()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
