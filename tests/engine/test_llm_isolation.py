"""One request's bad data or failure never hurts another, and the offline API leaks nothing.

Values the API documents as valid (temperatures down to 5e-324, top_p down to 5e-324) sample
without error; invalid ones raise ValueError before anything is queued; a request whose
sampling fails on the last stage ends alone with an error while its batch-mates keep their
reference tokens; a step whose compute fails aborts only that step's requests; and after every
error path no request is running and every page is free or cached.
"""

import asyncio
import dataclasses
import signal
import threading

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

PROMPTS = [
    torch.randint(2, 258, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (40, 300)
]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    engine = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    yield engine
    engine.shutdown()


def _assert_nothing_held(llm) -> None:
    stats = llm.core.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]
    assert llm.core.outputs.unfinished() == [] and not llm.core.outputs.outputs
    assert not llm.core.scoring
    llm.core.check_integrity()


def _assert_no_step_left(llm) -> None:
    """After a call that ran to its end: no step of an interrupted call is still tracked."""
    assert not llm.core.in_flight and not llm.core.scheduler._in_flight
    assert not getattr(llm.core.pipeline, "fills", None)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1e-38},
        {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 0.7, "top_p": 1e-300},
    ],
)
def test_extreme_valid_values_give_greedy_tokens(llm, tiny_model, kw):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True, **kw))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == reference_greedy(tiny_model, PROMPTS[0], 4)
    _assert_nothing_held(llm)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(stop="\ud800"), "stop"),
        (lambda: SamplingParams(stop=["fine", "\udc00x"]), "stop"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(logit_bias=[1, 2]), "logit_bias"),  # a list, not pairs
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match=r"^prompt 1: .*vocabulary"):  # named by its place
        llm.generate([PROMPTS[0], [0, 10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt 2: .*holds float"):
        llm.score([PROMPTS[0], PROMPTS[1], [3, 4.0]])
    with pytest.raises(ValueError, match="request id"):
        llm.core.add_request("bad\ud800id", PROMPTS[0], SamplingParams())
    for prompts, named in [(5, "got int"), ([PROMPTS[0], [3, 4.0]], "holds float"),
                           ([None], "got NoneType"), (b"Hello", "got bytes"),
                           ("a\ud800b", "prompt is not valid text")]:  # fmt: skip
        with pytest.raises(ValueError, match=named):
            llm.generate(prompts, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
    _assert_nothing_held(llm)


def test_a_sampling_failure_ends_only_its_request(llm, tiny_model, monkeypatch):
    worker = llm.core.pipeline.workers[-1]
    add, added = worker._add, []

    def add_with_bad_sampling(new):  # the second request reaches the stage with top_p 0
        added.append(new.req_id)
        if len(added) == 2:
            new = dataclasses.replace(new, sampling={**new.sampling, "top_p": 0.0})
        add(new)

    monkeypatch.setattr(worker, "_add", add_with_bad_sampling)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].token_ids == reference_greedy(tiny_model, PROMPTS[0], 4)
    assert outs[1].finish_reason == "abort" and "sampling failed" in outs[1].error
    assert llm.core.num_rebuilds == 0
    _assert_nothing_held(llm)


def test_a_failed_step_aborts_its_requests_and_the_engine_keeps_serving(
    llm, tiny_model, monkeypatch
):
    worker = llm.core.pipeline.workers[0]
    run = worker.run_layers
    calls = []

    def run_failing_once(*args):
        calls.append(1)
        if len(calls) == 2:  # the first decode step of the batch
            raise RuntimeError("injected compute failure")
        return run(*args)

    monkeypatch.setattr(worker, "run_layers", run_failing_once)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert all("pipeline stage" in o.error and "injected" not in o.error for o in outs)
    _assert_nothing_held(llm)
    again = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert again.token_ids == reference_greedy(tiny_model, PROMPTS[1], 3)
    assert llm.core.num_rebuilds == 0


def test_an_interrupted_generate_leaves_no_request_behind(llm, monkeypatch):
    step = llm.core.step
    steps = []

    def step_then_interrupt():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.core, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=8))
    monkeypatch.undo()
    _assert_nothing_held(llm)


def _interrupt_on(llm, monkeypatch, where: str, nth_call: int = 2) -> None:
    """Ctrl-C while a generate queues its prompts, while it waits for a step, or (a real
    SIGINT) in the middle of admitting a request, where the scheduler holds half of its ids."""
    calls = []

    def nth(fn, n, action):
        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                action()
            return fn(*args, **kwargs)

        return wrapped

    def interrupt():
        raise KeyboardInterrupt

    core = llm.core
    if where == "queueing":
        monkeypatch.setattr(core, "add_request", nth(core.add_request, 2, interrupt))
    elif where == "collect":
        collect = nth(core.pipeline.collect, nth_call, interrupt)
        monkeypatch.setattr(core.pipeline, "collect", collect)
    else:
        kv = core.scheduler.kv
        signal_now = lambda: signal.raise_signal(signal.SIGINT)  # noqa: E731
        monkeypatch.setattr(kv, "grow", nth(kv.grow, 2, signal_now))


@pytest.mark.parametrize("where", ["queueing", "collect", "admission"])
def test_ctrl_c_anywhere_in_a_generate_leaves_nothing_held(llm, tiny_model, monkeypatch, where):
    _interrupt_on(llm, monkeypatch, where)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([*PROMPTS, PROMPTS[0][:20]], SamplingParams(max_tokens=8))
    monkeypatch.undo()
    _assert_nothing_held(llm)
    again = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert again.token_ids == reference_greedy(tiny_model, PROMPTS[1], 3)
    _assert_nothing_held(llm)
    _assert_no_step_left(llm)


def test_ctrl_c_while_a_dead_stage_is_found_still_rebuilds_before_the_next_call(
    llm, tiny_model, monkeypatch
):
    """A Ctrl-C that lands while a submit finds a dead stage: the call ends with
    KeyboardInterrupt, and the next call gets a rebuilt pipeline instead of meeting the dead
    stage again and having its own requests aborted."""
    from dsv4ray.engine.pipeline import PipelineFailure

    pipeline, dead = llm.core.pipeline, {"stage": True, "signalled": False}
    submit, rebuild = pipeline.submit, pipeline.rebuild

    def dead_submit(plan):
        if dead["stage"] and plan.batch:
            if not dead["signalled"]:
                dead["signalled"] = True
                signal.raise_signal(signal.SIGINT)  # lands inside the step's deferred block
            raise PipelineFailure("stage gone")
        return submit(plan)

    def fresh_stages():
        dead["stage"] = False
        rebuild()

    monkeypatch.setattr(pipeline, "submit", dead_submit)
    monkeypatch.setattr(pipeline, "rebuild", fresh_stages)
    rebuilds = llm.core.num_rebuilds
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    again = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    monkeypatch.undo()
    assert again.finish_reason == "length", again.error
    assert again.token_ids == reference_greedy(tiny_model, PROMPTS[1], 3)
    assert llm.core.num_rebuilds == rebuilds + 1
    _assert_nothing_held(llm)


def test_an_interrupted_score_leaves_nothing_held(llm, monkeypatch):
    _interrupt_on(llm, monkeypatch, "collect", nth_call=1)  # both prompts score in one step
    with pytest.raises(KeyboardInterrupt):
        llm.score([PROMPTS[0], PROMPTS[1]])
    monkeypatch.undo()
    _assert_nothing_held(llm)


@pytest.mark.parametrize("failing_pass", [1, 2])
def test_a_score_whose_pass_failed_raises_and_leaves_nothing_held(
    llm, tiny_ckpt, monkeypatch, failing_pass
):
    """A stage failure in a score's first pass, or in a later chunk of a long prompt, raises
    naming the prompt, never a partial [n, V] result, and the engine keeps scoring."""
    chunked = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=256)
    try:
        worker, passes = chunked.core.pipeline.workers[0], []
        run = worker.run_layers

        def run_failing(*args):
            passes.append(1)
            if len(passes) == failing_pass:
                raise RuntimeError("injected compute failure")
            return run(*args)

        monkeypatch.setattr(worker, "run_layers", run_failing)
        long = [5 + i % 200 for i in range(600)]  # three passes of 256 tokens
        first = 0 if failing_pass == 1 else 1  # the first pass holds both prompts
        with pytest.raises(RuntimeError, match=rf"^prompt {first}: not scored: .*pipeline stage"):
            chunked.score([PROMPTS[0], long])
        monkeypatch.undo()
        _assert_nothing_held(chunked)
        got = chunked.score([long])[0]
        assert got.shape[0] == len(long)
        torch.testing.assert_close(got, llm.score([long])[0], rtol=0, atol=1e-4)
    finally:
        chunked.shutdown()


