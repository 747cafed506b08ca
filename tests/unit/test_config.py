"""ModelConfig: both key spellings, raw-file restoration (seed 003), IndexShare tables, errors."""

import json

import pytest

from dsv4ray.config import ConfigError, ModelConfig
from dsv4ray.model.tiny import PRESETS, tiny_config


def _raw(**kw):
    raw = dict(PRESETS["tiny"])
    raw.update(kw)
    return raw


def test_official_keys_give_per_layer_facts():
    cfg = ModelConfig.from_hf(_raw())
    kinds = [s.attn_kind for s in cfg.layers]
    assert kinds == ["window", "c4", "c128", "c4", "c4", "c128"]
    assert [s.moe_kind for s in cfg.layers] == ["hash", "hash"] + ["score"] * 4
    assert cfg.layers[0].rope.yarn is None and cfg.layers[0].rope.theta == cfg.rope_theta
    assert all(
        s.rope.yarn is not None and s.rope.theta == cfg.compress_rope_theta
        for s in cfg.layers
        if s.compress_ratio
    )
    assert cfg.mtp_layer.compress_ratio == 0 and cfg.mtp_layer.rope.yarn is None


def test_transformers_spelling_reads_the_same(tmp_path):
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**_raw())
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "compress_ratios" not in saved and "layer_types" in saved
    ours = ModelConfig.from_hf(tmp_path)
    official = tiny_config("tiny")
    assert ours.layer_ratios == official.layer_ratios
    assert ours.num_hash_layers == official.num_hash_layers
    assert ours.qk_rope_head_dim == 64 and ours.compress_scaling == official.compress_scaling
    assert ours.rope_for(4) == official.rope_for(4) and ours.rope_for(0) == official.rope_for(0)


def test_raw_config_restores_fields_a_config_class_clobbers(tmp_path):
    """Seed 003: a config class dropped qk_rope_head_dim and index_topk_freq; re-read them."""
    raw = _raw(index_topk_freq=2, qk_rope_head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(raw))

    class ClobberingConfig:
        _name_or_path = str(tmp_path)

        def to_dict(self):
            d = dict(raw)
            d.pop("index_topk_freq")
            d["qk_rope_head_dim"] = 32
            return d

    cfg = ModelConfig.from_hf(ClobberingConfig())
    assert cfg.index_topk_freq == 2 and cfg.qk_rope_head_dim == 64
    assert any(s.skip_topk for s in cfg.layers)


RATIOS_10 = [0, 4, 128, 4, 4, 4, 128, 4, 4, 4, 0]


@pytest.mark.parametrize(
    "given,drop,clobber",
    [
        ({"index_topk_pattern": ["compute", "share", "share", "compute", "share", "compute",
                                 "share"]}, "index_topk_pattern", None),
        ({"index_topk_freq": 2, "index_skip_topk_offset": 3}, "index_skip_topk_offset", None),
        ({"index_topk_freq": 3}, None, ("index_topk_freq", 1)),
        ({"num_hash_layers": 2}, None, ("num_hash_layers", 0)),
        ({"compress_ratios": [0, 4, 4, 4, 4, 128, 128, 4, 4, 4, 0]}, None,
         ("compress_ratios", RATIOS_10)),
    ],
    ids=["pattern dropped", "offset dropped", "freq clobbered", "hash layers clobbered",
         "ratios clobbered"],
)  # fmt: skip
def test_every_index_share_and_layer_field_is_reread_from_the_raw_file(tmp_path, given, drop,
                                                                       clobber):  # fmt: skip
    """Seed 003's class: whatever a config class drops or resets, each layer's compress ratio,
    IndexShare flags and hash routing are the raw file's."""
    raw = _raw(**{"num_hidden_layers": 10, "compress_ratios": RATIOS_10, **given})
    (tmp_path / "config.json").write_text(json.dumps(raw))

    class LossyConfig:
        _name_or_path = str(tmp_path)

        def to_dict(self):
            d = dict(raw)
            d.pop(drop, None)
            if clobber is not None:
                d[clobber[0]] = clobber[1]
            return d

    want = ModelConfig.from_hf(str(tmp_path))
    got = ModelConfig.from_hf(LossyConfig())
    assert got == want
    plain = ModelConfig.from_hf(LossyConfig().to_dict())  # what the lossy dict alone says
    assert plain.layers != want.layers or plain.num_hash_layers != want.num_hash_layers


def _seed_skip(c, freq, offset=None):
    """Seed 003's formulas, with the C4 ordinal c in place of layer_id."""
    if offset is not None:
        return max(c - offset + 1, 0) % freq != 0, max(c - offset + 2, 0) % freq != 0
    return max(c - 1, 0) % freq != 0, c % freq != 0


@pytest.mark.parametrize("freq,offset", [(1, None), (2, None), (3, None), (2, 1), (2, 3), (3, 2)])
def test_index_share_tables_follow_seed_formulas(freq, offset):
    ratios = [0, 4, 128, 4, 4, 4, 128, 4, 4, 4, 0]
    kw = dict(index_topk_freq=freq)
    if offset is not None:
        kw["index_skip_topk_offset"] = offset
    cfg = ModelConfig.from_hf(_raw(num_hidden_layers=10, compress_ratios=ratios, **kw))
    c4 = [s for s in cfg.layers if s.compress_ratio == 4]
    assert [s.c4_ordinal for s in c4] == list(range(len(c4)))
    for s in c4:
        assert (s.skip_topk, s.next_skip_topk) == _seed_skip(s.c4_ordinal, freq, offset)
        assert s.has_indexer == (not s.skip_topk)
    assert not c4[0].skip_topk
    assert all(not s.skip_topk for s in cfg.layers if s.compress_ratio != 4)


