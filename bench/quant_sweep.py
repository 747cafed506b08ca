"""Tile sweep of the quantized-weight kernels at the dsv4-mini decode shapes: the weight-only FP8
linear (kernels/fp8_linear.py) against a GEMV-style variant, and the FP8 / FP4 grouped experts
(kernels/moe.py), each next to the bf16 peer (cuBLAS F.linear, the dense grouped experts) and the
copy ceiling. Every variant's output is checked against the torch reference before it is timed.

    python bench/quant_sweep.py [--out-dir DIR]      # one GPU
    python bench/quant_sweep.py --from-json sweep.json --commit SHA   # summarise a raw sweep

Writes the raw timings (sweep.json) and bench/results/quant-sweep-<device>.json: per kernel, shape
and M the time of the tiles the kernels ship, against the copy ceiling for the bytes read.
"""

import itertools
import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4ray.bench.report import (
    RESULTS_DIR,
    bench_parser,
    git_commit,
    result,
    write_benchmarks_md,
    write_results,
)
from dsv4ray.bench.roofline import ceilings
from dsv4ray.kernels import fp8_linear as fp8
from dsv4ray.kernels import moe
from dsv4ray.kernels.bits import num_sms
from dsv4ray.kernels.quant_tiles import dequantize_ref, kernel_bytes, load_scale
from dsv4ray.model.quant import quantize_fp4, quantize_fp8

# (name, N per group, K, groups) of the dsv4-mini FP8 linears
LINEARS = [
    ("q_b", 32768, 1024, 1),
    ("o_a", 1024, 4096, 8),
    ("o_b", 4096, 8192, 1),
    ("q_a", 1024, 4096, 1),
    ("idx_q_b", 8192, 1024, 1),
]
HIDDEN, INTER, EXPERTS, TOPK = 4096, 2048, 8, 2


