"""Prefill/decode disaggregation over the real Mooncake engine (TCP on loopback): a decode
engine's greedy tokens equal the colocated engine's with fp32 pages, every handoff verified; a
byte flipped on the wire or a killed prefill engine ends in a local prefill, with the same tokens
and no ids left behind."""

import socket
import time

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.worker.pd.listen_filter import admit_only, listening_sockets

# around the window (128) and page (256) edges, as one batch of mixed lengths
LENGTHS = [1, 127, 128, 129, 255, 256, 257, 300]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2)
SEQUENTIAL = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def colocated(tiny_ckpt, prompts):
    """The colocated engine's outputs (in process, fp32 pages): the oracle."""
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logprobs = llm.generate(prompts[-2:], WITH_LOGPROBS)
    finally:
        llm.shutdown()
    return tokens, logprobs


@pytest.fixture(scope="module")
def pd_engine(ray_session, tiny_ckpt):
    """pd_engine(prefill_pp, decode_pp) -> LLM; one pair at a time (the last one is kept for
    the next test that asks for the same split)."""
    held = {}

    def get(prefill_pp: int, decode_pp: int) -> LLM:
        key = (prefill_pp, decode_pp)
        if key not in held:
            for llm in held.values():
                llm.shutdown()
            held.clear()
            held[key] = LLM(
                tiny_ckpt, kv_cache_dtype="fp32", prefill_pp_size=prefill_pp, pp_size=decode_pp
            )
        return held[key]

    yield get
    for llm in held.values():
        llm.shutdown()


def assert_nothing_held(llm: LLM) -> None:
    llm.core.check_integrity()
    stats = llm.core.stats()
    assert stats["num_transferring"] == 0 and not llm.core.handoffs
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]
    assert not llm.scheduler.held


def test_a_hisparse_decode_side_takes_handoffs_token_exact(ray_session, tiny_ckpt, prompts,
                                                           colocated):  # fmt: skip
    """PD with HiSparse on both sides: prefill writes each request's C4 history into the
    decode side's host store (slot 0 included) and the decode side's few hot rows miss, so
    decoding reads the handed-over history through the host: tokens equal the colocated ones.
    First in the file: the engines pd_engine keeps would otherwise idle beside this one."""
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", prefill_pp_size=1, pp_size=2,
              enable_hisparse=True, hisparse_hot_rows=17)  # fmt: skip
    try:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.core.stats()
        assert [o.token_ids for o in outs] == colocated[0]
        assert stats["pd_remote_prefills"] == len(prompts) and stats["pd_local_prefills"] == 0
        assert stats["hisparse_misses"] > 0
        assert_nothing_held(llm)
        # one at a time, each handed into a state slot an earlier request left: its hot rows
        # start empty (rows kept from that request point at its C4 entries, and decoding would
        # read them: logprobs off by 1e-2)
        got = [llm.generate([p], SEQUENTIAL)[0] for p in prompts[-3:]]
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
    ref = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    try:
        want = ref.generate(prompts[-3:], SEQUENTIAL)
    finally:
        ref.shutdown()
    for out, ref_out in zip(got, want):
        assert_logprobs_equal(out, ref_out)


# prefill pp 2 and decode pp 2: tests/ray/test_combinations.py (with drafts and the host tier)
@pytest.mark.parametrize(("prefill_pp", "decode_pp"), [(1, 1)])
def test_decode_tokens_equal_colocated_ones(pd_engine, prompts, colocated, prefill_pp, decode_pp):
    llm = pd_engine(prefill_pp, decode_pp)
    before = llm.core.stats()
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == colocated[0]
    stats = llm.core.stats()
    assert stats["pd_remote_prefills"] - before["pd_remote_prefills"] == len(prompts)
    assert stats["pd_local_prefills"] == before["pd_local_prefills"]
    assert stats["pd_checksum_failures"] == 0 and stats["pd_transfer_bytes"] > 0
    assert all(o.metrics.kv_transfer_s > 0 for o in outs)
    # the writes happen inside the prefill engine's time, which lies inside the TTFT
    times = [(o.metrics.kv_transfer_s, o.metrics.remote_prefill_s, o.metrics.ttft_s) for o in outs]
    assert all(write < remote < ttft for write, remote, ttft in times), times
    assert len(llm.core.pipeline.actors) == decode_pp
    assert llm.core.describe()["prefill_pp_size"] == prefill_pp
    assert_nothing_held(llm)
    # the first token's logprobs travel with the handoff
    got = llm.generate(prompts[-2:], WITH_LOGPROBS)
    for out, ref in zip(got, colocated[1]):
        assert_logprobs_equal(out, ref)


