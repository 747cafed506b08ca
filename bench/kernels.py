"""Kernel benchmark: the ceilings and each kernel's achieved bandwidth in one run (PERF.md).

    python bench/kernels.py --commit <sha>                # GPU: bench/results, bench/BENCHMARKS.md
    python bench/kernels.py --commit <sha> --out-dir DIR  # results file and a BENCHMARKS.md in DIR
    python bench/kernels.py --dry-run                     # tiny sizes; runs on CPU (interpreter)

Achieved bandwidth = bytes that must move / median time (CUDA events, after warmup). Against the
device copy ceiling bytes count as read + written (like `b.copy_(a)`); against the pinned ceilings,
bytes crossing the bus, compared with the ceiling measured at the nearest batch size. A dry run
writes into a temporary directory unless --out-dir is given.
"""

import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from dsv4ray.bench.report import (  # noqa: E402
    BENCHMARKS_MD,
    RESULTS_DIR,
    bench_parser,
    git_commit,
    result,
    write_benchmarks_md,
    write_results,
)
from dsv4ray.cache.layout import read_entries, write_entries  # noqa: E402
from dsv4ray.cache.page_layout import layout_for  # noqa: E402
from dsv4ray.kernels import compress, indexer, sparse_mqa, topk, transfer  # noqa: E402

MIB = 1 << 20
ENTRY_BYTES = 584  # fp8 kv entry: 576 value bytes + 8 scale bytes


@dataclass(frozen=True)
class Sizes:
    copy_bytes: tuple  # device copy ceiling, one measurement per size
    pinned_bytes: tuple  # pinned H2D / D2H ceilings
    transfer_bytes: int  # page-row and token transfer batches
    layers: int
    decode_requests: int  # compress decode: one block-completing token per request
    prefill_requests: int
    prefill_tokens: int
    index_requests: int  # indexer decode
    index_entries: int  # visible C4 entries per request (context / 4)
    heads: int  # indexer and attention heads
    topk: int
    attn_requests: int  # sparse decode attention
    warmup: int
    iters: int


FULL = Sizes(
    copy_bytes=(2 << 30, 4 << 30),
    pinned_bytes=(16 * MIB, 64 * MIB, 256 * MIB),
    transfer_bytes=64 * MIB,
    layers=4,
    decode_requests=1024,
    prefill_requests=16,
    prefill_tokens=16384,
    index_requests=64,
    index_entries=16384,
    heads=64,
    topk=512,
    attn_requests=64,
    warmup=3,
    iters=20,
)
DRY = Sizes(
    copy_bytes=(4 * MIB,),
    pinned_bytes=(MIB,),
    transfer_bytes=MIB,
    layers=2,
    decode_requests=8,
    prefill_requests=2,
    prefill_tokens=64,
    index_requests=2,
    index_entries=128,
    heads=4,
    topk=16,
    attn_requests=2,
    warmup=1,
    iters=2,
)


