"""Prefix-aware routing's policy: prompts that share blocks share keys, the replica last sent the
longest prefix is ranked first unless its queue is too long, and the table stays bounded."""

import os
import random

import pytest

from dsv4ray.entrypoints.prefix_routing import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    PrefixTable,
    choose,
    prefix_keys,
)


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_keys_name_complete_blocks_and_a_shared_prefix_shares_them():
    base = _ids(3 * BLOCK_TOKENS + 5, 0)
    keys = prefix_keys(base)
    assert len(keys) == 3  # the incomplete last block has no key
    turn = base + _ids(2 * BLOCK_TOKENS, 1)  # the next turn of the conversation
    assert prefix_keys(turn)[:3] == keys
    other = base[:BLOCK_TOKENS] + [base[BLOCK_TOKENS] + 1] + base[BLOCK_TOKENS + 1 :]
    assert prefix_keys(other)[0] == keys[0] and prefix_keys(other)[1:] != keys[1:]
    text = "x" * (2 * BLOCK_CHARS + 1)
    assert len(prefix_keys(text)) == 2 and prefix_keys(text + "y")[:2] == prefix_keys(text)
    assert prefix_keys(None) == prefix_keys(b"bytes") == prefix_keys(_ids(10, 2)) == []


def test_keys_are_the_same_in_every_process():
    # the routers of several ingress processes share one table: a key must not depend on the
    # process (Python salts str hashes per process)
    import subprocess
    import sys

    code = (
        "from dsv4ray.entrypoints.prefix_routing import prefix_keys; "
        f"print(prefix_keys('é' * {2 * BLOCK_CHARS}), prefix_keys(list(range({BLOCK_TOKENS}))))"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(runs) == 1


def test_the_longest_prefix_among_the_candidates_wins():
    table = PrefixTable()
    a, b = _ids(4 * BLOCK_TOKENS, 3), _ids(4 * BLOCK_TOKENS, 4)
    table.insert(prefix_keys(a[: 2 * BLOCK_TOKENS]), "r1")
    table.insert(prefix_keys(b), "r2")
    assert table.match(prefix_keys(a), {"r1", "r2"}) == ("r1", 2)
    assert table.match(prefix_keys(b + a), {"r1", "r2"}) == ("r2", 4)
    assert table.match(prefix_keys(b), {"r1"}) == (None, 0)  # its holder is no candidate
    table.insert(prefix_keys(a), "r3")  # the latest replica sent a prefix holds it
    assert table.match(prefix_keys(a), {"r1", "r2", "r3"}) == ("r3", 4)
    table.forget("r3")
    assert table.match(prefix_keys(a), {"r1", "r3"}) == (None, 0) and len(table) == 4


def test_the_table_drops_the_least_recently_used_blocks():
    table = PrefixTable(max_blocks=4)
    a, b, c = (_ids(2 * BLOCK_TOKENS, seed) for seed in (5, 6, 7))
    table.insert(prefix_keys(a), "r1")
    table.insert(prefix_keys(b), "r2")
    assert table.match(prefix_keys(a), {"r1"}) == ("r1", 2)  # used again: b is now the oldest
    table.insert(prefix_keys(c[:BLOCK_TOKENS]), "r3")
    assert len(table) == 4
    assert table.match(prefix_keys(b), {"r2"}) == (None, 0)  # its first block went first
    assert table.match(prefix_keys(a), {"r1"}) == ("r1", 2)
    assert table.match(prefix_keys(c), {"r3"}) == ("r3", 1)
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixTable(0)


def test_choose_ranks_the_prefix_holder_first_unless_its_queue_is_long():
    rng, lens = random.Random(0), {"r1": 0, "r2": 0, "r3": 0}
    ranks = choose(None, lens, imbalance=4, rng=rng)  # no known prefix: two at random
    assert len(ranks) == 1 and len(set(ranks[0])) == 2 and set(ranks[0]) <= set(lens)
    ranks = choose("r2", lens, imbalance=4, rng=rng)
    assert ranks[0] == ["r2"] and "r2" not in ranks[1] and ranks[1]
    assert choose("r2", {**lens, "r2": 4}, imbalance=4, rng=rng)[0] == ["r2"]
    busy = choose("r2", {**lens, "r2": 5}, imbalance=4, rng=rng)
    assert len(busy) == 1  # more than 4 requests over the shortest queue: no affinity
    assert choose("r2", {**lens, "r2": None}, rng=rng)[0] == ["r2"]  # not probed yet
    assert choose("r2", {"r2": 9}, rng=rng) == [["r2"], ["r2"]]  # the only replica
    assert choose(None, {"r1": None}, rng=rng) == [["r1"]]


def test_the_serve_app_routes_by_prefix_unless_told_otherwise(tiny_ckpt):
    from dsv4ray.entrypoints.serve_config import ROUTERS, ServeSettings

    options = ServeSettings.from_config({"model": tiny_ckpt}).deployment_options()
    assert options["request_router_config"].request_router_class == ROUTERS["prefix"]
    pow2 = ServeSettings.from_config({"model": tiny_ckpt, "routing": "pow2"})
    assert "request_router_config" not in pow2.deployment_options()
    with pytest.raises(ValueError, match="routing must be one of"):
        ServeSettings.from_config({"model": tiny_ckpt, "routing": "random"})
