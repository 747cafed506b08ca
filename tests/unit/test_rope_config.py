"""RoPE fields read as transformers 5.23 reads them: random rope types, thetas, YaRN factors with
and without attention_factor / mscale, flat and nested spellings. The oracle is transformers'
own DeepseekV4RotaryEmbedding (cos/sin tables) and DeepseekV4ForCausalLM (logits)."""

import json
import random

import pytest
import torch

from dsv4ray.config import ConfigError, ModelConfig
from dsv4ray.model import load_reference
from dsv4ray.model.layers.rope import cos_sin
from dsv4ray.model.tiny import PRESETS
from tests.oracle import ROPE_KINDS, make_hf_checkpoint, max_rel_err, random_rope_fields

pytest.importorskip("transformers")

POSITIONS = torch.arange(0, 70000, 7)  # past YaRN's original length in some cases


def _hf_tables(hf_cfg, kind: str):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    return rotary(x, POSITIONS[None], layer_type=kind)


@pytest.mark.parametrize("compress_kind", ROPE_KINDS)
@pytest.mark.parametrize("spelling", ["rope_scaling", "flat", "nested"])
def test_cos_sin_tables_match_transformers(tmp_path, spelling, compress_kind):
    from transformers import DeepseekV4Config

    seed = f"{spelling}/{compress_kind}"
    fields = random_rope_fields(random.Random(seed), spelling, compress_kind)
    raw = {**PRESETS["tiny"], "rope_scaling": None, **fields}
    hf_cfg = DeepseekV4Config(**raw)
    hf_cfg.save_pretrained(tmp_path)
    for source in (raw, tmp_path):  # as written, and as transformers saved it
        ours = ModelConfig.from_hf(source)
        for kind, ratio in (("main", 0), ("compress", 4)):
            ref_cos, ref_sin = _hf_tables(hf_cfg, kind)
            cos, sin = cos_sin(ours.rope_for(ratio), POSITIONS)
            assert max_rel_err(cos, ref_cos[0]) <= 1e-4, (kind, fields)
            assert max_rel_err(sin, ref_sin[0]) <= 1e-4, (kind, fields)


def test_nested_yarn_without_attention_factor_gets_yarn_mscale(tmp_path):
    """The case the release-format reader got wrong: cos/sin scale by 0.1 ln(16) + 1."""
    fields = {
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {
                "rope_type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "rope_theta": 160000.0,
            },
        }
    }
    cfg = ModelConfig.from_hf({**PRESETS["tiny"], "rope_scaling": None, **fields})
    assert cfg.rope_for(4).attention_factor == pytest.approx(1.2772588722239782)
    assert cfg.rope_for(0).attention_factor == 1.0
    official = ModelConfig.from_hf(PRESETS["tiny"])  # flat rope_scaling: no mscale
    assert official.rope_for(4).attention_factor == 1.0


LOGIT_CASES = [
    pytest.param(
        {
            "main": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.125},
            "compress": {
                "rope_type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "rope_theta": 160000.0,
                "partial_rotary_factor": 0.125,
            },
        },
        id="nested-yarn-default-mscale",
    ),
    pytest.param(
        {
            "main": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5000.0},
            "compress": {
                "rope_type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "mscale": 0.9,
                "mscale_all_dim": 0.6,
                "beta_fast": 16,
                "rope_theta": 50000.0,
            },
        },
        id="nested-linear-yarn-mscale-pair",
    ),
    pytest.param(
        {
            "main": {
                "rope_type": "yarn",
                "factor": 4,
                "original_max_position_embeddings": 2048,
                "attention_factor": 0.8,
            },
            "compress": {"rope_type": "default", "rope_theta": 99000.0},
        },
        id="nested-yarn-main-explicit-factor",
    ),
]


@pytest.mark.parametrize("rope_parameters", LOGIT_CASES)
def test_logits_match_transformers_on_the_checkpoint_it_saved(tmp_path, rope_parameters):
    hf = make_hf_checkpoint(
        tmp_path,
        seed=5,
        compress_ratios=[0, 4, 128, 0],
        hidden_size=64,
        moe_intermediate_size=32,
        rope_scaling=None,
        rope_parameters=json.loads(json.dumps(rope_parameters)),
    )
    saved = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    if "attention_factor" not in rope_parameters["compress"]:
        assert "attention_factor" not in saved["compress"]  # the default applies on reading
    ours = load_reference(str(tmp_path), torch.float32)
    ids = torch.randint(2, 512, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert max_rel_err(ours(ids), ref) <= 1e-4


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        (
            {
                "rope_parameters": {
                    "main": {"rope_type": "longrope", "factor": 2.0},
                    "compress": {"rope_type": "default"},
                }
            },
            "rope_parameters.main.rope_type",
        ),
        (
            {
                "rope_parameters": {
                    "main": {"rope_type": "default"},
                    "compress": {"rope_type": "default", "partial_rotary_factor": 0.25},
                }
            },
            "rope_parameters.compress.partial_rotary_factor",
        ),
        ({"rope_parameters": {"compress": {"rope_type": "default"}}}, "rope_parameters"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}},
            "rope_scaling.truncate",
        ),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor"),
    ],
    ids=["dynamic", "longrope", "partial-rotary", "half-nested", "truncate", "linear-no-factor"],
)
def test_unsupported_rope_fields_are_named(fields, field):
    raw = {**PRESETS["tiny"], "rope_scaling": None, **fields}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf(raw)
