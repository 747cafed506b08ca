"""Page layouts and the torch quantisation that defines the stored bytes (cache/layout.py)."""

import math

import pytest
import torch

from dsv4ray.cache.formats import DTYPES, KINDS
from dsv4ray.cache.layout import (
    dequantize_entries,
    entry_byte_offsets,
    hadamard_128,
    hadamard_rotate,
    quantize_entries,
    read_entries,
    ue8m0_exponent_byte,
    write_entries,
)
from dsv4ray.cache.page_layout import PageLayout, layout_for, layout_signature

# SPEC_MODEL.md section 7: fp8 bytes per page and entries per page
SPEC_FP8 = {"window": (74880, 128), "c4": (37440, 64), "c128": (1728, 2), "indexer": (8448, 64)}
# SPEC_SERVING.md section 2: padded bytes per entry b(kind) in fp8
SPEC_FP8_BYTES_PER_ENTRY = {"window": 585, "c4": 585, "c128": 864, "indexer": 132}


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_layouts_match_the_spec(kind):
    lay = layout_for(kind, "fp8")
    assert (lay.page_bytes, lay.entries_per_page) == SPEC_FP8[kind]
    assert lay.bytes_per_entry == SPEC_FP8_BYTES_PER_ENTRY[kind]
    kv = kind != "indexer"
    assert (lay.value_bytes, lay.scale_bytes) == ((448 + 2 * 64, 8) if kv else (128, 4))
    assert lay.scale_offset == lay.entries_per_page * lay.value_bytes
    assert lay.scale_offset + lay.entries_per_page * lay.scale_bytes <= lay.page_bytes
    if kv:
        assert lay.page_bytes % lay.value_bytes == 0  # padded to a multiple of 576


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_plain_layouts_hold_values_only(kind, dtype):
    lay = layout_for(kind, dtype)
    assert lay.scale_bytes == 0
    assert lay.value_bytes == lay.dim * (2 if dtype == "bf16" else 4)
    assert lay.page_bytes == lay.entries_per_page * lay.value_bytes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_value_ranges_and_rows_are_16_byte_aligned(kind, dtype):
    # the transfer kernels copy 16-byte pairs of words and rely on this
    lay = layout_for(kind, dtype)
    assert lay.page_bytes % 16 == 0 and lay.value_bytes % 16 == 0


