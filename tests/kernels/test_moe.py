"""Grouped-GEMM experts against the model's MoE (a loop over experts), and the pair alignment."""

import pytest
import torch

from dsv4ray.kernels.bits import interpreting
from dsv4ray.kernels.moe import LIST_MAX_PAIRS, activate_splits, align, fused_moe, list_pairs
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.layers.moe import MoE
from dsv4ray.model.tiny import tiny_config


def _moe(device, dtype, hashed: bool, **overrides) -> MoE:
    cfg = tiny_config("tiny", hidden_size=64, moe_intermediate_size=32, **overrides)
    moe = MoE(cfg, hashed).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if hashed:
            moe.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, moe.gate.tid2eid.shape))
    return moe.to(dtype)


def _routed(moe: MoE, x, token_ids):
    """The MoE's routing with the shared expert as one more slot (weight 1), as the engine runs."""
    weights, ids = moe.gate(x, token_ids)
    shared = torch.full_like(ids[:, :1], len(moe.experts))
    return torch.cat([ids, shared], 1), torch.cat([weights, torch.ones_like(weights[:, :1])], 1)


DTYPES = [torch.float32] if interpreting() else [torch.float32, torch.bfloat16]


# 1, 5 and 70 tokens group their pairs by list; 400 tokens (1,200 pairs) sort them
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 70, 400])
@pytest.mark.parametrize("hashed", [False, True])
def test_fused_moe_matches_the_expert_loop(num_tokens, hashed, dtype, device):
    assert 400 * 3 > LIST_MAX_PAIRS >= 70 * 3
    moe = _moe(device, dtype, hashed)
    x = torch.randn(num_tokens, 64, device=device).to(dtype)
    token_ids = torch.randint(0, 512, (num_tokens,), device=device)
    ids, weights = _routed(moe, x, token_ids)
    w13, w2 = moe.stack_experts()
    out = fused_moe(x, ids, weights, w13, w2, moe.limit)
    if dtype == torch.float32:
        assert_close("moe", out, moe(x, token_ids), 1e-5, 1e-4)
        return
    # bf16: the expert loop rounds every product and partial sum to bf16, the kernels once;
    # both are compared with the fp32 loop over the same (bf16) weights and inputs
    truth = moe.float()(x.float(), token_ids)
    ref_err = (moe.to(dtype)(x, token_ids).float() - truth).abs().max()
    assert (out.float() - truth).abs().max() <= 1.5 * ref_err + 1e-3


def test_a_tokens_fp32_experts_do_not_depend_on_its_batch(device):
    """Listed fp32 calls take narrower tiles for a few pairs than for many; a token's result is
    the same bits in a 1-token decode, a 4-token verification and a 60-token batch."""
    moe = _moe(device, torch.float32, False)
    x = torch.randn(60, 64, device=device)
    ids, weights = _routed(moe, x, torch.zeros(60, dtype=torch.long, device=device))
    w13, w2 = moe.stack_experts()
    full = fused_moe(x, ids, weights, w13, w2, moe.limit)
    for n in (1, 4):
        assert torch.equal(fused_moe(x[:n], ids[:n], weights[:n], w13, w2, moe.limit), full[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_epilogue_sums_the_partials_and_activates(dtype, device):
    """K-split gate-up partials [S, P, 2 inter]: gate and up summed over the splits in order, then
    silu(min(g, limit)) * clamp(u, -limit, limit) (values past the limit on both sides)."""
    g = torch.Generator().manual_seed(0)
    part = torch.randn(3, 5, 2 * 48, generator=g) * 6
    gate_up = part[0] + part[1] + part[2]
    gate, up = gate_up[:, :48].clamp(max=7.0), gate_up[:, 48:].clamp(-7.0, 7.0)
    want = (gate * torch.sigmoid(gate) * up).to(dtype)
    h = activate_splits(part.to(device), torch.empty(5, 48, dtype=dtype, device=device), 7.0)
    # exp differs by an ulp or so between torch and the kernel: one rounding step of h's dtype
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert_close("activate_splits", h, want, 1e-6, ulp)
    empty = torch.empty(0, 48, dtype=dtype, device=device)
    assert activate_splits(torch.zeros(3, 0, 96, device=device), empty, 7.0).shape == (0, 48)


def test_stacked_experts_are_the_module_weights(device):
    """Stacking leaves one copy: the experts' parameters are views of the stacked tensors."""
    moe = _moe(device, torch.float32, hashed=False)
    before = [e.w3.weight.clone() for e in moe.experts]
    w13, w2 = moe.stack_experts()
    assert w13.shape[0] == len(moe.experts) + 1  # the shared expert has the experts' width
    for i, e in enumerate(moe.experts):
        assert torch.equal(e.w3.weight, before[i])
        assert e.w3.weight.data_ptr() == w13[i, 32:].data_ptr()
    assert moe.stack_experts()[0] is w13


def test_align_covers_every_pair_once_by_expert(device):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 3]], device=device)
    order, blocks, counts = align(ids, num_experts=5, block_m=2)
    flat = ids.reshape(-1)
    assert counts.tolist() == torch.bincount(flat.cpu(), minlength=5).tolist()
    seen = []
    for expert, first, end in blocks.tolist():
        if expert < 0:
            assert first == end == 0
            continue
        assert 0 < end - first <= 2
        pairs = order[first:end].tolist()
        assert all(flat[p].item() == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(flat.numel()))
    assert blocks.shape[0] == -(-flat.numel() // 2) + 5  # fixed by the shapes alone


def test_list_pairs_rows_hold_each_experts_pairs_in_order(device):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 3]], device=device)
    table, counts = list_pairs(ids, num_experts=5)
    flat = ids.reshape(-1).tolist()
    for e in range(5):
        want = [p for p, i in enumerate(flat) if i == e]
        assert counts[e].item() == len(want)
        assert table[e, : len(want)].tolist() == want


def test_fused_moe_of_no_tokens_is_empty(device):
    moe = _moe(device, torch.float32, hashed=False)
    w13, w2 = moe.stack_experts()
    x = torch.zeros(0, 64, device=device)
    ids = torch.zeros(0, 3, dtype=torch.int64, device=device)
    out = fused_moe(x, ids, torch.zeros(0, 3, device=device), w13, w2, moe.limit)
    assert out.shape == (0, 64)


def test_bf16_h_is_rounded_to_nearest_even(device):
    """The gate-up epilogue stores h in bf16 rounded to nearest even, as the reference rounds it
    (a plain cast truncates under the interpreter): with the down projection the identity the
    output is h, each value within half a bf16 ulp of the fp64 h."""
    g = torch.Generator().manual_seed(0)
    hidden = inter = 64
    w13 = (torch.randn(1, 2 * inter, hidden, generator=g) * 0.3).bfloat16().to(device)
    w2 = torch.eye(hidden, inter)[None].bfloat16().contiguous().to(device)
    x = torch.randn(1, hidden, generator=g).bfloat16().to(device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    out = fused_moe(x, ids, torch.ones(1, 1, device=device), w13, w2, 1e4)[0].double().cpu()
    gu = w13[0].double().cpu() @ x[0].double().cpu()
    h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
    half_ulp = torch.exp2(torch.floor(torch.log2(h.abs())) - 8)
    assert ((out - h).abs() <= half_ulp * 1.001 + 1e-6 * h.abs()).all()