def test_requests_with_min_tokens_are_prefilled_remotely(pd_engine, prompts, colocated):
    # the prefill engine samples the first token alone (max_tokens 1): a request's min_tokens
    # above that must not make it refuse the request (it was prefilled locally, PD skipped)
    llm = pd_engine(1, 1)
    before = llm.core.stats()
    params = SamplingParams(max_tokens=4, ignore_eos=True, min_tokens=3)
    outs = llm.generate(prompts[:3], params)
    stats = llm.core.stats()
    assert stats["pd_remote_prefills"] - before["pd_remote_prefills"] == 3
    assert stats["pd_local_prefills"] == before["pd_local_prefills"]
    assert [o.token_ids for o in outs] == colocated[0][:3]


def assert_logprobs_equal(out, ref) -> None:
    """Same tokens and, at every step, the same top logprobs (fp32 pages: within 1e-4)."""
    assert out.token_ids == ref.token_ids
    assert len(out.logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for step, ref_step in zip(out.logprobs, ref.logprobs):
        assert step.keys() == ref_step.keys()
        assert all(abs(step[t] - ref_step[t]) < 1e-4 for t in step), (step, ref_step)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, IPv4 and IPv6 (/proc)."""
    return set(listening_sockets(pid).values())


def _stage_actors() -> list[dict]:
    """This driver's live stage actors (the decode pipeline's and the prefill engine's): pid,
    Ray's worker port (from the GCS's actor table)."""
    job = ray.get_runtime_context().get_job_id()
    return [
        {"pid": a["Pid"], "ray_port": a["Address"]["Port"]}
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "StageActor" and a["State"] == "ALIVE" and a["JobID"] == job
    ]


def test_every_pd_stage_binds_its_transfer_engine_to_the_node_address(pd_engine):
    """What a stage actor of either pipeline exposes (docs/operations.md, Ports): Ray's worker
    port and the Mooncake engine's two listeners, bound to the node's Ray address (the IPv6 one
    as its v4-mapped form), never to every interface: through loopback nothing answers, through
    the node's address both do. Anything else listening fails this test."""
    llm = pd_engine(1, 1)
    node = ray.util.get_node_ip_address()
    other = "127.0.0.1" if node != "127.0.0.1" else None
    sessions = {e.session for e in llm.core.pipeline.kv_endpoints}
    stages = _stage_actors()
    assert len(stages) == 2, stages  # one decode stage, one prefill stage
    for stage in stages:
        ray_port = stage["ray_port"]
        listening = _listening(stage["pid"])
        mooncake = {(a.removeprefix("::ffff:"), p) for a, p in listening if p != ray_port}
        assert len(listening) == 3 and len(mooncake) == 2, listening  # Ray's, handshake, data
        assert {a for a, _ in mooncake} == {node}, listening
        for _, port in mooncake:
            assert _answers(node, port)
            if other is not None:  # a machine whose Ray address is loopback has no other
                assert not _answers(other, port)
    # the decode stage's advertised session is one of its bound listeners
    decode = [s for s in stages if any(f"{node}:{p}" in sessions for _, p in _listening(s["pid"]))]
    assert len(decode) == 1


def test_a_wildcard_listener_behind_the_filter_answers_only_on_its_address():
    """Where the bind library cannot be built, a stage filters the engine's wildcard listeners:
    a connection through any other address of the machine gets no answer."""
    node = ray.util.get_node_ip_address()  # the address Ray would pick, started or not
    if node == "127.0.0.1":
        pytest.skip("this machine has no address but loopback to tell apart")
    with socket.socket(socket.AF_INET) as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        inode = next(i for i, (_, p) in listening_sockets().items() if p == port)
        assert _answers("127.0.0.1", port)
        assert admit_only(node, {inode}) == 1
        assert _answers(node, port) and not _answers("127.0.0.1", port)


def _answers(address: str, port: int) -> bool:
    """Whether a TCP connection to address:port is accepted within a second."""
    with socket.socket(socket.AF_INET) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect((address, port))
        except OSError:  # dropped (timeout) or refused
            return False
    return True


def test_a_byte_flipped_on_the_wire_is_caught_and_prefilled_locally(pd_engine, prompts, colocated):
    llm = pd_engine(1, 1)
    before = llm.core.stats()
    llm.core.corrupt_transfers = 1  # test hook: the next handoff flips one byte on the wire
    out = llm.generate([prompts[-1]], GREEDY)[0]
    stats = llm.core.stats()
    assert out.token_ids == colocated[0][-1]
    assert stats["pd_checksum_failures"] - before["pd_checksum_failures"] == 1
    assert stats["pd_local_prefills"] - before["pd_local_prefills"] == 1
    assert stats["pd_remote_prefills"] == before["pd_remote_prefills"]
    assert_nothing_held(llm)


