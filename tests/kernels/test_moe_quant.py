"""Grouped-GEMM experts on FP8 and FP4 weights: the kernels against `fused_moe_ref`, the reference
against the loader's dequantisation, and the engine's fused MoE op on layers kept quantised
against the same layers' torch forward."""

import pytest
import torch

from dsv4ray.config_quant import FP4_MAX_SCALE_BYTE
from dsv4ray.kernels import dispatch
from dsv4ray.kernels import moe as moe_kernels
from dsv4ray.kernels.bits import interpreting
from dsv4ray.kernels.dequant import dequantize
from dsv4ray.kernels.moe import (
    FP4_WIDE_PAIRS,
    FP32_FEW_PAIRS,
    LIST_MAX_PAIRS,
    fused_moe,
    fused_moe_ref,
    small_pairs,
    stored_scales,
)
from dsv4ray.kernels.quant_tiles import dequantize_ref, group_major_scales, scale_float_ref
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.layers.moe import MoE
from dsv4ray.model.layers.quant_linear import QuantLinear
from dsv4ray.model.quant import QuantizedWeight, pack_fp4, quantize_fp4, quantize_fp8
from dsv4ray.model.tiny import tiny_config
from dsv4ray.worker import ops

HIDDEN, INTER, EXPERTS = 96, 64, 5  # not multiples of the 128-wide FP8 scale blocks
LAYOUTS = [("fp8", "float"), ("fp8", "ue8m0"), ("fp4", "ue8m0")]


def _quantize(w, fmt, scale_fmt):
    return quantize_fp4(w) if fmt == "fp4" else quantize_fp8(w, (128, 128), scale_fmt)


def _stacks(fmt, scale_fmt, device, seed=0):
    """(w13, w2, (s13, s2), dequantised w13, dequantised w2) of EXPERTS random experts."""
    g = torch.Generator().manual_seed(seed)

    def one(rows, cols):
        q = _quantize(torch.randn(rows, cols, generator=g) * cols**-0.5, fmt, scale_fmt)
        return q, QuantizedWeight("w", *q, fmt).dequantize()

    experts = [(one(INTER, HIDDEN), one(INTER, HIDDEN), one(HIDDEN, INTER)) for _ in range(EXPERTS)]
    w13 = torch.stack([torch.cat([w1[0][0], w3[0][0]]) for w1, w3, _ in experts])
    s13 = torch.stack([torch.cat([w1[0][1], w3[0][1]]) for w1, w3, _ in experts])
    w2 = torch.stack([e[2][0][0] for e in experts])
    s2 = torch.stack([e[2][0][1] for e in experts])
    dense13 = torch.stack([torch.cat([w1[1], w3[1]]) for w1, w3, _ in experts])
    dense2 = torch.stack([e[2][1] for e in experts])
    to = lambda t: t.to(device)  # noqa: E731
    return to(w13), to(w2), (to(s13), to(s2)), to(dense13), to(dense2)


def _routing(num_tokens, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.randint(0, EXPERTS, (num_tokens, 3), generator=g)
    return x.to(device), ids.to(device), torch.rand(num_tokens, 3, generator=g).to(device)


SORTED = "sorted"  # a num_tokens case: more pairs than LIST_MAX_PAIRS (`sorted_tokens`)


@pytest.fixture
def sorted_tokens(monkeypatch) -> int:
    """Tokens whose pairs are sorted rather than listed: 400 (1,200 pairs) natively; under the
    interpreter, which pays per program and op, 30 (90 pairs) with the list limit at 64 pairs."""
    if not interpreting():
        return 400
    monkeypatch.setattr(moe_kernels, "LIST_MAX_PAIRS", 64)
    return 30


def _tokens(num_tokens, sorted_tokens: int) -> int:
    return sorted_tokens if num_tokens == SORTED else num_tokens


# 1 and 5 tokens group their pairs by list on the narrow tiles, 7 tokens (21 pairs) by list on the
# 64-pair tiles; SORTED sorts them
@pytest.mark.parametrize("num_tokens", [1, 5, 7, SORTED])
@pytest.mark.parametrize("fmt,scale_fmt", LAYOUTS)
def test_quantized_experts_match_reference(fmt, scale_fmt, num_tokens, device, sorted_tokens):
    assert 400 * 3 > LIST_MAX_PAIRS >= 7 * 3 > small_pairs(EXPERTS) >= 5 * 3
    assert sorted_tokens * 3 > moe_kernels.LIST_MAX_PAIRS >= 7 * 3
    w13, w2, scales, _, _ = _stacks(fmt, scale_fmt, device)
    x, ids, weights = _routing(_tokens(num_tokens, sorted_tokens), device)
    out = fused_moe(x, ids, weights, w13, w2, 1.0, scales, fmt)
    ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, fmt)
    assert_close(f"moe {fmt}", out, ref, 1e-5, 1e-4)  # fp32: reordered sums only


