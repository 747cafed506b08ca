"""PageAllocator: all-or-nothing allocation, reference counts, cache ownership, conservation."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ray.cache.allocator import PageAllocator


def test_fresh_ids_are_distinct_and_include_zero():
    alloc = PageAllocator(4)
    ids = alloc.alloc(4)
    assert sorted(ids) == [0, 1, 2, 3]
    assert alloc.num_free == 0 and alloc.num_in_use == 4


def test_short_pool_returns_none_and_takes_nothing():
    alloc = PageAllocator(3)
    assert alloc.alloc(2) is not None
    assert alloc.alloc(2) is None
    assert alloc.num_free == 1
    assert alloc.alloc(1) is not None
    assert alloc.alloc(0) == []


def test_shared_id_is_freed_at_refcount_zero():
    alloc = PageAllocator(2)
    (idx,) = alloc.alloc(1)
    alloc.incref([idx])
    assert alloc.decref([idx]) == []
    assert alloc.refcount(idx) == 1 and alloc.num_free == 1
    assert alloc.free([idx]) == [idx]
    assert alloc.num_free == 2


def test_double_free_and_unknown_ids_raise():
    alloc = PageAllocator(2)
    (idx,) = alloc.alloc(1)
    alloc.free([idx])
    with pytest.raises(ValueError, match="free"):
        alloc.free([idx])
    with pytest.raises(ValueError, match="outside"):
        alloc.incref([2])
    with pytest.raises(ValueError, match="outside"):
        alloc.refcount(-1)


def test_cache_reference_counts_as_cached_only_when_alone():
    alloc = PageAllocator(3)
    (idx,) = alloc.alloc(1)
    alloc.cache_adopt([idx])  # the request's reference becomes the cache's
    assert (alloc.num_free, alloc.num_cached, alloc.num_in_use) == (2, 1, 0)
    alloc.incref([idx])  # a request shares the cached page
    assert (alloc.num_cached, alloc.num_in_use) == (0, 1)
    with pytest.raises(ValueError, match="already held"):
        alloc.cache_adopt([idx])
    alloc.decref([idx])
    assert alloc.num_cached == 1
    with pytest.raises(ValueError, match="only by the cache"):
        alloc.decref([idx])
    assert alloc.cache_release([idx]) == [idx]
    assert (alloc.num_free, alloc.num_cached, alloc.num_in_use) == (3, 0, 0)
    alloc.check_integrity()


def test_cache_release_of_a_shared_id_keeps_it_in_use():
    alloc = PageAllocator(1)
    (idx,) = alloc.alloc(1)
    alloc.cache_adopt([idx])
    alloc.incref([idx])
    assert alloc.cache_release([idx]) == []
    assert alloc.refcount(idx) == 1 and not alloc.is_cache_held(idx)
    assert alloc.num_in_use == 1


def test_integrity_check_detects_a_corrupted_free_list():
    alloc = PageAllocator(4)
    alloc.alloc(2)
    alloc.check_integrity()
    alloc._free_ids.append(alloc._free_ids[0])  # the same id listed twice
    with pytest.raises(RuntimeError, match="twice"):
        alloc.check_integrity()


def test_integrity_check_detects_an_in_use_id_on_the_free_list():
    alloc = PageAllocator(4)
    (idx,) = alloc.alloc(1)
    alloc._free_ids.append(idx)
    with pytest.raises(RuntimeError, match="refcount-0"):
        alloc.check_integrity()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "incref", "decref", "adopt", "release"]),
        st.integers(0, 5),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(0, 8), ops=_ops)
def test_random_operations_conserve_ids(num_pages, ops):
    """A model of holders (request references, cache references) predicts every counter."""
    alloc = PageAllocator(num_pages)
    request_refs, cache_held = Counter(), set()
    for op, arg in ops:
        live = sorted(i for i in range(num_pages) if request_refs[i] or i in cache_held)
        if op == "alloc":
            ids = alloc.alloc(arg)
            assert (ids is None) == (arg > num_pages - len(live))
            request_refs.update(ids or [])
        elif live:
            idx = live[arg % len(live)]
            if op == "incref":
                alloc.incref([idx])
                request_refs[idx] += 1
            elif op == "decref" and request_refs[idx]:
                alloc.decref([idx])
                request_refs[idx] -= 1
            elif op == "adopt" and request_refs[idx] and idx not in cache_held:
                alloc.cache_adopt([idx])
                request_refs[idx] -= 1
                cache_held.add(idx)
            elif op == "release" and idx in cache_held:
                alloc.cache_release([idx])
                cache_held.discard(idx)
        alloc.check_integrity()
        num_cached = sum(1 for i in cache_held if request_refs[i] == 0)
        num_live = sum(1 for i in range(num_pages) if request_refs[i] or i in cache_held)
        assert alloc.num_free == num_pages - num_live
        assert alloc.num_cached == num_cached
        assert alloc.num_free + alloc.num_cached + alloc.num_in_use == num_pages
        for i in range(num_pages):
            assert alloc.refcount(i) == request_refs[i] + (i in cache_held)
