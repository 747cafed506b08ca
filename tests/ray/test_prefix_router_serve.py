"""PrefixRouter inside Ray Serve: every turn of a conversation reaches one replica of the
routed deployment, whichever caller in front routed it (with Serve's default router a turn
lands on a random replica)."""

import random

import pytest


@pytest.fixture(scope="module")
def front(ray_session):
    """Two callers, each a deployment of its own with a PrefixRouter of its own, calling three
    replicas of Echo (the engine's call shape, generate(prompt, params, request_id), answering
    with its replica id): as ingress replicas call the engine deployment. An ingress picks
    the caller of each call, so a test decides which router routes each turn rather than
    leaving it to Serve's random choice between ingress replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from dsv4ray.entrypoints.serve_config import ROUTERS

    @serve.deployment(
        num_replicas=3,
        ray_actor_options={"num_cpus": 0.01},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS["prefix"]),
    )
    class Echo:
        async def generate(self, prompt, params, request_id):
            return serve.get_replica_context().replica_id.unique_id

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    class Caller:
        def __init__(self, echo) -> None:
            self.echo = echo

        async def generate(self, prompt, request_id):
            me = serve.get_replica_context().replica_id.unique_id
            return me, await self.echo.generate.remote(prompt, None, request_id)

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    class Front:
        def __init__(self, *callers) -> None:
            self.callers = callers

        async def generate(self, prompt, request_id, via=0):
            return await self.callers[via].generate.remote(prompt, request_id)

    echo = Echo.bind()
    callers = [Caller.options(name=f"Caller{k}").bind(echo) for k in range(2)]
    serve.start()
    yield serve.run(Front.bind(*callers), name="prefix-routing", route_prefix=None)
    serve.delete("prefix-routing")
    serve.shutdown()


def test_each_conversation_stays_on_one_replica_whichever_caller_routes_it(front):
    rng = random.Random(0)
    conversations = [[rng.randrange(1000) for _ in range(70)] for _ in range(7)]
    callers, seen = [set() for _ in conversations], [[] for _ in conversations]
    for turn in range(4):
        for i, prompt in enumerate(conversations):
            prompt += [rng.randrange(1000) for _ in range(70)]  # the next user turn
            via = (i + turn) % 2  # turns of one conversation alternate between the callers
            caller, echo = front.generate.remote(list(prompt), f"c{i}-{turn}", via).result()
            callers[i].add(caller)
            seen[i].append(echo)
    # turns of one conversation came through both callers, each with a router of its own
    assert all(len(c) == 2 for c in callers), callers
    assert all(len(set(replicas)) == 1 for replicas in seen), seen
    assert len({replicas[0] for replicas in seen}) > 1  # new conversations still spread


def test_requests_route_on_when_the_table_actor_dies(front):
    import ray

    rng = random.Random(1)
    prompt = [rng.randrange(1000) for _ in range(140)]
    front.generate.remote(prompt, "before").result(timeout_s=60)  # the table exists
    named = ray.util.list_named_actors(all_namespaces=True)
    [table] = [a for a in named if a["name"] == "dsv4ray-prefix-table:prefix-routing:Echo"]
    ray.kill(ray.get_actor(table["name"], namespace=table["namespace"]))
    # the first calls find the table gone (each caller's router on its own), route by two
    # choices and start a fresh table, which the later calls share
    replicas = [
        front.generate.remote(prompt, f"after-{k}", k % 2).result(timeout_s=60)[1]
        for k in range(10)
    ]
    assert len(set(replicas[-3:])) == 1  # the fresh table keeps the prompt on one replica