@pytest.mark.parametrize("fmt,scale_fmt", LAYOUTS)
def test_reference_decodes_as_the_loader(fmt, scale_fmt, device):
    """The quantised reference equals the dense reference on the loader's dequantised weights."""
    w13, w2, scales, dense13, dense2 = _stacks(fmt, scale_fmt, device)
    x, ids, weights = _routing(7, device)
    ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, fmt)
    assert torch.equal(ref, fused_moe_ref(x, ids, weights, dense13, dense2, 1.0))


def test_bf16_activations(device):
    """bf16 x and h: the kernels and the reference round h to bf16 at one place each."""
    w13, w2, scales, _, _ = _stacks("fp4", "ue8m0", device)
    x, ids, weights = _routing(5, device)
    x = x.bfloat16()
    out = fused_moe(x, ids, weights, w13, w2, 1.0, scales, "fp4")
    ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, "fp4")
    assert out.dtype == torch.bfloat16
    assert_close("moe bf16", out, ref, 2e-2, 2e-2)


def test_no_tokens(device):
    w13, w2, scales, _, _ = _stacks("fp4", "ue8m0", device)
    ids = torch.zeros(0, 3, dtype=torch.int64, device=device)
    x, weights = torch.zeros(0, HIDDEN, device=device), torch.zeros(0, 3, device=device)
    assert fused_moe(x, ids, weights, w13, w2, 1.0, scales, "fp4").shape == (0, HIDDEN)


@pytest.mark.parametrize("fmt", ["fp4", "dense"])
@pytest.mark.parametrize("num_slots", [3, 17])
def test_compile_variants_reaches_every_tile_shape_a_call_can_take(num_slots, fmt, device,
                                                                   monkeypatch):  # fmt: skip
    """The start-up compile runs each tile variant that some batch with num_slots slots per token
    would take (few pairs, FP4's wider few-pair tiles on group-major scales, listed, sorted; fp32
    experts: their few-pair and listed tiles), so no batch size compiles a kernel while serving."""
    if fmt == "fp4":
        w13, w2, scales, _, _ = _stacks("fp4", "ue8m0", device)
        scales = tuple(stored_scales(fmt, s) for s in scales)  # as the worker stacks them
    else:
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device)
        w2, scales = torch.randn(EXPERTS, HIDDEN, INTER, device=device), None
    taken, real = set(), moe_kernels._tiles
    fp32 = not interpreting()  # what fused_moe passes for fp32 inputs

    def record(listed, fmt, num_pairs, fp32=False, num_experts=1, group_major=fmt == "fp4"):
        tiles = real(listed, fmt, num_pairs, fp32, num_experts, group_major)
        taken.add(tuple(sorted(tiles.items())))
        return tiles

    monkeypatch.setattr(moe_kernels, "_tiles", record)
    moe_kernels.compile_variants(w13, w2, scales, fmt, (128, 128), num_slots, torch.float32)
    compiled = set(taken)
    taken.clear()
    bounds = (FP4_WIDE_PAIRS, small_pairs(EXPERTS), FP32_FEW_PAIRS, LIST_MAX_PAIRS)
    for pairs in (1, *bounds, *(b + 1 for b in bounds)):
        tokens = -(-pairs // num_slots)
        record(tokens * num_slots <= LIST_MAX_PAIRS, fmt, tokens * num_slots, fp32, EXPERTS)
    assert taken <= compiled
    if fmt == "fp4":  # few pairs (narrow, then wide), listed, sorted
        assert small_pairs(EXPERTS) > FP4_WIDE_PAIRS
        assert len(compiled) == (4 if num_slots <= FP4_WIDE_PAIRS else 3)
    else:  # few pairs, more listed pairs, sorted (the interpreter lists with one tile)
        assert len(compiled) == (3 if fp32 else 2)


def _quantized_moe(fmt, scale_fmt, device) -> MoE:
    """A MoE layer whose experts (and, for FP8, the shared expert) keep quantised weights."""
    cfg = tiny_config("tiny", hidden_size=HIDDEN, moe_intermediate_size=INTER)
    moe = MoE(cfg, hashed=False)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    for expert in list(moe.experts) + [moe.shared_experts]:
        for name in ("w1", "w2", "w3"):
            old = getattr(expert, name)
            kind = "fp8" if expert is moe.shared_experts else fmt
            layer = QuantLinear(old.in_features, old.out_features, kind, (128, 128),
                                scale_bytes=scale_fmt == "ue8m0" or kind == "fp4")  # fmt: skip
            data, scale = _quantize(old.weight.detach(), kind, scale_fmt)
            layer.weight.copy_(data.view(layer.weight.dtype))
            layer.scale.copy_(scale.view(torch.uint8) if scale.element_size() == 1 else scale)
            setattr(expert, name, layer)
    return moe.to(device)


@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "float"), ("fp4", "ue8m0")])
def test_engine_moe_op_on_quantized_layers(fmt, scale_fmt, device):
    """ops.moe on the Triton backend (stacked quantised experts; FP8 stacks the FP8 shared
    expert with them, FP4 runs it through the FP8 linear kernel) equals the layer's torch forward,
    which dequantises each weight as the loader does."""
    moe = _quantized_moe(fmt, scale_fmt, device)
    x, _, _ = _routing(6, device)
    token_ids = torch.randint(0, 512, (6,), device=device)
    want = moe(x, token_ids)
    with dispatch.use_backend("triton"):
        ops.prepare([_Block(moe)])
        assert moe.shared_in_stack == (fmt == "fp8")
        got = ops.moe(moe, x, token_ids, static=False)
    assert_close(f"ops.moe {fmt}", got, want, 1e-5, 1e-4)


