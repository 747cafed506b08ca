"""Chaos run: one engine under steady greedy load while faults land at random times.

    python bench/chaos.py [--model .tiny] [--faults 100] [--duration 900] [--seed 0]

An AsyncEngine (pp 2, host tier on, fp32 pages, a small device pool so prefixes move to the host
tier and back) serves --clients concurrent greedy requests (random token-id prompts from a pool,
random max_tokens, ignore_eos) on a local Ray bound to loopback. Faults, --faults in all, land at
random times: a random stage actor killed (possibly while another fault's rebuild runs; the
next fault waits until the engine serves again), the host tier actor killed (while it lives),
and poison requests (a lone surrogate in a stop string, temperature 1e-38 and 5e-324, top_p
5e-324 and 1e-300 at temperature 1). Counted:

  aborts        allowed when a stage was killed while the request ran; any other abort is a
                bystander's (of a poison request when one overlapped it)
  wrong tokens  finished greedy requests whose tokens differ from the reference model's greedy
                continuation (incremental path, fp32, cached per prompt)
  hangs         requests not finished within --request-timeout
  poison        refused at submission (ValueError: correct), served, aborted; served ones with
                tokens other than greedy (temperatures below 1e-5 and a top_p that leaves no
                token both mean greedy)
  leaks         device pages not free or cached once the load drained (and check_integrity()),
                /dev/shm files of the engine left after shutdown

Writes <results-dir>/chaos-<device>.json (bench/report.py's format), and with --records every
request and fault as JSON lines. No fault is injected after --duration seconds of load; the
requests then in flight finish or time out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from dsv4ray import SamplingParams
from dsv4ray.bench.chaos_report import summarize, write_records
from dsv4ray.bench.report import bench_parser, save_results
from dsv4ray.cluster.channel_files import node_shm_files, raylet_pid
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.model import load_reference

MAX_NEW_TOKENS = 16  # short requests: more of them, and more faults, per minute of CPU
POISON = {  # ignore_eos: served ones are compared with the reference's greedy tokens
    "stop lone surrogate": lambda: SamplingParams(max_tokens=8, stop=["\ud800"]),
    "temperature 1e-38": lambda: SamplingParams(max_tokens=8, temperature=1e-38, ignore_eos=True),
    "temperature 5e-324": lambda: SamplingParams(max_tokens=8, temperature=5e-324, ignore_eos=True),
    "top_p 5e-324": lambda: SamplingParams(
        max_tokens=8, temperature=1.0, top_p=5e-324, seed=1, ignore_eos=True
    ),
    "top_p 1e-300": lambda: SamplingParams(
        max_tokens=8, temperature=1.0, top_p=1e-300, seed=1, ignore_eos=True
    ),
}
FAULT_WEIGHTS = {"poison": 0.72, "kill_stage": 0.2, "kill_host_tier": 0.08}


@dataclass
class Record:
    """One request: kind "greedy" or "poison:<name>"; outcome "done", "abort", "refused",
    "hang" or "error" (an exception other than ValueError)."""

    kind: str
    prompt: tuple[int, ...]
    start: float
    end: float = float("inf")
    outcome: str = ""
    max_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str = ""


class Chaos:
    def __init__(self, args: argparse.Namespace, engine: AsyncEngine, prompts, refs) -> None:
        self.args, self.engine, self.prompts, self.refs = args, engine, prompts, refs
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.stage_kills: list[float] = []
        self.host_kills: list[float] = []
        self.poison_sent = 0
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ requests
    async def request(self, kind: str, prompt: list[int], make_params) -> Record:
        rec = Record(kind, tuple(prompt), time.monotonic())
        self.records.append(rec)
        try:
            await asyncio.wait_for(self._consume(rec, make_params), self.args.request_timeout)
        except asyncio.TimeoutError:
            rec.outcome = "hang"
        except ValueError as exc:  # refused at submission: a poison request handled correctly
            rec.outcome, rec.error = "refused", str(exc)[:200]
        except Exception as exc:
            rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"[:200]
        rec.end = time.monotonic()
        return rec

    async def _consume(self, rec: Record, make_params) -> None:
        params = make_params()  # a poison SamplingParams may be refused right here
        rec.max_tokens = params.max_tokens
        async for update in self.engine.generate(list(rec.prompt), params):
            if update.output is not None:
                out = update.output
                rec.tokens, rec.error = list(out.token_ids), out.error or ""
                rec.outcome = "abort" if out.finish_reason == "abort" else "done"

    async def client(self) -> None:
        while not self.stopping:
            prompt = self.rng.choice(self.prompts)
            max_tokens = self.rng.randint(1, MAX_NEW_TOKENS)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            await self.request("greedy", prompt, lambda p=params: p)

    # ------------------------------------------------------------------ faults
    async def inject(self, deadline: float) -> None:
        for _ in range(self.args.faults):
            await asyncio.sleep(self.rng.expovariate(1 / self.args.fault_gap))
            if time.monotonic() > deadline:
                return
            kind = self.rng.choices(list(FAULT_WEIGHTS), list(FAULT_WEIGHTS.values()))[0]
            if kind == "kill_host_tier" and not await self.host_tier_alive():
                kind = "poison"  # the tier is gone already; the engine serves without it
            if kind == "kill_stage":
                await self.kill_stage(deadline)
            elif kind == "kill_host_tier":
                self.kill_host_tier()
            else:
                self.poison()

    async def kill_stage(self, deadline: float) -> None:
        import ray

        actors = self.engine.core.pipeline.actors
        if not actors:  # between a teardown and the next build
            return
        actor = self.rng.choice(actors)
        t_kill = time.monotonic()
        self.stage_kills.append(t_kill)
        ray.kill(actor, no_restart=True)
        # the next fault waits for a request started after the kill to finish: killing the
        # actors of a pipeline that is still being rebuilt is a different experiment
        while time.monotonic() < min(deadline, t_kill + self.args.request_timeout):
            if any(r.start > t_kill and r.outcome == "done" for r in self.records[-64:]):
                return
            await asyncio.sleep(0.2)

    async def host_tier_alive(self) -> bool:
        tiers = self.engine.core.pipeline.tiers
        try:
            return bool(tiers) and await asyncio.wait_for(tiers[0].ping.remote(), 10)
        except Exception:  # a dead actor surfaces in several exception types
            return False

    def kill_host_tier(self) -> None:
        import ray

        tiers = self.engine.core.pipeline.tiers
        if not tiers:  # a rebuild or a drop of the tier took it meanwhile
            return
        self.host_kills.append(time.monotonic())
        ray.kill(tiers[0], no_restart=True)

    def poison(self) -> None:
        name = self.rng.choice(list(POISON))
        self.poison_sent += 1
        task = asyncio.ensure_future(
            self.request(f"poison:{name}", self.rng.choice(self.prompts), POISON[name])
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------------ run
    async def run(self) -> dict:
        """The load with its faults; then the engine's state once drained."""
        start = self.t_start = time.monotonic()
        deadline = start + self.args.duration
        clients = [asyncio.ensure_future(self.client()) for _ in range(self.args.clients)]
        await self.inject(deadline)
        await asyncio.sleep(min(self.args.tail, max(0.0, deadline - time.monotonic())))
        self.stopping = True  # clients finish the request they run, then stop
        await asyncio.gather(*clients, *self.tasks)
        self.load_s = time.monotonic() - start
        return await drained_state(self.engine)


