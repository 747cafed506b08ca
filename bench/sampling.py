"""Host-side costs of the last stage and the output path, each against the scheme it replaces.

Detokenisation of an 8,192-token answer (the tiny byte-level tokenizer, multi-byte text): the
streaming decoder against re-decoding the whole output per token, and OutputProcessor.on_token
with two stop strings against re-decoding plus a stop search over the whole text. Sampling of
one decode step (batch 64, vocab 129,280, temperature / top-k / top-p, logprobs on a quarter of
the rows): the batched pass against the per-request reference loop. Writes
bench/results/sampling-<device>.json.

    python bench/sampling.py [--device cuda] [--commit SHA]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict

import torch

from dsv4ray.bench.report import bench_parser, device_slug, result, save_results
from dsv4ray.engine.output_processor import OutputProcessor
from dsv4ray.engine.request import FinishedRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.text.tokenizer import StreamDecoder, Tokenizer
from dsv4ray.text.tokenizer_files import write_byte_tokenizer
from dsv4ray.worker.sampling.sampler import (
    ReferenceSampler,
    SamplingRow,
    reference_logprobs,
    sample_batch,
)

NUM_ANSWER_TOKENS = 8192
STOPS = ["<never>", "\n\n\n\n"]
TEXT = "The answer, step by step: 日本語のテキスト, naïve café, ✓ done 😀.\n"


def _answer_ids() -> list[int]:
    data = (TEXT * (NUM_ANSWER_TOKENS // len(TEXT.encode()) + 1)).encode()
    return [b + 2 for b in data[:NUM_ANSWER_TOKENS]]  # byte b is token b + 2


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _redecode(tok: Tokenizer, ids: list[int], stops: list[str]) -> str:
    """The replaced scheme: decode the whole output per token, search the whole text."""
    text = ""
    for i in range(1, len(ids) + 1):
        full = tok.decode(ids[:i])
        if not full.endswith("\ufffd"):
            text = full
        for stop in stops:
            text.find(stop)
    return text


def _stream(tok: Tokenizer, ids: list[int]) -> str:
    decoder = StreamDecoder(tok)
    return "".join(decoder.push([token]) for token in ids) + decoder.flush()


def _processor(tok: Tokenizer, ids: list[int]) -> str:
    proc = OutputProcessor(tok)
    proc.add("r", [0], SamplingParams(max_tokens=len(ids), stop=STOPS))
    for token in ids:
        proc.on_token("r", token, None)
    return proc.on_finish(FinishedRequest("r", [0], ids, "length", 0)).text


def detok_rows(repeats: int) -> tuple[dict, list]:
    with tempfile.TemporaryDirectory() as path:
        write_byte_tokenizer(path)
        tok = Tokenizer(path)
    ids = _answer_ids()
    assert _stream(tok, ids) == _processor(tok, ids) == tok.decode(ids)
    old_stream = _median_s(lambda: _redecode(tok, ids, []), max(1, repeats // 4))
    old_stops = _median_s(lambda: _redecode(tok, ids, STOPS), max(1, repeats // 4))
    new_stream = _median_s(lambda: _stream(tok, ids), repeats)
    new_stops = _median_s(lambda: _processor(tok, ids), repeats)
    note = f"{NUM_ANSWER_TOKENS}-token answer, byte-level tokenizer; ratio = new / old, target 10x"
    ceilings = {
        "re-decode per token": {"value": old_stream * 1e3, "unit": "ms", "note": note},
        "re-decode + whole-text stop search": {
            "value": old_stops * 1e3,
            "unit": "ms",
            "note": note,
        },
    }
    rows = [
        result("StreamDecoder", new_stream * 1e3, "ms", old_stream * 1e3, 0.1, "<=", note),
        result(
            "OutputProcessor.on_token, 2 stop strings",
            new_stops * 1e3,
            "ms",
            old_stops * 1e3,
            0.1,
            "<=",
            note,
        ),
    ]
    return ceilings, rows


def _sampling_case(device: torch.device, batch: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device)
    settings = [(1.0, -1, 1.0), (0.7, 50, 1.0), (0.9, -1, 0.9), (0.8, 40, 0.95)]
    rows = [
        SamplingRow(*settings[i % len(settings)], seed=i) if i % 8 else SamplingRow(0.0, 1.0, -1, i)
        for i in range(batch)
    ]
    num_top = [5 if i % 4 == 0 else None for i in range(batch)]
    return logits, rows, list(range(1000, 1000 + batch)), num_top


def _reference_step(logits, rows, num_top) -> None:
    for row, x, n in zip(rows, logits, num_top):
        token = ReferenceSampler(asdict(row), row.seed).sample(x)
        if n is not None:
            reference_logprobs(x, token, n)


def sampling_rows(device: torch.device, repeats: int) -> tuple[dict, list]:
    batch, vocab = 64, 129_280
    logits, rows, positions, num_top = _sampling_case(device, batch, vocab)

    def batched():
        sample_batch(logits, rows, positions, num_top)  # ends in its one host copy

    def reference():
        _reference_step(logits, rows, num_top)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    batched(), reference()  # warm-up
    new = _median_s(batched, repeats)
    old = _median_s(reference, max(1, repeats // 4))
    note = f"batch {batch}, vocab {vocab}, 7/8 rows drawn, 1/4 with 5 logprobs; ratio = new / old"
    ceilings = {"per-request reference loop": {"value": old * 1e3, "unit": "ms", "note": note}}
    rows_out = [result("batched sampling step", new * 1e3, "ms", old * 1e3, 0.25, "<=", note)]
    return ceilings, rows_out


def main(argv=None) -> None:
    parser = bench_parser(__doc__, device="cpu")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ceilings, rows = detok_rows(args.repeats)
    more_ceilings, more_rows = sampling_rows(device, args.repeats)
    ceilings.update(more_ceilings)
    rows += more_rows
    path = save_results(args, "sampling", name, ceilings, rows)
    for row in rows:
        print(
            f"{row['name']}: {row['value']:.2f} ms vs {row['ceiling']:.2f} ms "
            f"(ratio {row['ratio']:.4f}, target {row['op']} {row['target']})"
        )
    print(f"wrote {path} ({device_slug(name)})")


if __name__ == "__main__":
    main()