class _Block(torch.nn.Module):
    """The part of a Block that ops.prepare reads."""

    def __init__(self, ffn: MoE) -> None:
        super().__init__()
        self.ffn = ffn


MANY = 40  # experts: the grid is bounded by the pairs, not by the experts


def _many_stacks(fmt, device, seed=2, experts=MANY, hidden=HIDDEN, inter=INTER):
    g = torch.Generator().manual_seed(seed)

    def one(rows, cols):
        return _quantize(torch.randn(rows, cols, generator=g) * cols**-0.5, fmt, "ue8m0")

    def gate_up():  # w1 and w3 quantised apart: each has its own FP8 block rows
        (a, sa), (b, sb) = one(inter, hidden), one(inter, hidden)
        return torch.cat([a, b]), torch.cat([sa, sb])

    q13 = [gate_up() for _ in range(experts)]
    q2 = [one(hidden, inter) for _ in range(experts)]
    stack = lambda qs, i: torch.stack([q[i] for q in qs]).to(device)  # noqa: E731
    return stack(q13, 0), stack(q2, 0), (stack(q13, 1), stack(q2, 1))


ROUTINGS = {
    "one pair per expert": lambda g, t: torch.randperm(MANY, generator=g)[: 6 * t].view(t, 6),
    "ragged": lambda g, t: torch.randint(0, MANY, (t, 6), generator=g),
    "two experts": lambda g, t: torch.randint(7, 9, (t, 6), generator=g),
    "every slot one expert": lambda g, t: torch.full((t, 6), MANY - 1),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_many_experts_with_few_pairs_each(fmt, routing, device):
    """40 experts, 6 slots: pairs spread one per expert, ragged, concentrated on two experts or on
    the last one (the 16-pair blocks of several programs), and most experts empty every time."""
    w13, w2, scales = _many_stacks(fmt, device)
    g = torch.Generator().manual_seed(4)
    for num_tokens in (1, 5):
        ids = ROUTINGS[routing](g, num_tokens).to(device)
        x = torch.randn(num_tokens, HIDDEN, generator=g).to(device)
        weights = torch.rand(num_tokens, 6, generator=g).to(device)
        out = fused_moe(x, ids, weights, w13, w2, 1.0, scales, fmt)
        ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, fmt)
        assert_close(f"moe {fmt} {routing}", out, ref, 1e-5, 1e-4)