def make_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 258) for _ in range(rng.randint(4, 300))] for _ in range(num)]


def reference_greedy(model, prompts, num_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations of every prompt on the reference's incremental path."""
    return {tuple(prompt): model.greedy(prompt, num_tokens) for prompt in prompts}


async def drained_state(engine: AsyncEngine, timeout_s: float = 60) -> dict:
    """Engine stats once nothing runs or waits, with check_integrity's verdict."""
    deadline = time.monotonic() + timeout_s
    stats = await engine.stats()
    while (stats["num_running"] or stats["num_waiting"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        stats = await engine.stats()
    try:
        engine.core.check_integrity()  # the engine thread is idle: nothing runs
        stats["integrity"] = "ok"
    except Exception as exc:
        stats["integrity"] = f"{type(exc).__name__}: {exc}"[:200]
    return stats


def shm_after_shutdown(engine: AsyncEngine, baseline: set[str], pid: int) -> set[str]:
    key = engine.core.pipeline.key
    engine.shutdown()
    deadline = time.monotonic() + 30  # exiting actors remove their files as they end
    while (left := node_shm_files(pid, [key]) - baseline) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def start_engine(args: argparse.Namespace) -> tuple[int, set[str], AsyncEngine]:
    """(raylet pid, /dev/shm files of the node before the engine, the engine)."""
    import ray

    # loopback only; no dashboard; actors' logs stay in Ray's log files
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=4,
        log_to_driver=False,
        logging_level="ERROR",
    )
    pid = raylet_pid()
    baseline = node_shm_files(pid, [])
    engine = AsyncEngine(
        args.model,
        pp_size=2,
        enable_hicache=True,
        kv_cache_dtype="fp32",
        max_total_tokens=args.max_total_tokens,
        max_num_batched_tokens=512,
    )
    return pid, baseline, engine


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dsv4ray").setLevel(args.log_level.upper())
    prompts = make_prompts(args.num_prompts, args.seed)
    t0 = time.monotonic()
    torch.set_num_threads(1)  # spinning intra-op threads crawl on a shared, busy CPU
    refs = reference_greedy(load_reference(args.model, torch.float32), prompts, MAX_NEW_TOKENS)
    print(f"chaos: reference tokens of {len(prompts)} prompts in {time.monotonic() - t0:.0f} s")
    pid, baseline, engine = start_engine(args)
    print(f"chaos: engine up in {time.monotonic() - t0:.0f} s", flush=True)
    live_files = len(node_shm_files(pid, [engine.core.pipeline.key]) - baseline)
    chaos = Chaos(args, engine, prompts, refs)
    print(f"chaos: load with {args.faults} faults, at most {args.duration:.0f} s", flush=True)
    state = asyncio.run(chaos.run())
    leaked_files = shm_after_shutdown(engine, baseline, pid)
    rows, text = summarize(chaos, state, leaked_files, live_files)
    print(text)
    if args.records:
        write_records(chaos, args.records)
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    path = save_results(args, "chaos", device, {}, rows)
    print(f"chaos: wrote {path}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__, model=".tiny")
    p.add_argument("--faults", type=int, default=100, help="stage/host kills + poison requests")
    p.add_argument("--duration", type=float, default=900.0, help="cap on the load, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=4, help="concurrent greedy requests")
    p.add_argument("--fault-gap", type=float, default=1.0, help="mean seconds between faults")
    p.add_argument("--tail", type=float, default=5.0, help="seconds of load after the faults")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a slower one hangs")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-total-tokens", type=int, default=2048, help="device KV capacity")
    p.add_argument("--records", default=None, help="also write every request and fault (JSONL)")
    p.add_argument("--log-level", default="WARNING", help="level of the engine's own logs")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
