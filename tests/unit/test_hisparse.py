"""HiSparse at the stage: the compressor writes physical rows (never another request's), host
slot 0 moves like any slot, the store's bookkeeping holds, and sizing counts hot rows only."""

import pytest
import torch

from dsv4ray.cache.configurator import size_stage
from dsv4ray.cache.formats import KINDS
from dsv4ray.cache.hisparse import HiSparseStore
from dsv4ray.cache.hisparse_sizing import c4_device_bytes_per_request, resolve_hot_rows
from dsv4ray.cache.layout import entry_byte_offsets
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.plan import BatchEntry, StepPlan
from dsv4ray.entrypoints.cli import build_parser
from dsv4ray.entrypoints.cli_options import engine_options
from dsv4ray.kernels import dispatch
from dsv4ray.model.loader import load_stage
from dsv4ray.model.tiny import tiny_config
from dsv4ray.worker.batch import build_batch
from dsv4ray.worker.host.hisparse_io import c4_cache, scratch_step
from dsv4ray.worker.paged import _compress
from dsv4ray.worker.req_table import ReqTable
from dsv4ray.worker.rope_tables import RopeTables

HOT_ROWS = 17  # the tiny preset's index_topk (16) + the reserved row


def _entry_bytes(pages: torch.Tensor, slot: int, layout) -> torch.Tensor:
    value, scale = entry_byte_offsets(torch.tensor([slot]), layout)
    return pages.view(-1)[torch.cat((value, scale), 1)[0]].clone()


def _pools(cfg, dtype: str, hot_rows: int) -> StagePools:
    sizes = PoolSizes(4, 8, 3, 0, hisparse_hot_rows=hot_rows)
    return StagePools(cfg, 0, cfg.num_hidden_layers, sizes, dtype)


def _meta(cfg, entries, tables, pools: StagePools):
    plan = StepPlan(step_id=0, batch=[BatchEntry(r, s, n, True) for r, s, n in entries],
                    token_ids=[5] * sum(n for _, _, n in entries))  # fmt: skip
    ropes = RopeTables([cfg.layers[i].rope for i in range(cfg.num_hidden_layers)], "cpu")
    meta = build_batch(plan, tables, "cpu", ropes)
    meta.hisparse_step = scratch_step(plan, pools, tables, cfg.index_topk, "cpu", None)
    return meta


@pytest.fixture(scope="module")
def stage(tiny_ckpt):
    cfg = tiny_config("tiny")
    return cfg, load_stage(tiny_ckpt, 0, cfg.num_hidden_layers, torch.float32, "cpu", cfg)


def _write(stage_model, pools, meta, layer_id: int, seed: int):
    """The engine's compressor write of one C4 layer through the step's C4 cache."""
    info = pools.info(layer_id)
    cache = c4_cache(pools, meta, info)
    x = torch.randn(meta.num_tokens, stage_model.cfg.hidden_size,
                    generator=torch.Generator().manual_seed(seed))  # fmt: skip
    cos_t, sin_t = meta.ropes.get(stage_model.cfg.layers[layer_id].rope)
    comp = stage_model.block(layer_id).attn.compressor
    state = pools.c4_state[info.compress_layer_id]
    _compress(comp, x, meta, state, cache.pages, pools.layouts["c4"], cache.out_loc, cos_t, sin_t)
    cache.written()


