"""Page transfers: byte-exact against the reference and against the layout's byte ranges."""

import pytest
import torch

from dsv4ray.cache.formats import DTYPES, KINDS
from dsv4ray.cache.layout import entry_byte_offsets
from dsv4ray.cache.page_layout import layout_for
from dsv4ray.kernels.testing import assert_bytes_equal
from dsv4ray.kernels.transfer import (
    transfer_cache_dsv4_mla,
    transfer_cache_dsv4_mla_ref,
    transfer_page_rows,
    transfer_page_rows_ref,
)

NUM_LAYERS = 2


def _buffers(layout, num_pages, device, pin=False):
    bufs = [
        torch.randint(0, 256, (num_pages, layout.page_bytes), dtype=torch.uint8)
        for _ in range(NUM_LAYERS)
    ]
    return [b.pin_memory() if pin else b.to(device) for b in bufs]


def _index_cases(src_slots: int, dst_slots: int) -> dict:
    return {
        "odd_count": (torch.randperm(src_slots)[:7], torch.randperm(dst_slots)[:7]),
        "slot_0_both_sides": (torch.tensor([0, src_slots - 1]), torch.tensor([dst_slots - 1, 0])),
        "minus_one_skipped": (torch.tensor([3, -1, 1, 2]), torch.tensor([-1, 4, 0, 5])),
        "single": (torch.tensor([1]), torch.tensor([1])),
    }


def _check_moved(src, dst, before, src_idx, dst_idx, layout):
    """dst == its old bytes with each kept pair's value and scale bytes taken from src."""
    keep = (src_idx >= 0) & (dst_idx >= 0)
    src_offsets = torch.cat(entry_byte_offsets(src_idx[keep], layout), 1)
    dst_offsets = torch.cat(entry_byte_offsets(dst_idx[keep], layout), 1)
    for layer, (s, d, old) in enumerate(zip(src, dst, before, strict=True)):
        expected = old.clone()
        expected.view(-1)[dst_offsets] = s.cpu().view(-1)[src_offsets]
        assert_bytes_equal(f"layer {layer}", d.cpu(), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_entry_transfer_moves_value_and_scale_bytes(kind, dtype, device):
    lay = layout_for(kind, dtype)
    epp = lay.entries_per_page
    num_src = 3 if epp > 2 else 5  # >= 7 source slots
    num_dst = num_src + 1
    src = _buffers(lay, num_src, device)
    for case, (src_idx, dst_idx) in _index_cases(num_src * epp, num_dst * epp).items():
        dst = _buffers(lay, num_dst, device)
        before = [d.cpu().clone() for d in dst]
        ref = [d.clone() for d in dst]
        transfer_cache_dsv4_mla(src, dst, src_idx.to(device), dst_idx.to(device), lay)
        transfer_cache_dsv4_mla_ref(src, ref, src_idx.to(device), dst_idx.to(device), lay)
        for layer, (got, want) in enumerate(zip(dst, ref, strict=True)):
            assert_bytes_equal(f"{kind}/{dtype}/{case}/layer {layer}", got, want)
        _check_moved(src, dst, before, src_idx, dst_idx, lay)


@pytest.mark.parametrize("fn", [transfer_page_rows, transfer_page_rows_ref])
def test_page_rows_are_copied_whole(fn, device):
    lay = layout_for("c128", "fp8")
    src, dst = _buffers(lay, 4, device), _buffers(lay, 5, device)
    before = [d.clone() for d in dst]
    src_pages = torch.tensor([3, 0, -1, 1], device=device)
    fn(src, dst, src_pages, torch.tensor([0, 4, 2, -1], device=device))
    for s, d, old in zip(src, dst, before, strict=True):
        assert torch.equal(d[0], s[3]) and torch.equal(d[4], s[0])
        assert torch.equal(d[1:4], old[1:4])


@pytest.mark.parametrize(
    "fns",
    [
        (transfer_cache_dsv4_mla, transfer_page_rows),
        (transfer_cache_dsv4_mla_ref, transfer_page_rows_ref),
    ],
)
def test_empty_is_a_no_op_and_bad_arguments_raise(fns, device):
    entries, rows = fns
    lay = layout_for("c4", "fp8")
    src, dst = _buffers(lay, 2, device), _buffers(lay, 2, device)
    before = [d.clone() for d in dst]
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    entries(src, dst, empty, empty, lay)
    rows(src, dst, empty, empty)
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))
    three, four = torch.arange(3, device=device), torch.arange(4, device=device)
    with pytest.raises(ValueError, match="3 entries.*4"):
        entries(src, dst, three, four, lay)
    with pytest.raises(ValueError, match="4 entries.*3"):
        rows(src, dst, four, three)
    with pytest.raises(ValueError, match="2 source layers but 1"):
        entries(src, dst[:1], three, three, lay)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
@pytest.mark.parametrize("direction", ["device_to_host", "host_to_device"])
def test_transfers_between_device_and_pinned_host(direction):
    lay = layout_for("c4", "fp8")
    device_bufs, host_bufs = _buffers(lay, 4, "cuda"), _buffers(lay, 4, "cpu", pin=True)
    src, dst = device_bufs, host_bufs
    if direction == "host_to_device":
        src, dst = dst, src
    before = [d.cpu().clone() for d in dst]
    src_idx, dst_idx = torch.randperm(256)[:9], torch.randperm(256)[:9]
    transfer_cache_dsv4_mla(src, dst, src_idx, dst_idx, lay)
    torch.cuda.synchronize()
    _check_moved(src, dst, before, src_idx, dst_idx, lay)
    transfer_page_rows(src, dst, torch.tensor([2, 0]), torch.tensor([1, 3]))
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[1].cpu(), s[2].cpu()) and torch.equal(d[3].cpu(), s[0].cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_unpinned_host_memory_is_refused():
    lay = layout_for("c4", "fp8")
    with pytest.raises(ValueError, match="pinned"):
        transfer_page_rows(
            _buffers(lay, 2, "cuda"), _buffers(lay, 2, "cpu"), torch.tensor([0]), torch.tensor([1])
        )
