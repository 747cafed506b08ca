"""One local Ray for the whole test session (tests in tests/ray share it)."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # logical CPUs: pipelines of 0.5-CPU stages, a Serve replica and the proxy share 2 cores
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
