"""Comparison helpers shared by kernel tests (CPU under the interpreter, and GPU)."""

import torch

from dsv4ray.cache.layout import PageLayout, entry_byte_offsets, read_entries


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """out == ref within atol + rtol * |ref|, after checking the shapes and the NaN / inf masks."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    nan_diff = torch.isnan(out) != torch.isnan(ref)
    assert not nan_diff.any(), f"{name}: NaN mask differs at {nan_diff.nonzero()[:5].tolist()}"
    inf_diff = torch.isinf(out) != torch.isinf(ref)
    assert not inf_diff.any(), f"{name}: inf mask differs at {inf_diff.nonzero()[:5].tolist()}"
    infinite = torch.isinf(ref)
    assert torch.equal(out[infinite], ref[infinite]), f"{name}: signs of inf differ"
    finite = torch.isfinite(ref)
    err = (out - ref).abs()[finite]
    bound = (atol + rtol * ref.abs())[finite]
    if err.numel() and (err > bound).any():
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name}: {(err > bound).sum().item()} of {err.numel()} values off; max abs err "
            f"{err.max().item():.3g}, worst at flat index {worst} (|err| {err[worst].item():.3g} > "
            f"{bound[worst].item():.3g})"
        )


def assert_bytes_equal(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """Byte-exact equality of two uint8 buffers, naming the first differing positions."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    diff = (out.cpu() != ref.cpu()).nonzero()
    assert diff.numel() == 0, f"{name}: {diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


def format_tolerance(layout: PageLayout) -> tuple:
    """(atol, rtol) for values that went through one quantisation in layout's format."""
    return {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 2**-7), "fp8": (1e-3, 2**-3)}[layout.dtype]


def assert_entries_close(
    name: str,
    pages: torch.Tensor,
    ref_pages: torch.Tensor,
    slots: torch.Tensor,
    layout: PageLayout,
    min_exact: float = 0.99,
) -> None:
    """Entries computed by two implementations (in fp32 with different rounding) and then quantised.

    A last-bit difference before quantisation may move a value to the neighbouring code, so this
    demands that every dequantised value is within one quantisation step and, for bf16 and fp8, that
    at least `min_exact` of the entries' bytes agree.
    """
    entries = read_entries(pages.cpu(), slots.cpu(), layout)
    ref_entries = read_entries(ref_pages.cpu(), slots.cpu(), layout)
    atol, rtol = format_tolerance(layout)
    if layout.dtype == "fp8":
        atol = atol * ref_entries.abs().amax().item()
    assert_close(name, entries, ref_entries, atol, rtol)
    if layout.dtype == "fp32":
        return  # fp32 entries keep every last-bit difference; the values were compared above
    value_offsets, scale_offsets = entry_byte_offsets(slots[slots >= 0].cpu(), layout)
    offsets = torch.cat((value_offsets, scale_offsets), 1)
    same = pages.cpu().view(-1)[offsets] == ref_pages.cpu().view(-1)[offsets]
    same = same.float().mean().item()
    assert same >= min_exact, f"{name}: only {same:.4f} of the entry bytes agree"
