"""Command line: ``dsv4ray {generate, job, serve, make-tiny}`` (also ``python -m dsv4ray``)."""

from __future__ import annotations

import argparse
import logging

from dsv4ray.cache.formats import DTYPES as KV_DTYPES
from dsv4ray.config_quant import RELEASE_LAYOUTS
from dsv4ray.entrypoints.model_path import DEFAULT_MODEL_ENV, default_model, model_path


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from dsv4ray.model.tiny import make_tiny

    path = make_tiny(args.out, args.preset, args.seed, quantize=args.quantize)
    layout = f", {args.quantize} release layout" if args.quantize else ""
    print(f"wrote the {args.preset!r} checkpoint (seed {args.seed}{layout}) to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dsv4ray.entrypoints.generate import generate

    return generate(
        model_path(args.model),
        args.prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        pp_size=args.pp,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_num_steps=args.speculative_num_steps,
    )


def cmd_job(args: argparse.Namespace) -> int:
    from dsv4ray.entrypoints.job import run_job

    # run_job checks the checkpoint itself: a missing one is a usage error (exit 2) there
    return run_job(
        args.model or default_model(),
        args.input,
        args.output,
        pp_size=args.pp,
        default_max_tokens=args.max_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_num_steps=args.speculative_num_steps,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from dsv4ray.entrypoints.serve import run_server

    config = {
        "model": model_path(args.model),
        "pp_size": args.pp,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_num_steps": args.speculative_num_steps,
    }
    if args.prefill_pp:
        config["prefill_pp_size"] = args.prefill_pp
    for name in ("max_total_tokens", "served_model_name", "api_key", "api_key_file"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return run_server(config, host=args.host, port=args.port)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _log_parent() -> argparse.ArgumentParser:
    """--log-level, accepted before or after the subcommand (after wins)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default=argparse.SUPPRESS, help="python logging level")
    return parent


def _engine_parent(pp_help: str = "pipeline-parallel stages") -> argparse.ArgumentParser:
    """The options every engine-running subcommand shares."""
    parent = argparse.ArgumentParser(add_help=False, parents=[_log_parent()])
    parent.add_argument(
        "--model", default=None, help=f"checkpoint folder (default: ${DEFAULT_MODEL_ENV} or .tiny)"
    )
    parent.add_argument("--pp", type=_positive_int, default=1, help=pp_help)
    parent.add_argument("--kv-cache-dtype", default="fp8", choices=list(KV_DTYPES))
    parent.add_argument(
        "--speculative-num-steps",
        type=_steps,
        default=0,
        metavar="K",
        help="MTP draft tokens per request and step, verified by the model (0: off; needs the "
        "checkpoint's mtp.* tensors)",
    )
    return parent


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate", parents=[_engine_parent()], help="generate text, streamed to the terminal"
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=_positive_int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)


def _add_job(sub) -> None:
    job = sub.add_parser(
        "job",
        parents=[_engine_parent()],
        help="batch generation over a JSONL file (ray job submit)",
        description="Batch generation over a JSONL file; results are appended to --output, "
        "keyed by id (the last line of an id wins). A rerun skips finished ids and retries "
        "aborted ones.",
        epilog="exit codes: 0 every request finished; 1 a bad input line or an aborted "
        "request; 2 usage error (no input file or checkpoint, bad option); "
        "130 interrupted (Ctrl-C), 143 stopped by SIGTERM (ray job stop): the requests left "
        "are done by a rerun",
    )
    job.add_argument("--input", required=True, help="JSONL: {id, prompt | messages, ...}")
    job.add_argument("--output", required=True, help="JSONL results, appended as they finish")
    job.add_argument("--max-tokens", type=_positive_int, default=16, help="default per request")
    job.set_defaults(func=cmd_job)


def _add_serve(sub) -> None:
    srv = sub.add_parser(
        "serve",
        parents=[_engine_parent("pipeline-parallel stages per replica")],
        help="OpenAI-compatible HTTP server on Ray Serve",
    )
    srv.add_argument("--host", default="127.0.0.1", help="other than loopback needs an API key")
    srv.add_argument("--port", type=int, default=8000)
    key = srv.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require 'Authorization: Bearer KEY', KEY read from PATH (default: "
        "$DSV4RAY_API_KEY_FILE, else $DSV4RAY_API_KEY); without a key only local clients "
        "(loopback Host and Origin) are answered",
    )
    key.add_argument(
        "--api-key", default=None, help="the key itself (visible in ps: prefer --api-key-file)"
    )
    srv.add_argument(
        "--prefill-pp",
        type=_steps,
        default=0,
        metavar="P",
        help="prefill/decode disaggregation: a prefill pipeline of P stages hands its KV to "
        "this --pp decode pipeline over Mooncake (0: off)",
    )
    srv.add_argument("--max-total-tokens", type=int, default=None, help="KV capacity cap")
    srv.add_argument("--served-model-name", default=None, help="default: the folder name")
    srv.set_defaults(func=cmd_serve)


def _add_make_tiny(sub) -> None:
    tiny = sub.add_parser(
        "make-tiny", parents=[_log_parent()], help="write a random tiny checkpoint"
    )
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--preset", default="tiny", choices=["tiny", "dsv4-mini"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--quantize",
        default=None,
        choices=list(RELEASE_LAYOUTS),
        help="write the release's block-quantised layout (fp8 linears; fp4 or fp8 experts)",
    )
    tiny.set_defaults(func=cmd_make_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4ray", description="Serve DeepSeek-V4 models on Ray.")
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_job, _add_serve, _add_make_tiny):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)
