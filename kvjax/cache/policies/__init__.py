"""Cache policies: evict tokens (StreamingLLM, H2O, SnapKV, PyramidKV) or select pages (Quest).

`kivi.py` runs Quest and a page-granular H2O on KIVI-quantized caches.

See `base.py` for the interface a decode loop calls, `compaction.py` for how
eviction returns pages to the pool.
"""

from kvjax.cache.policies.base import (
    CachePolicy,
    NoPolicy,
    Selection,
    full_selection,
    selected_decode_attention,
)
from kvjax.cache.policies.compaction import compact, keep_heavy_and_recent
from kvjax.cache.policies.h2o import H2O, H2OState
from kvjax.cache.policies.kivi import KIVIH2O, KIVIH2OState, KIVIPolicy, KIVIQuest
from kvjax.cache.policies.pyramidkv import PyramidKV, PyramidState
from kvjax.cache.policies.quest import Quest, QuestState, quest_page_bounds
from kvjax.cache.policies.rope import apply_rope, rerotate, rope_inv_freq
from kvjax.cache.policies.snapkv import SnapKV, snapkv_scores
from kvjax.cache.policies.streaming_llm import StreamingLLM

__all__ = [
    "H2O",
    "H2OState",
    "CachePolicy",
    "KIVIH2O",
    "KIVIH2OState",
    "KIVIPolicy",
    "KIVIQuest",
    "NoPolicy",
    "PyramidKV",
    "PyramidState",
    "Quest",
    "QuestState",
    "Selection",
    "SnapKV",
    "StreamingLLM",
    "apply_rope",
    "compact",
    "full_selection",
    "keep_heavy_and_recent",
    "quest_page_bounds",
    "rerotate",
    "rope_inv_freq",
    "selected_decode_attention",
    "snapkv_scores",
]
