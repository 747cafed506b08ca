"""HTTP fuzz: thousands of malformed requests in families; none may hurt the server.

    python bench/http_fuzz.py [--model .tiny] [--concurrency 8] [--duration 900]
        [--max-requests 6000] [--scale 1] [--seed 0] [--commit SHA]
        [--url http://127.0.0.1:PORT --served-model-name NAME --context N [--api-key KEY]]

In-process (no ``--url``): the Serve app on a local Ray at 127.0.0.1:<free port>, twice: with an
API key (the key family runs), then without one (the Host/Origin family runs); every other
family of bench/http_fuzz_cases.py runs against both. With ``--url``: one loopback server.
Per server: a greedy completion (token ids, temperature 0) first; then the malformed requests,
``--concurrency`` at a time, while one client keeps asking for the same greedy completion; then
the greedy completion again and the engine's ``num_pipeline_rebuilds`` (when it reports one);
last, the valid requests with extreme values (temperature 5e-324, top_p 5e-324, ...), one at a
time, and the greedy completion a third time. Checked: no 5xx; every 4xx carries OpenAI's error
body and names the field where the case knows it; valid requests get 200; every greedy
completion equals the first. Bounded by ``--duration`` and ``--max-requests`` (all servers).
Writes bench/results/http-fuzz-<device>.json and regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import time
from dataclasses import dataclass, field

import httpx

from dsv4ray.bench.http_fuzz_cases import Case, Target, check_response, families
from dsv4ray.bench.report import (
    add_server_args,
    bench_parser,
    check_loopback_url,
    result,
    save_results,
)
from dsv4ray.entrypoints.serve import APP_NAME, build_app

FUZZ_KEY = "fuzz-key"
GREEDY_PROMPT = [0, 17, 99, 250, 3, 42, 7, 128]
GREEDY_TOKENS = 8


@dataclass
class Tally:
    """Counts over every server of the run."""

    sent: collections.Counter = field(default_factory=collections.Counter)  # by family
    wrong: collections.Counter = field(default_factory=collections.Counter)  # by kind
    examples: dict = field(default_factory=dict)  # kind -> one case and its answer
    valid_sent: int = 0
    valid_ok: int = 0
    valid_failed: collections.Counter = field(default_factory=collections.Counter)  # by fields
    greedy_during: list = field(default_factory=list)  # True per identical completion
    greedy_after: list = field(default_factory=list)
    greedy_final: list = field(default_factory=list)
    rebuilds: list = field(default_factory=list)  # per server, None when not reported
    wall_s: float = 0.0

    @property
    def malformed_sent(self) -> int:
        return sum(self.sent.values())


class Server:
    """One server under test, reached through one HTTP client; the key goes with every request
    but those of the key family."""

    def __init__(self, url: str, model: str, api_key: str | None) -> None:
        self.url, self.model, self.api_key = url, model, api_key
        limits = httpx.Limits(max_connections=64)
        self.http = httpx.AsyncClient(base_url=url, timeout=120, limits=limits)

    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def send(self, case: Case) -> tuple[int, bytes]:
        headers = {} if case.family == "missing or bad keys" else self.auth()
        if case.body is not None:
            headers["content-type"] = "application/json"
        headers.update(case.headers)  # a case's own Content-Type, Host or Origin wins
        response = await self.http.request(
            case.method, self.url + case.path, content=case.body, headers=headers
        )
        return response.status_code, response.content

    async def context(self) -> int:
        models = await self.http.get("/v1/models", headers=self.auth())
        return models.json()["data"][0]["max_model_len"]

    async def greedy(self) -> list[int] | None:
        """The greedy completion's token ids; None when it fails."""
        body = {"model": self.model, "prompt": GREEDY_PROMPT, "max_tokens": GREEDY_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        try:
            response = await self.http.post("/v1/completions", json=body, headers=self.auth())
            return response.json()["choices"][0]["token_ids"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    async def rebuilds(self) -> int | None:
        stats = await self.http.get("/v1/dsv4ray/stats", headers=self.auth())
        return stats.json().get("num_pipeline_rebuilds")


@dataclass
class Budget:
    deadline: float  # time.monotonic()
    max_requests: int
    used: int = 0

    def take(self) -> bool:
        if self.used >= self.max_requests or time.monotonic() > self.deadline:
            return False
        self.used += 1
        return True


async def send_all(server: Server, cases: list[Case], tally: Tally, concurrency: int, budget):
    pending = iter(cases)  # shared by the workers: each case is sent once

    async def worker() -> None:
        for case in pending:
            if not budget.take():
                return
            try:
                status, content = await server.send(case)
                problem = check_response(case, status, content)
            except httpx.HTTPError as exc:
                status, content, problem = None, repr(exc).encode(), "transport"
            record(tally, case, problem, status, content)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def record(tally: Tally, case: Case, problem: str | None, status, content: bytes) -> None:
    if case.valid:
        tally.valid_sent += 1
        tally.valid_ok += problem is None
        if problem is not None:
            tally.examples.setdefault("valid", _example(case, status, content))
            tally.valid_failed[f"{_own_fields(case)} -> {status}"] += 1
        return
    tally.sent[case.family] += 1
    if problem is not None:
        tally.wrong[problem] += 1
        tally.examples.setdefault(problem, _example(case, status, content))


def _own_fields(case: Case) -> str:
    """What a valid case adds to the plain request (its extreme values)."""
    fields = json.loads(case.body) if case.body else {}
    plain = ("model", "prompt", "max_tokens", "ignore_eos")
    own = {k: v for k, v in fields.items() if k not in plain or k == "prompt" and v != "Hello"}
    return json.dumps(own or dict(case.headers))[:60]


def _example(case: Case, status, content: bytes) -> dict:
    body = None if case.body is None else repr(case.body[:160])
    return {"family": case.family, "method": case.method, "path": case.path[:80],
            "body": body, "headers": case.headers, "param": case.param,
            "status": status, "answer": content[:300].decode("utf-8", "replace")}  # fmt: skip


async def fuzz(server: Server, args, tally: Tally, budget: Budget) -> None:
    """One server: greedy, malformed requests beside a greedy loop, greedy, valid extremes,
    greedy (see the module docstring)."""
    target = Target(server.model, await server.context(), server.api_key)
    cases = families(target, args.seed, args.scale)
    reference = await server.greedy()
    assert reference is not None, "the server does not answer a plain greedy completion"
    rebuilds_before = await server.rebuilds()
    done = asyncio.Event()

    async def keep_asking() -> None:
        while not done.is_set():
            tally.greedy_during.append(await server.greedy() == reference)

    asker = asyncio.create_task(keep_asking())
    await send_all(server, [c for c in cases if not c.valid], tally, args.concurrency, budget)
    done.set()
    await asker
    tally.greedy_after.append(await server.greedy() == reference)
    rebuilds_after = await server.rebuilds()
    if None not in (rebuilds_before, rebuilds_after):
        tally.rebuilds.append(rebuilds_after - rebuilds_before)
    await send_all(server, [c for c in cases if c.valid], tally, 1, budget)
    tally.greedy_final.append(await server.greedy() == reference)
    await server.http.aclose()


def start_server(args, api_key: str | None) -> Server:
    """The Serve app on the local Ray at 127.0.0.1:<free port> (replacing the previous one)."""
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.shutdown()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = os.path.abspath(args.model)
    config = {"model": model, "api_key": api_key, "kv_cache_dtype": args.kv_cache_dtype,
              "max_total_tokens": args.max_total_tokens}  # fmt: skip
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return Server(f"http://127.0.0.1:{port}", os.path.basename(model), api_key)


def rows_for(tally: Tally, note: str) -> list[dict]:
    sent = tally.malformed_sent
    families_note = ", ".join(f"{name} {num}" for name, num in tally.sent.items())
    wrong = ", ".join(f"{kind} {num}" for kind, num in tally.wrong.items()) or "none"
    failed = "; ".join(f"{what} ({num}x)" for what, num in tally.valid_failed.items())
    rebuilds = "" if tally.rebuilds else "; the engine reports no num_pipeline_rebuilds"
    rows = [
        result("malformed requests answered 4xx with OpenAI's error body",
               sent - sum(tally.wrong.values()), "requests", sent, 1.0, ">=",
               f"{note}; wrong answers: {wrong}; sent by family: {families_note}"),
        result("5xx answers to malformed requests", tally.wrong["5xx"], "requests", sent, 0.0,
               "<=", note),
        result("4xx answers naming another field than the one at fault", tally.wrong["param"],
               "requests", sent, 0.0, "<=", note),
        _share("greedy completions during the fuzz equal to the first", tally.greedy_during,
               "one client asking for the same greedy completion back to back"),
        _share("greedy completion after the malformed requests equal to the first",
               tally.greedy_after, "one per server" + rebuilds),
        result("valid extreme-value requests answered 200", tally.valid_ok, "requests",
               tally.valid_sent, 1.0, ">=", "temperature 1e-38 and 5e-324, top_p 5e-324, "
               "top_k 2^63-1, seeds +-(2^63-1), ...: valid, so sent as valid requests; "
               f"failed: {failed or 'none'}"),
        _share("greedy completion after the valid extreme-value requests equal to the first",
               tally.greedy_final, "one per server"),
    ]  # fmt: skip
    if tally.rebuilds:
        rows.insert(5, result("pipeline rebuilds during the malformed requests",
                              sum(tally.rebuilds), "rebuilds", 1, 0.0, "<=",
                              "num_pipeline_rebuilds from /v1/dsv4ray/stats"))  # fmt: skip
    return rows


def _share(name: str, outcomes: list[bool], note: str) -> dict:
    return result(name, sum(outcomes), "completions", len(outcomes), 1.0, ">=", note)


def parse_args(argv=None) -> argparse.Namespace:
    parser = bench_parser(__doc__, model=".tiny", kv_cache_dtype="fp8")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=900.0, help="seconds, all servers")
    parser.add_argument("--max-requests", type=int, default=6000, help="all servers")
    parser.add_argument("--scale", type=int, default=1, help="0: a sample of each family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    add_server_args(parser)
    args = parser.parse_args(argv)
    check_loopback_url(parser, args.url)
    if min(args.concurrency, args.max_requests) < 1 or args.duration <= 0:
        parser.error("--concurrency, --max-requests and --duration must be positive")
    return args


def run(args, tally: Tally, budget: Budget) -> str:
    """Fuzzes the server(s); returns what the results note says about them."""
    if args.url:
        model = args.served_model_name or os.path.basename(os.path.abspath(args.model))
        asyncio.run(fuzz(Server(args.url, model, args.api_key), args, tally, budget))
        return f"the server at {args.url} ({'a key' if args.api_key else 'no key'})"
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        for api_key in (FUZZ_KEY, None):
            asyncio.run(fuzz(start_server(args, api_key), args, tally, budget))
    finally:
        serve.shutdown()
        ray.shutdown()
    return (
        f"{os.path.basename(os.path.abspath(args.model))}, kv {args.kv_cache_dtype}, "
        f"{args.max_total_tokens} tokens, two servers: with an API key, then without"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tally, budget = Tally(), Budget(time.monotonic() + args.duration, args.max_requests)
    start = time.perf_counter()
    about = run(args, tally, budget)
    tally.wall_s = time.perf_counter() - start
    note = (
        f"{about}; {tally.malformed_sent} malformed requests, {args.concurrency} at a time "
        f"(scale {args.scale}, seed {args.seed}); {tally.wall_s:.0f} s in all, servers' starts "
        "and the valid requests included"
    )
    path = save_results(args, "http-fuzz", device, {}, rows_for(tally, note))
    summary = {"sent": tally.sent, "wrong": tally.wrong, "examples": tally.examples,
               "valid": [tally.valid_ok, tally.valid_sent], "valid_failed": tally.valid_failed,
               "rebuilds": tally.rebuilds}  # fmt: skip
    print(json.dumps(summary, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
