"""Benchmark results files (PERF.md's format) and bench/BENCHMARKS.md, regenerated from all of them.

A results file is bench/results/<benchmark>-<device slug>.json:
    {"benchmark", "device", "commit", "date", "ceilings": {name: {"value", "unit", "note"}},
     "results": [{"name", "value", "unit", "ceiling", "ratio", "op", "target", "note"}]}
Benchmarks build their options with `bench_parser(__doc__, ...)` (--commit and --out-dir, and
--model, --kv-cache-dtype or --device where they take one) and save with `save_results(args,
...)`: `write_results(...)`, then `write_benchmarks_md()` when the file went to bench/results.
Run this file (`python -m dsv4ray.bench report`) to rebuild BENCHMARKS.md after copying results
files in.
"""

import argparse
import datetime
import json
import re
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
BENCHMARKS_MD = BENCH_DIR / "BENCHMARKS.md"
SHARED = {  # options several benchmarks take (bench_parser's keywords): flag, help
    "model": ("--model", "checkpoint directory"),
    "kv_cache_dtype": ("--kv-cache-dtype", "format of the KV pages"),
    "device": ("--device", "torch device to run on"),
}


def git_commit() -> str:
    """Short commit of this checkout (wherever the run starts), or "unknown" (the GPU copies
    carry no git history: pass --commit there)."""
    import subprocess

    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"],
            text=True,
            stderr=subprocess.DEVNULL,
            cwd=BENCH_DIR,
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_prompts(batch: int, length: int, seed: int) -> list:
    """batch prompts of length byte-level token ids (2..257), reproducible from seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (length,), generator=g).tolist() for _ in range(batch)]


def device_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (safe in file names)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def result(
    name: str,
    value: float,
    unit: str,
    ceiling: float,
    target: float,
    op: str = ">=",
    note: str = "",
) -> dict:
    """One results row; ratio = value / ceiling, and the target applies to the ratio."""
    ratio = value / ceiling if ceiling else float("nan")
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "ceiling": ceiling,
        "ratio": ratio,
        "op": op,
        "target": target,
        "note": note,
    }


def write_results(
    benchmark: str,
    device: str,
    commit: str,
    ceilings: dict,
    results: list,
    results_dir: Path = RESULTS_DIR,
) -> Path:
    """Write <results_dir>/<benchmark>-<device slug>.json and return its path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": benchmark,
        "device": device,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings,
        "results": results,
    }
    path = results_dir / f"{benchmark}-{device_slug(device)}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def _met(row: dict) -> str:
    ratio, target = row.get("ratio"), row.get("target")
    if ratio is None or target is None or ratio != ratio:
        return ""
    ok = ratio >= target if row.get("op", ">=") == ">=" else ratio <= target
    return "yes" if ok else "NO"


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"
    return "" if x is None else str(x)


def _section(data: dict) -> list:
    lines = [
        f"## {data['benchmark']} on {data['device']}",
        "",
        f"commit `{data['commit']}`, {data['date']}",
        "",
    ]
    if data.get("ceilings"):
        lines += ["| ceiling | value | unit | note |", "|---|---|---|---|"]
        for name, c in data["ceilings"].items():
            lines.append(f"| {name} | {_fmt(c['value'])} | {c['unit']} | {c.get('note', '')} |")
        lines.append("")
    lines += [
        "| result | value | unit | ceiling | ratio | target | met | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        target = f"{r.get('op', '>=')} {_fmt(r.get('target'))}"
        lines.append(
            f"| {r['name']} | {_fmt(r['value'])} | {r['unit']} | {_fmt(r.get('ceiling'))} "
            f"| {_fmt(r.get('ratio'))} | {target} | {_met(r)} | {r.get('note', '')} |"
        )
    return lines + [""]


def write_benchmarks_md(results_dir: Path = RESULTS_DIR, path: Path = BENCHMARKS_MD) -> Path:
    """Rebuild the benchmarks page from every results file in results_dir."""
    files = sorted(Path(results_dir).glob("*.json"))
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/report.py` from `bench/results/*.json`; do not edit by hand. "
        "Ratios and targets follow PERF.md (every ratio is measured against a ceiling taken "
        "in the same run).",
        "",
    ]
    for f in files:
        lines += _section(json.loads(f.read_text()))
    Path(path).write_text("\n".join(lines).rstrip() + "\n")
    return Path(path)


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph on one line (a benchmark's description)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def bench_parser(doc: str | None, *, results: bool = True, **shared) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by its docstring's first paragraph, with the
    options benchmarks share. With ``results`` (the default) --commit and --out-dir (alias
    --results-dir), which ``save_results`` reads. ``shared`` adds the SHARED options it names,
    each with its default: ``model=".tiny"``, ``kv_cache_dtype="fp8"``, ``device="cpu"``
    (``model_help`` replaces --model's help)."""
    parser = argparse.ArgumentParser(description=summary(doc))
    model_help = shared.pop("model_help", None)
    for dest, default in shared.items():
        if dest not in SHARED:
            raise TypeError(f"bench_parser: no shared option {dest!r} (known: {list(SHARED)})")
        flag, text = SHARED[dest]
        text = model_help if dest == "model" and model_help else f"{text} (default: {default})"
        parser.add_argument(flag, default=default, help=text)
    if results:
        parser.add_argument(
            "--commit",
            default=None,
            help="commit of the code measured (default: the checkout's; pass it where the copy "
            "has no git history)",
        )
        parser.add_argument(
            "--out-dir",
            "--results-dir",
            dest="out_dir",
            default=None,
            help="where the results file goes (default: bench/results, and bench/BENCHMARKS.md "
            "is rebuilt)",
        )
    return parser


def results_dir_for(args: argparse.Namespace) -> Path:
    """Where a run's results file goes: --out-dir, or bench/results."""
    return Path(args.out_dir) if args.out_dir else RESULTS_DIR


def save_results(
    args: argparse.Namespace, benchmark: str, device: str, ceilings: dict, results: list
) -> Path:
    """write_results for a run parsed by bench_parser (--commit or the checkout's commit, into
    results_dir_for(args)); when that is bench/results, BENCHMARKS.md is rebuilt from it."""
    out = results_dir_for(args)
    path = write_results(benchmark, device, args.commit or git_commit(), ceilings, results, out)
    if out.resolve() == RESULTS_DIR:
        write_benchmarks_md()
    return path


def add_server_args(parser) -> None:
    """Flags the HTTP benchmarks share: a running loopback server instead of a fresh one, its
    model name and key."""
    import os

    parser.add_argument("--url", default=None, help="a running loopback server instead")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=os.environ.get("DSV4RAY_API_KEY"))


def check_loopback_url(parser, url: str | None) -> None:
    """Benchmarks drive loopback servers only."""
    import urllib.parse

    from dsv4ray.entrypoints.openai.edge import is_loopback

    if url and not is_loopback(urllib.parse.urlparse(url).hostname or ""):
        parser.error("--url must be a loopback address (127.0.0.1, ::1, localhost)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Rebuild bench/BENCHMARKS.md from every results file in bench/results."
    )
    parser.parse_args(argv)
    print(write_benchmarks_md())


if __name__ == "__main__":
    main()
