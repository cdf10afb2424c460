"""Cache policies: evict tokens (StreamingLLM, H2O, SnapKV, PyramidKV) or select pages (Quest).

Every policy acts on every page kind where its method is defined: full-precision
K/V and MLA latents token by token, KIVI-quantized pages a whole page at a time
(the full-precision tail of recent tokens always kept). See `base.py` for the
interface a decode loop calls, `compaction.py` for how eviction returns pages to
the pool.
"""

from kvjax.cache.policies.base import (
    CachePolicy,
    NoPolicy,
    Selection,
    UndefinedCombination,
    full_selection,
)
from kvjax.cache.policies.compaction import compact, keep_heavy_and_recent
from kvjax.cache.policies.h2o import H2O, H2OState
from kvjax.cache.policies.pyramidkv import PyramidKV, PyramidState
from kvjax.cache.policies.quest import Quest, QuestState, kivi_key_bounds, quest_page_bounds
from kvjax.cache.policies.rope import apply_rope, rerotate, rope_inv_freq
from kvjax.cache.policies.snapkv import SnapKV, snapkv_scores
from kvjax.cache.policies.streaming_llm import StreamingLLM

__all__ = [
    "H2O",
    "H2OState",
    "CachePolicy",
    "NoPolicy",
    "PyramidKV",
    "PyramidState",
    "Quest",
    "QuestState",
    "Selection",
    "SnapKV",
    "StreamingLLM",
    "UndefinedCombination",
    "apply_rope",
    "compact",
    "full_selection",
    "kivi_key_bounds",
    "keep_heavy_and_recent",
    "quest_page_bounds",
    "rerotate",
    "rope_inv_freq",
    "snapkv_scores",
]
