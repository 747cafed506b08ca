"""Pools with a draft worker: every stage's rings double, the last stage (whose device the draft
layer shares) prices it as one more layer of its own, and rejected drafts' C128 rows are reset."""

import dataclasses

import pytest

from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.cluster.pd import prefill_config
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.worker.pool_sizing import pool_sizes, size_pipeline

GIB = 2**30


def _capacity(ckpt, steps):
    ec = EngineConfig(ckpt, pp_size=2, device="cuda", speculative_num_steps=steps)
    return size_pipeline(ModelConfig.from_hf(ckpt), ec, [GIB, GIB])


def test_the_draft_layer_and_longer_rings_are_priced(tiny_ckpt):
    plain, spec = _capacity(tiny_ckpt, 0), _capacity(tiny_ckpt, 3)
    (p0, p1), (s0, s1) = plain.stages, spec.stages
    num_layers = s1.end - s1.start
    assert s0.bytes_per_full_token == p0.bytes_per_full_token  # stage 0 hosts no draft
    assert s1.bytes_per_full_token == pytest.approx(
        p1.bytes_per_full_token * (num_layers + 1) / num_layers
    )
    assert s0.num_full_tokens < p0.num_full_tokens  # doubled rings reserve more up front
    assert spec.num_full_tokens < plain.num_full_tokens
    assert pool_sizes(spec, 2).ring_scale == 2 and pool_sizes(plain).ring_scale == 1


def test_a_prefill_engine_keeps_the_decode_sides_rings_without_the_draft_layer(tiny_ckpt):
    decode = EngineConfig(tiny_ckpt, pp_size=2, device="cuda", speculative_num_steps=3,
                          prefill_pp_size=2, use_ray=True)  # fmt: skip
    prefill = prefill_config(decode)
    assert prefill.speculative_num_steps == 0 and prefill.ring_scale == decode.ring_scale == 2
    plain, spec = _capacity(tiny_ckpt, 0), _capacity(tiny_ckpt, 3)
    cap = size_pipeline(ModelConfig.from_hf(tiny_ckpt), prefill, [GIB, GIB])
    # doubled rings on both stages, no MTP layer priced on the last
    assert [s.bytes_per_full_token for s in cap.stages] == [
        s.bytes_per_full_token for s in plain.stages
    ]
    (c0, c1), (s0, s1), (p0, p1) = cap.stages, spec.stages, plain.stages
    assert c0.num_full_tokens == s0.num_full_tokens < p0.num_full_tokens
    assert s1.num_full_tokens < c1.num_full_tokens < p1.num_full_tokens
    assert prefill_config(dataclasses.replace(decode, speculative_num_steps=0)).ring_scale == 1


def test_rejected_c128_rows_are_reset_and_nothing_else(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    sizes = PoolSizes(4, 8, 2, 2, ring_scale=2)
    pools = StagePools(cfg, 0, cfg.num_hidden_layers, sizes, "fp32")
    assert pools.c128_state and pools.c128_state[0][0].shape[1] == 256
    for kv, score in pools.c128_state + pools.c4_state:
        kv.fill_(1.0)
        score.fill_(2.0)
    # ring rows 44, 45, 46 of slot 1 and 255, 0 of slot 0 (a span across the ring's end)
    pools.reset_c128_rows([(1, range(300, 303)), (0, range(511, 513))])
    assert len(pools.c128_state) == 2  # every C128 layer of the stage
    for kv, score in pools.c128_state:
        for slot, rows in ((1, [44, 45, 46]), (0, [255, 0])):
            assert (kv[slot, rows] == 0).all() and (score[slot, rows] == float("-inf")).all()
            kept = [r for r in range(256) if r not in rows]
            assert (kv[slot, kept] == 1).all() and (score[slot, kept] == 2).all()
    assert all((kv == 1).all() for kv, _ in pools.c4_state)
