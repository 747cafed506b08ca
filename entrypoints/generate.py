"""``dsv4ray generate``: stream completions of prompts to the terminal through the engine."""

from __future__ import annotations

import asyncio
import sys

from dsv4ray.engine.checks import without_request_id
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.entrypoints.engines import engine_config
from dsv4ray.entrypoints.stop_signals import (
    TERMINATED,
    by_sigterm,
    restore_sigterm,
    signals_held,
    sigterm_interrupts,
    stop_asked,
)

EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 130, 143


def generate(
    model_path: str,
    prompts: list[str],
    max_tokens: int = 32,
    temperature: float = 0.0,
    pp_size: int = 1,
    seed: int | None = None,
    out=None,
    **options,
) -> int:
    """Streams each prompt's completion to ``out`` -> the exit code: 0, or 1 when a prompt was
    refused or aborted; a bad option is a usage error (one line, 2). SIGINT and SIGTERM stop it
    after the engine shuts down, with a line saying so (130 and 143, as a shell reports them)."""
    out = out or sys.stdout
    TERMINATED.clear()
    previous, engine = sigterm_interrupts(), None
    try:
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
            config = engine_config(model_path, pp_size=pp_size, **options)
        except (ValueError, TypeError) as exc:  # an option's value or type
            print(f"dsv4ray: {exc}", file=sys.stderr)
            return EXIT_USAGE
        try:
            engine = AsyncEngine(config=config)
        except ValueError as exc:  # what the checkpoint or the machine cannot take
            print(f"dsv4ray: {exc}", file=sys.stderr)
            return EXIT_USAGE
        sigterm_interrupts()  # again: starting Ray installs its own SIGTERM handler
        if engine.config.speculative_num_steps:
            print(f"dsv4ray: {describe(engine.config.speculative_num_steps)}", file=sys.stderr)
        return asyncio.run(_stream_all(engine, prompts, params, out))
    except (KeyboardInterrupt, SystemExit) as exc:
        if not stop_asked(exc):
            raise
        out.write("\n")
        print("dsv4ray: stopped", file=sys.stderr)
        return EXIT_TERMINATED if by_sigterm(exc) else EXIT_INTERRUPTED
    finally:
        with signals_held():  # the engine's shutdown runs to its end
            if engine is not None:
                engine.shutdown()
        restore_sigterm(previous)


async def _stream_all(engine: AsyncEngine, prompts: list[str], params, out) -> int:
    failed = 0
    for number, prompt in enumerate(prompts):
        out.write(prompt)
        out.flush()
        shown, final = "", None
        try:
            async for update in engine.generate(prompt, params, request_id=f"prompt-{number}"):
                out.write(update.text)
                out.flush()
                shown += update.text
                final = update.output
        except ValueError as exc:  # this prompt is refused (too long, ...); the next ones run
            out.write("\n")
            reason = without_request_id(str(exc), f"prompt-{number}")
            print(f"dsv4ray: prompt refused: {reason}", file=sys.stderr)
            failed += 1
            continue
        if final is not None and final.text.startswith(shown):
            out.write(final.text[len(shown) :])  # an unfinished UTF-8 tail the stream held back
        out.write("\n")
        if final is None or final.finish_reason == "abort":
            failed += 1
            reason = final.error if final is not None else "no output"
            print(f"dsv4ray: request aborted: {reason}", file=sys.stderr)
    return 1 if failed else 0
