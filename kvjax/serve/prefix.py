"""Prefix caching: full pages of earlier prompts, found by a hash chain, kept by refcount.

Page i of a prompt is named by a hash chain, h_i = H(h_{i-1}, the page's token ids),
rooted at a hash of an optional salt (requests with different salts never share a
page). A hash names a page's whole prefix, so the deepest cached hash of a new prompt
is its longest cached prefix.

Cached pages live in the cache itself, held by *holder* slots: spare sequence slots
of the page table that no request decodes in. Registering a request's prompt pages
forks its slot into a free holder and truncates the holder to those pages, so the
pages gain one reference and outlive the request; a hit forks the holder into the new
request's slot and truncates it to the pages that hit. Every page is therefore free,
or referenced by block tables (requests and holders) — the allocator's own invariants,
with no second bookkeeping of refcounts. A quantized (KIVI) page is complete when it
is written, so it is shared as it is; a quantized sequence can end on a whole page
(`kvjax.cache.truncate`), its full-precision tail stays private.

Eviction is least-recently-used over holders: evicting one frees its slot, and the
pages no other holder or request holds go back to the pool. A holder registered
after another with the same system prompt shares that prompt's pages, so evicting
the older one returns only its own suffix pages.

With a host tier (`kvjax.cache.host`), an evicted holder can move to a *parked row*
of the host pool instead of being forgotten (`park`): its entries stay, now naming
the row, so a later prompt still matches them; the engine brings the row back into
a free holder slot (`unpark`) before it shares the pages. Parked holders are
forgotten least-recently-used first when the host tier needs room (`drop_parked`).

With window groups (`kvjax.cache.window`: sliding-window layers that keep only a ring
of their last pages), a holder's rings hold its windowed layers' pages from some
logical page on only (`ring_lo`, one per group, recorded at `add`); a hit of n pages
needs the pages the windows reach before its end, so the engine passes a `usable`
test to `holder_of` and `parked_of` that picks only holders whose rings reach back far
enough.

This module is host-side bookkeeping (hashes, holders, LRU order); the engine runs
the forks, truncations, frees and swaps on the cache.
"""

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["PrefixCache", "page_hashes"]


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int,
                salt: str | None = None) -> list[bytes]:
    """The hash chain of every full page of `tokens` (a partial last page has none)."""
    tokens = np.asarray(tokens, np.int64)
    h = hashlib.blake2b(b"kvjax-prefix" + (salt or "").encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size: (i + 1) * page_size]
        h = hashlib.blake2b(h + page.tobytes(), digest_size=16).digest()
        out.append(h)
    return out


@dataclasses.dataclass
class _Holder:
    hashes: list[bytes]
    tokens: np.ndarray  # the token ids of its pages, page_size * len(hashes)
    salt: str | None
    last_used: int
    ring_lo: tuple[int, ...] = ()  # per window group: the first logical page its ring holds


@dataclasses.dataclass
class _Entry:
    depth: int  # page index in the chain
    tokens: bytes  # the page's token ids (int32)
    holders: set[int]  # holder slots (device)
    parked: set[int] = dataclasses.field(default_factory=set)  # parked rows (host)

    def empty(self) -> bool:
        return not self.holders and not self.parked