def test_fp4_every_code_at_the_extreme_scales(device):
    """All 16 e2m1 codes (the subnormal 0.5 included) under scale bytes from 2 (2^-125) to
    FP4_MAX_SCALE_BYTE (2^1) decode exactly: gate and up rows of huge and tiny magnitudes,
    clamped by the limit, against the reference."""
    g = torch.Generator().manual_seed(6)
    w13, w2, (s13, s2), _, _ = _stacks("fp4", "ue8m0", "cpu")
    w13 = pack_fp4(torch.randint(0, 16, (EXPERTS, 2 * INTER, HIDDEN), generator=g))
    choices = torch.tensor([2, 3, 100, 127, FP4_MAX_SCALE_BYTE], dtype=torch.uint8)
    s13 = choices[torch.randint(0, len(choices), s13.shape, generator=g)].view(s13.dtype)
    x, ids, weights = _routing(5, "cpu")
    args = [t.to(device) for t in (x, ids, weights, w13, w2)]
    scales = (s13.to(device), s2.to(device))
    out = fused_moe(*args, 1.0, scales, "fp4")
    ref = fused_moe_ref(*args, 1.0, scales, "fp4")
    assert_close("moe fp4 extreme scales", out, ref, 1e-5, 1e-4)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp4_decodes_every_code_at_the_extreme_scales_exactly(out_dtype, device):
    """kernels/dequant.py on all 16 e2m1 codes under scale bytes from 2 (2^-125) to
    FP4_MAX_SCALE_BYTE: each value, as the loader's reference rounds it to the scratch's dtype."""
    g = torch.Generator().manual_seed(7)
    w13, _, (s13, _), _, _ = _stacks("fp4", "ue8m0", "cpu")
    w13 = pack_fp4(torch.randint(0, 16, (EXPERTS, 2 * INTER, HIDDEN), generator=g))
    choices = torch.tensor([2, 3, 100, 127, FP4_MAX_SCALE_BYTE], dtype=torch.uint8)
    s13 = choices[torch.randint(0, len(choices), s13.shape, generator=g)].view(s13.dtype)
    want = dequantize_ref(w13, s13, "fp4").to(out_dtype)
    out = torch.empty(want.shape, dtype=out_dtype, device=device)
    dequantize(w13.to(device), s13.to(device), "fp4", (128, 128), out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_k_split_partial_sums_equal_the_reference(fmt, device, monkeypatch):
    """A decode call with too few programs to fill the GPU splits K over programs (gate and up
    sums added up before the activation, down-projection partials before the slot sum): with
    512 x 512 experts, one and three tokens take 2 or more splits, and equal the reference."""
    w13, w2, scales = _many_stacks(fmt, device, experts=6, hidden=512, inter=512)
    taken, real = [], moe_kernels._k_splits
    monkeypatch.setattr(moe_kernels, "_k_splits", lambda *a: taken.append(real(*a)) or taken[-1])
    g = torch.Generator().manual_seed(8)
    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, 512, generator=g).to(device)
        ids = torch.randint(0, 6, (num_tokens, 2), generator=g).to(device)
        weights = torch.rand(num_tokens, 2, generator=g).to(device)
        out = fused_moe(x, ids, weights, w13, w2, 1.0, scales, fmt)
        ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, fmt)
        assert_close(f"moe {fmt} split", out, ref, 1e-5, 1e-4)
    assert min(splits for _, splits in taken) >= 2, taken


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "in a graph capture"])
@pytest.mark.parametrize("chunk_experts", [EXPERTS, 2])
@pytest.mark.parametrize("fmt,scale_fmt", LAYOUTS)
def test_prefill_decodes_its_experts_first(
    fmt, scale_fmt, chunk_experts, capturing, device, monkeypatch, sorted_tokens
):
    """Sorted quantized calls with many pairs per expert decode their experts into a scratch (here
    in chunks of 2 experts as well as all at once) and multiply with the dense kernels: bit for
    bit what those kernels compute on the same weights dequantised to bf16, an expert without
    pairs included. Eager calls launch each chunk's own blocks; in a capture (no value may reach
    the host) every chunk launches all blocks: the same bits either way."""
    w13, w2, scales, dense13, dense2 = _stacks(fmt, scale_fmt, device)
    monkeypatch.setattr(moe_kernels, "DEQUANT_PAIRS_PER_EXPERT", 4)
    monkeypatch.setattr(moe_kernels, "_capturing", lambda x: capturing)
    per_expert = 3 * INTER * HIDDEN * 2  # bf16
    monkeypatch.setattr(moe_kernels, "DEQUANT_SCRATCH_BYTES", chunk_experts * per_expert)
    x, ids, weights = _routing(sorted_tokens, device)  # sorted pairs
    x, ids = x.bfloat16(), torch.where(ids == 4, 3, ids)  # expert 4 gets no pair
    got = fused_moe(x, ids, weights, w13, w2, 1.0, scales, fmt)
    want = fused_moe(x, ids, weights, dense13.bfloat16(), dense2.bfloat16(), 1.0)
    assert torch.equal(got, want)
    ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, scales, fmt)
    assert_close(f"moe {fmt} decoded first", got, ref, 2e-2, 2e-2)


