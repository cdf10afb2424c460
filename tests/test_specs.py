"""Spec validation: bad values raise ValueError naming what was given and what is allowed."""

import pytest

import kvjax as kvx


def test_specs_are_hashable_and_derive_kinds():
    gqa = kvx.AttentionSpec(q_heads=32, kv_heads=8, head_dim=128)
    assert (gqa.kind, gqa.group_size) == ("GQA", 4)
    assert kvx.AttentionSpec(q_heads=8, kv_heads=8, head_dim=64).kind == "MHA"
    assert kvx.AttentionSpec(q_heads=8, kv_heads=1, head_dim=64).kind == "MQA"
    spec = kvx.CacheSpec(attention=gqa, num_layers=2, page_size=16, num_pages=8, max_seqs=2,
                         max_pages_per_seq=4, dtype="bfloat16")
    same = kvx.CacheSpec(attention=gqa, num_layers=2, page_size=16, num_pages=8, max_seqs=2,
                         max_pages_per_seq=4, dtype="bfloat16")
    assert hash(spec) == hash(same) and spec == same
    assert spec.pool_shapes[0] == (2, 8, 8, 16, 128)
    mla = kvx.MLASpec(q_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                      v_head_dim=128)
    mspec = spec.replace(attention=mla)
    assert mspec.is_mla and mspec.pool_shapes == ((2, 1, 8, 16, 512), (2, 1, 8, 16, 64))


@pytest.mark.parametrize("kwargs,match", [
    (dict(q_heads=12, kv_heads=5, head_dim=64),
     r"kv_heads=5 must divide q_heads=12.*\[1, 2, 3, 4, 6, 12\]"),
    (dict(q_heads=0, kv_heads=1, head_dim=64), r"q_heads must be a positive int, got 0"),
    (dict(q_heads=8, kv_heads=2, head_dim=6.5), r"head_dim must be a positive int, got 6.5"),
])
def test_attention_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvx.AttentionSpec(**kwargs)


def test_mla_spec_errors():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        kvx.MLASpec(q_heads=4, kv_lora_rank=32, qk_rope_head_dim=7, qk_nope_head_dim=16,
                    v_head_dim=16)
    with pytest.raises(ValueError, match="q_lora_rank must be a positive int"):
        kvx.MLASpec(q_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                    v_head_dim=16, q_lora_rank=0)


@pytest.mark.parametrize("change,match", [
    (dict(page_size=12),
     r"page_size must be a power of two, got 12; nearest allowed values are 8 and 16"),
    (dict(num_pages=-1), r"num_pages must be a positive int, got -1"),
    (dict(dtype="int8"),
     r"dtype must be one of \('float32', 'bfloat16', 'float16'\), got int8"),
    (dict(dtype="float77"), r"Unknown dtype 'float77'"),
    (dict(attention="gqa"), r"attention must be an AttentionSpec or MLASpec, got str"),
])
def test_cache_spec_errors(change, match):
    base = dict(attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=1,
                page_size=16, num_pages=4, max_seqs=1, max_pages_per_seq=2)
    with pytest.raises(ValueError, match=match):
        kvx.CacheSpec(**{**base, **change})
