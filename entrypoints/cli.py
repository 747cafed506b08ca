"""Command line: ``dsv4ray {generate, job, serve, make-tiny}`` (also ``python -m dsv4ray``).

Every engine-running subcommand takes every EngineConfig option as a flag (cli_options.py);
``--log-level`` goes anywhere on the line (the last one wins).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsv4ray.cluster.placement import ACCELERATORS
from dsv4ray.config_quant import RELEASE_LAYOUTS
from dsv4ray.entrypoints.cli_options import add_engine_flags, engine_options
from dsv4ray.entrypoints.model_path import DEFAULT_MODEL_ENV, default_model, model_path, usage_exit


def cmd_make_tiny(args: argparse.Namespace) -> int:
    import torch

    from dsv4ray.model.tiny import PRESETS, STREAMED, make_tiny

    device = args.device or ("cuda" if args.preset in STREAMED and torch.cuda.is_available()
                             else "cpu")  # fmt: skip
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"dsv4ray make-tiny: --device {device}: this machine has no CUDA GPU")
    over = {}
    if args.layers is not None:  # the preset's hash-routed layers come first: at most all
        hash_layers = PRESETS.get(args.preset, {}).get("num_hash_layers", 0)
        over = {"num_hidden_layers": args.layers, "num_hash_layers": min(hash_layers, args.layers)}
    try:
        path = make_tiny(args.out, args.preset, args.seed, device, args.quantize, **over)
    except (OSError, RuntimeError) as exc:  # the output path; a device torch does not know
        raise SystemExit(f"dsv4ray make-tiny: {exc}") from None
    except ValueError as exc:  # options the preset cannot take (too few --layers for it)
        usage_exit(f"dsv4ray make-tiny: {exc}")
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
        seed=args.seed,
        **engine_options(args),
    )


def cmd_job(args: argparse.Namespace) -> int:
    from dsv4ray.entrypoints.job import JobOptions, run_job

    # run_job checks the checkpoint itself: a missing one is a usage error (exit 2) there
    job = JobOptions(args.replicas, args.accelerator, args.max_tokens)
    return run_job(
        args.model or default_model(), args.input, args.output, job, **engine_options(args)
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from dsv4ray.entrypoints.serve import run_server
    from dsv4ray.entrypoints.serve_file import ServeFile, read_serve_file

    try:
        file = read_serve_file(args.config) if args.config else ServeFile({})
    except ValueError as exc:
        usage_exit(f"dsv4ray serve: {exc}")
    config = {**file.args, **engine_options(args)}
    model = _serve_model(args) or config.get("model")
    if not os.environ.get("RAY_ADDRESS"):
        model_path(model)  # a local Ray: the checkpoint must be here, so say so now
    if model:
        config["model"] = model
    for name in ("accelerator", "served_model_name", "api_key", "api_key_file"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    if args.api_key is not None or args.api_key_file is not None:  # the flag replaces the file's
        config.pop("api_key_file" if args.api_key is not None else "api_key", None)
    http = dict(file.serve_options.get("http_options") or {})
    host = args.host if args.host is not None else http.get("host", "127.0.0.1")
    port = args.port if args.port is not None else http.get("port", 8000)
    return run_server(config, host, port, file.deployment, file.serve_options)


def _serve_model(args: argparse.Namespace) -> str | None:
    """MODEL or --model (one of them, or both the same); None when neither names one (on a
    cluster the replicas read the checkpoint where they run)."""
    if args.model and args.model_pos and args.model != args.model_pos:
        usage_exit(
            f"dsv4ray serve: MODEL {args.model_pos!r} and --model {args.model!r} differ; give one"
        )
    return args.model or args.model_pos


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a checkpoint's folder, URI or Hugging Face id, got ''")
    return text


def _log_level(text: str) -> str:
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"not a logging level: {text!r} (DEBUG, INFO, ...)")
    return level


def _log_parent() -> argparse.ArgumentParser:
    """--log-level, accepted before or after the subcommand (after wins)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--log-level", type=_log_level, default=argparse.SUPPRESS, help="python logging level"
    )
    return parent


