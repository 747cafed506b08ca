"""Reference-counted integer id allocator (pure Python, no tensors).

One class serves every id space the scheduler owns:

- full pages: id p names the 256-token logical page p. The C4, C128 and C4-indexer pools use the
  SAME id p for their compressed pages (entries per page = 256 // ratio): one id moves every pool;
- window pages: id w names 128 window-KV entries (window slot = w * 128 + pos % 128);
- compressor-state slots: one per running request (its C4/C128 rings);
- cached-state slots: one per radix-node snapshot (a copy of the C4 rings at a page boundary).

Every id 0..num_pages-1 (pages or slots) is ordinary: id 0 is no sentinel. An id is in one of
three states:

    free    refcount 0, on the free list
    cached  refcount 1 and that one reference belongs to the prefix cache (radix index)
    in use  any other refcount > 0 (requests, possibly together with the cache)

Invariant (``check_integrity``): free + cached + in use == num_pages, and the free list holds
exactly the ids with refcount 0, each once.

``alloc`` is all-or-nothing and returns None when fewer than n ids are free: callers (the scheduler)
decide whether to evict, preempt or wait, so running out is an expected outcome, not an error.
Misuse (double free, unknown id, caching an unreferenced id) raises ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Integer ids with reference counts and a prefix-cache ownership flag per id."""

    def __init__(self, num_pages: int, name: str = "pages") -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        self.name = name
        self._num_pages = num_pages
        # Popped from the end: ids come out in ascending order on a fresh allocator.
        self._free_ids = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages
        self._cache_held = [False] * num_pages
        self._num_cached = 0

    # ---------------------------------------------------------------- counters
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_cached(self) -> int:
        """Ids whose only reference is the prefix cache's (evictable)."""
        return self._num_cached

    @property
    def num_in_use(self) -> int:
        return self._num_pages - len(self._free_ids) - self._num_cached

    def refcount(self, idx: int) -> int:
        self._check_id(idx)
        return self._refcount[idx]

    def is_cache_held(self, idx: int) -> bool:
        self._check_id(idx)
        return self._cache_held[idx]

    # ---------------------------------------------------------------- requests' references
    def alloc(self, n: int) -> list[int] | None:
        """n fresh ids with refcount 1, or None (nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} ids")
        if n > len(self._free_ids):
            return None
        ids = [self._free_ids.pop() for _ in range(n)]
        for idx in ids:
            self._refcount[idx] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference to each id (a second request sharing a page)."""
        for idx in ids:
            self._check_live(idx)
            was_cached = self._is_cached(idx)
            self._refcount[idx] += 1
            self._num_cached -= was_cached

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference from each id; returns the ids that went back to the free list."""
        freed = []
        for idx in ids:
            self._check_live(idx)
            if self._cache_held[idx] and self._refcount[idx] == 1:
                raise ValueError(
                    f"{self.name}: id {idx} is held only by the cache; use cache_release"
                )
            self._refcount[idx] -= 1
            self._num_cached += self._is_cached(idx)
            if self._refcount[idx] == 0:
                self._free_ids.append(idx)
                freed.append(idx)
        return freed

    def free(self, ids: Iterable[int]) -> list[int]:
        """Release the caller's reference (the same as ``decref``; reads better for sole owners)."""
        return self.decref(ids)

    # ---------------------------------------------------------------- the prefix cache's reference
    def cache_adopt(self, ids: Iterable[int]) -> None:
        """Turn one existing reference per id into the cache's reference (refcount unchanged)."""
        for idx in ids:
            self._check_live(idx)
            if self._cache_held[idx]:
                raise ValueError(f"{self.name}: id {idx} is already held by the cache")
            self._cache_held[idx] = True
            self._num_cached += self._is_cached(idx)

    def cache_release(self, ids: Iterable[int]) -> list[int]:
        """Drop the cache's reference; returns the ids that went back to the free list."""
        freed = []
        for idx in ids:
            self._check_live(idx)
            if not self._cache_held[idx]:
                raise ValueError(f"{self.name}: id {idx} is not held by the cache")
            self._num_cached -= self._is_cached(idx)
            self._cache_held[idx] = False
            self._refcount[idx] -= 1
            if self._refcount[idx] == 0:
                self._free_ids.append(idx)
                freed.append(idx)
        return freed

    # ---------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """RuntimeError unless the free list is exactly the refcount-0 ids and the counts agree."""
        free_set = set(self._free_ids)
        if len(free_set) != len(self._free_ids):
            raise RuntimeError(f"{self.name}: an id is on the free list twice")
        zero = {i for i, rc in enumerate(self._refcount) if rc == 0}
        if zero != free_set:
            raise RuntimeError(
                f"{self.name}: free list {sorted(free_set)[:8]}... differs from refcount-0 ids "
                f"{sorted(zero)[:8]}..."
            )
        if any(rc < 0 for rc in self._refcount):
            raise RuntimeError(f"{self.name}: negative refcount")
        if any(held and rc == 0 for held, rc in zip(self._cache_held, self._refcount, strict=True)):
            raise RuntimeError(f"{self.name}: a free id is marked as held by the cache")
        # With the free list exact and the cached counter recounted, in use (refcount > 0 and not
        # cached) is the remainder, so free + cached + in use == total holds.
        cached = sum(1 for i in range(self._num_pages) if self._is_cached(i))
        if cached != self._num_cached:
            raise RuntimeError(f"{self.name}: cached counter {self._num_cached} != {cached}")

    def _is_cached(self, idx: int) -> bool:
        return self._cache_held[idx] and self._refcount[idx] == 1

    def _check_id(self, idx: int) -> None:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self._num_pages:
            raise ValueError(f"{self.name}: id {idx!r} outside [0, {self._num_pages})")

    def _check_live(self, idx: int) -> None:
        self._check_id(idx)
        if self._refcount[idx] == 0:
            raise ValueError(f"{self.name}: id {idx} is free (double free or stale id)")

    def __repr__(self) -> str:
        return (
            f"PageAllocator({self.name}: {self.num_free} free, {self.num_cached} cached, "
            f"{self.num_in_use} in use of {self._num_pages})"
        )
