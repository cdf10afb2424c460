"""Paging-waste simulator against a hand example and general invariants."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.memory.paging import paging_waste


def test_hand_example():
    # Lengths 1, 16, 17, 40 with 16-token pages.
    # Contiguous: 4 sequences x max_len 40 = 160 tokens.
    # Paged: 1 + 1 + 2 + 3 = 7 pages = 112 tokens.
    # Used: 1 + 16 + 17 + 40 = 74 tokens.
    w = paging_waste([1, 16, 17, 40], page_size=16)
    assert (w.contiguous_bytes, w.paged_bytes, w.used_bytes) == (160, 112, 74)
    assert (w.num_seqs, w.max_len, w.page_size) == (4, 40, 16)
    assert w.contiguous_waste == pytest.approx(1 - 74 / 160)  # 0.5375
    assert w.paged_waste == pytest.approx(1 - 74 / 112)  # 0.339
    assert w.paged_over_contiguous == pytest.approx(112 / 160)  # 0.7


def test_explicit_max_len_and_bytes_per_token():
    # Same lengths, contiguous slabs of 64 tokens: 4 x 64 = 256 tokens; at 3/2 bytes
    # per token (e.g. 12-bit codes) that is 384 bytes, paged 112 x 3/2 = 168, used 111.
    w = paging_waste([1, 16, 17, 40], page_size=16, max_len=64, bytes_per_token=Fraction(3, 2))
    assert (w.contiguous_bytes, w.paged_bytes, w.used_bytes) == (384, 168, 111)
    assert isinstance(w.paged_bytes, Fraction)


def test_empty_sequences_reserve_no_pages():
    w = paging_waste([0, 0])
    assert (w.contiguous_bytes, w.paged_bytes, w.used_bytes) == (0, 0, 0)
    assert w.contiguous_waste == w.paged_waste == w.paged_over_contiguous == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(lengths=[]), "empty"), (dict(lengths=[3, -1]), "-1"),
     (dict(lengths=[3], page_size=0), "page_size"),
     (dict(lengths=[10, 20], max_len=19), r"longest sequence \(20\)")],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paging_waste(**kwargs)


@given(
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=50),
    page_size=st.sampled_from([1, 8, 16, 256]),
    extra=st.integers(0, 1000),
)
def test_invariants(lengths, page_size, extra):
    w = paging_waste(lengths, page_size=page_size, max_len=max(lengths) + extra)
    assert w.used_bytes == sum(lengths)
    assert w.contiguous_bytes == len(lengths) * (max(lengths) + extra)
    # Only the last page of each sequence can be partly empty.
    assert w.used_bytes <= w.paged_bytes < w.used_bytes + len(lengths) * page_size
    assert w.paged_bytes % page_size == 0
