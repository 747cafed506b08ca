"""The host tier's regions at the end of a job that started its own Ray: a replica killed
with its engine (Ray Data stops its pool so) keeps its region leased, so the job has every
node's tier release them all before it stops the Ray. A file of its own: no other engine of
this Ray holds a region while it runs."""

import os

import ray

from dsv4ray.actors.host_tier import host_tier_for_node, release_host_tiers


def test_host_tiers_release_every_region_before_a_job_shuts_its_ray_down(ray_session):
    tier = host_tier_for_node(ray.get_runtime_context().get_node_id())
    region = ray.get(tier.create_region.remote("test-release", 1 << 20))
    assert os.path.exists(region["path"])
    assert release_host_tiers() >= 1
    assert not os.path.exists(region["path"])
    assert ray.get(tier.usage.remote())["num_regions"] == 0
