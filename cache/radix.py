"""Radix prefix index over full pages (pure Python, no tensors).

One node per full page: the key is the page's tuple of page_size (256) token ids, the value its page
id, so a path from the root spells a page-aligned prefix and lists its page table:

    root -> [t0..t255] page 7 -> [t256..t511] page 3 (snapshot: window page 12, state slot 5)

A node may carry a snapshot, everything a request needs to continue after the node's boundary b
(= depth * page_size) besides the pages: the window page holding positions [b - 128, b) and a
cached-state slot with the C4 compressor rings (main + indexer) as they were at b. A match ends
only at a node with a snapshot (the deepest one on the matched path); nodes without one are path
only. The C128 ring is empty at every page boundary, so it is never kept.

Ownership: the index holds one reference per page id, snapshot window page and cached-state slot
(``PageAllocator.cache_adopt``); eviction drops it (``cache_release``) so ids go back to the
caller's allocators. Requests that use a node lock it and its ancestors (``lock``), which
guarantees parent.lock_ref >= sum of children's lock_ref; only unlocked leaves are evicted, least
recently used first.

Eviction costs O(k log n) for k nodes dropped, not a walk of the whole index: an ``LruHeap``
holds an entry (tick, serial, node) for every eviction candidate (a leaf; see ``_candidate``)
with the node's current tick. Entries go stale when a node is touched again, gains a child or
leaves the index; they are skipped when popped and dropped when the heap is rebuilt at twice the
index's size. A candidate that cannot go yet (locked, or its pages still held by a running
request) is put back after the eviction.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dsv4ray.cache.allocator import PageAllocator

_SERIALS = itertools.count()  # creation order: the LRU's tie-break among nodes of one tick


@dataclass(frozen=True)
class Snapshot:
    """Window page of the last 128 tokens before a boundary, and the C4 rings at the boundary."""

    window_page_id: int
    state_slot: int


class RadixNode:
    """A full page of a cached prefix. depth = number of pages from the root to here inclusive."""

    __slots__ = (
        "key",
        "page_id",
        "parent",
        "children",
        "depth",
        "lock_ref",
        "snapshot",
        "tick",
        "host_page",
        "host_snapshot",
        "hits",
        "serial",
    )

    def __init__(self, key: tuple[int, ...], page_id: int, parent: RadixNode | None) -> None:
        self.key = key
        self.page_id = page_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.depth = 0 if parent is None else parent.depth + 1
        self.lock_ref = 0
        self.snapshot: Snapshot | None = None
        self.tick = 0  # last use, from a counter (deterministic LRU)
        # Host tier (cache/hicache.py): a copy of the page / snapshot in host memory, -1 = none.
        # page_id is -1 while the page lives only on the host.
        self.host_page = -1
        self.host_snapshot = -1
        self.hits = 0
        self.serial = next(_SERIALS)


class InsertResult(NamedTuple):
    """unadopted_page_ids: the caller's references the index did not take (duplicates): free them.
    snapshot_adopted: False when the node already had a snapshot (free the caller's)."""

    unadopted_page_ids: list[int]
    snapshot_adopted: bool


class EvictResult(NamedTuple):
    """Ids that went back to the free lists of the page, window and cached-state allocators."""

    page_ids: list[int]
    window_page_ids: list[int]
    state_slots: list[int]


class LruHeap:
    """Entries (tick, serial, node), least recently used first, for every node of an index that
    candidate(node) accepts, at its current tick (see the module doc)."""

    def __init__(self, candidate: Callable[[RadixNode], bool]) -> None:
        self.candidate = candidate
        self.entries: list[tuple[int, int, RadixNode]] = []

    def offer(self, node: RadixNode) -> None:
        if self.candidate(node):
            heapq.heappush(self.entries, (node.tick, node.serial, node))

    def rebuild(self, nodes: Iterator[RadixNode]) -> None:
        self.entries = [(n.tick, n.serial, n) for n in nodes if self.candidate(n)]
        heapq.heapify(self.entries)

    def current(self, tick: int, node: RadixNode) -> bool:
        """Whether an entry still stands for a candidate in the index at that tick."""
        parent = node.parent
        return (
            node.tick == tick
            and parent is not None
            and parent.children.get(node.key) is node
            and self.candidate(node)
        )

    def drop_lru(self, evictable, drop, more: Callable[[], bool]) -> None:
        """drop(node) for evictable candidates, least recently used first, while more(); a
        drop offers what it makes a candidate (a parent whose last child went)."""
        waiting: dict[int, tuple[int, int, RadixNode]] = {}  # candidates that cannot go yet
        while self.entries and more():
            entry = heapq.heappop(self.entries)
            tick, serial, node = entry
            if not self.current(tick, node):
                continue
            if evictable(node):
                drop(node)
            else:
                waiting[serial] = entry
        for entry in waiting.values():
            heapq.heappush(self.entries, entry)

    def missing(self, nodes: list[RadixNode]) -> bool:
        """Whether a candidate among nodes has no current entry."""
        entered = {n.serial for tick, _, n in self.entries if self.current(tick, n)}
        return any(self.candidate(n) and n.serial not in entered for n in nodes)


class RadixIndex:
    """Page-granular prefix index with snapshots, locks and LRU eviction of unlocked leaves."""

    def __init__(
        self,
        page_alloc: PageAllocator,
        window_alloc: PageAllocator,
        state_alloc: PageAllocator,
        page_size: int = 256,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        # The allocators are shared with the scheduler's KV manager; the index adopts pages into
        # them and releases pages back, and the host-tier subclass does the same.
        self.page_alloc, self.window_alloc, self.state_alloc = page_alloc, window_alloc, state_alloc
        self._root = RadixNode((), -1, None)
        self._clock = itertools.count(1)
        self._num_nodes = 0
        self._lru = LruHeap(self._candidate)  # device eviction's candidates (module doc)
        self._heaps = [self._lru]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def _touch(self, path: Sequence[RadixNode]) -> None:
        """Marks a path from the root as just used; entries for its candidates at the new tick
        (a node whose child on the path keeps it from being one is passed over: long paths)."""
        tick = next(self._clock)
        for node in path:
            node.tick = tick
        for node, below in zip(path, [*path[1:], None]):
            if below is None or not self._keeps_parent(below):
                self._offer(node)

    def _keeps_parent(self, child: RadixNode) -> bool:
        """Whether a child alone keeps its parent from being an eviction candidate."""
        return True

    def _candidate(self, node: RadixNode) -> bool:
        """Whether the node is evicted when nothing else keeps it: a leaf."""
        return not node.children

    def _offer(self, node: RadixNode) -> None:
        """Entries for the node at its current tick where it is a candidate."""
        if node is self._root:
            return
        for heap in self._heaps:
            heap.offer(node)
            if len(heap.entries) > 2 * self._num_nodes + 64:
                heap.rebuild(self._iter_nodes())

    def _keys(self, token_ids: Sequence[int], num_pages: int) -> Iterator[tuple[int, ...]]:
        size = self.page_size
        for page_idx in range(num_pages):
            yield tuple(token_ids[page_idx * size : (page_idx + 1) * size])

    def _walk(self, token_ids: Sequence[int], max_pages: int) -> list[RadixNode]:
        """Nodes of the longest cached path spelling token_ids, at most max_pages deep."""
        path, node = [], self._root
        for key in self._keys(token_ids, min(max_pages, len(token_ids) // self.page_size)):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, token_ids: Sequence[int], max_pages: int) -> tuple[list[int], RadixNode | None]:
        """Longest cached prefix of at most max_pages full pages that ends at a snapshot.

        Returns (its page ids, its last node) or ([], None). The caller locks the node to use it.
        """
        path = self._walk(token_ids, max_pages)
        while path and path[-1].snapshot is None:
            path.pop()
        if not path:
            return [], None
        self._touch(path)
        return [n.page_id for n in path], path[-1]

    def path_depth(self, token_ids: Sequence[int], max_pages: int) -> int:
        """Full pages of token_ids already in the index, snapshot or not (no LRU update)."""
        return len(self._walk(token_ids, max_pages))

    def lock(self, node: RadixNode) -> None:
        """Protect the node and its ancestors from eviction (one lock per using request)."""
        while node is not self._root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self._root:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of an unlocked radix node (page {node.page_id})")
            node.lock_ref -= 1
            node = node.parent

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], snapshot: Snapshot | None
    ) -> InsertResult:
        """Cache the prefix token_ids (len = len(page_ids) * page_size) with its pages.

        The caller passes one reference per page id (and per snapshot id); the index keeps those
        of new nodes and returns the rest. The snapshot goes to the last node if it has none.
        """
        if len(token_ids) != len(page_ids) * self.page_size:
            raise ValueError(
                f"insert needs {len(page_ids)} * {self.page_size} tokens, got {len(token_ids)}"
            )
        if not page_ids:
            return InsertResult([], False)
        unadopted, node, path = [], self._root, []
        for key, page_id in zip(self._keys(token_ids, len(page_ids)), page_ids, strict=True):
            child = node.children.get(key)
            if child is None:
                self.page_alloc.cache_adopt([page_id])
                child = RadixNode(key, page_id, node)
                node.children[key] = child
                self._num_nodes += 1
            elif child.page_id < 0:  # only on the host tier: the device copy comes back
                self.page_alloc.cache_adopt([page_id])
                child.page_id = page_id
            else:
                unadopted.append(page_id)
            node = child
            path.append(node)
        self._touch(path)
        if snapshot is None or node.snapshot is not None:
            return InsertResult(unadopted, False)
        self.window_alloc.cache_adopt([snapshot.window_page_id])
        self.state_alloc.cache_adopt([snapshot.state_slot])
        node.snapshot = snapshot
        return InsertResult(unadopted, True)

    def evict(
        self, num_pages: int = 0, num_window_pages: int = 0, num_state_slots: int = 0
    ) -> EvictResult:
        """Evict unlocked leaves, least recently used first, until at least the requested
        numbers of ids went back to the free lists (or nothing evictable is left); then, if the
        window or cached-state pool is still short, spare snapshots (``_drop_snapshots``)."""
        return self._evict_lru(
            self._evictable, self._remove_leaf, num_pages, num_window_pages, num_state_slots
        )

    def _drop_snapshots(self, result: EvictResult, num_window_pages: int,
                        num_state_slots: int) -> None:  # fmt: skip
        """Snapshots no request uses, least recently used first, until the window and cached-
        state pools got what was asked; their nodes stay, as path to deeper snapshots. Those
        of a locked path are reclaimed this way: a request alone with a long cached path
        would otherwise hold them while its next chunk waits for their window pages."""

        def short() -> bool:
            return (len(result.window_page_ids) < num_window_pages
                    or len(result.state_slots) < num_state_slots)  # fmt: skip

        # a spare snapshot's ids are held by the index alone: with none such in a short pool,
        # there is nothing to walk the index for
        windows_short = len(result.window_page_ids) < num_window_pages
        states_short = len(result.state_slots) < num_state_slots
        if not (windows_short and self.window_alloc.num_cached) and not (
            states_short and self.state_alloc.num_cached
        ):
            return
        spare = [n for n in self._iter_nodes() if self._spare_snapshot(n)]
        for node in sorted(spare, key=lambda n: (n.tick, n.serial)):
            if not short():
                return
            self._release_snapshot(node, result)

    def _spare_snapshot(self, node: RadixNode) -> bool:
        """Whether the node's snapshot can go: no request's match ends at the node (a lock
        there beyond its children's) and nothing but the index holds its ids."""
        snap = node.snapshot
        return (
            snap is not None
            and node.lock_ref == sum(c.lock_ref for c in node.children.values())
            and self.window_alloc.refcount(snap.window_page_id) == 1
            and self.state_alloc.refcount(snap.state_slot) == 1
        )

    def _release_snapshot(self, node: RadixNode, result: EvictResult) -> None:
        if node.snapshot is not None:
            result.window_page_ids.extend(
                self.window_alloc.cache_release([node.snapshot.window_page_id])
            )
            result.state_slots.extend(self.state_alloc.cache_release([node.snapshot.state_slot]))
            node.snapshot = None

    def _evict_lru(
        self, evictable, drop, num_pages: int, num_window_pages: int, num_state_slots: int
    ) -> EvictResult:
        """Drops evictable candidates least recently used first until the requested numbers of
        ids went back, or none is left; then spare snapshots while a window or cached-state
        pool is still short (``_drop_snapshots``)."""
        result = EvictResult([], [], [])
        wanted = (num_pages, num_window_pages, num_state_slots)
        self._lru.drop_lru(
            evictable,
            lambda node: drop(node, result),
            lambda: any(len(got) < n for got, n in zip(result, wanted, strict=True)),
        )
        self._drop_snapshots(result, num_window_pages, num_state_slots)
        return result

    def _evictable(self, node: RadixNode) -> bool:
        return (
            node is not self._root
            and not node.children
            and node.lock_ref == 0
            and self._only_cached(node)
        )

    def _only_cached(self, node: RadixNode) -> bool:
        """Whether the index holds the only reference to the node's device ids, so that dropping
        it frees them. A running request that inserted its own prefix still holds those pages
        (unlocked: it matched nothing): dropping the node would free nothing and lose the prefix
        the request needs back if it is preempted."""
        if node.page_id >= 0 and self.page_alloc.refcount(node.page_id) > 1:
            return False
        snap = node.snapshot
        return snap is None or (
            self.window_alloc.refcount(snap.window_page_id) == 1
            and self.state_alloc.refcount(snap.state_slot) == 1
        )

    def _remove_leaf(self, node: RadixNode, result: EvictResult) -> None:
        del node.parent.children[node.key]
        self._num_nodes -= 1
        self._offer(node.parent)
        if node.page_id >= 0:
            result.page_ids.extend(self.page_alloc.cache_release([node.page_id]))
        self._release_snapshot(node, result)

    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def held_ids(self) -> tuple[list[int], list[int], list[int]]:
        """(page ids, snapshot window page ids, cached-state slots) the index holds."""
        pages, windows, states = [], [], []
        for node in self._iter_nodes():
            if node.page_id >= 0:
                pages.append(node.page_id)
            if node.snapshot is not None:
                windows.append(node.snapshot.window_page_id)
                states.append(node.snapshot.state_slot)
        return pages, windows, states

    def check_integrity(self) -> None:
        """RuntimeError unless node counts, lock counts and cache ownership are consistent."""
        nodes = list(self._iter_nodes())
        if len(nodes) != self._num_nodes:
            raise RuntimeError(
                f"radix: {len(nodes)} nodes reachable, counter says {self._num_nodes}"
            )
        for node in nodes:
            if node.lock_ref < sum(child.lock_ref for child in node.children.values()):
                raise RuntimeError(f"radix: node of page {node.page_id} locked less than children")
            if node.page_id < 0 and node.host_page < 0:
                raise RuntimeError("radix: a node with neither a device nor a host page")
            if len(node.key) != self.page_size or node.depth != node.parent.depth + 1:
                raise RuntimeError(f"radix: malformed node of page {node.page_id}")
        if any(heap.missing(nodes) for heap in self._heaps):
            raise RuntimeError("radix: an eviction candidate has no entry in its LRU heap")
        pages, windows, states = self.held_ids()
        for alloc, ids in (
            (self.page_alloc, pages),
            (self.window_alloc, windows),
            (self.state_alloc, states),
        ):
            if len(set(ids)) != len(ids):
                raise RuntimeError(f"radix: an id of {alloc.name} is held twice")
            if not all(alloc.is_cache_held(idx) for idx in ids):
                raise RuntimeError(f"radix: an id of {alloc.name} is held but not marked cached")
