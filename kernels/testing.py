"""Comparison helpers shared by kernel tests (CPU under the interpreter, and GPU)."""

import torch

from dsv4ray.cache.layout import entry_byte_offsets, read_entries
from dsv4ray.cache.page_layout import PageLayout


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


def build_for_hopper(
    kernel: str, args: dict, constexprs: dict, num_warps: int, num_stages: int
) -> str:
    """Compiles the Triton kernel "module:name" for sm_90 with Triton's own ptxas, no GPU needed,
    and returns its SASS: a CPU run proves that the code the interpreter cannot run (inline PTX,
    tensor-core layouts) builds for Hopper. args: every runtime argument by name, a pointer as
    "*<type>" (bf16, u8, i32, ...), an int (multiples of 16 specialised as the launcher does) or a
    float. Under the interpreter the kernels are not compilable objects, so a fresh interpreter
    process without TRITON_INTERPRET builds it."""
    import json
    import os
    import subprocess
    import sys

    request = dict(kernel=kernel, args=args, constexprs=constexprs, num_warps=num_warps,
                   num_stages=num_stages)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, sys; from dsv4ray.kernels.testing import _build; "
    code += "print(_build(**json.loads(sys.stdin.read())), end='')"
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(request), env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"building {kernel} for sm_90 failed:\n{done.stderr[-4000:]}")
    return done.stdout


def _build(kernel: str, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
    import importlib
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    unspecialised = {fn.arg_names[i] if isinstance(i, int) else i
                     for i in fn.do_not_specialize or ()}  # fmt: skip
    signature, attrs, constants = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        value = constexprs.get(arg, args.get(arg))
        if arg in constexprs:
            signature[arg], constants[arg] = "constexpr", value
        elif isinstance(value, str):
            signature[arg], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[arg] = "i32"
            if value % 16 == 0 and arg not in unspecialised:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32"
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": num_warps, "num_stages": num_stages}
    )
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        dump = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True)  # fmt: skip
    return dump.stdout
