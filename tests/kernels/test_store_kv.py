"""store_kv: the Triton kernel writes the torch reference's bytes in every pool and format."""

import pytest
import torch

from dsv4ray.cache.formats import DTYPES, KINDS
from dsv4ray.cache.layout import hadamard_rotate, read_entries
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels.store_kv import store_kv, store_kv_ref
from dsv4ray.kernels.testing import assert_bytes_equal, assert_close, format_tolerance


def _slot_cases(epp: int, num_pages: int) -> dict:
    total = epp * num_pages
    return {
        "regular": torch.arange(min(8, total)),
        "ragged_odd": torch.randperm(total)[:7],
        "minus_one_and_slot_0": torch.tensor([-1, 0, total - 1, -1, epp]),
        "empty": torch.zeros(0, dtype=torch.int64),
        "across_pages": torch.arange(epp - 2, epp + 3) % total,
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_reference_bytes(kind, dtype, device):
    lay = layout_for(kind, dtype)
    num_pages = 3 if lay.entries_per_page > 2 else 5
    for case, slots in _slot_cases(lay.entries_per_page, num_pages).items():
        # rows inside a wider buffer: the kernel must honour the row stride
        magnitude = torch.logspace(-6, 6, slots.numel())[:, None]
        wide = torch.randn(slots.numel(), lay.dim + 16) * magnitude
        x, slots = wide[:, : lay.dim].to(device), slots.to(device)
        pages = torch.randint(0, 256, (num_pages, lay.page_bytes), dtype=torch.uint8, device=device)
        ref_pages = pages.clone()
        store_kv(x, pages, slots, lay)
        store_kv_ref(x, ref_pages, slots, lay)
        assert_bytes_equal(f"{kind}/{dtype}/{case}", pages, ref_pages)


@pytest.mark.parametrize("kind", ["window", "indexer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_entries_read_back_within_format_error(kind, dtype, device):
    lay = layout_for(kind, dtype)
    x = torch.randn(6, lay.dim, device=device)
    pages = torch.zeros(1, lay.page_bytes, dtype=torch.uint8, device=device)
    slots = torch.tensor([3, 0, 5, 1, 2, 4], device=device)
    store_kv(x, pages, slots, lay)
    atol, rtol = format_tolerance(lay)
    expected = hadamard_rotate(x) if lay.dtype == "fp8" and kind == "indexer" else x
    assert_close(f"{kind}/{dtype}", read_entries(pages, slots, lay), expected, atol, rtol)