def test_a_refused_prompt_is_named_by_its_place_in_the_call(llm):
    too_long = [5] * (llm.core.max_model_len + 1)
    bad_bias = SamplingParams(max_tokens=2, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match=r"^prompt 1: logit_bias") as info:
        llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=2), bad_bias])
    assert info.value.field == "logit_bias"
    with pytest.raises(ValueError, match=r"^prompt 2: prompt has") as info:
        llm.generate([PROMPTS[0], PROMPTS[1], too_long])
    assert "llm-" not in str(info.value)
    _assert_nothing_held(llm)


def _faulty(engine, faults: dict, release: threading.Event | None = None):
    """Stage failures on the local pipeline: the first ``faults["submit"]`` plans that carry a
    request raise PipelineFailure, the first ``faults["rebuild"]`` rebuilds raise; a rebuild
    waits for ``release`` (a restart takes seconds to minutes on a real cluster)."""
    from dsv4ray.engine.pipeline import PipelineFailure

    pipeline = engine.core.pipeline
    submit, rebuild = pipeline.submit, pipeline.rebuild

    def failing_submit(plan):
        if faults.get("submit") and plan.batch:
            faults["submit"] -= 1
            raise PipelineFailure("stage gone")
        return submit(plan)

    def failing_rebuild():
        assert release is None or release.wait(timeout=60)
        if faults.get("rebuild"):
            faults["rebuild"] -= 1
            raise RuntimeError("the cluster cannot start a stage now")
        rebuild()

    pipeline.submit, pipeline.rebuild = failing_submit, failing_rebuild


