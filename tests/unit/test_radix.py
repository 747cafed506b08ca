"""Radix prefix index: page-granular matches ending at snapshots, locks, LRU eviction, ownership."""

import copy
import heapq
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ray.cache.allocator import PageAllocator
from dsv4ray.cache.radix import EvictResult, RadixIndex, Snapshot

PAGE = 4


def make_index(num_pages=16, num_windows=16, num_states=8):
    pages = PageAllocator(num_pages, "pages")
    windows = PageAllocator(num_windows, "window pages")
    states = PageAllocator(num_states, "cached-state slots")
    return RadixIndex(pages, windows, states, page_size=PAGE), pages, windows, states


def cache_prefix(index, pages, windows, states, tokens, with_snapshot=True):
    """Allocate ids as a finished request would hold them and insert the prefix."""
    page_ids = pages.alloc(len(tokens) // PAGE)
    snap = Snapshot(windows.alloc(1)[0], states.alloc(1)[0]) if with_snapshot else None
    result = index.insert(tokens, page_ids, snap)
    pages.free(result.unadopted_page_ids)
    if snap is not None and not result.snapshot_adopted:
        windows.free([snap.window_page_id])
        states.free([snap.state_slot])
    return page_ids, snap, result


def test_match_returns_the_pages_up_to_a_snapshot():
    index, pages, windows, states = make_index()
    tokens = list(range(12))
    page_ids, snap, _ = cache_prefix(index, pages, windows, states, tokens)
    matched, node = index.match(tokens + [99], max_pages=3)
    assert matched == page_ids and node.snapshot == snap and node.depth == 3
    # a match may not end at a node without a snapshot
    assert index.match(tokens, max_pages=2) == ([], None)
    assert index.match([7] + tokens[1:], max_pages=3) == ([], None)


def test_match_ends_at_the_deepest_snapshot_on_the_path():
    index, pages, windows, states = make_index()
    tokens = list(range(16))
    page_ids, _, _ = cache_prefix(index, pages, windows, states, tokens)
    _, short_snap, result = cache_prefix(index, pages, windows, states, tokens[:4])
    assert result.snapshot_adopted and len(result.unadopted_page_ids) == 1
    query = tokens[:8] + [50, 51, 52, 53]  # diverges inside page 2
    matched, node = index.match(query, max_pages=3)
    assert matched == page_ids[:1] and node.snapshot == short_snap


def test_insert_dedupes_pages_and_keeps_the_first_snapshot():
    index, pages, windows, states = make_index()
    tokens = list(range(8))
    first_ids, first_snap, _ = cache_prefix(index, pages, windows, states, tokens)
    free_before = pages.num_free
    second_ids = pages.alloc(2)
    second_snap = Snapshot(windows.alloc(1)[0], states.alloc(1)[0])
    result = index.insert(tokens, second_ids, second_snap)
    assert result.unadopted_page_ids == second_ids and not result.snapshot_adopted
    pages.free(result.unadopted_page_ids)
    assert pages.num_free == free_before
    matched, node = index.match(tokens + [0], 2)
    assert matched == first_ids and node.snapshot == first_snap


def test_insert_length_must_be_whole_pages():
    index, pages, *_ = make_index()
    with pytest.raises(ValueError, match="tokens"):
        index.insert(list(range(6)), pages.alloc(2), None)


def test_evict_frees_lru_unlocked_leaves_and_their_snapshots():
    index, pages, windows, states = make_index()
    a_ids, a_snap, _ = cache_prefix(index, pages, windows, states, [1] * 8)
    b_ids, b_snap, _ = cache_prefix(index, pages, windows, states, [2] * 8)
    index.match([1] * 9, 2)  # a is now the most recently used
    result = index.evict(num_pages=1)
    assert result.page_ids == [b_ids[1]]
    assert result.window_page_ids == [b_snap.window_page_id]
    assert result.state_slots == [b_snap.state_slot]
    assert index.match([2] * 9, 2) == ([], None)
    assert index.match([1] * 9, 2)[0] == a_ids
    for alloc in (pages, windows, states):
        alloc.check_integrity()


def test_locked_prefixes_survive_eviction():
    index, pages, windows, states = make_index()
    cache_prefix(index, pages, windows, states, [3] * 8)
    _, node = index.match([3] * 9, 2)
    index.lock(node)
    assert index.evict(num_pages=10).page_ids == []
    index.unlock(node)
    assert len(index.evict(num_pages=10).page_ids) == 2
    assert index.num_nodes == 0 and pages.num_free == pages.num_pages
    with pytest.raises(ValueError, match="unlock"):
        index.unlock(node)


def test_a_prefix_a_running_request_still_holds_is_not_evicted_for_nothing():
    # a request inserts its own prefix while it runs (it matched nothing, so nothing is locked)
    # and keeps its references: dropping those nodes frees no id, and the request, if it is
    # preempted next, would find its prefix gone and compute it again
    index, pages, windows, states = make_index()
    held = pages.alloc(2)
    snap = Snapshot(windows.alloc(1)[0], states.alloc(1)[0])
    pages.incref(held)  # the index adopts one reference of each; the request keeps its own
    windows.incref([snap.window_page_id])
    states.incref([snap.state_slot])
    index.insert([4] * 8, held, snap)
    cached_ids, _, _ = cache_prefix(index, pages, windows, states, [6] * 8)
    result = index.evict(num_pages=4)
    assert sorted(result.page_ids) == sorted(cached_ids)  # only what eviction really frees
    assert index.match([4] * 9, 2)[0] == held
    pages.free(held)  # the request is preempted: its pages stay cached for its return
    windows.free([snap.window_page_id])
    states.free([snap.state_slot])
    assert index.match([4] * 9, 2)[0] == held and pages.num_cached == 2
    assert sorted(index.evict(num_pages=2).page_ids) == sorted(held)
    for alloc in (pages, windows, states):
        alloc.check_integrity()


def test_leaves_without_snapshot_are_evictable():
    index, pages, windows, states = make_index()
    cache_prefix(index, pages, windows, states, [5] * 8, with_snapshot=False)
    assert index.match([5] * 9, 2) == ([], None)  # path only: no match
    assert sorted(index.evict(num_pages=2).page_ids) == [0, 1]


def test_lock_on_a_child_keeps_its_ancestors():
    index, pages, windows, states = make_index()
    tokens = list(range(12))
    cache_prefix(index, pages, windows, states, tokens)
    _, node = index.match(tokens + [0], 3)
    index.lock(node)
    assert index.evict(num_pages=3).page_ids == []
    index.check_integrity()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "use", "done", "evict"]),
        st.lists(st.integers(0, 1), min_size=PAGE, max_size=4 * PAGE),
        st.integers(0, 6),
        st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(ops=_ops)
