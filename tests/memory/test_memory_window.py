"""Sliding-window presets (Gemma 2, Gemma 3) and their window-only KV, by hand arithmetic.

The config numbers below are the public configs' (Gemma 3 4B/12B/27B: their
`text_config`): layers, width, MLP width, query / KV heads, head_dim, vocabulary, window,
and the local:global pattern (Gemma 2 1:1, Gemma 3 5:1).
"""

import math

import pytest

from kvjax.__main__ import main
from kvjax.memory import get_preset
from kvjax.memory import window as swa
from kvjax.specs import ring_pages

# name: (layers, hidden, intermediate, q_heads, kv_heads, head_dim, vocab, window, interval)
CONFIGS = {
    "gemma-2-2b": (26, 2304, 9216, 8, 4, 256, 256_000, 4096, 2),
    "gemma-2-9b": (42, 3584, 14336, 16, 8, 256, 256_000, 4096, 2),
    "gemma-2-27b": (46, 4608, 36864, 32, 16, 128, 256_000, 4096, 2),
    "gemma-3-1b": (26, 1152, 6912, 4, 1, 256, 262_144, 512, 6),
    "gemma-3-4b": (34, 2560, 10240, 8, 4, 256, 262_208, 1024, 6),
    "gemma-3-12b": (48, 3840, 15360, 16, 8, 256, 262_208, 1024, 6),
    "gemma-3-27b": (62, 5376, 21504, 32, 16, 128, 262_208, 1024, 6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_presets_are_the_public_configs(name):
    layers, hidden, inter, q, kv, d, vocab, window, interval = CONFIGS[name]
    p = get_preset(name)
    assert (p.num_layers, p.hidden_size, p.q_heads, p.kv_heads, p.head_dim, p.vocab) == (
        layers, hidden, q, kv, d, vocab)
    assert (p.sliding_window, p.global_attention_interval) == (window, interval)
    assert p.label == ("MQA" if kv == 1 else "GQA") + "+SWA"
    # Layer i is global when (i + 1) % interval == 0.
    n_global = layers // interval
    assert p.layer_types.count("full_attention") == n_global
    assert p.local_layers == layers - n_global and p.kv_layers == layers
    assert p.layer_types[interval - 1] == "full_attention"
    assert set(p.layer_types[:interval - 1]) == {"sliding_attention"}
    # The text model's exact size: tied embedding, q/k/v/o, the gated MLP, four norms per
    # layer (and Gemma 3's q/k norms), the final norm.
    qk_norms = 2 * d if name.startswith("gemma-3") else 0
    per_layer = hidden * q * d + 2 * hidden * kv * d + q * d * hidden + 3 * hidden * inter \
        + 4 * hidden + qk_norms
    assert p.num_params == vocab * hidden + layers * per_layer + hidden


def test_published_sizes():
    """The model cards' sizes (Gemma 3 4B/12B/27B: text model, without the ~0.4B vision
    encoder the cards' 4.3B / 12.2B / 27.4B include)."""
    sizes = {n: get_preset(n).num_params / 1e9 for n in CONFIGS}
    assert round(sizes["gemma-2-2b"], 2) == 2.61 and round(sizes["gemma-2-9b"], 2) == 9.24
    assert round(sizes["gemma-2-27b"], 1) == 27.2 and round(sizes["gemma-3-1b"], 1) == 1.0
    for name, total in (("gemma-3-4b", 4.3), ("gemma-3-12b", 12.2), ("gemma-3-27b", 27.4)):
        assert 0.3 < total - sizes[name] < 0.5, name


def test_gemma3_27b_compare_prints_full_and_window_only_kv(capsys):
    """`python -m kvjax memory --model gemma-3-27b --context 131072 --compare`: 52 local
    layers of 2 (K, V) x 16 KV heads x 128 x 2 bytes = 8,192 B per token; 131,072 tokens
    = 8,192 pages of 16 tokens each with every page kept, a ring of
    ceil((1024 + 256 - 2) / 16) + 1 = 81 pages with window-only pages."""
    assert main(["memory", "--model", "gemma-3-27b", "--context", "131072", "--compare"]) == 0
    out = capsys.readouterr().out
    per_token_layer = 2 * 16 * 128 * 2
    ring = math.ceil((1024 + 256 - 2) / 16) + 1
    assert ring == 81
    local_full = 52 * 131072 * per_token_layer
    local_window = 52 * ring * 16 * per_token_layer
    global_kv = 10 * 131072 * per_token_layer
    assert (local_full, local_window) == (55_834_574_848, 552_075_264)
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert f"{local_full:,}" in rows["local layers (52), full context"]
    assert f"{local_window:,}" in rows["local layers (52), window-only"]
    assert f"{global_kv:,}" in rows["global layers (10)"]
    assert f"{global_kv + local_window:,}" in rows["all layers, window-only local pages"]
    assert f"({(global_kv + local_full) / (global_kv + local_window):.2f}x smaller)" in out


def test_window_only_pages_short_contexts_and_batches():
    """A context inside the ring keeps all its pages; the batch multiplies; ring_pages is
    the cache's formula."""
    p = get_preset("gemma-2-2b")
    w = swa.window_cache_bytes(p, 1000, batch=3, fmt="fp32", page_size=16, chunk=64)
    assert w.ring_pages == ring_pages(4096, 64, 16) == math.ceil((4096 + 64 - 2) / 16) + 1
    page = 16 * 2 * 4 * 256 * 4  # fp32
    assert w.context_pages == w.window_pages == 63
    assert w.local_full_bytes == w.local_window_bytes == 13 * 63 * page
    assert w.batch_bytes(w.window_bytes) == 3 * 26 * 63 * page
    long = swa.window_cache_bytes(p, 8192, fmt="fp32", page_size=16, chunk=64)
    assert long.local_window_bytes == 13 * w.ring_pages * page < long.local_full_bytes
    with pytest.raises(ValueError, match="full-precision"):
        swa.window_cache_bytes(p, 1000, fmt="int8")
    with pytest.raises(ValueError, match="no sliding-window layers"):
        swa.window_cache_bytes(get_preset("llama-3-8b"), 1000)
