"""The scheduler's id pools and how a request's ids change (pure Python on ints).

Four ``PageAllocator``s and the radix index, all owned here:

    pages               full pages; request page table index = position // 256 (compressed pools
                        use the same id: C4/indexer entry of slot f at page * 64 + (f % 256) // 4)
    window_pages        window pages; request window index = position // 128; resident only from
                        computed - 128 on, plus the page each snapshot pins
    state_slots         compressor-state rings, one per running request
    cached_state_slots  C4 rings copied at a page boundary (snapshots, then radix nodes)

Every id has one reference per holder (a request's page table or window map, a snapshot, the radix
index), so sharing a cached prefix is an incref and ``check_integrity`` can recount every holder.
When a pool is short, unlocked cached prefixes are evicted first (LRU); callers decide what else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from dsv4ray.cache.allocator import PageAllocator
from dsv4ray.cache.hicache import HiRadixIndex
from dsv4ray.cache.radix import RadixIndex, RadixNode, Snapshot
from dsv4ray.engine.config import SchedulerConfig
from dsv4ray.engine.request import Request, RequestSnapshot


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares, snapshots and releases the ids of requests."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.page_size = config.page_size
        self.window_size = config.window_page_size
        self.prefix_caching = config.enable_prefix_caching and config.num_cached_state_slots > 0
        self.pages = PageAllocator(config.num_pages, "pages")
        self.window_pages = PageAllocator(config.num_window_pages, "window pages")
        self.state_slots = PageAllocator(config.num_state_slots, "state slots")
        self.cached_state_slots = PageAllocator(config.num_cached_state_slots, "cached-state slots")
        self.hicache = config.num_host_pages > 0 and self.prefix_caching
        if self.hicache:
            self.radix = HiRadixIndex(
                self.pages,
                self.window_pages,
                self.cached_state_slots,
                PageAllocator(config.num_host_pages, "host pages"),
                PageAllocator(max(1, config.num_host_snapshots), "host snapshots"),
                config.hicache_write_policy,
                config.page_size,
            )
        else:
            self.radix = RadixIndex(
                self.pages, self.window_pages, self.cached_state_slots, config.page_size
            )

    def match(self, req: Request) -> tuple[list[int], RadixNode | None]:
        """Cached prefix for a request about to be admitted: it leaves at least one token to
        compute and ends at a snapshot."""
        if not self.prefix_caching or not req.use_prefix_cache:
            return [], None
        return self.radix.match(req.token_ids, (req.num_tokens - 1) // self.page_size)

    def _missing_windows(self, req: Request, start: int, num_tokens: int) -> list[int]:
        """Window pages a step over [start, start + n) reads or writes and the request lacks."""
        first = max(0, start - self.window_size + 1) // self.window_size
        last = (start + num_tokens - 1) // self.window_size
        return [idx for idx in range(first, last + 1) if idx not in req.window_pages]

    def ensure_free(self, num_pages: int, num_windows: int, num_cached_states: int = 0) -> bool:
        """Evict cached prefixes until the pools have that many free ids; False if impossible."""
        needs = (
            (self.pages, num_pages),
            (self.window_pages, num_windows),
            (self.cached_state_slots, num_cached_states),
        )
        short = [max(0, need - alloc.num_free) for alloc, need in needs]
        if any(short):
            self.radix.evict(*short)
        return all(alloc.num_free >= need for alloc, need in needs)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give the request the pages its next num_tokens tokens touch (all or nothing)."""
        start = req.num_computed_tokens
        num_new_pages = max(0, cdiv(start + num_tokens, self.page_size) - len(req.page_ids))
        window_idxs = self._missing_windows(req, start, num_tokens)
        if not (num_new_pages or window_idxs):
            return True  # a decode's usual step: its page and window pages are there
        if not self.ensure_free(num_new_pages, len(window_idxs)):
            return False
        req.page_ids.extend(self.pages.alloc(num_new_pages))
        new_windows = self.window_pages.alloc(len(window_idxs))
        for idx, page_id in zip(window_idxs, new_windows, strict=True):
            req.window_pages[idx] = page_id
            req.new_windows.append((idx, page_id))
        return True

    def admit(
        self, req: Request, page_ids: list[int], node: RadixNode | None, num_tokens: int
    ) -> bool:
        """Start a waiting request on a prefix hit (page_ids up to node, or none) and give it the
        ids for its first num_tokens tokens; False (nothing taken) when the pools are short.
        Pages of the hit that live only on the host tier are loaded back (req records how many
        tokens came from there)."""
        start = len(page_ids) * self.page_size
        if node is not None:
            self.radix.lock(node)  # before any eviction, so the matched prefix survives
        load_pages, load_snaps = self.radix.missing(node) if self.hicache and node else (0, 0)
        num_new_pages = cdiv(start + num_tokens, self.page_size) - len(page_ids) + load_pages
        num_windows = len(self._missing_windows(req, start, num_tokens)) + load_snaps
        if start:  # the hit's own window page counts as missing until it is resident
            num_windows -= 1
        if self.state_slots.num_free < 1 or not self.ensure_free(
            num_new_pages, num_windows, load_snaps
        ):
            if node is not None:
                self.radix.unlock(node)
            return False
        if self.hicache and node is not None:
            page_ids, num_loaded = self.radix.load_path(node)
            if req.num_cached_tokens is None:  # metrics report the first admission's hit
                req.num_host_cached_tokens = num_loaded
        if node is not None:
            # The hit's window page holds [start - 128, start): read only, nothing writes there.
            req.window_pages[start // self.window_size - 1] = node.snapshot.window_page_id
        self.pages.incref(page_ids)
        self.window_pages.incref(req.window_pages.values())
        req.page_ids, req.node, req.num_computed_tokens = list(page_ids), node, start
        req.state_copy_from = node.snapshot.state_slot if node is not None else -1
        req.state_slot = self.state_slots.alloc(1)[0]
        self.grow(req, num_tokens)  # cannot fail: ensure_free made the ids free
        return True

    def attach_host_ops(self, plan) -> None:
        """Moves the host tier copies queued since the last plan into this plan."""
        if not self.hicache:
            return
        ops = self.radix.pop_ops(plan.step_id)
        plan.host = ops if ops else None

    def has_pending_host_ops(self) -> bool:
        return self.hicache and bool(self.radix.ops)

    def confirm_host_ops(self, step_id: int) -> None:
        if self.hicache:
            self.radix.confirm(step_id)

    def share_boundaries(self, req: Request, start: int) -> tuple[int, ...]:
        """Boundaries other requests are likely to resume from: the last one an identical prompt
        can match, and the one where this request leaves the cached path (a shared system
        prompt). Keeping only the newest snapshot until release would lose both. A request that
        computes every position (use_prefix_cache=False) shares only at release: its pages may
        duplicate a cached prefix, and shared mid-request they would hang under that prefix's
        node, pinned there with it while the request runs (in a full pool it preempted itself,
        was admitted again from 0, and shared again: it never finished)."""
        if not self.prefix_caching or not req.use_prefix_cache:
            return ()
        max_pages = (req.num_tokens - 1) // self.page_size
        prompt_end = (req.prompt_len - 1) // self.page_size * self.page_size
        branch = self.radix.path_depth(req.token_ids, max_pages) * self.page_size
        return tuple(sorted({b for b in (prompt_end, branch) if b > start}))

    def take_snapshot(self, req: Request, boundary: int) -> int | None:
        """Reserve a cached-state slot for the rings at this page boundary and pin the window
        page of [boundary - 128, boundary); None when no slot can be had (no snapshot then)."""
        if not self.prefix_caching or not self.ensure_free(0, 0, 1):
            return None
        slot = self.cached_state_slots.alloc(1)[0]
        window_page_id = req.window_pages[boundary // self.window_size - 1]
        self.window_pages.incref([window_page_id])
        req.pending_snapshot = RequestSnapshot(boundary, window_page_id, slot)
        return slot

    def take_step_snapshots(self, entries, lookahead: list[Request]) -> list[tuple[str, int]]:
        """A cached-state slot for each request whose step entry (req, start, n) ends on a page
        boundary, when one can be had; the stages copy the rings into it after the step. A
        lookahead entry's snapshot waits as the request's later one until the step before
        it is committed."""
        snapshots = []
        for req, start, num_tokens in entries:
            boundary = start + num_tokens
            if boundary % self.page_size or (req in lookahead and req.later_snapshot):
                continue
            pending = req.pending_snapshot
            slot = self.take_snapshot(req, boundary)
            if slot is not None:
                snapshots.append((req.req_id, slot))
                if req in lookahead:
                    req.later_snapshot, req.pending_snapshot = req.pending_snapshot, pending
        return snapshots

    def adopt_later_snapshot(self, req: Request) -> None:
        """The step in flight before a lookahead step was committed: the lookahead's snapshot
        is now the pending one (promoted when that step is committed)."""
        if req.later_snapshot is not None and req.page_ids:  # not released meanwhile
            req.pending_snapshot, req.later_snapshot = req.later_snapshot, None

    def stats(self) -> dict[str, int]:
        """The pools' free, cached and total ids, and host pages in use."""
        return {
            "num_free_pages": self.pages.num_free,
            "num_cached_pages": self.pages.num_cached,
            "num_pages": self.pages.num_pages,
            "num_free_window_pages": self.window_pages.num_free,
            "num_cached_window_pages": self.window_pages.num_cached,
            "num_window_pages": self.window_pages.num_pages,
            "num_host_pages_used": len(self.radix.host_held_ids()[0]) if self.hicache else 0,
        }

    def promote_snapshot(self, req: Request) -> None:
        """The step that took the pending snapshot ran: it becomes the request's only one, or
        goes to the radix index now if its boundary is one to share."""
        if req.pending_snapshot is None:
            return
        self._drop_snapshot(req.snapshot)
        req.snapshot, req.pending_snapshot = req.pending_snapshot, None
        if req.snapshot.boundary in req.share_boundaries:
            self._share_prefix(req)

    def settle_snapshot(self, req: Request) -> None:
        """After a step: its pending snapshot is promoted, unless rejected drafts left its
        boundary past the verified positions (then its ids are given back)."""
        pending = req.pending_snapshot
        if pending is not None and pending.boundary > req.num_computed_tokens:
            self._drop_snapshot(pending)
            req.pending_snapshot = None
        self.promote_snapshot(req)

    def cut_pages(self, req: Request) -> None:
        """Frees the full pages wholly past the request's tokens (only rejected drafts wrote
        there); the stages cut their page tables in the request's next diff."""
        keep = cdiv(req.num_tokens, self.page_size)
        if len(req.page_ids) > keep:
            self.pages.free(req.page_ids[keep:])
            del req.page_ids[keep:]
            req.num_synced_pages = min(req.num_synced_pages, keep)
            req.cut_pages = keep

    def _share_prefix(self, req: Request) -> None:
        """Insert the request's prefix up to its snapshot while it keeps running: the index takes
        references of its own to the pages (the request keeps its own) and adopts the snapshot."""
        snap = req.snapshot
        page_ids = req.page_ids[: snap.boundary // self.page_size]
        self.pages.incref(page_ids)
        result = self.radix.insert(
            req.token_ids[: snap.boundary], page_ids, Snapshot(snap.window_page_id, snap.state_slot)
        )
        self.pages.free(result.unadopted_page_ids)
        if result.snapshot_adopted:
            req.snapshot = None  # the index owns it now

    def _drop_snapshot(self, snap: RequestSnapshot | None) -> None:
        if snap is not None:
            self.window_pages.free([snap.window_page_id])
            self.cached_state_slots.free([snap.state_slot])

    def free_old_windows(self, req: Request) -> None:
        """Free window pages wholly before computed - 128 (a snapshot keeps its own pin)."""
        keep_from = req.num_computed_tokens - self.window_size
        for idx in sorted(req.window_pages):
            if (idx + 1) * self.window_size > keep_from:
                break
            self.window_pages.free([req.window_pages.pop(idx)])
            req.freed_windows.append(idx)

    def release(self, req: Request) -> None:
        """Give back every id the request holds. Its tokens up to the newest committed snapshot
        go into the radix index, which keeps the new pages and the snapshot if it adopts it."""
        free_pages, snap = req.page_ids, req.snapshot
        if snap is not None and self.prefix_caching:
            num_pages = snap.boundary // self.page_size
            result = self.radix.insert(
                req.token_ids[: snap.boundary],
                req.page_ids[:num_pages],
                Snapshot(snap.window_page_id, snap.state_slot),
            )
            free_pages = result.unadopted_page_ids + req.page_ids[num_pages:]
            if result.snapshot_adopted:
                snap = None
        self.pages.free(free_pages)
        self._drop_snapshot(snap)
        self._drop_snapshot(req.pending_snapshot)
        self._drop_snapshot(req.later_snapshot)
        self.window_pages.free(req.window_pages.values())
        if req.state_slot >= 0:
            self.state_slots.free([req.state_slot])
        if req.node is not None:
            self.radix.unlock(req.node)
        req.reset_cache_state()

    def check_integrity(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        """RuntimeError unless each id's refcount equals what its holders account for (running
        requests, their snapshots, the radix index) and every allocator conserves its ids."""
        pages, windows, cached_states = (Counter(ids) for ids in self.radix.held_ids())
        states = Counter()
        for req in running:
            pages.update(req.page_ids)
            windows.update(req.window_pages.values())
            states[req.state_slot] += 1
            for snap in (req.snapshot, req.pending_snapshot, req.later_snapshot):
                if snap is not None:
                    windows[snap.window_page_id] += 1
                    cached_states[snap.state_slot] += 1
        for req in waiting:
            if req.page_ids or req.window_pages or req.state_slot >= 0 or req.snapshot:
                raise RuntimeError(f"waiting request {req.req_id!r} holds ids")
        self.radix.check_integrity()
        for alloc, expected in (
            (self.pages, pages),
            (self.window_pages, windows),
            (self.state_slots, states),
            (self.cached_state_slots, cached_states),
        ):
            alloc.check_integrity()
            for idx in range(alloc.num_pages):
                if alloc.refcount(idx) != expected[idx]:
                    raise RuntimeError(
                        f"{alloc.name}: id {idx} has refcount {alloc.refcount(idx)}, "
                        f"its holders account for {expected[idx]}"
                    )
