"""The native-weight kernels at V4-Flash's shapes, each beside its bf16 peer and the copy ceiling
measured in the same run (one GPU).

    python -m dsv4ray.bench native_kernels [--out-dir DIR] [--commit SHA] [--prefill-rows 8192]

Decode (M = 1, 16, 64 rows): every FP8 linear as the engine calls it (kernels/fp8_linear.py)
against cuBLAS on its weight dequantised to bf16, and the time its FP8 bytes take at the copy
ceiling; the grouped experts (FP4, FP8 and bf16, 256 experts, top-6, M tokens on distinct random
experts) against the copy time of the experts they touch; decode outputs are checked against the
torch references first. Prefill (--prefill-rows rows): every
FP8 linear as served (bf16 activations: the weight decoded into a scratch, then cuBLAS), with
FP8 activations (`fp8_prefill`: kernels/fp8_act.py) and cuBLAS bf16, outputs checked against
cuBLAS on the dequantised weight; the grouped experts as served against the bf16 experts (the
weights before quantisation: outputs within the quantisation's error). Times are medians of
CUDA-graph replays (decode) or of events around single calls (prefill). Writes
bench/results/native-kernels-<device>.json.
"""

from __future__ import annotations

import json
from functools import partial

import torch
import torch.nn.functional as F

from dsv4ray.bench import quant_sweep
from dsv4ray.bench.quant_sweep import graph_ms
from dsv4ray.bench.report import bench_parser, result, save_results
from dsv4ray.bench.roofline import ceilings, median_s
from dsv4ray.kernels import fp8_act, moe
from dsv4ray.kernels import fp8_linear as fp8
from dsv4ray.kernels.quant_tiles import dequantize_ref
from dsv4ray.model.quant import quantize_fp4, quantize_fp8

# (name, N per group, K, groups) of V4-Flash's FP8 linears: dsv4-mini's (the same per-layer
# shapes) and the KV projection
LINEARS = [*quant_sweep.LINEARS, ("wkv", 512, 4096, 1)]
HIDDEN, INTER, EXPERTS, TOPK = 4096, 2048, 256, 6
DECODE_ROWS = (1, 16, 64)


def _linear(n: int, k: int, groups: int):
    """(e4m3 weight, ue8m0 scales, bf16 dequantised weight) of a random [G N, K] linear."""
    w = torch.randn(groups * n, k, device="cuda") * k**-0.5
    q, s = quantize_fp8(w, (128, 128), "ue8m0")
    return q, s, dequantize_ref(q, s, "fp8").bfloat16()


def _dense(x, w, groups: int) -> torch.Tensor:
    if groups == 1:
        return F.linear(x, w)
    k = w.shape[1]
    y = torch.bmm(x.view(-1, groups, k).transpose(0, 1), w.view(groups, -1, k).transpose(1, 2))
    return y.transpose(0, 1).reshape(x.shape[0], -1)


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    if not err <= tol:
        raise SystemExit(f"{name}: max error {err:.3g} of the largest output (> {tol})")


def _one_linear(name: str, n: int, k: int, groups: int, copy_bw: float, prefill_rows: int):
    """(rows, raw timings) of one FP8 linear at the decode row counts and the prefill rows."""
    q, s, wd = _linear(n, k, groups)
    native = partial(fp8.fp8_linear, weight=q, scale=s, groups=groups)
    dense = partial(_dense, w=wd, groups=groups)
    rows, raw = [], {}
    for m in DECODE_ROWS:
        x = torch.randn(m, groups * k, device="cuda").bfloat16()
        _check(name, native(x), dense(x), 2e-2)
        ms, peer = graph_ms(partial(native, x)), graph_ms(partial(dense, x))
        floor = 1e3 * (q.numel() + s.numel() * s.element_size()) / copy_bw
        raw[f"{name} M={m}"] = {"native_ms": ms, "cublas_bf16_ms": peer, "copy_ms": floor}
        rows.append(result(f"{name}, {m} rows: FP8 weights as served vs their bytes at the copy "
                           "ceiling", ms, "ms", floor, None, "<=",
                           f"cuBLAS on the bf16 weight: {peer:.4f} ms"))  # fmt: skip
    x = torch.randn(prefill_rows, groups * k, device="cuda").bfloat16()
    ref = dense(x)
    _check(name, native(x), ref, 2e-2)
    timings = {"cublas_bf16_ms": 1e3 * median_s(partial(dense, x)),
               "native_ms": 1e3 * median_s(partial(native, x))}  # fmt: skip
    if fp8_act.supported(x.device):
        _check(name, native(x, act_fp8=True), ref, 0.1)
        timings["fp8_act_ms"] = 1e3 * median_s(partial(native, x, act_fp8=True))
    raw[f"{name} M={prefill_rows}"] = timings
    note = ", ".join(f"{key} {value:.4f}" for key, value in timings.items())
    for key, label in (("native_ms", "as served"), ("fp8_act_ms", "on FP8 activations")):
        if key in timings:
            rows.append(result(f"{name}, {prefill_rows} rows: FP8 weights {label} vs cuBLAS "
                               "bf16", timings[key], "ms", timings["cublas_bf16_ms"], 1.0, "<=",
                               note))  # fmt: skip
    return rows, raw