def graph_ms(fn, reps: int = 20, iters: int = 10) -> float:
    """Median ms of one fn call, replayed from a CUDA graph of `reps` calls (bench/kernels.py's
    Timer graphs one call per replay: at ~10 us kernels the replay's own launch would count)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


@triton.jit(do_not_specialize=["M", "k_per_split", "num_splits"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    part_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_sn,
    block_n,
    block_k,
    k_per_split,
    num_splits,
    SCALE_BYTES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # program (n tile * num_splits + split, group g): part[split, m, g N + n], m < ROWS
    n = (tl.program_id(0) // num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(0) % num_splits
    g = tl.program_id(1).to(tl.int64)
    m = tl.arange(0, ROWS)
    m_ok, n_ok = m < M, n < N
    w_rows = g * N + n
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((ROWS, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(
            w_ptr + w_rows[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
        )
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + g * K + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        s = load_scale(s_ptr + (w_rows // block_n) * stride_sn + k0 // block_k, n_ok, SCALE_BYTES)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2) * s[None, :]
    width = tl.num_programs(1) * N
    offs = m.to(tl.int64)[:, None] * width + w_rows[None, :]
    tl.store(
        part_ptr + split.to(tl.int64) * M * width + offs, acc, mask=m_ok[:, None] & n_ok[None, :]
    )


def gemv(x, weight, scale, groups, rows, block_n, block_k, warps, stages, sm_mult):
    n, k = weight.shape[0] // groups, weight.shape[1]
    m = x.shape[0]
    tiles_n = triton.cdiv(n, block_n) * groups
    k_steps = triton.cdiv(k, block_k)
    target = sm_mult * num_sms(x.device)
    splits = 1 if tiles_n >= target else min(k_steps, triton.cdiv(target, tiles_n))
    per = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, per)
    part = torch.empty(splits, m, groups * n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n) * splits, groups)](
        x,
        kernel_bytes(weight),
        kernel_bytes(scale),
        part,
        m,
        n,
        k,
        x.stride(0),
        scale.shape[1],
        128,
        128,
        per * block_k,
        splits,
        SCALE_BYTES=scale.element_size() == 1,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return part.sum(0).to(x.dtype) if splits > 1 else part[0].to(x.dtype)


def _close(out, ref) -> bool:
    return bool(((out.float() - ref.float()).abs() <= 2e-2 * ref.float().abs().max() + 1e-3).all())


def sweep_linear(name, n, k, groups, m, copy_gbps, rows_out):
    w = torch.randn(groups * n, k, device="cuda") * k**-0.5
    codes, scale = quantize_fp8(w, (128, 128), "ue8m0")
    codes, scale = codes.cuda(), scale.cuda()
    x = torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)
    ref = fp8.fp8_linear_ref(x, codes, scale, (128, 128), groups)
    wbytes = codes.numel()
    dense = dequantize_ref(codes, scale, "fp8").to(torch.bfloat16)

    def row(variant, fn, moved):
        out = fn()
        ok = _close(out, ref) if variant != "cuBLAS bf16" else True
        ms = graph_ms(fn)
        r = dict(
            kernel="fp8_linear",
            shape=name,
            m=m,
            variant=variant,
            ms=ms,
            ok=ok,
            gbps=moved / ms / 1e6,
            of_ceiling=moved / ms / 1e6 / copy_gbps,
        )
        rows_out.append(r)
        print(json.dumps(r), flush=True)

    if groups == 1:
        row("cuBLAS bf16", lambda: F.linear(x, dense), 2 * wbytes)
    else:
        dg = dense.view(groups, n, k)
        xg = x.view(m, groups, k).transpose(0, 1)
        row("cuBLAS bf16", lambda: torch.bmm(xg, dg.transpose(1, 2)), 2 * wbytes)
    row("current", lambda: fp8.fp8_linear(x, codes, scale, (128, 128), groups), wbytes)
    orig = fp8.tiles
    bm = 16 if m <= 16 else 64
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 5)):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        fp8.tiles = lambda *_, cfg=cfg: dict(cfg)
        try:
            row(
                f"dot {bn}x{bk} w{warps} s{stages}",
                lambda: fp8.fp8_linear(x, codes, scale, (128, 128), groups),
                wbytes,
            )
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print("skip", cfg, type(e).__name__, str(e)[:100])
        finally:
            fp8.tiles = orig
    if m <= 4:
        rows = triton.next_power_of_2(m)
        for bn, bk, warps, stages, mult in itertools.product(
            (16, 32, 64), (128,), (2, 4, 8), (2, 4), (1, 2, 4)
        ):
            row(
                f"gemv {bn}x{bk} w{warps} s{stages} x{mult}",
                lambda c=(bn, bk, warps, stages, mult): gemv(x, codes, scale, groups, rows, *c),
                wbytes,
            )


def sweep_moe(fmt, m, copy_gbps, rows_out):
    g = torch.Generator().manual_seed(0)
    quantize = (
        quantize_fp4 if fmt == "fp4" else partial(quantize_fp8, block=(128, 128), scale_fmt="ue8m0")
    )
    q13 = [
        quantize(torch.randn(2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5) for _ in range(EXPERTS)
    ]
    q2 = [quantize(torch.randn(HIDDEN, INTER, generator=g) * INTER**-0.5) for _ in range(EXPERTS)]
    w13 = torch.stack([a for a, _ in q13]).cuda()
    s13 = torch.stack([b for _, b in q13]).cuda()
    w2 = torch.stack([a for a, _ in q2]).cuda()
    s2 = torch.stack([b for _, b in q2]).cuda()
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(m)]).cuda()
    wts = torch.rand(m, TOPK, generator=g).cuda()
    ref = moe.fused_moe_ref(x, ids, wts, w13, w2, 10.0, (s13, s2), fmt)
    active = ids.unique().numel()
    moved = (w13[0].numel() + w2[0].numel()) * active
    d13 = torch.stack([dequantize_ref(a, b, fmt) for a, b in zip(w13, s13)]).to(torch.bfloat16)
    d2 = torch.stack([dequantize_ref(a, b, fmt) for a, b in zip(w2, s2)]).to(torch.bfloat16)

    def row(variant, fn, nbytes, check=True):
        out = fn()
        ok = _close(out, ref) if check else True
        ms = graph_ms(fn)
        r = dict(
            kernel=f"moe {fmt}",
            m=m,
            variant=variant,
            ms=ms,
            ok=ok,
            gbps=nbytes / ms / 1e6,
            of_ceiling=nbytes / ms / 1e6 / copy_gbps,
        )
        rows_out.append(r)
        print(json.dumps(r), flush=True)

    dense_bytes = 2 * active * (d13[0].numel() + d2[0].numel())
    row(
        "dense bf16 (current tiles)",
        lambda: moe.fused_moe(x, ids, wts, d13, d2, 10.0),
        dense_bytes,
        False,
    )
    row("current", lambda: moe.fused_moe(x, ids, wts, w13, w2, 10.0, (s13, s2), fmt), moved)
    orig = moe._tiles
    for bm, bn, bk, warps, stages in itertools.product(
        (16, 64), (32, 64, 128), (64, 128, 256), (4,), (2, 3)
    ):
        if fmt == "fp8" and bk > 128:
            continue
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        moe._tiles = lambda listed, fmt, pairs, *rest, cfg=cfg: (
            dict(cfg, SWAP=False) if listed else orig(listed, fmt, pairs, *rest)
        )
        try:
            row(
                f"{bm}x{bn}x{bk} w{warps} s{stages}",
                lambda: moe.fused_moe(x, ids, wts, w13, w2, 10.0, (s13, s2), fmt),
                moved,
            )
        except Exception as e:  # noqa: BLE001
            print("skip", cfg, type(e).__name__, str(e)[:100])
        finally:
            moe._tiles = orig


def tiles_name(kernel: str, m: int) -> str:
    """The sweep's variant name of the tiles the kernels ship for M = m."""
    if kernel == "fp8_linear":
        t = fp8.tiles(m)
        return f"dot {t['BLOCK_N']}x{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']}"
    fmt = kernel.split()[1]
    t = moe._tiles(True, fmt, m * TOPK, False, EXPERTS)
    return f"{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']}"


