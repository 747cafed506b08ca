"""Where users meet speculative decoding without running it: the CLI flag on every engine
command, the Serve config key and the startup line, and the option's validation by name."""

import pytest

from dsv4ray.engine.config import EngineConfig
from dsv4ray.entrypoints.cli import build_parser
from dsv4ray.entrypoints.cli_options import engine_options
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.entrypoints.serve import ServeSettings, startup_line


@pytest.mark.parametrize("command", [["generate", "x"], ["job", "--input", "i", "--output", "o"],
                                     ["serve"]])  # fmt: skip
def test_every_engine_command_takes_the_flag(command, tiny_ckpt):
    args = build_parser().parse_args([*command, "--speculative-num-steps", "3"])
    assert engine_options(args)["speculative_num_steps"] == 3
    assert "speculative_num_steps" not in engine_options(build_parser().parse_args(command))
    bad = engine_options(build_parser().parse_args([*command, "--speculative-num-steps", "-1"]))
    with pytest.raises(ValueError, match="speculative_num_steps"):
        EngineConfig.build(tiny_ckpt, **bad)


def test_serve_config_key_and_startup_line(tiny_ckpt):
    settings = ServeSettings.from_config({"model": tiny_ckpt, "speculative_num_steps": 2})
    assert settings.engine_options["speculative_num_steps"] == 2
    info = {"model": tiny_ckpt, "served_model_name": "m", "pp_size": 1, "kv_cache_dtype": "fp8",
            "device": "cpu", "capacity_tokens": 4096, "max_model_len": 4096}  # fmt: skip
    assert "drafts" not in startup_line(info, "127.0.0.1", 8000)
    info["speculative_num_steps"] = 2
    assert "MTP drafts on (2 per step)" in startup_line(info, "127.0.0.1", 8000)


@pytest.mark.parametrize("value", [9, -1, 1.5, "3"])
def test_bad_step_counts_are_refused_by_name(tiny_ckpt, value):
    with pytest.raises(ValueError, match="speculative_num_steps"):
        LLM(tiny_ckpt, speculative_num_steps=value, use_ray=False)
