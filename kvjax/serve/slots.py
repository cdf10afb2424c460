"""The engine's device state and the host's mirror of it (`CacheSlots`).

The engine's `DecodeState` (its cache and decoding rows) lives on the device; the host
keeps a copy of the few numbers its decisions read (each slot's length, its page-table
tokens, the free pages of both tiers), refreshed after every program that changes them.
`CacheSlots` owns both and runs the bookkeeping programs of `kvjax.serve.steps` and
`kvjax.cache.host` on the state: freeing slots and rows, sharing a prefix, swapping a
sequence to the host tier and back. It decides nothing: the scheduler and the prefix
cache (`kvjax.serve.scheduler`, `kvjax.serve.prefixes`) say what to run.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache import host
from kvjax.cache.policies.base import CachePolicy
from kvjax.generate.loop import DecodeState
from kvjax.serve import steps

__all__ = ["CacheSlots"]


class CacheSlots:
    """The engine's `DecodeState` and the host mirror of its lengths and free pages.

    Slots [0, rows) are decoding rows; the slots after them hold cached prefixes (and, with
    a cache policy, one blank slot whose policy state stays initial).

    Args:
      state: the engine's decode state (its cache built for the engine).
      rows: decoding rows.
      host_rows: parked rows of the host tier (0: none).
      policy: the cache policy, or None.
      blank: the blank slot (with a policy), or None.

    Attributes:
      state: the `DecodeState`; every program here donates it and stores the new one.
      lengths, quant: int64[max_seqs] per slot, its tokens and its page-table tokens (on
        KIVI the quantized ones), as of the last `sync`.
      free_pages: free pages of the device pool (a sharded pool: its emptiest shard).
      host_free: free pages of the host tier (0 without one).
      windows, rings: per window group, its window and ring pages.
      ring_base: int64[max_seqs, groups] per slot, the first logical page its rings hold
        beyond what its length implies (a prefix hit starts a ring part-filled).
    """

    def __init__(self, state: DecodeState, *, rows: int, host_rows: int,
                 policy: CachePolicy | None, blank: int | None):
        self.state = state
        self.spec = state.cache.spec
        self.rows = rows
        self.host_rows = host_rows
        self.policy = policy
        self.blank = blank
        ps, gs = self.spec.page_size, self.spec.window_groups
        self.windows = np.array([g.window for g in gs], np.int64)
        self.rings = np.array([g.ring_pages(ps) for g in gs], np.int64)
        self.ring_base = np.zeros((self.spec.max_seqs, len(gs)), np.int64)
        self.sync()

    # ------------------------------------------------------------------ the mirror

    def sync(self) -> None:
        """Reads the lengths and free counts back from the device."""
        c = self.state.cache
        self.mirror(jax.device_get((c.lengths, c.table.lengths, c.table.num_free,
                                    self.host_free_array())))

    def host_free_array(self):
        """The host tier's free-page count on the device (None without a tier)."""
        c = self.state.cache
        return None if c.host is None else c.host.table.num_free

    def mirror(self, got) -> None:
        """Takes (lengths, table lengths, free pages, host free pages) read off the device."""
        lengths, quant, free, host_free = got
        self.lengths = np.array(lengths)
        self.quant = np.array(quant)
        self.free_pages = int(np.min(free))  # a sharded pool: the emptiest shard
        self.host_free = 0 if host_free is None else int(host_free)

    def pages_for(self, slot: int, n: int) -> int:
        """Pages slot's sequence allocates to take n more tokens."""
        return self.growth(int(self.lengths[slot]), int(self.quant[slot]), n)

    def growth(self, L: int, q: int, n: int) -> int:
        """Pages a sequence of L tokens (q of them in its page table) allocates to take n
        more tokens."""
        ps = self.spec.page_size
        if self.spec.quant is None:
            return -(-(L + n) // ps) - (-(-L // ps))
        new_q = max(kv_cache.quantized.quantized_tokens(self.spec, L + n), q)
        return (new_q - q) // ps

    # ------------------------------------------------------------------ programs

    def set_cache(self, cache) -> None:
        self.state = dataclasses.replace(self.state, cache=cache)

    def free_slots(self, slots: Sequence[int]) -> None:
        """Frees the slots (cached prefixes); the mirror is stale until `sync`."""
        mask = np.zeros((self.spec.max_seqs,), bool)
        mask[list(slots)] = True
        self.set_cache(steps.free(self.state.cache, mask))

    def release(self, rows: Sequence[int]) -> None:
        """Frees the decoding rows' slots and marks the rows done (mirror stale until
        `sync`)."""
        mask = np.zeros((self.rows,), bool)
        mask[list(rows)] = True
        self.state = steps.release(self.state, mask)

    def share(self, src: int, dst: int, length: int) -> None:
        """Slot dst (empty) shares the first `length` tokens (whole pages) of slot src."""
        if self.lengths[dst] or length > self.lengths[src] or length % self.spec.page_size:
            raise AssertionError(f"cannot share {length} tokens of slot {src} (holding "
                                 f"{self.lengths[src]}) with slot {dst} (holding "
                                 f"{self.lengths[dst]})")
        cache, _ = steps.share(self.state.cache, np.int32(src), np.int32(dst), np.int32(length))
        self.set_cache(cache)
        # Mirrors the device: no page changes hands but those shared (free count unchanged).
        self.lengths[dst] = self.quant[dst] = length

    def reset_policy_row(self, slot: int) -> None:
        """The row's policy state becomes the blank slot's (initial)."""
        p = self.policy.fork_state(self.state.policy_state, jnp.int32([self.blank]),
                                   jnp.int32([slot]))
        self.state = dataclasses.replace(self.state, policy_state=p)

    # ------------------------------------------------------------------ window rings

    def ring_lo(self, slot: int) -> np.ndarray:
        """Per window group, the first logical page slot's ring holds: the last R pages of
        its length, or fewer after a prefix hit (its ring then starts at the holder's)."""
        held = -(-int(self.lengths[slot]) // self.spec.page_size)
        return np.maximum(self.ring_base[slot], held - self.rings)

    def ring_holds(self, lo, j: int) -> bool:
        """Whether rings holding pages from `lo` (per group) on hold every page that the
        windows of queries at position j * page_size and later reach back to."""
        ps = self.spec.page_size
        first = np.maximum(j * ps - self.windows + 1, 0) // ps
        return bool(np.all(first >= np.asarray(lo, np.int64)))

    # ------------------------------------------------------------------ host tier

    def swap_out(self, slot: int, row: int) -> bool:
        """Slot's sequence to parked row `row` (the slot is empty after); False (nothing
        changed) when the host pool is short."""
        cache, st = host.swap_out(self.state.cache, slot, row)
        self.set_cache(cache)
        self.sync()
        return int(st.code) == 0

    def swap_in(self, row: int, slot: int) -> bool:
        """Parked row `row` into the empty slot; False (nothing changed) when the pool is
        short."""
        cache, st = host.swap_in(self.state.cache, row, slot)
        self.set_cache(cache)
        self.sync()
        return int(st.code) == 0

    def drop_row(self, row: int) -> None:
        """Forgets parked row `row` (mirror stale until `sync`)."""
        self.set_cache(host.drop_parked(self.state.cache, row))

    def take_row(self, slot: int) -> steps.RowState:
        """Decoding row `slot`'s state, on the host."""
        return jax.device_get(steps.take_row(self.state, jnp.int32(slot)))

    def put_row(self, slot: int, row: steps.RowState) -> None:
        """Row `slot` takes a state `take_row` saved."""
        self.state = steps.put_row(self.state, jnp.int32(slot), row)

    def check_rings(self, holders_ring_lo: dict[int, tuple[int, ...]]) -> None:
        """AssertionError unless every slot's rings hold the pages the engine counts on:
        per group, logical pages [`ring_lo`, its last page) (what its windows read and a
        hit may share), and each holder's recorded first ring page (`holders_ring_lo`,
        slot -> per group) is the slot's."""
        ps, cache = self.spec.page_size, self.state.cache
        lengths = np.asarray(cache.lengths)
        for g, grp in enumerate(cache.groups):
            bt = np.asarray(grp.table.block_tables)
            for s in np.flatnonzero(lengths):
                lo, end = int(self.ring_lo(s)[g]), -(-int(lengths[s]) // ps)
                miss = [p for p in range(lo, end) if bt[s, p % self.rings[g]] < 0]
                if miss:
                    raise AssertionError(f"slot {s} ({lengths[s]} tokens) misses pages {miss} "
                                         f"of window group {g} (its ring {bt[s].tolist()})")
        for s, lo in holders_ring_lo.items():
            if lo != tuple(self.ring_base[s].tolist()):
                raise AssertionError(f"holder {s}'s rings start at {self.ring_base[s].tolist()}, "
                                     f"its entry says {list(lo)}")