@pytest.mark.parametrize(
    "shape,backend",
    [("decode", "torch"), ("decode", "triton"), ("mixed", "torch"), ("mixed", "triton")],
)
def test_compressor_writes_physical_rows_never_another_requests(stage, shape, backend):
    """A's newest entry has logical C4 slot 19 (page 0, position 19), which is B's hot row 2 in
    the hot buffer: written there (the logical slot), it would overwrite B's row. In a mixed
    step (B prefills 84 tokens beside A's decode) slot 19 of the step's scratch buffer holds B's
    20th entry: written there, A's entry would overwrite B's. It must land
    in A's reserved row and A's host history, bytes equal to the all-on-device write, and B's
    entries must reach its history untouched."""
    cfg, model = stage
    layer_id = next(i for i, r in enumerate(cfg.layer_ratios) if r == 4)
    hot = _pools(cfg, "fp32", HOT_ROWS)
    device = StagePools(cfg, 0, cfg.num_hidden_layers, PoolSizes(4, 8, 3, 0), "fp32")
    store, i = hot.hisparse, hot.info(layer_id).compress_layer_id
    assert store.hot_slot(1, 2) == 19 == store.host_slot([0], 19)  # the collision
    # B: a decode at 43, or a prefill chunk 0..83 whose region holds scratch slots 0..20
    b_start, b_tokens = (43, 1) if shape == "decode" else (0, 84)
    tables = {"A": ReqTable(0, [0], [0]), "B": ReqTable(1, [2], [1])}
    entries = [("A", 79, 1), ("B", b_start, b_tokens)]
    store.hot[i].random_(0, 256, generator=torch.Generator().manual_seed(3))
    before = store.hot[i].clone()
    with dispatch.use_backend(backend):
        for pools in (hot, device):
            pools.reset_rings([0, 1])
            _write(model, pools, _meta(cfg, entries, tables, pools), layer_id, seed=7)
    layout = hot.layouts["c4"]
    for slot in range(store.hot_slot(1, 0), store.reserved_slot(1)):  # B's LRU rows, row 2 too
        assert torch.equal(_entry_bytes(store.hot[i], slot, layout),
                           _entry_bytes(before, slot, layout)), slot  # fmt: skip
    a_entry = _entry_bytes(device.c4[i], 19, layout)  # all on device: at the logical slot
    assert torch.equal(_entry_bytes(store.hot[i], store.reserved_slot(0), layout), a_entry)
    assert torch.equal(_entry_bytes(store.history[i], 19, layout), a_entry)
    b_slots = [2 * 64 + 10] if shape == "decode" else [2 * 64 + c for c in range(21)]
    for slot in b_slots:  # B's entries in its history (page 2), equal to the device pool's
        assert torch.equal(_entry_bytes(store.history[i], slot, layout),
                           _entry_bytes(device.c4[i], slot, layout))  # fmt: skip
    if shape == "decode":  # B's newest entry sits in B's reserved row
        assert torch.equal(_entry_bytes(store.hot[i], store.reserved_slot(1), layout),
                           _entry_bytes(device.c4[i], b_slots[0], layout))  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp8", "fp32"])
def test_host_slot_zero_moves_into_a_hot_row(dtype):
    cfg = tiny_config("tiny")
    pools = _pools(cfg, dtype, HOT_ROWS)
    store, layout = pools.hisparse, pools.layouts["c4"]
    gen = torch.Generator().manual_seed(1)
    for history in store.history:
        history.random_(0, 256, generator=gen)
    tables = {"A": ReqTable(2, [0], [0])}  # page 0: its C4 position 0 is host slot 0
    meta = _meta(cfg, [("A", 80, 1)], tables, pools)
    topk = torch.full((1, cfg.index_topk), -1, dtype=torch.int64)
    topk[0, :3] = torch.tensor([0, 19, 7])
    layer_id = next(i for i, r in enumerate(cfg.layer_ratios) if r == 4)
    info = pools.info(layer_id)
    pages, phys = c4_cache(pools, meta, info).read(topk)
    history = store.history[info.compress_layer_id]
    for j, pos in enumerate([0, 19, 7]):
        row = int(phys[0, j])
        assert store.hot_slot(2, 0) <= row < store.reserved_slot(2)  # A's own LRU rows
        assert torch.equal(_entry_bytes(pages, row, layout), _entry_bytes(history, pos, layout))
    assert store.stats()["hisparse_misses"] == 3 and store.stats()["hisparse_hits"] == 0
    store.check_integrity()


def test_store_reset_and_integrity_check():
    store = HiSparseStore(2, 3, 5, 2, "fp8")
    store.row_pos[1][0, :2] = torch.tensor([4, 9])
    store.row_age[1][0, :2] = torch.tensor([1, 1])
    store.clock[1][0] = 1
    store.check_integrity()
    store.row_pos[1][0, 1] = 4  # one position in two rows
    with pytest.raises(RuntimeError, match="two rows"):
        store.check_integrity()
    store.reset_slots([0])
    store.check_integrity()
    assert (store.row_pos[1][0] == -1).all() and store.clock[1][0] == 0
    with pytest.raises(ValueError, match="hot row"):
        store.hot_slot(3, 0)