class Timer:
    """Median milliseconds of a callable.

    On CUDA the callable is captured once into a CUDA graph and the replays are timed, so the launch
    overhead of the Python wrappers is not counted; `mode` says how the last measurement ran.
    """

    def __init__(self, device: torch.device, sizes: Sizes):
        self.cuda = device.type == "cuda"
        self.warmup, self.iters = sizes.warmup, sizes.iters
        self.mode = "CUDA graph" if self.cuda else "eager"

    def ms(self, fn, graph: bool = True) -> float:
        """Median ms of fn; graph=False times eager launches on CUDA too."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda or not graph:
            if self.cuda:
                self.mode = "eager"
                return self._eager_cuda(fn)
            times = []
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        run = self._graphed(fn)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.iters)
        ]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def _eager_cuda(self, fn) -> float:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def _graphed(self, fn):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as err:
            self.mode = f"eager (graph capture failed: {str(err).splitlines()[0][:80]})"
            return fn
        self.mode = "CUDA graph"
        return graph.replay


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e6)


def _host(shape, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")


def measure_ceilings(sizes: Sizes, timer: Timer, device) -> dict:
    """Device copy at each size, captured in a CUDA graph and eager (a graph may turn the copy into
    a copy-engine memcpy node); the best is `device_copy`. Then the pinned host copies."""
    ceilings = {}
    for n in sizes.copy_bytes:
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        for graph in (True, False):
            ms = timer.ms(lambda a=a, b=b: b.copy_(a), graph=graph)
            ceilings[f"device_copy_{n // MIB}MiB_{'graph' if graph else 'eager'}"] = {
                "value": gbps(2 * n, ms),
                "unit": "GB/s",
                "note": f"b.copy_(a), {n // MIB} MiB, read + written; {timer.mode}",
            }
        del a, b
    best = max((k for k in ceilings), key=lambda k: ceilings[k]["value"])
    ceilings["device_copy"] = {
        "value": ceilings[best]["value"],
        "unit": "GB/s",
        "note": f"best of the device_copy_* rows ({best})",
    }
    for n in sizes.pinned_bytes:
        host, dev = _host(n, device), torch.empty(n, dtype=torch.uint8, device=device)
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            ms = timer.ms(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True))
            kind = "pinned" if device.type == "cuda" else "host (no CUDA)"
            ceilings[f"{name}_{n // MIB}MiB"] = {
                "value": gbps(n, ms),
                "unit": "GB/s",
                "note": f"{kind} copy_, {n // MIB} MiB; {timer.mode}",
            }
    return ceilings


def pinned_ceiling(ceilings: dict, direction: str, num_bytes: int) -> float:
    """The pinned ceiling of `direction` measured at the size nearest (log scale) to num_bytes."""
    sizes = [int(k.split("_")[1][:-3]) * MIB for k in ceilings if k.startswith(direction)]
    nearest = min(sizes, key=lambda n: abs(math.log2(n / num_bytes)))
    return ceilings[f"{direction}_{nearest // MIB}MiB"]["value"]


def bench_page_rows(s: Sizes, timer: Timer, device, ceilings: dict) -> list:
    lay = layout_for("c4", "fp8")
    pages = max(2, s.transfer_bytes // (s.layers * lay.page_bytes))
    num_bytes = pages * lay.page_bytes * s.layers
    dev = [
        torch.randint(0, 256, (pages, lay.page_bytes), dtype=torch.uint8, device=device)
        for _ in range(s.layers)
    ]
    host = [_host((pages, lay.page_bytes), device) for _ in range(s.layers)]
    src_pages = torch.randperm(pages, device=device)
    dst_pages = torch.randperm(pages, device=device)
    note = f"{s.layers} layers x {pages} c4 fp8 pages ({num_bytes / MIB:.0f} MiB)"
    rows = []
    for name, src, dst, direction in (
        ("device -> pinned host", dev, host, "d2h"),
        ("pinned host -> device", host, dev, "h2d"),
    ):
        ms = timer.ms(
            lambda src=src, dst=dst: transfer.transfer_page_rows(src, dst, src_pages, dst_pages)
        )
        rows.append(
            result(
                f"page-row transfer, {name}",
                gbps(num_bytes, ms),
                "GB/s",
                pinned_ceiling(ceilings, direction, num_bytes),
                0.9,
                note=f"{note}; vs pinned {direction} ceiling; {timer.mode}",
            )
        )
    return rows


def bench_token_transfer(s: Sizes, timer: Timer, device, ceilings: dict) -> list:
    lay = layout_for("c4", "fp8")
    num = max(8, s.transfer_bytes // (s.layers * ENTRY_BYTES))
    pages = -(-2 * num // lay.entries_per_page)  # the entries are a random half of the pool
    src = [
        torch.randint(0, 256, (pages, lay.page_bytes), dtype=torch.uint8, device=device)
        for _ in range(s.layers)
    ]
    host = [_host((pages, lay.page_bytes), device) for _ in range(s.layers)]
    dev = [torch.empty_like(t) for t in src]
    src_idx = torch.randperm(pages * lay.entries_per_page, device=device)[:num]
    dst_idx = torch.randperm(pages * lay.entries_per_page, device=device)[:num]
    moved = num * s.layers * ENTRY_BYTES
    note = f"{s.layers} layers x {num} random c4 fp8 entries (584 B, value/scale split)"
    d2h_ms = timer.ms(lambda: transfer.transfer_cache_dsv4_mla(src, host, src_idx, dst_idx, lay))
    d2h = result(
        "token transfer, device -> pinned host",
        gbps(moved, d2h_ms),
        "GB/s",
        pinned_ceiling(ceilings, "d2h", moved),
        0.6,
        note=f"{note}; vs pinned d2h ceiling; {timer.mode}",
    )
    d2d_ms = timer.ms(lambda: transfer.transfer_cache_dsv4_mla(src, dev, src_idx, dst_idx, lay))
    d2d = result(
        "token transfer, device -> device",
        gbps(2 * moved, d2d_ms),
        "GB/s",
        ceilings["device_copy"]["value"],
        0.4,
        note=f"{note}; read + written; {timer.mode}",
    )
    return [d2h, d2d]


def _compress_case(ratio: int, positions, seq_start, state_slots, num_slots: int, device):
    """Arguments of compress_norm_rope_store for one batch, fp8 pages, main compressor (d = 512)."""
    lay = layout_for("c4" if ratio == 4 else "c128", "fp8")
    cd, ring, num = (2 if ratio == 4 else 1) * 512, (8 if ratio == 4 else 128), positions.numel()
    done = (positions + 1) % ratio == 0
    out_loc = torch.full((num,), -1, dtype=torch.int64, device=device)
    out_loc[done] = torch.randperm(int(done.sum()), device=device)
    pages = torch.zeros(
        -(-num // lay.entries_per_page), lay.page_bytes, dtype=torch.uint8, device=device
    )
    cos, sin = torch.rand(2, int(positions.max()) + 1, 32, device=device).unbind(0)
    return (
        torch.randn(num, cd, device=device),
        torch.randn(num, cd, device=device),
        positions,
        state_slots,
        seq_start,
        torch.randn(num_slots, ring, cd, device=device),
        torch.randn(num_slots, ring, cd, device=device),
        torch.randn(ratio, cd, device=device),
        torch.rand(512, device=device),
        1e-6,
        cos.contiguous(),
        sin.contiguous(),
        out_loc,
        pages,
        lay,
        ratio,
    )


def bench_compress(s: Sizes, timer: Timer, device, ceilings: dict) -> list:
    copy, rows = ceilings["device_copy"]["value"], []
    n = s.decode_requests  # decode: every token completes a block, 7 of its 8 rows are in the ring
    pos = 4 * torch.randint(1, 1000, (n,), device=device) + 3
    args = _compress_case(4, pos, pos, torch.arange(n, device=device), n, device)
    row = 2 * 1024 * 4  # kv + score, fp32
    ms = timer.ms(lambda: compress.compress_norm_rope_store(*args))
    rows.append(
        result(
            "compress c4 decode",
            gbps(n * (8 * row + ENTRY_BYTES + row), ms),
            "GB/s",
            copy,
            0.5,
            note=f"{n} requests, all completing; 8 rows read, entry + "
            f"ring row written; {timer.mode}",
        )
    )
    for ratio in (4, 128):
        per_req = s.prefill_tokens // s.prefill_requests
        pos = torch.arange(per_req, device=device).repeat(s.prefill_requests)
        starts = torch.zeros_like(pos)
        slots = torch.arange(s.prefill_requests, device=device).repeat_interleave(per_req)
        args = _compress_case(ratio, pos, starts, slots, s.prefill_requests, device)
        row = 2 * (2 if ratio == 4 else 1) * 512 * 4
        ring = 8 if ratio == 4 else 128
        moved = pos.numel() * row + pos.numel() // ratio * ENTRY_BYTES
        moved += s.prefill_requests * ring * row
        ms = timer.ms(lambda args=args: compress.compress_norm_rope_store(*args))
        rows.append(
            result(
                f"compress c{ratio} prefill",
                gbps(moved, ms),
                "GB/s",
                copy,
                0.5,
                note=f"{s.prefill_requests} x {per_req} tokens; rows read once; "
                f"{1e3 * ms:.1f} us; {timer.mode}",
            )
        )
    return rows


def indexer_case(s: Sizes, device) -> tuple:
    """(q, weights, pages, page_table, req_idx, bound, layout): every request's decode query over
    s.index_entries fp8 indexer keys in shuffled pages."""
    lay = layout_for("indexer", "fp8")
    pages_per_req = s.index_entries // lay.entries_per_page
    num_pages = s.index_requests * pages_per_req
    pages = torch.empty(num_pages, lay.page_bytes, dtype=torch.uint8, device=device)
    slots = torch.arange(num_pages * lay.entries_per_page, device=device)
    write_entries(pages, slots, torch.randn(slots.numel(), 128, device=device), lay)
    page_table = torch.randperm(num_pages, device=device).view(s.index_requests, pages_per_req)
    q = torch.randn(s.index_requests, s.heads, 128, device=device)
    weights = torch.randn(s.index_requests, s.heads, device=device)
    req_idx = torch.arange(s.index_requests, device=device)
    bound = torch.full((s.index_requests,), s.index_entries, device=device)
    return q, weights, pages, page_table, req_idx, bound, lay


def bench_indexer(s: Sizes, timer: Timer, device, ceilings: dict) -> list:
    q, weights, pages, page_table, req_idx, bound, lay = indexer_case(s, device)
    num_pages = pages.shape[0]
    ms = timer.ms(
        lambda: indexer.indexer_topk(q, weights, pages, page_table, req_idx, bound, s.topk, lay)
    )
    scores = indexer.indexer_scores(q, weights, pages, page_table, req_idx, bound, lay)
    scores_ms = timer.ms(
        lambda: indexer.indexer_scores(q, weights, pages, page_table, req_idx, bound, lay)
    )
    topk_ms = timer.ms(lambda: topk.topk_rows(scores, s.topk))
    moved = num_pages * lay.page_bytes
    return [
        result(
            "indexer logits + top-k, decode",
            gbps(moved, ms),
            "GB/s",
            ceilings["device_copy"]["value"],
            0.5,
            note=f"{s.index_requests} requests x {s.index_entries} C4 entries (context "
            f"{4 * s.index_entries}), {s.heads} heads, top-{s.topk}; K bytes read; "
            f"{1e3 * ms:.1f} us = scores {1e3 * scores_ms:.1f} us + top-k "
            f"{1e3 * topk_ms:.1f} us (each alone); {timer.mode}",
        )
    ]


def _kv_pool(kind: str, num_entries: int, device):
    lay = layout_for(kind, "fp8")
    pages = torch.empty(
        -(-num_entries // lay.entries_per_page), lay.page_bytes, dtype=torch.uint8, device=device
    )
    slots = torch.arange(pages.shape[0] * lay.entries_per_page, device=device)
    write_entries(pages, slots, torch.randn(slots.numel(), 512, device=device), lay)
    return lay, pages


def _dense_attention_ms(timer: Timer, q: torch.Tensor, *pools: tuple) -> float:
    """Median ms of dense bf16 attention (bmm, softmax, bmm) of q [n, H, 512] over each token's
    keys of `pools` ((pages, slots [n, k], layout) each), gathered and dequantised beforehand: the
    tensor-core work of sparse_mqa without its gather, dequantisation or sink."""
    n = q.shape[0]
    kv = torch.cat(
        [read_entries(pages, slots.flatten(), lay).view(n, -1, 512) for pages, slots, lay in pools],
        1,
    ).to(torch.bfloat16)
    qb = q.to(torch.bfloat16)
    scale = 512**-0.5

    def dense():
        probs = (torch.bmm(qb, kv.transpose(1, 2)).float() * scale).softmax(-1)
        return torch.bmm(probs.to(torch.bfloat16), kv)

    return timer.ms(dense)


def bench_sparse_mqa(s: Sizes, timer: Timer, device, ceilings: dict) -> list:
    n, window = s.attn_requests, 128
    w_lay, w_pages = _kv_pool("window", n * window, device)
    w_slots = torch.arange(n * window, device=device).view(n, window)
    q, sink = torch.randn(n, s.heads, 512, device=device), torch.randn(s.heads, device=device)
    rows = []
    for kind, history in (("c4", 8 * s.topk), ("c128", s.topk)):  # top-k of C4 / all of C128
        c_lay, c_pages = _kv_pool(kind, n * history, device)
        picks = torch.rand(n, history, device=device).argsort(1)[:, : s.topk]
        c_slots = (picks + history * torch.arange(n, device=device)[:, None]).contiguous()
        ms = timer.ms(
            lambda c_lay=c_lay, c_pages=c_pages, c_slots=c_slots: sparse_mqa.sparse_mqa(
                q, w_pages, w_slots, c_pages, c_slots, sink, 512**-0.5, w_lay, c_lay
            )
        )
        peer_ms = _dense_attention_ms(
            timer, q, (w_pages, w_slots, w_lay), (c_pages, c_slots, c_lay)
        )
        moved = n * (window + s.topk) * ENTRY_BYTES
        splits = sparse_mqa.num_splits_for(n, 1, window + s.topk, device)
        rows.append(
            result(
                f"sparse decode attention, window + {kind}",
                gbps(moved, ms),
                "GB/s",
                ceilings["device_copy"]["value"],
                0.5,
                note=f"{n} requests, {s.heads} heads, {window} + {s.topk} fp8 "
                f"entries each; KV bytes read; {1e3 * ms:.1f} us, {splits} key "
                f"splits; {timer.mode}; peer: torch bf16 bmm + softmax + bmm over the same "
                f"keys already gathered and dequantised {1e3 * peer_ms:.1f} us",
            )
        )
    return rows


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes; runs on CPU; results (and a BENCHMARKS.md) in a temporary directory "
        "unless --out-dir is given",
    )
    args = parser.parse_args(argv)
    sizes = DRY if args.dry_run else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out_dir = Path(args.out_dir or (tempfile.mkdtemp() if args.dry_run else RESULTS_DIR))
    timer = Timer(device, sizes)
    ceilings = measure_ceilings(sizes, timer, device)
    results = []
    for bench in (
        bench_page_rows,
        bench_token_transfer,
        bench_compress,
        bench_indexer,
        bench_sparse_mqa,
    ):
        results += bench(sizes, timer, device, ceilings)
    path = write_results("kernels", name, args.commit or git_commit(), ceilings, results, out_dir)
    report = BENCHMARKS_MD if out_dir.resolve() == RESULTS_DIR else out_dir / "BENCHMARKS.md"
    write_benchmarks_md(out_dir, report)
    for r in results:
        print(
            f"{r['name']:45s} {r['value']:9.1f} {r['unit']}  ratio {r['ratio']:.2f} "
            f"(target {r['op']} {r['target']})"
        )
    print(f"wrote {path} and {report}")


if __name__ == "__main__":
    main()
