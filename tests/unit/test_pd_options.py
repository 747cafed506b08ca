"""Prefill/decode options: errors name the option, PD runs on Ray actors, the CLI flag parses."""

import pytest

from dsv4ray.engine.config import EngineConfig
from dsv4ray.entrypoints.cli import build_parser
from dsv4ray.entrypoints.cli_options import engine_options


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"prefill_pp_size": -1}, "prefill_pp_size"),
        ({"prefill_pp_size": 1.5}, "prefill_pp_size"),
        ({"pd_protocol": "udp"}, "pd_protocol"),
        ({"pd_timeout_s": 0}, "pd_timeout_s"),
        ({"num_gpus_per_stage": 1.5}, "num_gpus_per_stage"),
        ({"pd_test_corrupt_transfers": -2}, "pd_test_corrupt_transfers"),
        ({"prefill_pp_size": 1, "use_ray": False}, "prefill_pp_size"),
    ],
)
def test_bad_pd_options_name_the_option(tiny_ckpt, options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.build(tiny_ckpt, **options)


def test_pd_runs_its_stages_as_ray_actors(tiny_ckpt):
    assert EngineConfig.build(tiny_ckpt, prefill_pp_size=2).uses_ray
    assert not EngineConfig.build(tiny_ckpt).uses_ray


def test_serve_takes_prefill_pp(tiny_ckpt):
    args = build_parser().parse_args(["serve", "--prefill-pp", "2", "--pp", "3"])
    assert engine_options(args) == {"prefill_pp_size": 2, "pp_size": 3}
    assert "prefill_pp_size" not in engine_options(build_parser().parse_args(["serve"]))
    bad = engine_options(build_parser().parse_args(["serve", "--prefill-pp", "-1"]))
    with pytest.raises(ValueError, match="prefill_pp_size"):
        EngineConfig.build(tiny_ckpt, **bad)
