"""Hierarchical prefix cache: the radix index with host-tier residency (pure Python).

A node's page and snapshot may live on the device (``page_id``, ``snapshot``), in host memory
(``host_page``, ``host_snapshot``), or both. Host ids index the host tier's pages, which mirror
device pages byte for byte for every pool kind of every stage (the same host id names the page
in each stage's host region, as device page ids do on the device):

    device page p (C4 / indexer / C128 rows of 256 tokens)  <->  host page h
    device snapshot (window page w, cached-state slot s)    <->  host snapshot slot hs

Write policies decide when a device page is copied to the host:
    write_through            when the node enters the index (default)
    write_through_selective  when the node has been hit twice
    write_back               when the device copy is evicted

Device eviction drops the device copy of unlocked nodes with no device-resident child, least
recently used first; a node with a host copy stays in the index (host only, its snapshot backed
up then if the host held none) and a later match loads it back. Host eviction takes snapshots of
device-resident nodes first, then removes host-only leaves, then host pages of resident nodes.
Copies are not performed here: they are queued as ``HostOps`` for the next StepPlan, and the
stages run backups before loads before the step's compute.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from dsv4ray.cache.allocator import PageAllocator
from dsv4ray.cache.radix import (
    EvictResult,
    InsertResult,
    LruHeap,
    RadixIndex,
    RadixNode,
    Snapshot,
)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class HostOps:
    """Copies the stages perform at the start of a step, in this order."""

    backups: list[tuple[int, int]] = field(default_factory=list)  # (device page, host page)
    snapshot_backups: list[tuple[int, int, int]] = field(default_factory=list)  # (w, s, hs)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host page, device page)
    snapshot_loads: list[tuple[int, int, int]] = field(default_factory=list)  # (hs, w, s)

    def __bool__(self) -> bool:
        return bool(self.backups or self.snapshot_backups or self.loads or self.snapshot_loads)


class HiRadixIndex(RadixIndex):
    def __init__(
        self,
        page_alloc: PageAllocator,
        window_alloc: PageAllocator,
        state_alloc: PageAllocator,
        host_pages: PageAllocator,
        host_snapshots: PageAllocator,
        policy: str = "write_through",
        page_size: int = 256,
    ) -> None:
        if policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache write policy must be one of {WRITE_POLICIES}, got {policy!r}"
            )
        super().__init__(page_alloc, window_alloc, state_alloc, page_size)
        self._host_lru = LruHeap(self._host_candidate)  # host-only leaves (``evict_host``)
        self._heaps.append(self._host_lru)
        self.host_pages, self.host_snapshots, self.policy = host_pages, host_snapshots, policy
        self.ops = HostOps()
        self.enabled = True
        # host ids whose backup rides in a plan not yet committed: valid only after the commit
        self._unconfirmed: dict[int, tuple[list[int], list[int]]] = {}

    def pop_ops(self, step_id: int) -> HostOps:
        """The queued copies, for the plan of step_id (whose commit confirms the backups)."""
        ops, self.ops = self.ops, HostOps()
        if ops.backups or ops.snapshot_backups:
            self._unconfirmed[step_id] = (
                [h for _, h in ops.backups],
                [hs for _, _, hs in ops.snapshot_backups],
            )
        return ops

    def confirm(self, step_id: int) -> None:
        """The plan of step_id ran, and with it every earlier one (stages run plans in order;
        one whose commit never came was abandoned by an interrupted caller)."""
        for done in [s for s in self._unconfirmed if s <= step_id]:
            del self._unconfirmed[done]

    # ------------------------------------------------------------------ matching and loading
    def match(self, token_ids, max_pages: int) -> tuple[list[int], RadixNode | None]:
        """Like RadixIndex.match, but a page or snapshot on the host counts: ``load_path``
        brings it back once the caller has locked the node. Host-only pages show as -1."""
        path = self._walk(token_ids, max_pages)
        while path and path[-1].snapshot is None and path[-1].host_snapshot < 0:
            path.pop()
        if not path:
            return [], None
        self._touch(path)
        self.lock(path[-1])  # a backup may evict host copies: never those of this path
        for node in path:
            node.hits += 1
            if self.policy == "write_through_selective" and node.hits >= 2:
                self._backup(node)
        self.unlock(path[-1])
        return [n.page_id for n in path], path[-1]

    def missing(self, node: RadixNode) -> tuple[int, int]:
        """(device pages, snapshots) that loading the path to node needs."""
        pages = sum(1 for n in self._path(node) if n.page_id < 0)
        return pages, int(node.snapshot is None)

    def load_path(self, node: RadixNode) -> tuple[list[int], int]:
        """Gives host-only nodes on the (locked) path device ids and queues the loads; the
        caller made sure the allocators have them. Returns (page ids, tokens loaded)."""
        path = self._path(node)
        loaded = 0
        for n in path:
            if n.page_id < 0:
                n.page_id = self.page_alloc.alloc(1)[0]
                self.page_alloc.cache_adopt([n.page_id])
                self.ops.loads.append((n.host_page, n.page_id))
                loaded += self.page_size
                self._offer(n)  # resident again: a candidate once its path is unlocked
        if node.snapshot is None:
            window, slot = self.window_alloc.alloc(1)[0], self.state_alloc.alloc(1)[0]
            self.window_alloc.cache_adopt([window])
            self.state_alloc.cache_adopt([slot])
            node.snapshot = Snapshot(window, slot)
            self.ops.snapshot_loads.append((node.host_snapshot, window, slot))
        return [n.page_id for n in path], loaded

    def _path(self, node: RadixNode) -> list[RadixNode]:
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        return path[::-1]

    # ------------------------------------------------------------------ backups
    def insert(self, token_ids, page_ids, snapshot: Snapshot | None) -> InsertResult:
        result = super().insert(token_ids, page_ids, snapshot)
        if self.policy == "write_through" and page_ids:
            for node in self._walk(token_ids, len(page_ids)):
                self._backup(node)
        return result

    def _backup(self, node: RadixNode, leaving: bool = False) -> bool:
        """Queues a device -> host copy of the node's page and snapshot; False if no room.
        leaving: the node's device copy is being evicted. A node that stays on the device takes
        a host snapshot only from other resident nodes, never from a host-only prefix (host
        snapshots are few; a resident one can be remade when its node leaves the device)."""
        if not self.enabled or node.page_id < 0:
            return False
        if node.host_page < 0:
            host = self._alloc_host(self.host_pages)
            if host is None:
                return False
            node.host_page = host
            self.ops.backups.append((node.page_id, host))
        if node.snapshot is not None and node.host_snapshot < 0:
            host_snap = self._alloc_host(self.host_snapshots, keep_host_only=not leaving)
            if host_snap is not None:
                node.host_snapshot = host_snap
                snap = node.snapshot
                self.ops.snapshot_backups.append((snap.window_page_id, snap.state_slot, host_snap))
        return True

    def _alloc_host(self, alloc: PageAllocator, keep_host_only: bool = False) -> int | None:
        if alloc.num_free == 0:
            self.evict_host(
                1 if alloc is self.host_pages else 0,
                1 if alloc is self.host_snapshots else 0,
                keep_host_only,
            )
        ids = alloc.alloc(1)
        return None if ids is None else ids[0]

    # ------------------------------------------------------------------ eviction
    def evict(
        self, num_pages: int = 0, num_window_pages: int = 0, num_state_slots: int = 0
    ) -> EvictResult:
        """Drops device copies (LRU, unlocked, no device-resident child) until enough ids are
        free. Nodes with a host copy (made now under write_back) stay, host only."""
        return self._evict_lru(
            self._device_evictable,
            self._evict_device,
            num_pages,
            num_window_pages,
            num_state_slots,
        )

    def _evict_device(self, node: RadixNode, result: EvictResult) -> None:
        """A node leaving the device keeps a host copy: all of it under write_back, and under
        the write-through policies the snapshot its host page lacks (host snapshots are fewer
        than host pages, so resident nodes give theirs up first: ``evict_host``)."""
        if self.policy == "write_back" or node.host_page >= 0:
            self._backup(node, leaving=True)
        self._drop_device(node, result)

    def _device_evictable(self, node: RadixNode) -> bool:
        return node.lock_ref == 0 and self._candidate(node) and self._only_cached(node)

    def _keeps_parent(self, child: RadixNode) -> bool:
        return child.page_id >= 0  # a host-only child leaves its device copy evictable

    def _candidate(self, node: RadixNode) -> bool:
        """A device-resident node none of whose children is: its device copy can go."""
        return node.page_id >= 0 and not any(c.page_id >= 0 for c in node.children.values())

    def _drop_device(self, node: RadixNode, result: EvictResult) -> None:
        if node.host_page < 0:  # nothing left to serve it from: remove it and its subtree
            self._remove_subtree(node, result)
            return
        result.page_ids.extend(self.page_alloc.cache_release([node.page_id]))
        node.page_id = -1
        self._offer(node)  # host only now: a leaf is a candidate of ``evict_host``
        self._offer(node.parent)  # its last device-resident child may have gone
        self._release_snapshot(node, result)

    def _remove_subtree(self, node: RadixNode, result: EvictResult) -> None:
        for child in list(node.children.values()):
            self._remove_subtree(child, result)
        self._free_host(node)
        self._release_snapshot(node, result)
        self._remove_leaf(node, result)

    def _free_host(self, node: RadixNode) -> None:
        if node.host_page >= 0:
            self.host_pages.free([node.host_page])
            node.host_page = -1
        if node.host_snapshot >= 0:
            self.host_snapshots.free([node.host_snapshot])
            node.host_snapshot = -1

    def evict_host(self, num_pages: int = 0, num_snapshots: int = 0,
                   keep_host_only: bool = False) -> None:  # fmt: skip
        """Frees host ids. Snapshots come first from device-resident nodes (a node's snapshot is
        backed up again when its device copy is evicted), then host-only leaves go (least
        recently used first; none with keep_host_only), then device-resident nodes give up
        their host pages."""

        def enough() -> bool:
            return (
                self.host_pages.num_free >= num_pages
                and self.host_snapshots.num_free >= num_snapshots
            )

        if self.host_snapshots.num_free < num_snapshots:
            self._free_resident(enough, pages=False)
        if keep_host_only:
            return
        self._host_lru.drop_lru(
            self._host_evictable,
            lambda node: self._remove_subtree(node, EvictResult([], [], [])),
            lambda: not enough(),
        )
        self._free_resident(enough, pages=True)

    def _free_resident(self, enough, pages: bool) -> None:
        """Host copies of unlocked device-resident nodes, least recently used first, until
        enough(): their snapshots only, or with pages their pages and snapshots. A host id read
        by a load queued for this plan is never freed (a backup running before that load in
        the same plan would rewrite it)."""
        if enough():
            return
        loading = {h for h, _ in self.ops.loads}
        loading_snaps = {hs for hs, _, _ in self.ops.snapshot_loads}
        # the nodes with something to free, in a heap: a call that needs few ids pops few of
        # them instead of sorting the whole tree (ties keep the tree's order, as a sort would)
        heap = [
            (node.tick, i, node)
            for i, node in enumerate(self._iter_nodes())
            if node.page_id >= 0
            and node.lock_ref == 0  # a matched path may be about to load from its copies
            and node.host_page not in loading
            and node.host_snapshot not in loading_snaps
            and (node.host_snapshot >= 0 or (pages and node.host_page >= 0))
        ]
        heapq.heapify(heap)
        while heap and not enough():
            node = heapq.heappop(heap)[2]
            if pages:
                self._free_host(node)
            else:
                self.host_snapshots.free([node.host_snapshot])
                node.host_snapshot = -1

    def _host_evictable(self, node: RadixNode) -> bool:
        """A host-only leaf nobody uses (a locked node is on some request's matched path)."""
        return node.lock_ref == 0 and self._host_candidate(node)

    def _host_candidate(self, node: RadixNode) -> bool:
        return node.page_id < 0 and not node.children

    # ------------------------------------------------------------------ failures
    def drop_device_residency(self) -> None:
        """A stage restarted with empty pools: keep only what the host tier holds for sure.
        Every request was released first, so nothing is locked. Backups queued or in flight
        may never have run: their host copies are forgotten."""
        pages = {h for p, _ in self._unconfirmed.values() for h in p}
        pages |= {h for _, h in self.ops.backups}
        snaps = {h for _, s in self._unconfirmed.values() for h in s}
        snaps |= {hs for _, _, hs in self.ops.snapshot_backups}
        self._unconfirmed.clear()
        for node in self._iter_nodes():
            if node.host_page in pages:
                self.host_pages.free([node.host_page])
                node.host_page = -1
            if node.host_snapshot in snaps:
                self.host_snapshots.free([node.host_snapshot])
                node.host_snapshot = -1
        result = EvictResult([], [], [])
        for node in sorted(self._iter_nodes(), key=lambda n: -n.depth):
            if node.parent is None or node.key not in node.parent.children:
                continue  # removed with an ancestor's subtree
            if node.page_id >= 0:
                self._drop_device(node, result)
        self.ops = HostOps()

    def drop_host_residency(self) -> None:
        """The host tier is gone: forget host copies and stop making new ones."""
        result = EvictResult([], [], [])
        for node in sorted(self._iter_nodes(), key=lambda n: n.depth):
            if node.key not in node.parent.children:
                continue
            if node.page_id < 0:
                self._remove_subtree(node, result)
            else:
                self._free_host(node)
        self.ops = HostOps()
        self._unconfirmed.clear()
        self.enabled = False

    # ------------------------------------------------------------------ checks
    def host_held_ids(self) -> tuple[list[int], list[int]]:
        pages = [n.host_page for n in self._iter_nodes() if n.host_page >= 0]
        snaps = [n.host_snapshot for n in self._iter_nodes() if n.host_snapshot >= 0]
        return pages, snaps

    def check_integrity(self) -> None:
        super().check_integrity()
        pages, snaps = self.host_held_ids()
        for alloc, ids in ((self.host_pages, pages), (self.host_snapshots, snaps)):
            alloc.check_integrity()
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"hicache: an id of {alloc.name} is held twice")
            if alloc.num_in_use + alloc.num_cached != len(ids):
                raise RuntimeError(
                    f"hicache: {alloc.name} has {alloc.num_in_use} ids in use, the index holds "
                    f"{len(ids)}"
                )
        for node in self._iter_nodes():
            if node.lock_ref and node.page_id < 0:
                raise RuntimeError("hicache: a locked node has no device page")