def _engine_parent() -> argparse.ArgumentParser:
    """The options every engine-running subcommand shares: --model and every engine option."""
    parent = argparse.ArgumentParser(add_help=False, parents=[_log_parent()])
    parent.add_argument(
        "--model",
        type=_model,
        default=None,
        help=f"checkpoint folder (default: ${DEFAULT_MODEL_ENV} or .tiny)",
    )
    add_engine_flags(parent)
    return parent


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate", parents=[_engine_parent()], help="generate text, streamed to the terminal"
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--max-tokens", type=_positive_int, default=32, help="tokens per prompt at most [32]"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 picks the likeliest token [0.0]"
    )
    gen.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: different each run)"
    )
    gen.set_defaults(func=cmd_generate)


def _add_job(sub) -> None:
    job = sub.add_parser(
        "job",
        parents=[_engine_parent()],
        help="batch generation over a JSONL file on Ray Data (ray job submit)",
        description="Batch generation over a JSONL file on Ray Data: one engine per replica "
        "(an actor of the pool). Results are appended to --output, keyed by id (the last "
        "line of an id wins). A rerun skips finished ids and retries aborted ones.",
        epilog="exit codes: 0 every request finished; 1 a bad input line or an aborted "
        "request; 2 usage error (no input file or checkpoint, bad option); "
        "130 interrupted (Ctrl-C), 143 stopped by SIGTERM (ray job stop): the requests left "
        "are done by a rerun",
    )
    job.add_argument(
        "--input",
        required=True,
        help="JSONL: {id, prompt | messages, ...}; a local path or "
        "any URI pyarrow reads (s3://, gs://, ...)",
    )
    job.add_argument("--output", required=True, help="JSONL results, appended as they finish")
    job.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=16,
        help="per request, where its line gives none [16]",
    )
    job.add_argument(
        "--replicas",
        "--concurrency",
        type=_positive_int,
        default=1,
        help="engines (actors of the Ray Data pool), each one pipeline [1]",
    )
    job.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default="auto",
        help="the stages' bundles; auto: gpu when the cluster has or declares GPUs [auto]",
    )
    job.set_defaults(func=cmd_job)


def _add_serve(sub) -> None:
    srv = sub.add_parser(
        "serve",
        parents=[_engine_parent()],
        help="OpenAI-compatible HTTP server on Ray Serve",
        description="Serve MODEL with the OpenAI API on Ray Serve (a local Ray, or the "
        "cluster at RAY_ADDRESS). Flags override --config's values.",
    )
    srv.add_argument(
        "model_pos",
        nargs="?",
        type=_model,
        default=None,
        metavar="MODEL",
        help=f"checkpoint folder (or --model; default: ${DEFAULT_MODEL_ENV} or .tiny)",
    )
    srv.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a Serve config file (the schema of deploy/serve.yaml)",
    )
    srv.add_argument(
        "--host", type=_host, default=None, help="other than loopback needs an API key [127.0.0.1]"
    )
    srv.add_argument("--port", type=_port, default=None, help="1-65535 [8000]")
    srv.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default=None,
        help="the stages' bundles; auto: gpu when the cluster has or declares GPUs [auto]",
    )
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
    srv.add_argument("--served-model-name", default=None, help="default: the folder name")
    srv.set_defaults(func=cmd_serve)


def _add_make_tiny(sub) -> None:
    tiny = sub.add_parser(
        "make-tiny", parents=[_log_parent()], help="write a random tiny checkpoint"
    )
    tiny.add_argument("--out", required=True)
    tiny.add_argument(
        "--preset", default="tiny", choices=["tiny", "dsv4-mini", "dsv4-flash-layers"]
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="num_hidden_layers (default: the preset's; its hash-routed layers are at most N)",
    )
    tiny.add_argument(
        "--device",
        default=None,
        help="where tensors are drawn (default: cuda for dsv4-flash-layers "
        "when there is one, else cpu)",
    )
    tiny.add_argument(
        "--quantize",
        default=None,
        choices=list(RELEASE_LAYOUTS),
        help="write the release's block-quantised layout (fp8 linears; fp4 or fp8 experts)",
    )
    tiny.set_defaults(func=cmd_make_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4ray", description="Serve DeepSeek-V4 models on Ray.")
    parser.add_argument(
        "--log-level", type=_log_level, default="WARNING", help="python logging level"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_job, _add_serve, _add_make_tiny):
        add(sub)
    return parser


def _port(text: str) -> int:
    """A TCP port to listen on (argparse type)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 1-65535, got {text!r}")
    return port


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before the command's own handling began (importing torch, ...)
        print("\ndsv4ray: stopped", file=sys.stderr)
        return 0 if args.command == "serve" else 130  # Ctrl-C is how a server is stopped