def test_random_operations_conserve_every_allocator(ops):
    """Requests insert prefixes (with or without snapshot), use matches (lock + one reference per
    page), finish with them, and the index evicts; every id stays accounted for."""
    index, pages, windows, states = make_index(num_pages=12, num_windows=6, num_states=6)
    users = []  # (node, page ids) of matches in use
    for op, tokens, num, flag in ops:
        tokens = tokens[: len(tokens) // PAGE * PAGE]
        if op == "insert" and len(tokens) // PAGE <= pages.num_free:
            snapshot = flag and windows.num_free > 0 and states.num_free > 0
            cache_prefix(index, pages, windows, states, tokens, snapshot)
        elif op == "use":
            matched, node = index.match(tokens, max_pages=num)
            assert len(matched) <= num
            if node is not None:
                assert node.snapshot is not None and node.depth == len(matched)
                index.lock(node)
                pages.incref(matched)
                users.append((node, matched))
        elif op == "done" and users:
            node, matched = users.pop(num % len(users))
            pages.decref(matched)
            index.unlock(node)
        elif op == "evict":
            twin = copy.deepcopy(index)
            want = (num, int(flag), int(flag))
            expected = scan_evict(twin, twin._evictable, twin._remove_leaf, want)
            assert index.evict(*want) == expected
        _check(index, pages, windows, states, users)


def scan_evict(index, evictable, drop, want) -> EvictResult:
    """Eviction by its definition, over every node of the index: evictable nodes least
    recently used first (ties in creation order), a parent joining once its last child went,
    until want = (pages, window pages, state slots) went back."""
    heap = [(n.tick, n.serial, n) for n in index._iter_nodes() if evictable(n)]
    heapq.heapify(heap)
    result = EvictResult([], [], [])
    while heap and any(len(got) < n for got, n in zip(result, want)):
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        drop(node, result)
        if evictable(parent):
            heapq.heappush(heap, (parent.tick, parent.serial, parent))
    # then snapshots no request uses, least recently used first, while windows or slots lack
    for node in sorted(index._iter_nodes(), key=lambda n: (n.tick, n.serial)):
        if all(len(got) >= n for got, n in list(zip(result, want))[1:]):
            break
        snap = node.snapshot
        ends_a_match = node.lock_ref > sum(c.lock_ref for c in node.children.values())
        if snap is None or ends_a_match:
            continue
        if index.window_alloc.refcount(snap.window_page_id) == 1:
            if index.state_alloc.refcount(snap.state_slot) == 1:
                result.window_page_ids.extend(
                    index.window_alloc.cache_release([snap.window_page_id])
                )
                result.state_slots.extend(index.state_alloc.cache_release([snap.state_slot]))
                node.snapshot = None
    return result


def test_a_locked_path_gives_up_the_snapshots_no_match_ends_at():
    """A request that matched the end of a long cached path locks it, but it needs only the
    snapshot it matched: the window pages and cached-state slots of the snapshots before it
    go back when those pools are short, and the path still leads to the match."""
    index, pages, windows, states = make_index()
    tokens = list(range(4 * PAGE))
    for depth in (1, 2, 3):  # a conversation growing page by page: a snapshot at each end
        cache_prefix(index, pages, windows, states, tokens[: depth * PAGE])
    matched, node = index.match(tokens + [0], 3)
    index.lock(node)
    got = index.evict(num_window_pages=3, num_state_slots=3)
    assert (len(got.window_page_ids), len(got.state_slots), got.page_ids) == (2, 2, [])
    assert node.snapshot is not None and index.match(tokens + [0], 3) == (matched, node)
    assert index.match(tokens[: 2 * PAGE] + [0], 2) == ([], None)  # no snapshot to end at
    index.unlock(node)
    index.check_integrity()


def test_eviction_does_not_walk_the_whole_index():
    """Evicting a page from an index of 16,000 cached pages pops candidates from the LRU heap:
    it never visits every node (which took milliseconds a page at this size)."""
    index, pages, windows, states = make_index(16000, 2000, 2000)
    rng = random.Random(0)
    for _ in range(2000):
        cache_prefix(index, pages, windows, states, [rng.randrange(50) for _ in range(8 * PAGE)])

    def walk():
        raise AssertionError("eviction walked the whole index")

    index._iter_nodes = walk
    for _ in range(100):
        assert len(index.evict(num_pages=1).page_ids) == 1
    del index._iter_nodes
    index.check_integrity()


def _check(index, pages, windows, states, users):
    index.check_integrity()
    held_pages, held_windows, held_states = index.held_ids()
    expected = Counter(held_pages)
    for _, matched in users:
        expected.update(matched)
    for alloc, counts in (
        (pages, expected),
        (windows, Counter(held_windows)),
        (states, Counter(held_states)),
    ):
        alloc.check_integrity()
        assert all(alloc.refcount(i) == counts[i] for i in range(alloc.num_pages))
        assert alloc.num_free + alloc.num_cached + alloc.num_in_use == alloc.num_pages
