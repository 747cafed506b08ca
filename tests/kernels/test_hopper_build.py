"""Kernels build for Hopper (sm_90) on any machine. The grouped FP4 expert kernels: the interpreter
runs their fp32 branch, so this is where the inline PTX that decodes FP4 on tensor-core paths, and
the tile shapes serving uses, meet ptxas before a GPU does; the SASS also shows the decode cheap:
the K loop spends a bounded number of instructions per weight value. The top-k kernel: its
runtime branch between the select passes and the whole-row pick (a control flow the interpreter
accepts more freely than the compiler), at the configuration decode uses."""

import re

import pytest

from dsv4ray.kernels import moe, topk
from dsv4ray.kernels.testing import build_for_hopper

HIDDEN, INTER = 4096, 2048  # V4-Flash's expert shape


def _args(down: bool) -> dict:
    """Arguments as serving passes them: the scales group-major (`moe.stored_scales`)."""
    common = dict(list_ptr="*i64", blocks_ptr="*i32", counts_ptr="*i32",
                  k_per_split=HIDDEN, num_splits=1, num_pairs=7, num_experts=256, hidden=HIDDEN,
                  inter=INTER, expert_lo=0, expert_hi=-1)  # fmt: skip
    if down:
        return dict(common, h_ptr="*bf16", w2_ptr="*u8", s2_ptr="*u8",
                    weight_ptr="*fp32", out_ptr="*fp32", stride_w=INTER // 2,
                    stride_se=HIDDEN * INTER // 32, stride_sr=1, stride_sg=HIDDEN, block_n=1,
                    block_k=128)  # fmt: skip
    return dict(common, x_ptr="*bf16", w13_ptr="*u8", s13_ptr="*u8",
                h_ptr="*bf16", part_ptr="*fp32", num_slots=6, limit=10.0,
                stride_w=HIDDEN // 2, stride_se=2 * INTER * HIDDEN // 32, stride_sr=1,
                stride_sg=2 * INTER, s_up=INTER, block_n=1, block_k=128)  # fmt: skip


def _loop_instructions(sass: str) -> int:
    """Instructions of the kernel's longest loop (a backward branch and its target)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    longest = 0
    for addr, text in lines:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < int(addr, 16):
            longest = max(longest, (int(addr, 16) - int(target.group(1), 16)) // 16 + 1)
    return longest


@pytest.mark.parametrize("down", [False, True], ids=["gate-up", "down"])
@pytest.mark.parametrize("tiles", ["small", "wide", "prefill"])
def test_fp4_expert_kernels_build_for_hopper(down, tiles):
    pairs = {"small": 7, "wide": moe.FP4_WIDE_PAIRS + 1, "prefill": moe.LIST_MAX_PAIRS + 1}[tiles]
    tile = moe._tiles(tiles != "prefill", "fp4", pairs, num_experts=256, group_major=True)
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    flags = dict(LISTED=tiles != "prefill", E_PAD=256, FMT=2, SCALE_BYTES=True, IEEE=False, **tile)
    kernel = "dsv4ray.kernels.moe:" + ("_down_kernel" if down else "_gate_up_kernel")
    sass = build_for_hopper(kernel, _args(down), flags, warps, stages)
    assert "HMUL2" in sass  # the bf16 decode, not the fp32 one
    # weight values a thread decodes per K step: gate and up, or the down projection's one tile
    values = (1 if down else 2) * tile["BLOCK_N"] * tile["BLOCK_K"] // (32 * warps)
    loop = _loop_instructions(sass)
    assert loop > 0, "no K loop found in the SASS"
    per_value = loop / values
    assert per_value < 8, f"{per_value:.1f} instructions per FP4 value in the K loop"


def test_topk_kernel_builds_for_hopper():
    args = dict(scores_ptr="*i32", pos_ptr="*i32", len_ptr="*i64", out_ptr="*i64",
                cand_ptr="*i32", cand_pos_ptr="*i32", buf_ptr="*i64", scratch_ptr="*i32",
                num_cols=1024, topk=512, row_stride=1024, seg_len=1024, mode=topk.MODE_ROW,
                use_len=1)  # fmt: skip
    chunk, warps = topk._config()
    flags = dict(K_POW2=512, CHUNK=chunk, RADIX_BITS=topk.RADIX_BITS, NARROW=topk.NARROW)
    # raises with ptxas's message where the branch does not compile
    build_for_hopper("dsv4ray.kernels.topk:_topk_rows_kernel", args, flags, warps, 3)