async def _last(engine, prompt, max_tokens: int = 3):
    updates = [u async for u in engine.generate(prompt, SamplingParams(max_tokens=max_tokens))]
    return updates[-1].output


def test_aborts_reach_their_streams_before_the_rebuild_and_new_requests_wait_for_it(
    tiny_ckpt, tiny_model
):
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine, release = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32"), threading.Event()
    _faulty(engine, {"submit": 1}, release)

    async def scenario():
        lost = await _last(engine, PROMPTS[0])  # while the rebuild has not even started
        assert lost.finish_reason == "abort" and "stage" in lost.error
        waiting = asyncio.ensure_future(_last(engine, PROMPTS[1]))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # it waits for the pipeline, it is not aborted
        release.set()
        return await waiting, await engine.stats()

    try:
        again, stats = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert again.token_ids == reference_greedy(tiny_model, PROMPTS[1], 3)
        assert stats["num_pipeline_rebuilds"] == 1 and stats["num_running"] == 0
    finally:
        release.set()
        engine.shutdown()


def test_a_failed_rebuild_ends_the_waiting_requests_and_the_next_one_is_served(
    tiny_ckpt, tiny_model
):
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine, faults = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32"), {"submit": 1, "rebuild": 1}
    _faulty(engine, faults)

    async def scenario():
        return [await _last(engine, prompt) for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[1])]

    try:
        lost, refused, again = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert lost.finish_reason == "abort" and "stage" in lost.error
        assert refused.finish_reason == "abort" and "could not be restarted" in refused.error
        assert again.token_ids == reference_greedy(tiny_model, PROMPTS[1], 3)
        assert faults == {"submit": 0, "rebuild": 0}
    finally:
        engine.shutdown()


def test_a_request_id_in_use_is_refused_and_a_left_ones_reuse_gets_only_its_own_tokens(
    tiny_ckpt, tiny_model
):
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32")
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def scenario():
        first = engine.generate(PROMPTS[0], params, request_id="dup")
        opened = await first.__anext__()  # running: its first token came
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate(PROMPTS[1], params, request_id="dup").__anext__()
        rest = [u async for u in first]
        return [*opened.token_ids, *(t for u in rest for t in u.token_ids)], rest[-1].output

    async def reuse_after_leaving():
        # the caller leaves a running stream and at once reuses its id: the old request is
        # still stepping, and none of its updates (nor its abort) may reach the new stream
        results = []
        for _ in range(3):
            old = engine.generate(PROMPTS[0], long, request_id="again")
            for _ in range(3):
                await old.__anext__()
            await old.aclose()
            updates = [u async for u in engine.generate(PROMPTS[1], params, request_id="again")]
            results.append(([t for u in updates for t in u.token_ids], updates[-1].output))
        return results

    long = SamplingParams(max_tokens=200, ignore_eos=True)
    try:
        tokens, out = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
        assert tokens == out.token_ids == reference_greedy(tiny_model, PROMPTS[0], 12)
        want = reference_greedy(tiny_model, PROMPTS[1], 12)
        for tokens, out in asyncio.run(asyncio.wait_for(reuse_after_leaving(), timeout=120)):
            assert tokens == out.token_ids == want
            assert out.finish_reason == "length" and out.error is None
        engine.core.check_integrity()
    finally:
        engine.shutdown()