class PrefixCache:
    """Which holder slot holds which cached pages; lookups, registration and LRU order.

    Args:
      page_size: tokens per page.
      slots: the cache slots set aside as holders.
    """

    def __init__(self, page_size: int, slots: Sequence[int]):
        self.page_size = page_size
        self.slots = tuple(int(s) for s in slots)
        self._free = list(reversed(self.slots))
        self._holders: dict[int, _Holder] = {}
        self._parked: dict[int, _Holder] = {}  # host row -> holder parked there
        self._entries: dict[bytes, _Entry] = {}
        self._clock = 0

    def __len__(self) -> int:
        """Cached pages (distinct hashes)."""
        return len(self._entries)

    @property
    def holders(self) -> dict[int, np.ndarray]:
        """Each occupied holder slot and the token ids its pages hold."""
        return {s: h.tokens for s, h in self._holders.items()}

    @property
    def parked(self) -> dict[int, np.ndarray]:
        """Each parked row (host tier) and the token ids its pages hold, least recently
        used first."""
        rows = sorted(self._parked, key=lambda r: self._parked[r].last_used)
        return {r: self._parked[r].tokens for r in rows}

    def match(self, hashes: Sequence[bytes], tokens: np.ndarray, *,
              parked: bool = True) -> int:
        """Pages of a prompt (its `hashes`, its `tokens`) found cached, from the first on
        (held by a holder slot, or by a parked row unless `parked` is False).

        A hash that matches but names other token ids (a collision) ends the match.
        """
        ps = self.page_size
        tokens = np.asarray(tokens, np.int32)
        n = 0
        for i, h in enumerate(hashes):
            e = self._entries.get(h)
            if e is None or e.depth != i or e.tokens != tokens[i * ps: (i + 1) * ps].tobytes() or (
                    not parked and not e.holders):
                break
            n = i + 1
        return n

    def holder_of(self, hashes: Sequence[bytes], n: int, *,
                  usable: Callable[[tuple[int, ...]], bool] | None = None,
                  touch: bool = True) -> int | None:
        """The most recently used holder slot holding the first `n` pages of this chain
        (and, with `usable`, whose `ring_lo` it accepts), marked used unless `touch` is
        False; None when no such slot holds them (parked rows may)."""
        holders = [s for s in self._entries[hashes[n - 1]].holders
                   if usable is None or usable(self._holders[s].ring_lo)]
        if not holders:
            return None
        slot = max(holders, key=lambda s: self._holders[s].last_used)
        if touch:
            self.touch(slot)
        return slot

    def parked_of(self, hashes: Sequence[bytes], n: int, *,
                  usable: Callable[[tuple[int, ...]], bool] | None = None,
                  touch: bool = True) -> int | None:
        """`holder_of` over the parked rows (host tier); None when no row qualifies."""
        rows = [r for r in self._entries[hashes[n - 1]].parked
                if usable is None or usable(self._parked[r].ring_lo)]
        if not rows:
            return None
        row = max(rows, key=lambda r: self._parked[r].last_used)
        if touch:
            self._clock += 1
            self._parked[row].last_used = self._clock
        return row

    def ring_lo(self, slot: int) -> tuple[int, ...]:
        """Holder `slot`'s window rings: per group, the first logical page held."""
        return self._holders[slot].ring_lo

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._holders[slot].last_used = self._clock

    def new_pages(self, hashes: Sequence[bytes]) -> int:
        """How many of these pages are not cached yet (from the first uncached one on)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._entries:
            n += 1
        return len(hashes) - n

    def free_slot(self) -> int | None:
        """A holder slot not in use, or None."""
        return self._free[-1] if self._free else None

    def lru_slot(self) -> int | None:
        """The least recently used holder, or None when nothing is cached."""
        if not self._holders:
            return None
        return min(self._holders, key=lambda s: self._holders[s].last_used)

    def add(self, slot: int, hashes: Sequence[bytes], tokens: np.ndarray,
            salt: str | None = None, ring_lo: Sequence[int] = ()) -> None:
        """Records that holder `slot` now holds the pages `hashes` (token ids `tokens`,
        hashed with `salt`) and, per window group, its ring's pages from logical page
        `ring_lo[g]` on."""
        if slot not in self._free:
            raise ValueError(f"holder slot {slot} is not free.")
        ps = self.page_size
        tokens = np.asarray(tokens[: len(hashes) * ps], np.int32).copy()
        self._free.remove(slot)
        self._clock += 1
        self._holders[slot] = _Holder(hashes=list(hashes), tokens=tokens, salt=salt,
                                      last_used=self._clock,
                                      ring_lo=tuple(int(p) for p in ring_lo))
        for i, h in enumerate(hashes):
            e = self._entries.get(h)
            if e is None:
                e = self._entries[h] = _Entry(
                    depth=i, tokens=tokens[i * ps: (i + 1) * ps].tobytes(), holders=set())
            e.holders.add(slot)

    def remove(self, slot: int) -> None:
        """Forgets holder `slot` (the engine frees the slot on the device)."""
        holder = self._holders.pop(slot)
        self._forget(holder, lambda e: e.holders.discard(slot))
        self._free.append(slot)

    def _forget(self, holder: _Holder, unlink) -> None:
        for h in holder.hashes:
            e = self._entries[h]
            unlink(e)
            if e.empty():
                del self._entries[h]

    def park(self, slot: int, row: int) -> None:
        """Records that holder `slot`'s pages moved to parked row `row` (the engine ran
        the swap); the slot is free again, the entries stay and name the row."""
        if row in self._parked:
            raise ValueError(f"parked row {row} already holds a prefix.")
        holder = self._holders.pop(slot)
        for h in holder.hashes:
            e = self._entries[h]
            e.holders.discard(slot)
            e.parked.add(row)
        self._parked[row] = holder
        self._free.append(slot)

    def unpark(self, row: int, slot: int) -> None:
        """Records that parked row `row` came back into the free holder `slot`."""
        if slot not in self._free:
            raise ValueError(f"holder slot {slot} is not free.")
        holder = self._parked.pop(row)
        for h in holder.hashes:
            e = self._entries[h]
            e.parked.discard(row)
            e.holders.add(slot)
        self._free.remove(slot)
        self._clock += 1
        holder.last_used = self._clock
        self._holders[slot] = holder

    def drop_parked(self, row: int) -> None:
        """Forgets the prefix parked in `row` (the engine drops the row on the host)."""
        holder = self._parked.pop(row)
        self._forget(holder, lambda e: e.parked.discard(row))

    def check(self) -> None:
        """AssertionError unless every holder's (slot or parked row) hashes are the hash
        chain of its tokens, every entry's tokens are its holders' tokens at its depth,
        and every holder's pages are entries naming it."""
        ps = self.page_size
        for where, holders, field in (("holder", self._holders, "holders"),
                                      ("parked row", self._parked, "parked")):
            for key, holder in holders.items():
                if page_hashes(holder.tokens, ps, holder.salt) != holder.hashes:
                    raise AssertionError(f"{where} {key}'s hashes are not its tokens' hash "
                                         f"chain")
                for i, h in enumerate(holder.hashes):
                    e = self._entries.get(h)
                    if e is None or key not in getattr(e, field):
                        raise AssertionError(f"{where} {key} page {i} has no entry naming it")
        for e in self._entries.values():
            if e.empty():
                raise AssertionError("an entry has no holder")
            for key, holder in [(s, self._holders[s]) for s in e.holders] + [
                    (r, self._parked[r]) for r in e.parked]:
                page = holder.tokens[e.depth * ps: (e.depth + 1) * ps]
                if page.tobytes() != e.tokens:
                    raise AssertionError(f"entry at depth {e.depth} disagrees with holder "
                                         f"{key}'s tokens")
        if set(self._free) & set(self._holders) or (
                len(self._free) + len(self._holders) != len(self.slots)):
            raise AssertionError("holder slots are lost or both free and used")
