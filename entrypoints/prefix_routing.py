"""Prefix-aware routing across the engine deployment's replicas: a request goes to the replica
that was last sent the longest prefix of its prompt, so a conversation's next turn (or another
request over the same system prompt) lands where the prefix cache holds that prefix.

``PrefixTable`` (pure Python) maps chained hashes of a prompt's blocks (BLOCK_TOKENS token ids,
or BLOCK_CHARS characters of a text prompt) to the replica last sent that prefix, at most
``max_blocks`` of them, least recently used dropped first. ``PrefixRouter`` is Ray Serve's
request router over it (``routing="prefix"``, the default of ``dsv4ray serve``): it runs in every
process that holds the engine deployment's handle (each ingress replica, whichever one the HTTP
proxy picked for a request), so the table lives in one actor per deployment
(``PrefixTableActor``, named after it) that every router asks. Per request:

    1. the candidate replica holding the longest known prefix of the prompt, unless its queue is
       more than ``imbalance`` requests longer than the shortest known queue: a hot prefix does
       not pile every request onto one replica;
    2. otherwise (and when that replica refuses the request) power of two choices, as Serve's
       default router.

The routed replica is recorded for every block of the prompt. A replica that dies is forgotten.
When the table's actor is gone (its owner, the router that started it, died) or does not answer
within MATCH_TIMEOUT_S, requests route by power of two choices; a router that found it gone
starts a fresh one.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections import OrderedDict
from collections.abc import Collection, Sequence

import ray
from ray.serve.request_router import FIFOMixin, RequestRouter

BLOCK_TOKENS = 64  # token ids per block of a tokenised prompt
BLOCK_CHARS = 256  # characters per block of a text prompt
MAX_BLOCKS = 1 << 18  # blocks a table remembers (16.8M prompt tokens; about 30 MiB)
IMBALANCE = 4  # queue length over the shortest at which a prefix's replica is passed over
MATCH_TIMEOUT_S = 1.0  # a table that does not answer in time routes the request by two choices


def prefix_keys(prompt) -> list[int]:
    """Chained hashes of the prompt's complete blocks: key i names blocks 0..i (a token-id list
    or a str; anything else has none)."""
    if isinstance(prompt, str):  # code points: str hashes differ between processes, ints do not
        prompt, size = [ord(c) for c in prompt], BLOCK_CHARS
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        size = BLOCK_TOKENS
    else:
        return []
    keys, key = [], 0
    for start in range(0, len(prompt) - size + 1, size):
        key = hash((key, tuple(prompt[start : start + size])))
        keys.append(key)
    return keys


class PrefixTable:
    """Which replica was last sent each prompt prefix (keys from ``prefix_keys``)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, keys: list[int], candidates: Collection[str]) -> tuple[str | None, int]:
        """(the candidate holding the longest prefix, its length in blocks); (None, 0) when no
        candidate holds the first block. Blocks past the first unknown one are not looked at."""
        best, depth = None, 0
        for i, key in enumerate(keys):
            owner = self._owner.get(key)
            if owner is None:
                break
            self._owner.move_to_end(key)
            if owner in candidates:
                best, depth = owner, i + 1
        return best, depth

    def insert(self, keys: list[int], replica: str) -> None:
        replica = sys.intern(replica)  # one string per replica, however many blocks name it
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


def choose(
    owner: str | None,
    queue_lens: dict[str, int | None],
    imbalance: int = IMBALANCE,
    rng: random.Random | None = None,
) -> list[list[str]]:
    """Ranked replica ids for a request (``owner``: the candidate holding the longest prefix
    of its prompt, or None; ``queue_lens``: every candidate, None where unknown): the owner
    first when its queue allows, then two random candidates."""
    ids = list(queue_lens)
    pair = (rng or random).sample(ids, min(2, len(ids)))
    if owner is None:
        return [pair]
    known = [q for q in queue_lens.values() if q is not None]
    mine = queue_lens[owner]
    if mine is not None and mine - min(known) > imbalance:
        return [pair]
    return [[owner], [r for r in pair if r != owner] or pair]


@ray.remote(num_cpus=0)
class PrefixTableActor:
    """One deployment's PrefixTable, shared by the routers of every process calling it."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.table = PrefixTable(max_blocks)

    def match(self, keys: list[int], candidates: list[str]) -> str | None:
        return self.table.match(keys, set(candidates))[0]

    def insert(self, keys: list[int], replica: str) -> None:
        self.table.insert(keys, replica)

    def forget(self, replica: str) -> None:
        self.table.forget(replica)


class PrefixRouter(FIFOMixin, RequestRouter):
    """Serve's request router: the shared table's longest prefix, ranked by ``choose``."""

    def initialize_state(self, max_blocks: int = MAX_BLOCKS, imbalance: int = IMBALANCE):
        self.max_blocks, self.imbalance, self._table = max_blocks, imbalance, None
        deployment = self._deployment_id
        self.table_name = f"dsv4ray-prefix-table:{deployment.app_name}:{deployment.name}"

    def table(self):
        """The deployment's table actor (started by the first router that asks)."""
        if self._table is None:
            self._table = PrefixTableActor.options(name=self.table_name, get_if_exists=True).remote(
                self.max_blocks
            )
        return self._table

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if not by_id:
            return []
        keys, owner = _request_keys(pending_request), None
        if keys:
            match = self.table().match.remote(keys, list(by_id))
            try:
                owner = await asyncio.wait_for(match, MATCH_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
            except ray.exceptions.RayError:  # gone: the next call starts another
                self._table = None
        cache = self.replica_queue_len_cache
        lens = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        ranks = choose(owner, lens, self.imbalance)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        keys = _request_keys(pending_request)
        if keys:  # not waited for: this process's next match is ordered after it
            self.table().insert.remote(keys, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table().forget.remote(replica_id.to_full_id_str())


def _request_keys(pending_request) -> list[int]:
    """The prompt is the engine's ``generate`` call's first argument (token ids from the
    ingress); other calls (stats, info) have no keys."""
    if pending_request is None or not pending_request.args:
        return []
    return prefix_keys(pending_request.args[0])
