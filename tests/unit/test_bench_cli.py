"""The benchmarks' shared CLI (python -m dsv4ray.bench) and options (bench/report.py), without
running a benchmark."""

import ast
import json
import sys
from pathlib import Path

import pytest

from dsv4ray.bench import __main__ as cli
from dsv4ray.bench.report import BENCHMARKS_MD, RESULTS_DIR, bench_parser, result, save_results

BENCH = Path(cli.__file__).resolve().parent


def test_the_cli_lists_every_module_with_a_main():
    with_main = {
        path.stem
        for path in BENCH.glob("*.py")
        if not path.name.startswith("_")
        and any(
            isinstance(node, ast.FunctionDef) and node.name == "main"
            for node in ast.parse(path.read_text()).body
        )
    }
    assert set(cli.BENCHMARKS) == with_main


def test_without_a_name_it_prints_the_list_and_refuses_unknown_names(capsys):
    assert cli.main([]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(cli.USAGE)
    assert all(f"  {name} " in listing for name in cli.BENCHMARKS)
    assert cli.main(["--help"]) == 0 and capsys.readouterr().out == listing
    assert cli.main(["no-such-bench"]) == 2
    assert "no benchmark 'no-such-bench'" in capsys.readouterr().err


def test_a_benchmark_gets_the_remaining_arguments(capsys):
    argv0 = sys.argv[0]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", "--help"])  # argparse's help: report.main parsed the argv it got
    assert exit_.value.code == 0 and sys.argv[0] == argv0
    assert "usage: python -m dsv4ray.bench report" in capsys.readouterr().out


def test_shared_options_and_the_results_file(tmp_path):
    parser = bench_parser("A benchmark.\n\nMore.", model=".tiny", kv_cache_dtype="fp8")
    assert parser.description == "A benchmark."
    args = parser.parse_args(["--results-dir", str(tmp_path), "--commit", "abc1234"])
    assert (args.model, args.kv_cache_dtype, args.out_dir) == (".tiny", "fp8", str(tmp_path))
    assert vars(bench_parser(None).parse_args([])) == {"commit": None, "out_dir": None}
    assert vars(bench_parser(None, results=False, device="cpu").parse_args([])) == {"device": "cpu"}
    with pytest.raises(TypeError):
        bench_parser(None, batch=1)

    before = BENCHMARKS_MD.stat().st_mtime_ns
    row = result("speed", 2.0, "tok/s", 4.0, 0.4)
    path = save_results(args, "bench-cli", "NVIDIA Test GPU", {}, [row])
    assert path == tmp_path / "bench-cli-nvidia-test-gpu.json"
    data = json.loads(path.read_text())
    assert list(data) == ["benchmark", "device", "commit", "date", "ceilings", "results"]
    assert (data["benchmark"], data["device"], data["commit"]) == (
        "bench-cli",
        "NVIDIA Test GPU",
        "abc1234",
    )
    assert data["results"] == [row] and row["ratio"] == 0.5
    assert list(row) == ["name", "value", "unit", "ceiling", "ratio", "op", "target", "note"]
    assert BENCHMARKS_MD.stat().st_mtime_ns == before  # only bench/results rebuilds the page
    assert not (RESULTS_DIR / path.name).exists()