def test_a_late_answer_after_a_timeout_writes_only_into_held_ids(pd_engine, prompts, colocated):
    llm = pd_engine(1, 1)
    before = llm.core.stats()
    llm.core.timeout_s = 0.0  # every handoff times out before its answer: prefilled here
    try:
        outs = llm.generate(prompts[4:7], GREEDY)
    finally:
        llm.core.timeout_s = llm.config.pd_timeout_s
    assert [o.token_ids for o in outs] == colocated[0][4:7]
    assert llm.core.stats()["pd_local_prefills"] - before["pd_local_prefills"] == 3
    drain(llm)  # the late answers free the held ids
    assert_nothing_held(llm)


def test_a_request_aborted_during_its_handoff_leaves_nothing_behind(pd_engine, prompts):
    llm = pd_engine(1, 1)
    core = llm.core
    core.add_request("gone", prompts[-1], GREEDY)
    core.step()  # reserves its ids, asks the prefill engine, waits 50 ms (a prefill takes longer)
    assert not core.scheduler.transfers["gone"].answered
    assert core.abort("gone", "the caller left").finish_reason == "abort"
    core.pop_output("gone")
    assert core.scheduler.held  # a write may still come: the ids wait for the answer
    drain(llm)  # its ids are held until the prefill engine's answer, then freed
    assert_nothing_held(llm)


def drain(llm: LLM, timeout_s: float = 30.0) -> None:
    """Steps the idle engine until every handoff got its answer (held ids are freed then)."""
    deadline = time.monotonic() + timeout_s
    while llm.core.handoffs and time.monotonic() < deadline:
        llm.core.step()
        time.sleep(0.05)


def test_a_killed_prefill_engine_means_local_prefill_not_a_hang(pd_engine, prompts, colocated):
    llm = pd_engine(1, 1)
    core, before = llm.core, llm.core.stats()
    core.add_request("in-flight", prompts[-1], GREEDY)
    core.step()  # its prefill is running on the prefill engine when the engine dies
    assert not core.scheduler.transfers["in-flight"].answered
    ray.kill(core.prefill.actor, no_restart=True)
    start = time.monotonic()
    core.run_until_done({"in-flight"})
    out = core.pop_output("in-flight")
    assert time.monotonic() - start < 60
    assert (out.token_ids, out.finish_reason) == (colocated[0][-1], "length")
    assert not core.prefill.alive
    outs = llm.generate(prompts[:3], GREEDY)  # later requests run here from the start
    assert [o.token_ids for o in outs] == colocated[0][:3]
    assert core.stats()["pd_local_prefills"] - before["pd_local_prefills"] == 1
    assert core.stats()["pd_remote_prefills"] == before["pd_remote_prefills"]
    drain(llm)  # ids the dead engine's stages might still have written are held a while
    assert_nothing_held(llm)
    # the idle engine's liveness check restarts the prefill engine, after removing the dead
    # one's stage placement group (it outlives its actor and holds what the new one needs)
    old_pg = llm.core.describe()["prefill_stage_placement_group_id"]
    deadline = time.monotonic() + 120
    while not core.prefill.alive and time.monotonic() < deadline:
        core.check_liveness()
        time.sleep(0.2)
    assert core.prefill.alive
    assert ray.util.placement_group_table()[old_pg]["state"] == "REMOVED"
    before = core.stats()
    outs = llm.generate(prompts[3:6], GREEDY)
    assert [o.token_ids for o in outs] == colocated[0][3:6]
    assert core.stats()["pd_remote_prefills"] - before["pd_remote_prefills"] == 3
    assert_nothing_held(llm)


def test_a_prefill_engine_killed_while_idle_is_found_and_restarted(pd_engine, prompts, colocated):
    llm = pd_engine(1, 1)
    core = llm.core
    ray.kill(core.prefill.actor, no_restart=True)
    core.check_liveness()  # found dead: local prefill until the new engine is up
    assert not core.prefill.alive
    out = llm.generate([prompts[2]], GREEDY)[0]
    assert out.token_ids == colocated[0][2]
    deadline = time.monotonic() + 120
    while not core.prefill.alive and time.monotonic() < deadline:
        core.check_liveness()
        time.sleep(0.2)
    before = core.stats()
    outs = llm.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == colocated[0][:2]
    assert core.stats()["pd_remote_prefills"] - before["pd_remote_prefills"] == 2
    assert_nothing_held(llm)