FP8 = {kind: layout_for(kind, "fp8").bytes_per_entry for kind in KINDS}


def test_sizing_counts_hot_rows_not_history():
    ratios, skip = [0, 4, 128, 4], [False] * 4
    args = dict(max_running_requests=8, available_bytes=2 << 30)
    off = size_stage(0, 0, 4, ratios, skip, FP8, **args)
    on = size_stage(0, 0, 4, ratios, skip, FP8, hisparse_hot_rows=1024, **args)
    assert on.bytes_per_full_token == pytest.approx(off.bytes_per_full_token - 585 * 2 / 4)
    assert on.num_full_tokens > off.num_full_tokens  # the freed C4 bytes hold more tokens
    capped = size_stage(0, 0, 4, ratios, skip, FP8, hisparse_hot_rows=1024,
                        hisparse_host_tokens=4096, **args)  # fmt: skip
    assert capped.num_full_tokens == 4096
    cpu = size_stage(0, 0, 4, ratios, skip, FP8, max_running_requests=8, hisparse_host_tokens=600)
    assert cpu.num_full_tokens == 512  # floored to pages

    # pp 2 over [4, 4 | 128, 0]: each stage reserves hot rows for its own C4 layers only
    ratios = [4, 4, 128, 0]
    for stage_idx, (start, end), num_c4 in ((0, (0, 2), 2), (1, (2, 4), 0)):
        small, large = (
            size_stage(stage_idx, start, end, ratios, skip, FP8, hisparse_hot_rows=rows, **args)
            for rows in (1024, 2048)
        )
        freed = 8 * 1024 * 585 * num_c4  # 8 running requests x 1024 more rows x C4 layers
        lost = small.num_full_tokens - large.num_full_tokens
        assert abs(lost - freed / small.bytes_per_full_token) <= 256, (stage_idx, lost)


@pytest.mark.parametrize("preset", ["tiny", "dsv4-mini"])
def test_device_c4_bytes_per_request_at_16k_are_a_quarter_or_less(preset):
    cfg = tiny_config(preset)
    ratios, skip = cfg.layer_ratios, [s.skip_topk for s in cfg.layers]
    rows = resolve_hot_rows(cfg.index_topk, None)
    assert rows == 2 * cfg.index_topk
    with_hot = c4_device_bytes_per_request(ratios, skip, FP8, 16384, rows)
    without = c4_device_bytes_per_request(ratios, skip, FP8, 16384)
    assert without == 16384 // 4 * 585 * sum(r == 4 for r in ratios)
    assert with_hot <= without / 4


def test_options_are_validated_with_their_names(tiny_ckpt):
    with pytest.raises(ValueError, match="hisparse_hot_rows is set but enable_hisparse"):
        EngineConfig(tiny_ckpt, hisparse_hot_rows=40)
    with pytest.raises(ValueError, match="hisparse_host_tokens"):
        EngineConfig(tiny_ckpt, enable_hisparse=True, hisparse_host_tokens=100)
    with pytest.raises(ValueError, match="enable_hisparse"):
        EngineConfig(tiny_ckpt, enable_hisparse="yes")
    with pytest.raises(ValueError, match=r"hisparse_hot_rows must be in \[index_topk \+ 1"):
        resolve_hot_rows(16, 16)
    # against the checkpoint's top-k, before a stage actor (or Ray) starts
    import sys

    from dsv4ray import LLM

    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    with pytest.raises(ValueError, match=r"\[17, 8192\], got 16"):
        LLM(tiny_ckpt, enable_hisparse=True, hisparse_hot_rows=16, pp_size=2, use_ray=True)
    assert ray_was_up or "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_cli_flags_become_llm_options():
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-hisparse",
            "--hisparse-hot-rows",
            "40",
            "--hisparse-host-tokens",
            "4096",
        ]  # fmt: skip
    )
    assert engine_options(args) == {
        "enable_hisparse": True, "hisparse_hot_rows": 40, "hisparse_host_tokens": 4096,
    }  # fmt: skip
    assert engine_options(build_parser().parse_args(["generate", "hi"])) == {}