def linear_rows(copy_bw: float, prefill_rows: int) -> tuple[list, dict]:
    rows, raw = [], {}
    for name, n, k, groups in LINEARS:
        more, timings = _one_linear(name, n, k, groups, copy_bw, prefill_rows)
        rows += more
        raw.update(timings)
        torch.cuda.empty_cache()
    return rows, raw


def _experts(fmt: str):
    """(w13, w2, scales) of EXPERTS random experts in `fmt` (bf16 for "dense")."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2, s13, s2 = [], [], [], []
    for _ in range(EXPERTS):
        a = torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
        b = torch.randn(HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5
        if fmt == "dense":
            w13.append(a.bfloat16())
            w2.append(b.bfloat16())
            continue
        quantize = quantize_fp4 if fmt == "fp4" else partial(quantize_fp8, block=(128, 128),
                                                              scale_fmt="ue8m0")  # fmt: skip
        (g, gs), (u, us), (d, ds) = (quantize(t) for t in (a[:INTER], a[INTER:], b))
        w13.append(torch.cat([g, u]))  # gate rows, then up rows, each on its own scale grid
        s13.append(torch.cat([gs, us]))
        w2.append(d)
        s2.append(ds)
    stack = lambda ts: torch.stack(ts).contiguous()  # noqa: E731
    if fmt == "dense":
        return stack(w13), stack(w2), None
    # the scales stored as the worker stacks a layer's experts for serving
    return stack(w13), stack(w2), tuple(moe.stored_scales(fmt, stack(s)) for s in (s13, s2))


def _routing(m: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOPK]
                       for _ in range(m)])  # fmt: skip
    return x, ids, torch.rand(m, TOPK, device="cuda", generator=gen)


def _one_format(fmt: str, copy_bw: float, prefill, dense_out):
    """(rows, raw, prefill output) of the grouped experts in `fmt`: the decode row counts against
    the copy ceiling, then the prefill (x, ids, weights) timed."""
    w13, w2, scales = _experts(fmt)
    experts = partial(moe.fused_moe, w13=w13, w2=w2, limit=10.0, scales=scales, fmt=fmt)
    per_expert = sum(t[0].numel() * t.element_size() for t in (w13, w2, *(scales or ())))
    rows, raw = [], {}
    for m in DECODE_ROWS:
        x, ids, weights = _routing(m, seed=m)
        if m == DECODE_ROWS[-1]:  # the reference dequantises every expert to fp32 once
            ref = moe.fused_moe_ref(x, ids, weights, w13, w2, 10.0, scales, fmt)
            _check(f"experts {fmt}", experts(x, ids, weights), ref, 2e-2)
            del ref
        ms = graph_ms(partial(experts, x, ids, weights))
        touched = ids.unique().numel()
        floor = 1e3 * touched * per_expert / copy_bw
        raw[f"{fmt} experts M={m}"] = {"ms": ms, "copy_ms": floor}
        rows.append(result(f"grouped experts, {fmt}, {m} tokens vs their bytes at the copy "
                           "ceiling", ms, "ms", floor, None, "<=",
                           f"{touched} of {EXPERTS} experts touched"))  # fmt: skip
    out = experts(*prefill)
    if dense_out is not None:  # the same weights before quantisation: within its error
        _check(f"experts {fmt}, {prefill[0].shape[0]} tokens", out, dense_out, 0.25)
    raw[f"{fmt} experts M={prefill[0].shape[0]}"] = 1e3 * median_s(partial(experts, *prefill))
    return rows, raw, out


def expert_rows(copy_bw: float, prefill_rows: int) -> tuple[list, dict]:
    rows, raw = [], {}
    prefill = _routing(prefill_rows, seed=0)
    dense_out = None
    for fmt in ("dense", "fp8", "fp4"):
        more, timings, out = _one_format(fmt, copy_bw, prefill, dense_out)
        dense_out = out if dense_out is None else dense_out
        rows += more
        raw.update(timings)
        torch.cuda.empty_cache()
    bf16 = raw[f"dense experts M={prefill_rows}"]
    for fmt in ("fp8", "fp4"):
        rows.append(result(f"grouped experts, {fmt} as served vs bf16, {prefill_rows} tokens",
                           raw[f"{fmt} experts M={prefill_rows}"], "ms", bf16, 1.0, "<=",
                           f"{EXPERTS} experts, top-{TOPK}"))  # fmt: skip
    return rows, raw


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.add_argument("--prefill-rows", type=int, default=8192)
    p.add_argument("--only", default="linears,experts")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("native_kernels times GPU kernels: it needs CUDA")
    copy_bw = ceilings()["copy"]
    rows, raw = [], {}
    if "linears" in args.only:
        more, raw["linears"] = linear_rows(copy_bw, args.prefill_rows)
        rows += more
    if "experts" in args.only:
        more, raw["experts"] = expert_rows(copy_bw, args.prefill_rows)
        rows += more
    print(json.dumps(raw, indent=1))
    note = f"bf16 activations unless said; raw: {json.dumps(raw)}"
    settings = {"name": "settings", "value": None, "unit": "", "ceiling": None, "ratio": None,
                "op": ">=", "target": None, "note": note}  # fmt: skip
    ceil = {"device copy": {"value": copy_bw / 1e9, "unit": "GB/s", "note": "read + write"}}
    print(save_results(args, "native-kernels", torch.cuda.get_device_name(), ceil,
                       rows + [settings]))  # fmt: skip


if __name__ == "__main__":
    main()
