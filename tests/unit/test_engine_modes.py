"""How the engine keeps a pipeline's stages busy, by configuration: stage actors on separate GPUs
run one micro-batch per stage; one stage, stages in this process or stages sharing a GPU
schedule a lookahead token instead; drafts keep one plan of decodes."""

import pytest

from dsv4ray.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("options", "overlap", "micro_batches"),
    [
        (dict(pp_size=1, device="cuda"), True, 1),
        (dict(pp_size=2, device="cuda"), False, 2),  # a GPU per stage actor
        (dict(pp_size=4, device="cuda"), False, 4),
        (dict(pp_size=2, device="cuda", num_gpus_per_stage=0.5), True, 1),  # sharing a GPU
        (dict(pp_size=2, device="cuda", use_ray=False), True, 1),  # in this process
        (dict(pp_size=2, device="cuda", overlap_scheduling=True), True, 1),  # asked for
        (dict(pp_size=3, device="cpu"), False, 3),
        (dict(pp_size=2, device="cuda", speculative_num_steps=2), False, 1),
        (dict(pp_size=2, device="cuda", prefill_pp_size=1), False, 2),  # the decode pipeline
        (dict(pp_size=2, device="cuda", pp_micro_batches=4), False, 4),  # asked for
        (dict(pp_size=2, device="cuda", pp_micro_batches=4, prefill_pp_size=1), False, 4),
    ],
)
def test_pipelines_use_micro_batches_or_a_lookahead(options, overlap, micro_batches):
    ec = EngineConfig("unused", **options)
    assert (ec.uses_overlap, ec.micro_batches) == (overlap, micro_batches)


@pytest.mark.parametrize(
    "options",
    [
        dict(pp_size=1, device="cuda"),  # one stage
        dict(pp_size=2, device="cuda", use_ray=False),  # in this process: a lookahead
        dict(pp_size=2, device="cuda", speculative_num_steps=2),  # drafts: one plan
        dict(pp_size=2, device="cuda", overlap_scheduling=True),
    ],
)
def test_a_micro_batch_count_where_none_run_is_refused(options):
    with pytest.raises(ValueError, match="pp_micro_batches applies to pipelines"):
        EngineConfig("unused", pp_micro_batches=3, **options)


def test_a_micro_batch_count_below_one_is_refused():
    with pytest.raises(ValueError, match="pp_micro_batches"):
        EngineConfig("unused", pp_size=2, device="cuda", pp_micro_batches=0)


def test_the_prefill_engine_of_a_pd_pair_runs_without_micro_batches():
    from dsv4ray.cluster.pd import prefill_config

    ec = EngineConfig("unused", pp_size=2, device="cuda", prefill_pp_size=1, pp_micro_batches=4)
    assert prefill_config(ec).pp_micro_batches is None