def test_index_share_pattern_overrides_formulas():
    pattern = ["compute", "share", "compute"]  # tiny has 3 C4 layers
    cfg = ModelConfig.from_hf(
        _raw(index_topk_pattern=pattern, index_topk_freq=3, index_skip_topk_offset=1)
    )
    c4 = [s for s in cfg.layers if s.compress_ratio == 4]
    assert [s.skip_topk for s in c4] == [False, True, False]
    assert [s.next_skip_topk for s in c4] == [True, False, False]


def test_pattern_longer_than_c4_layers_is_rejected():
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        ModelConfig.from_hf(_raw(index_topk_pattern=["compute", "share", "compute", "share"]))


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(compress_ratios=[0, 4, 128, 4, 4, 128]), "compress_ratios"),
        (dict(compress_ratios=[0, 4, 128, 4, 4, 128, 0, 0]), "compress_ratios"),
        (dict(compress_ratios=[0, 4, 64, 4, 4, 128, 0]), "compress_ratios"),
        (dict(index_skip_topk_offset=0), "index_skip_topk_offset"),
        (dict(index_skip_topk_offset=-2), "index_skip_topk_offset"),
        (dict(index_topk_pattern=["compute", "share"]), "index_topk_pattern"),
        (dict(index_topk_pattern=["compute", "skip", "share"]), "index_topk_pattern"),
        (dict(index_topk_pattern=["share", "compute", "share"]), "index_topk_pattern"),
        (dict(o_groups=3), "o_groups"),
        (dict(sliding_window=64), "sliding_window"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(vocab_size=None), "vocab_size"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    raw = _raw(**kw)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(raw)


def test_legacy_compress_rate_keys_fold_in_as_transformers_does():
    raw = _raw(layer_types=["sliding_attention", "compressed_sparse_attention"] * 3)
    raw.pop("compress_ratios")
    assert ModelConfig.from_hf(raw).layer_ratios == (0, 4) * 3
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_hf({**raw, "compress_rate_csa": 8})


def test_missing_ratios_is_named():
    raw = _raw()
    raw.pop("compress_ratios")
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_hf(raw)


def test_config_is_frozen():
    cfg = tiny_config()
    with pytest.raises(AttributeError):
        cfg.hidden_size = 7


@pytest.mark.parametrize(
    ("name", "value"),
    [("execution_timeout_s", 0), ("startup_timeout_s", -1.0), ("startup_timeout_s", "1800"),
     ("execution_timeout_s", float("nan")), ("pd_timeout_s", float("inf")),
     ("num_gpus_per_stage", float("nan"))],  # NaN passes any comparison that checks for <= 0
)  # fmt: skip
def test_bad_timeouts_name_the_option(tiny_ckpt, name, value):
    from dsv4ray.engine.config import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig.build(tiny_ckpt, **{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("dtype", "float16"), ("enable_prefix_caching", "false"), ("enable_hicache", "false"),
     ("draft_rings", 1), ("cuda_graphs", "no"), ("memory_fraction", "0.5"),
     ("memory_fraction", True), ("overlap_scheduling", 1), ("use_ray", 0),
     ("max_num_batched_tokens", 2**63), ("max_total_tokens", 2**41)],  # pool sizes overflow
)  # fmt: skip
def test_options_the_engine_cannot_honour_name_the_option(tiny_ckpt, name, value):
    """A string "false" would be truthy, and float16 has no attention kernel: refused by name
    before anything starts."""
    from dsv4ray.engine.config import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig.build(tiny_ckpt, **{name: value})


def test_a_vllm_option_name_points_at_this_engines_option(tiny_ckpt):
    import dataclasses
    import re

    from dsv4ray.engine.config import VLLM_OPTIONS, EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    for vllm_name, here in VLLM_OPTIONS.items():
        assert vllm_name not in names
        named = set(re.findall(r"[a-z_]+", here)) & names
        assert named or here.startswith("none;"), (vllm_name, here)  # each hint names options
        with pytest.raises(ValueError, match=rf"unknown LLM option '{vllm_name}' \(vLLM's"):
            EngineConfig.build(tiny_ckpt, **{vllm_name: 1})
    with pytest.raises(ValueError, match=r"'max_num_seqs' \(vLLM's option; here: max_running"):
        EngineConfig.build(tiny_ckpt, max_num_seqs=8)
    with pytest.raises(ValueError, match=r"unknown LLM option 'bogus'; known options"):
        EngineConfig.build(tiny_ckpt, bogus=1)


def test_a_float16_checkpoint_computes_in_bfloat16():
    assert ModelConfig.from_hf(_raw(torch_dtype="float16")).torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "overrides", [{"num_nextn_predict_layers": 0}, {"num_hidden_layers": 3},
                  {"num_hidden_layers": 4, "num_nextn_predict_layers": 0}],
)  # fmt: skip
def test_a_resized_preset_cycles_its_compress_pattern(overrides):
    """The layers of a preset given another depth cycle its pattern; MTP layers are dense."""
    base = tiny_config("tiny")
    cfg = tiny_config("tiny", **overrides)
    pattern = base.compress_ratios[: base.num_hidden_layers]
    want = [pattern[i % len(pattern)] for i in range(cfg.num_hidden_layers)]
    assert list(cfg.compress_ratios) == want + [0] * cfg.num_nextn_predict_layers


def test_a_host_tier_holds_at_least_one_page(tiny_ckpt):
    from dsv4ray.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"host_cache_tokens must be an int in \[256"):
        EngineConfig.build(tiny_ckpt, enable_hicache=True, host_cache_tokens=1)