def test_layout_rejects_unknown_names():
    with pytest.raises(ValueError, match="kind"):
        PageLayout("c8", "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PageLayout("c4", "fp16")


def test_signature_names_every_layout():
    a, b = layout_for("c4", "fp8"), layout_for("c4", "bf16")
    assert layout_signature(a) == layout_signature(layout_for("c4", "fp8"))
    assert layout_signature(a) != layout_signature(b)
    assert layout_signature(a, b) != layout_signature(b, a)


def test_ue8m0_exponent_is_ceil_log2_of_amax_over_448():
    powers = torch.tensor([448.0 * 2.0**k for k in range(-40, 40)])
    amax = torch.cat(
        (
            powers,
            powers * (1 + 2**-23),
            powers * (1 - 2**-24),
            torch.rand(1000) * 1e4,
            torch.logspace(-10, 30, 500),
        )
    ).float()
    expected = torch.tensor([math.ceil(math.log2(a / 448.0)) for a in amax.double().tolist()])
    assert torch.equal(ue8m0_exponent_byte(amax) - 127, expected.to(torch.int32))


def _spread_rows(num: int, dim: int) -> torch.Tensor:
    # rows spanning 40 binades, some with outliers and all-zero groups
    x = torch.randn(num, dim) * torch.logspace(-12, 8, num)[:, None]
    x[1, :64] = 0.0
    x[2, 5] = 1e4 * x[2].abs().max()
    return x


@pytest.mark.parametrize("kind", ["c4", "indexer"])
def test_fp8_round_trip_within_half_an_e4m3_step(kind):
    lay = layout_for(kind, "fp8")
    x = _spread_rows(24, lay.dim)
    values, scales = quantize_entries(x, lay)
    y = dequantize_entries(values, scales, lay)
    if kind == "indexer":
        x = hadamard_rotate(x)  # the indexer format stores (and returns) the rotated key
        scale = scales.view(torch.float32)  # [N, 1]
        assert ((x.abs().amax(1, keepdim=True) / scale) <= 448 * (1 + 2**-20)).all()  # rounded /
    else:
        scale = torch.pow(2.0, scales[:, :7].float() - 127).repeat_interleave(64, 1)
        amax = x[:, :448].abs().view(-1, 7, 64).amax(-1).repeat_interleave(64, 1)
        ratio = amax / scale
        assert ((ratio <= 448) & ((ratio > 224) | (amax < 1e-9))).all()  # the tightest power of two
        rope_err = (y[:, 448:] - x[:, 448:]).abs()
        assert (rope_err <= x[:, 448:].abs() * 2**-8).all()
        x, y = x[:, :448], y[:, :448]
    # e4m3: 3 mantissa bits (half step 2^-4 relative); subnormal step 2^-9 * scale
    assert ((y - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all()


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_and_fp32_formats_store_plain_values(kind):
    x = _spread_rows(6, layout_for(kind, "fp32").dim)
    for dtype, expected in (("fp32", x), ("bf16", x.to(torch.bfloat16).float())):
        lay = layout_for(kind, dtype)
        values, scales = quantize_entries(x, lay)
        assert scales.shape == (6, 0)
        assert torch.equal(dequantize_entries(values, scales, lay), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_entries_land_at_their_byte_ranges(kind, dtype):
    lay = layout_for(kind, dtype)
    epp = lay.entries_per_page
    slots = torch.tensor([0, epp - 1, epp + 1, 2 * epp])
    pages = torch.zeros(3, lay.page_bytes, dtype=torch.uint8)
    x = torch.randn(4, lay.dim) + 3.0  # no zero bytes expected in any scale or value group
    write_entries(pages, slots, x, lay)
    values, scales = quantize_entries(x, lay)
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, epp)
        row = pages[page]
        assert torch.equal(row[offset * lay.value_bytes :][: lay.value_bytes], values[i])
        scale_start = lay.scale_offset + offset * lay.scale_bytes
        assert torch.equal(row[scale_start : scale_start + lay.scale_bytes], scales[i])
    value_offsets, scale_offsets = entry_byte_offsets(slots, lay)
    untouched = torch.ones(pages.numel(), dtype=torch.bool)
    untouched[value_offsets.reshape(-1)] = False
    untouched[scale_offsets.reshape(-1)] = False
    assert (pages.view(-1)[untouched] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_slots_are_skipped_and_read_as_zero(dtype):
    lay = layout_for("window", dtype)
    pages = torch.zeros(2, lay.page_bytes, dtype=torch.uint8)
    x = torch.randn(3, lay.dim)
    write_entries(pages, torch.tensor([-1, 0, -7]), x, lay)
    written = read_entries(pages, torch.tensor([[0, -1], [1, 0]]), lay)
    assert written.shape == (2, 2, lay.dim)
    assert torch.equal(written[0, 0], written[1, 1]) and written[0, 0].abs().sum() > 0
    assert (written[0, 1] == 0).all() and (written[1, 0] == 0).all()  # slot 1 was never written


def test_hadamard_is_orthonormal_and_rotation_keeps_dot_products():
    h = hadamard_128()
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6) and torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((128, 128), 128**-0.5))
    q, k = torch.randn(5, 128), torch.randn(7, 128)
    assert torch.allclose(hadamard_rotate(k), k @ h, atol=1e-5)
    assert torch.allclose(hadamard_rotate(q) @ hadamard_rotate(k).T, q @ k.T, atol=1e-4)