def summary_rows(rows: list, copy_gbps: float) -> list:
    """Per kernel, shape and M: the shipped tiles' time against the copy ceiling for the bytes the
    kernel must read, beside the tiles of the run's commit, the sweep's best and the bf16 peer."""
    out = []
    keys = dict.fromkeys((r["kernel"], r.get("shape"), r["m"]) for r in rows)
    for kernel, shape, m in keys:
        group = {
            r["variant"]: r
            for r in rows
            if (r["kernel"], r.get("shape"), r["m"]) == (kernel, shape, m)
        }
        shipped = group.get(tiles_name(kernel, m))
        if shipped is None or not shipped["ok"]:
            continue
        peer = next(r for v, r in group.items() if v == "cuBLAS bf16" or v.startswith("dense"))
        best = min(
            (r for v, r in group.items() if r["ok"] and r is not peer), key=lambda r: r["ms"]
        )
        moved = shipped["gbps"] * shipped["ms"] * 1e6  # bytes
        ceiling_us = moved / copy_gbps / 1e3
        name = f"{kernel} {shape or ''} M={m}".replace("  ", " ")
        before = group["current"]["ms"] * 1e3
        note = (
            f"tiles {shipped['variant']}; the run's commit's tiles {before:.1f} us; best of "
            f"the sweep {best['variant']} {best['ms'] * 1e3:.1f} us; bf16 peer "
            f"({peer['variant']}, twice the weight bytes) {peer['ms'] * 1e3:.1f} us; "
            f"{moved / 2**20:.1f} MiB read"
        )
        out.append(result(name, shipped["ms"] * 1e3, "us", ceiling_us, None, "<=", note))
    return out


def write_summary(raw: dict, out_dir) -> str:
    ceil = {"device copy": {"value": raw["copy_gbps"], "unit": "GB/s", "note": "read + write"}}
    path = write_results(
        "quant-sweep",
        raw["device"],
        raw["commit"],
        ceil,
        summary_rows(raw["rows"], raw["copy_gbps"]),
        out_dir,
    )
    if Path(out_dir).resolve() == RESULTS_DIR:
        write_benchmarks_md()
    return str(path)


def main(argv=None) -> None:
    p = bench_parser(__doc__)  # --out-dir: the results file; the raw sweep.json (default: .)
    p.add_argument("--only", default="linear,moe")
    p.add_argument("--from-json", default=None, help="summarise a raw sweep.json, time nothing")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(write_summary(json.load(f), args.out_dir or RESULTS_DIR))
        return
    copy_gbps = ceilings()["copy"] / 1e9
    print("copy GB/s (read + write)", copy_gbps)
    rows = []
    if "linear" in args.only:
        for name, n, k, groups in LINEARS:
            for m in (1, 64):
                sweep_linear(name, n, k, groups, m, copy_gbps, rows)
    if "moe" in args.only:
        for fmt in ("fp4", "fp8"):
            for m in (1, 64):
                sweep_moe(fmt, m, copy_gbps, rows)
    raw = dict(
        device=torch.cuda.get_device_name(),
        commit=args.commit or git_commit(),
        copy_gbps=copy_gbps,
        rows=rows,
    )
    with open(os.path.join(args.out_dir or ".", "sweep.json"), "w") as f:
        json.dump(raw, f)
    for row in summary_rows(rows, copy_gbps):
        print(
            f"{row['name']}: {row['value']:.1f} us ({1 / row['ratio']:.0%} of the ceiling); "
            f"{row['note']}"
        )
    print(write_summary(raw, args.out_dir or RESULTS_DIR))


if __name__ == "__main__":
    main()
