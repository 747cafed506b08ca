"""A step plan survives its msgpack bytes with every field set (the form stage actors get)."""

from dsv4ray.cache.hicache import HostOps
from dsv4ray.engine.handoff import (
    BufferDesc,
    DeviceIds,
    Handoffs,
    KVCheck,
    KVDestination,
    KVSend,
    StageEndpoint,
)
from dsv4ray.engine.plan import (
    LOOKAHEAD_TOKEN,
    PENDING_DRAFT,
    BatchEntry,
    DraftPlan,
    NewRequest,
    RequestDiff,
    StepPlan,
    decode,
    encode,
)


def _full_plan() -> StepPlan:
    device = DeviceIds((3, 4), ((0, 7), (1, 8)), 2)
    endpoint = StageEndpoint("host:1234", 0, 3, "fp8", (BufferDesc("c4", 1, 4096, 584, 9),))
    return StepPlan(
        step_id=41,
        new_requests=[NewRequest("a", 2, [5, 6], [-1, 9], 256, 3, {"temperature": 0.5}, 11)],
        diffs=[RequestDiff("b", [7], [(3, 12)], [1], num_pages=2, rejected=[600, 603])],
        finished_ids=["c"],
        preempted_ids=["d"],
        batch=[BatchEntry("a", 256, 2, True), BatchEntry("b", 600, 3, True, num_drafts=2)],
        token_ids=[1, LOOKAHEAD_TOKEN, 4, PENDING_DRAFT, PENDING_DRAFT],
        snapshots=[("a", 1)],
        logprobs={"a": 2},
        full_logits=["b"],
        prompt_logprobs={"a": [2, [5, 6]]},
        eager=True,
        lookahead=["a"],
        lag=True,
        drafts=DraftPlan(next_tokens={"a": 9}, lookahead=["b"]),
        host=HostOps([(1, 2)], [(1, 2, 3)], [(4, 5)], [(6, 7, 8)]),
        kv=Handoffs(
            [KVSend("a", 256, KVDestination((endpoint,), device), corrupt=True)],
            [KVCheck("b", 512, device)],
        ),
    )


def test_every_field_of_a_plan_round_trips():
    plan = _full_plan()
    assert decode(encode(plan)) == plan
    empty = StepPlan(step_id=-2)
    assert decode(encode(empty)) == empty
