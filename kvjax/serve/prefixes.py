"""The engine's prefix caching: finding hits, sharing their pages, keeping and evicting
cached prefixes (`PrefixPages`), over the index of `kvjax.serve.prefix.PrefixCache`.

`PrefixCache` indexes which slot (a "holder") or parked host row holds which pages, by
their hash chain; `PrefixPages` acts on the cache through `CacheSlots`: a hit shares a
holder's pages with a request's slot, a prompt's pages are kept in a free holder slot,
and a holder leaves the device (to a parked row of the host tier when it has room, else
forgotten) when the pool needs its pages. See `kvjax.serve.engine` for which pages a
hit may use (whole chunks; on KIVI, quantized pages; with window groups, pages whose
windows the holder's rings still hold).
"""

import collections
from collections.abc import Callable

import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache.page_table import PageTable
from kvjax.serve import prefix
from kvjax.serve.prefix import PrefixCache
from kvjax.serve.slots import CacheSlots

__all__ = ["PrefixPages"]


class PrefixPages:
    """Prefix hits and cached prefixes on the engine's cache.

    Args:
      slots: the engine's `CacheSlots`.
      index: the `PrefixCache` over the holder slots, or None (prefix caching off: no hit,
        nothing kept).
      chunk: the engine's prefill chunk (hits cover whole chunks).
      stats: the engine's counters (hit_pages, evictions, prefix_parks, host_prefix_drops).
      reserved_rows: returns the parked rows other owners hold (swapped requests).
    """

    def __init__(self, slots: CacheSlots, index: PrefixCache | None, *, chunk: int,
                 stats: collections.Counter, reserved_rows: Callable[[], set[int]]):
        self.slots = slots
        self.index = index
        self.chunk = chunk
        self.stats = stats
        self.reserved_rows = reserved_rows

    @property
    def enabled(self) -> bool:
        return self.index is not None

    @property
    def parked(self) -> dict[int, np.ndarray]:
        """Parked row -> tokens of each prefix parked on the host (least recent first)."""
        return self.index.parked if self.index is not None else {}

    def hashes(self, req) -> list[bytes]:
        """The hash chain of the full pages of the request's `fed` tokens (cached)."""
        if req.hashes is None:
            req.hashes = prefix.page_hashes(req.fed, self.slots.spec.page_size, req.salt)
        return req.hashes

    def usable_hit(self, req, n: int) -> int:
        """The pages of an n-page match a request may take (whole chunks, see module doc)."""
        spec = self.slots.spec
        ps, per_chunk = spec.page_size, self.chunk // spec.page_size
        total = len(req.fed)
        j = min(n, (total - 1) // ps)
        j -= j % per_chunk
        if spec.quant is not None:
            qt = kv_cache.quantized.quantized_tokens
            while j > 0 and j * ps > qt(spec, min(j * ps + self.chunk, total)):
                j -= per_chunk
        return max(j, 0)

    def find_hit(self, req, *, parked: bool = True,
                 touch: bool = True) -> tuple[int, int | None, int | None]:
        """The longest usable hit for `req`: (pages j, holder slot, or None and the parked
        row holding them); (0, None, None) when none. Without window groups j is the
        whole-chunk match (`usable_hit`); with them, the longest such j whose holder's
        rings reach back far enough (`CacheSlots.ring_holds`)."""
        hashes = self.hashes(req)
        j = self.usable_hit(req, self.index.match(hashes, req.fed, parked=parked))
        usable = None
        while j > 0:
            if self.slots.windows.size:
                usable = lambda lo, j=j: self.slots.ring_holds(lo, j)  # noqa: E731
            slot = self.index.holder_of(hashes, j, usable=usable, touch=touch)
            if slot is not None:
                return j, slot, None
            row = self.index.parked_of(hashes, j, usable=usable, touch=touch) if (
                parked) else None
            if row is not None:
                return j, None, row
            j -= self.chunk // self.slots.spec.page_size
        return 0, None, None

    def attach(self, req) -> None:
        """Shares the longest usable hit's pages with the request's (empty) slot; its
        prefill starts after them."""
        j, holder, row = self.find_hit(req)
        if j == 0:
            return
        if holder is None:  # only a parked row holds them: bring it back first
            holder = self.unpark(row)
            if holder is not None:
                self.stats["host_prefix_hits"] += 1
            else:  # no room for it on the device: the longest hit held there
                j, holder, _ = self.find_hit(req, parked=False)
                if j == 0:
                    return
        ps = self.slots.spec.page_size
        self.slots.share(holder, req.slot, j * ps)
        if self.slots.windows.size:
            self.slots.ring_base[req.slot] = self.index.ring_lo(holder)
        req.done_tokens = j * ps
        if not req.output:  # a readmitted request's own pages do not count as hits
            req.cached_tokens = req.done_tokens
        self.stats["hit_pages"] += j

    def register(self, req) -> None:
        """Keeps the full pages of the request's prompt prefilled so far (quantized pages on
        KIVI) for later ones."""
        slots = self.slots
        ps = slots.spec.page_size
        # Only the prompt's pages (quantized ones on KIVI, which the decode steps after the
        # prompt's last chunk may have carried past it).
        held = req.done_tokens if slots.spec.quant is None else int(slots.quant[req.slot])
        n = min(held, len(req.fed)) // ps
        hashes = self.hashes(req)[:n]
        if n == 0 or slots.lengths[req.slot] < n * ps or self.index.new_pages(hashes) == 0:
            return  # nothing new, or the request already finished and freed its pages
        lo = slots.ring_lo(req.slot)
        if slots.windows.size and not slots.ring_holds(lo, n):
            return  # the rings no longer hold the window before page n: no hit could use it
        holder = self.index.free_slot()
        if holder is None:
            self.evict()
            holder = self.index.free_slot()
        slots.share(req.slot, holder, n * ps)
        slots.ring_base[holder] = lo
        self.index.add(holder, hashes, req.fed, req.salt, ring_lo=lo.tolist())

    def evict(self, protect: int | None = None) -> bool:
        """Evicts the least recently used cached prefix from the device: to a parked row
        when the host tier has room for it (dropping older parked prefixes, never the row
        `protect`), else forgotten. False when no holder is left."""
        slot = self.index.lru_slot() if self.index is not None else None
        if slot is None:
            return False
        self.stats["evictions"] += 1
        if self.slots.host_rows:
            pages = len(self.index.holders[slot]) // self.slots.spec.page_size
            row = self.host_room(pages, protect=protect)
            if row is not None and self.slots.swap_out(slot, row):
                self.index.park(slot, row)
                self.stats["prefix_parks"] += 1
                return True
        self.index.remove(slot)
        self.slots.free_slots([slot])
        self.slots.sync()
        return True

    def unpark(self, row: int) -> int | None:
        """Brings the prefix parked in `row` back into a free holder slot, evicting other
        holders if need be; returns the slot, or None when the pool has no room for it."""
        slots = self.slots
        pages = len(self.index.parked[row]) // slots.spec.page_size
        if self.index.free_slot() is None:
            self.evict(protect=row)
        while slots.free_pages < pages and self.evict(protect=row):
            pass
        slot = self.index.free_slot()
        if slot is None or slots.free_pages < pages or not slots.swap_in(row, slot):
            return None
        self.index.unpark(row, slot)
        slots.ring_base[slot] = self.index.ring_lo(slot)
        return slot

    def host_room(self, pages: int, protect: int | None = None) -> int | None:
        """A free parked row with `pages` free host pages, made by dropping parked
        prefixes (least recently used first, never the row `protect`) if it takes that;
        None, with nothing dropped, when dropping them all would not do. Rows of
        `reserved_rows` (swapped requests) are never dropped."""
        slots = self.slots
        ps = slots.spec.page_size
        parked = self.parked
        used = self.reserved_rows() | set(parked)
        free_rows = [r for r in range(slots.host_rows) if r not in used]
        free, drop = slots.host_free, []
        for r, toks in parked.items():  # least recently used first
            if (free_rows or drop) and free >= pages:
                break
            if r != protect:
                drop.append(r)
                free += len(toks) // ps
        if not ((free_rows or drop) and free >= pages):
            return None
        for r in drop:
            slots.drop_row(r)
            self.index.drop_parked(r)
            self.stats["host_prefix_drops"] += 1
        if drop:
            slots.sync()
        return free_rows[0] if free_rows else drop[0]

    def reset(self) -> None:
        """Forgets every cached prefix (holders and parked rows), returning the pages only
        they held to their pools."""
        if self.index is None:
            return
        for row in list(self.index.parked):
            self.slots.drop_row(row)
            self.index.drop_parked(row)
        holders = list(self.index.holders)
        for s in holders:
            self.index.remove(s)
        if holders:
            self.slots.free_slots(holders)
        self.slots.sync()

    def check(self, lengths: np.ndarray) -> None:
        """AssertionError unless the index agrees with itself and its holders hold what
        their entries say (`lengths`: the device's slot lengths)."""
        if self.index is None:
            return
        self.index.check()
        if isinstance(self.slots.state.cache.table, PageTable):
            ps = self.slots.spec.page_size
            for s, toks in self.index.holders.items():
                if lengths[s] != len(toks) or len(toks) % ps:
                    raise AssertionError(f"holder {s} holds {lengths[s]} tokens, its "
                                         f"entries {len(toks)}")
