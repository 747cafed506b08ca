"""Command line: ``dsv4ray {generate, job, serve, make-tiny}`` (also ``python -m dsv4ray``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsv4ray.config_quant import RELEASE_LAYOUTS

DEFAULT_MODEL_ENV = "DSV4RAY_MODEL"


def default_model() -> str:
    """``$DSV4RAY_MODEL``, else ``./.tiny`` when present, else ``.tiny`` beside the package."""
    if os.environ.get(DEFAULT_MODEL_ENV):
        return os.environ[DEFAULT_MODEL_ENV]
    if os.path.isdir(".tiny"):
        return os.path.abspath(".tiny")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), ".tiny")


def _model_path(path: str | None) -> str:
    path = path or default_model()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(
            f"dsv4ray: no checkpoint at {path!r} (no config.json). Make the tiny one with "
            "`dsv4ray make-tiny --out .tiny` or pass --model /path/to/checkpoint."
        )
    return path


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from dsv4ray.model.tiny import make_tiny

    path = make_tiny(args.out, args.preset, args.seed, quantize=args.quantize)
    layout = f", {args.quantize} release layout" if args.quantize else ""
    print(f"wrote the {args.preset!r} checkpoint (seed {args.seed}{layout}) to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dsv4ray.cluster.generate import generate

    return generate(
        _model_path(args.model),
        args.prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        pp_size=args.pp,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def cmd_job(args: argparse.Namespace) -> int:
    from dsv4ray.cluster.job import run_job

    options = {"kv_cache_dtype": args.kv_cache_dtype}
    return run_job(
        _model_path(args.model),
        args.input,
        args.output,
        pp_size=args.pp,
        default_max_tokens=args.max_tokens,
        **options,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from dsv4ray.cluster.serve import run_server

    config = {
        "model": _model_path(args.model),
        "pp_size": args.pp,
        "kv_cache_dtype": args.kv_cache_dtype,
        "api_key": args.api_key,
    }
    for name in ("max_total_tokens", "served_model_name"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return run_server(config, host=args.host, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4ray", description="Serve DeepSeek-V4 models on Ray.")
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts, streamed to the terminal")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--model", default=None, help=f"checkpoint folder (default: ${DEFAULT_MODEL_ENV} or .tiny)"
    )
    gen.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16", "fp32"])
    gen.set_defaults(func=cmd_generate)

    job = sub.add_parser("job", help="batch generation over a JSONL file (ray job submit)")
    job.add_argument("--model", default=None, help="checkpoint folder (default: .tiny)")
    job.add_argument("--input", required=True, help="JSONL: {id, prompt | messages, ...}")
    job.add_argument("--output", required=True, help="JSONL results, appended as they finish")
    job.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    job.add_argument("--max-tokens", type=int, default=16, help="default per request")
    job.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16", "fp32"])
    job.set_defaults(func=cmd_job)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server on Ray Serve")
    srv.add_argument("--model", default=None, help="checkpoint folder (default: .tiny)")
    srv.add_argument("--host", default="127.0.0.1", help="other than loopback needs --api-key")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages per replica")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("DSV4RAY_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (default: $DSV4RAY_API_KEY)",
    )
    srv.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16", "fp32"])
    srv.add_argument("--max-total-tokens", type=int, default=None, help="KV capacity cap")
    srv.add_argument("--served-model-name", default=None, help="default: the folder name")
    srv.set_defaults(func=cmd_serve)

    tiny = sub.add_parser("make-tiny", help="write a random tiny checkpoint")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
