"""Tile-size sweep of the GPU kernels at bench/kernels.py's shapes: times each variant and prints a
table (and writes sweep.json), so one lent-GPU call can pick tile sizes.

    python bench/kernel_sweep.py [--out-dir DIR]     # GPU; on CPU it runs tiny shapes (interpreter)
"""

import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from dsv4ray.bench.kernels import (  # noqa: E402
    DRY,
    ENTRY_BYTES,
    FULL,
    Timer,
    _compress_case,
    _kv_pool,
    gbps,
    indexer_case,
)
from dsv4ray.bench.report import bench_parser  # noqa: E402
from dsv4ray.kernels import compress, indexer, sparse_mqa, topk  # noqa: E402


def _sweep_sparse(s, timer, device, rows):
    n, window = s.attn_requests, 128
    w_lay, w_pages = _kv_pool("window", n * window, device)
    w_slots = torch.arange(n * window, device=device).view(n, window)
    c_lay, c_pages = _kv_pool("c4", n * 8 * s.topk, device)
    picks = torch.rand(n, 8 * s.topk, device=device).argsort(1)[:, : s.topk]
    c_slots = (picks + 8 * s.topk * torch.arange(n, device=device)[:, None]).contiguous()
    q, sink = torch.randn(n, s.heads, 512, device=device), torch.randn(s.heads, device=device)
    moved = n * (window + s.topk) * ENTRY_BYTES
    default = sparse_mqa._config
    variants = [(c, k, q) for c in ((64, 32, 8), (64, 64, 8)) for k in (1, 2, 3)]
    variants.append(((64, 64, 8), 2, q.to(torch.bfloat16)))
    for config, splits, q_in in variants:
        sparse_mqa._config = lambda heads, bf16, config=config: (
            (*config, False) if bf16 else (16, 16, 4, False)
        )
        ms = timer.ms(
            lambda splits=splits, q_in=q_in: sparse_mqa.sparse_mqa_split(
                q_in, w_pages, w_slots, c_pages, c_slots, sink, 512**-0.5, w_lay, c_lay, splits
            )
        )
        rows.append(
            ("sparse", f"H,N,warps={config} splits={splits} q={q_in.dtype}", ms, gbps(moved, ms))
        )
    sparse_mqa._config = default


def _sweep_indexer(s, timer, device, rows):
    q, w, pages, table, req, bound, lay = indexer_case(s, device)
    moved = pages.shape[0] * lay.page_bytes
    default = indexer._config
    for config in ((16, 4), (32, 4), (64, 4), (32, 8), (64, 8)):
        indexer._config = lambda *args, config=config: config
        ms = timer.ms(lambda: indexer.indexer_scores(q, w, pages, table, req, bound, lay))
        rows.append(("indexer scores", f"pages/program,warps={config}", ms, gbps(moved, ms)))
    indexer._config = default
    scores = indexer.indexer_scores(q, w, pages, table, req, bound, lay)
    default = topk._config
    for config in ((2048, 8), (4096, 8), (8192, 16), (16384, 16)):
        topk._config = lambda config=config: config
        ms = timer.ms(lambda: topk.topk_rows(scores, s.topk))
        rows.append(("indexer top-k", f"radix, chunk,warps={config}", ms, gbps(moved, ms)))
    topk._config = default
    ms = timer.ms(lambda: topk.topk_rows_ref(scores, s.topk))
    rows.append(("indexer top-k", "torch.topk on int64 keys", ms, gbps(moved, ms)))


def _sweep_compress(s, timer, device, rows):
    default, default_split = compress._config, compress._split
    per_req = s.prefill_tokens // s.prefill_requests
    pos = torch.arange(per_req, device=device).repeat(s.prefill_requests)
    slots = torch.arange(s.prefill_requests, device=device).repeat_interleave(per_req)
    c128 = [(r, w, k) for k in (1, 2, 4, 8, 16) for r, w in ((8, 8), (8, 4), (16, 8))]
    for ratio, configs in ((128, c128), (4, ((8, 8, 1), (8, 4, 1), (8, 2, 1)))):
        args = _compress_case(ratio, pos, torch.zeros_like(pos), slots, s.prefill_requests, device)
        row = 2 * (2 if ratio == 4 else 1) * 512 * 4
        moved = pos.numel() * row + pos.numel() // ratio * ENTRY_BYTES
        moved += s.prefill_requests * (8 if ratio == 4 else 128) * row
        for rows_, warps, split in configs:
            compress._config = lambda r, d, config=(rows_, warps): config
            compress._split = lambda r, split=split: split
            ms = timer.ms(lambda args=args: compress.compress_norm_rope_store(*args))
            variant = f"rows,warps,split={(rows_, warps, split)}"
            rows.append((f"compress c{ratio} prefill", variant, ms, gbps(moved, ms)))
    compress._config, compress._split = default, default_split


SWEEPS = {"sparse": _sweep_sparse, "indexer": _sweep_indexer, "compress": _sweep_compress}


def main(argv=None) -> None:
    parser = bench_parser(__doc__, results=False)
    parser.add_argument("--out-dir", type=Path, default=None, help="write sweep.json here")
    parser.add_argument("--only", choices=sorted(SWEEPS), action="append",
                        help="sweep only these kernels (repeatable; default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = FULL if device.type == "cuda" else DRY
    timer, rows = Timer(device, sizes), []
    for sweep in (SWEEPS[name] for name in args.only or SWEEPS):
        try:
            sweep(sizes, timer, device, rows)
        except Exception as err:  # report and go on: one failing variant must not hide the rest
            rows.append((sweep.__name__, f"FAILED {type(err).__name__}: {err}"[:160], 0.0, 0.0))
    for kernel, variant, ms, rate in rows:
        print(f"{kernel:22s} {variant:58s} {1e3 * ms:9.1f} us {rate:8.0f} GB/s")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
