"""Byte accounting of kvjax's concrete layouts (paged, quantized + tail), budgets, the CLI."""

from fractions import Fraction

import jax
import numpy as np
import pytest

import kvjax as kvx
from kvjax.__main__ import main
from kvjax.cache import quantized as qz
from kvjax.memory import GiB, kv_format
from kvjax.memory import capacity as cap
from kvjax.memory.presets import get_preset
from kvjax.specs import QuantSpec

GQA = kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=32)
MLA = kvx.MLASpec(q_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                  v_head_dim=16)


def test_page_and_tail_bytes_by_hand():
    int2 = kv_format("int2", group_size=32, residual=32)
    # bf16: 2 heads x 32 tokens x (32 + 32) elements x 2 bytes.
    assert cap.page_bytes(GQA, 1, 32, "bf16") == 8192
    # int2, G=32: per head and tensor 32*32*2/8 = 256 B of codes + 32*32/32 groups x 2 x 2 B
    # = 128 B of scale/zero -> (256 + 128) x 2 tensors x 2 heads.
    assert cap.page_bytes(GQA, 1, 32, int2) == 1536
    # MLA int4: c_KV 32*64*4/8 = 1024 + 32*2 groups*2*2 = 256; k_rope bf16 32*16*2 = 1024.
    assert cap.page_bytes(MLA, 1, 32, kv_format("int4", group_size=32)) == 2304
    # Ring of R + ps = 64 bf16 tokens per slot.
    assert cap.tail_bytes(GQA, 3, 32, int2) == 3 * 64 * 2 * 64 * 2
    assert cap.tail_bytes(GQA, 3, 32, "bf16") == 0
    assert cap.pages_held(100, 32, "bf16") == 4
    assert cap.pages_held(100, 32, int2) == 2  # floor((100 - 32) / 32)
    assert cap.pages_held(20, 32, int2) == 0


@pytest.mark.parametrize("att", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_accounting_matches_allocated_arrays(att, bits):
    # The formulas describe what init_cache really allocates.
    spec = kvx.CacheSpec(attention=att, num_layers=3, page_size=32, num_pages=5, max_seqs=2,
                         max_pages_per_seq=4, dtype="bfloat16",
                         quant=QuantSpec(bits=bits, group_size=16, residual=64))
    shapes = jax.eval_shape(lambda: qz.init_cache(spec))
    pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes.pages))
    ring = sum(x.size * x.dtype.itemsize for x in (shapes.tail.a, shapes.tail.b))  # rings
    fmt = kv_format(f"int{bits}", group_size=16, residual=64)
    assert pool == 5 * cap.page_bytes(att, 3, 32, fmt)
    assert ring == 2 * cap.tail_bytes(att, 3, 32, fmt)
    assert pool + ring == cap.paged_cache_bytes(att, 3, page_size=32, num_pages=5, max_seqs=2,
                                                fmt=fmt)


def test_int2_g32_fits_over_4_5x_tokens_of_paged_bf16():
    llama = get_preset("llama-3-8b")
    budget = 16 * GiB
    fmt = kv_format("int2", group_size=32, residual=128)
    kw = dict(seq_len=4096, page_size=32)
    bf16 = cap.tokens_in_budget(llama.attention, llama.num_layers, budget, fmt="bf16", **kw)
    int2 = cap.tokens_in_budget(llama.attention, llama.num_layers, budget, fmt=fmt, **kw)
    assert int2 >= 4.5 * bf16, (int2, bf16)
    # Without the tail and the scale/zero overhead it would be exactly 8x; they cost the rest.
    assert int2 < 16 / 3 * bf16


def test_paged_fits_over_2x_sequences_of_contiguous_on_the_spread():
    llama = get_preset("llama-3-8b")
    lengths = cap.length_spread(512, 8192, seed=0)
    assert min(lengths) >= 16 and max(lengths) <= 8192 and len(set(lengths)) > 100
    kw = dict(spec=llama.attention, num_layers=llama.num_layers, budget=16 * GiB,
              lengths=lengths)
    contiguous, _ = cap.sequences_in_budget(**kw, page_size=None, max_len=8192)
    paged, _ = cap.sequences_in_budget(**kw, page_size=16)
    assert contiguous == 16 * GiB // (8192 * 128 * 1024)
    assert paged >= 2 * contiguous


def test_sequences_in_budget_by_hand():
    b = cap.page_bytes(GQA, 1, 16, "bf16")
    # Lengths 10, 20, 40 hold 1, 2, 3 pages; a budget of 4 pages admits the first two.
    assert cap.sequences_in_budget(GQA, 1, 4 * b, [10, 20, 40], page_size=16) == (2, 30)
    # Contiguous slots of 40 tokens: 3 pages' worth is 48 tokens -> 1 slot of 40 fits in 4 pages.
    per_slot = Fraction(40, 16) * b
    assert cap.sequences_in_budget(GQA, 1, 4 * b, [10, 20, 40], page_size=None) == (
        int(4 * b // per_slot), 10)


def _main(capsys, *args):
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_cli_budget_table(capsys):
    out = _main(capsys, "memory", "--model", "llama-3-8b", "--kv-dtype", "int2", "--group", "32",
                "--residual", "128", "--budget", "16", "--page-size", "32", "--length-spread",
                "64", "--context", "8192")
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith(("paged ", "contiguous bf16 "))}
    assert float(rows["paged int2"][5]) >= 4.5  # x paged bf16, tokens
    assert int(rows["paged bf16"][-1]) >= 2 * int(rows["contiguous bf16"][-1])
    assert "last 128 tokens bf16" in out


@pytest.mark.parametrize("args, message", [
    (["--budget", "16", "--group", "32"], "must divide --page-size 16"),
    (["--budget", "16", "--residual", "20", "--kv-dtype", "int4"], "multiple of --page-size"),
    (["--budget", "-1"], "must be a positive number"),
])
def test_cli_bad_budget_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--model", "llama-3-8b", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_help_mentions_new_flags(capsys):
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    out = capsys.readouterr().out
    for flag in ("--group", "--residual", "--budget", "--kv-dtype"):
        assert flag in out
    assert np.all([flag in out for flag in ("int8", "int4", "int2")])