def test_what_async_callers_leave_behind_never_blocks_another_request(tiny_ckpt, tiny_model):
    """An anonymous request beside a caller's id shaped like the engine's own; an id reused at
    once by a caller that left its stream on the final update (the old generator closing later
    leaves the new stream alone); a caller whose event loop closed with its stream open (the
    engine thread goes on serving); and that stream's id after shutdown (refused, not awaited)."""
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32", use_ray=False)
    params, long = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 10_000))
    want = reference_greedy(tiny_model, PROMPTS[1], 4)

    async def tokens(stream) -> list[int]:
        return [t async for u in stream for t in u.token_ids]

    async def ids_reused():
        held = engine.generate(PROMPTS[0], long, request_id="req-0")
        await anext(held)
        anonymous = await tokens(engine.generate(PROMPTS[1], params))
        await held.aclose()
        first = engine.generate(PROMPTS[1], params, request_id="job")
        async for update in first:
            if update.output is not None:
                break
        again = engine.generate(PROMPTS[1], params, request_id="job")
        opened = (await anext(again)).token_ids
        await first.aclose()
        return anonymous, [*opened, *await tokens(again)]

    def abandon_a_loop():
        loop = asyncio.new_event_loop()
        loop.run_until_complete(anext(engine.generate(PROMPTS[0], long, request_id="left")))
        loop.close()

    try:
        assert asyncio.run(asyncio.wait_for(ids_reused(), timeout=60)) == (want, want)
        caller = threading.Thread(target=abandon_a_loop)
        caller.start()
        caller.join(timeout=60)
        served = asyncio.run(asyncio.wait_for(tokens(engine.generate(PROMPTS[1], params)), 60))
        assert served == want and engine._thread.is_alive()
    finally:
        engine.shutdown()

    async def reuse_after_shutdown():
        await anext(engine.generate(PROMPTS[1], params, request_id="left"))

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(asyncio.wait_for(reuse_after_shutdown(), timeout=10))


def test_an_async_engine_shut_down_ends_its_open_streams_and_refuses_calls(tiny_ckpt):
    from dsv4ray.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32", use_ray=False)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)

    async def scenario():
        stream = engine.generate(PROMPTS[0], params)
        await anext(stream)  # running
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        last = [u async for u in stream][-1].output
        with pytest.raises(RuntimeError, match="shut down"):
            await anext(engine.generate(PROMPTS[1], params))
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.stats()
        return last

    last = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert last.finish_reason == "abort" and "shut down" in last.error
    engine.shutdown()  # twice is fine


def test_a_shut_down_engine_refuses_requests_and_never_rebuilds(tiny_ckpt):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", use_ray=False)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    llm.shutdown()
    for call in (lambda: llm.generate("Hi"), lambda: llm.score([PROMPTS[0][:4]])):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    assert llm.core.step() == [] and llm.core.check_liveness() == []  # no rebuild
    llm.shutdown()  # twice is fine
    with pytest.raises(ValueError, match="model must be a checkpoint's path"):
        LLM(None)


def test_a_context_longer_than_the_model_supports_is_refused_by_name(tmp_path):
    from dsv4ray.model.tiny import make_tiny

    path = make_tiny(str(tmp_path / "short"), "tiny", seed=1, max_position_embeddings=1024)
    with pytest.raises(ValueError, match=r"max_model_len 4096 is more than .* \(1024\)"):
        LLM(path, use_ray=False, max_model_len=4096)
    llm = LLM(path, use_ray=False, max_model_len=1024)  # the model's own limit is fine
    llm.shutdown()


@pytest.mark.parametrize("hisparse", [False, True])
def test_pools_larger_than_the_machines_memory_are_refused_before_allocating(tiny_ckpt, hisparse):
    with pytest.raises(ValueError, match="lower max_total_tokens or max_running_requests"):
        LLM(tiny_ckpt, use_ray=False, max_running_requests=2**22, enable_hisparse=hisparse)
    with pytest.raises(ValueError, match="lower max_total_tokens"):  # the C4 history too
        LLM(tiny_ckpt, use_ray=False, max_total_tokens=2**36, enable_hisparse=hisparse)