@pytest.mark.parametrize("fmt,scale_fmt", LAYOUTS)
def test_experts_decode_exactly(fmt, scale_fmt, device):
    """kernels/dequant.py: every expert with pairs equals the loader's dequantisation in bf16,
    byte for byte (FP8's gate and up halves each on their own scale grid); experts without pairs
    are left as they were."""
    w13, w2, (s13, s2), dense13, dense2 = _stacks(fmt, scale_fmt, device)
    counts = torch.tensor([0, 3, 1, 0, 2], device=device)
    out = torch.full((3, HIDDEN, INTER), 7.0, dtype=torch.bfloat16, device=device)
    dequantize(w2, s2, fmt, (128, 128), out, 2, counts)  # experts 2, 3, 4
    assert torch.equal(out[0], dense2[2].bfloat16())
    assert torch.equal(out[1], torch.full_like(out[1], 7.0))
    assert torch.equal(out[2], dense2[4].bfloat16())
    if fmt == "fp4":
        one = dequantize(w13[1], s13[1], fmt, (128, 128), torch.empty_like(dense13[1]))
        assert torch.equal(one, dense13[1])  # fp32 out: the exact values
    none = torch.empty(0, HIDDEN, INTER, dtype=torch.bfloat16, device=device)
    assert dequantize(w2, s2, fmt, (128, 128), none, 5, counts).shape == none.shape


# 5 tokens: the narrow listed tiles; 6: FP4's wide ones; 7: the 64-pair listed tiles; SORTED:
# sorted pairs, in fp32 and, in bf16 with many pairs per expert, decoding the experts into a
# scratch first
CASES = [(5, torch.float32), (6, torch.float32), (7, torch.float32), (SORTED, torch.float32),
         (SORTED, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize("num_tokens,dtype", CASES)
@pytest.mark.parametrize("fmt,scale_fmt", LAYOUTS)
def test_group_major_scales_give_the_same_bytes(fmt, scale_fmt, num_tokens, dtype, device,
                                                monkeypatch, sorted_tokens):  # fmt: skip
    """Scales stored group-major (`group_major_scales`, as stacked quantised experts hold them) are
    read through their strides: every tile shape and the decode into a scratch give the bytes the
    row-major scales give."""
    monkeypatch.setattr(moe_kernels, "DEQUANT_PAIRS_PER_EXPERT", 4)
    w13, w2, (s13, s2), _, _ = _stacks(fmt, scale_fmt, device)
    x, ids, weights = _routing(_tokens(num_tokens, sorted_tokens), device)
    x = x.to(dtype)
    major = (group_major_scales(s13), group_major_scales(s2))
    assert major[0].stride()[1] == 1
    assert torch.equal(scale_float_ref(major[0]), scale_float_ref(s13))
    want = fused_moe(x, ids, weights, w13, w2, 1.0, (s13, s2), fmt)
    got = fused_moe(x, ids, weights, w13, w2, 1.0, major, fmt)
    if fmt == "fp4" and FP4_WIDE_PAIRS < ids.numel() <= small_pairs(EXPERTS):
        # the wide tiles split K otherwise: the reference's values up to the sums' order
        ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, major, fmt)
        assert_close("moe fp4 wide tiles", got, ref, 1e-5, 1e-4)
    else:
        assert torch.equal(got, want)
    ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, (s13, s2), fmt)
    got_ref = fused_moe_ref(x, ids, weights, w13, w2, 1.0, major, fmt)
    assert_close("reference on group-major scales", got_ref, ref, 1e-5, 1e-4)


def test_scales_in_another_layout_are_refused(device):
    w13, w2, (s13, s2), _, _ = _stacks("fp4", "ue8m0", device)
    x, ids, weights = _routing(5, device)
    odd = s13.transpose(0, 1).contiguous().transpose(0, 1)  # experts innermost
    with pytest.raises(AssertionError):
        fused_moe(x, ids, weights, w13, w2, 1.0, (odd, s2), "fp4")
