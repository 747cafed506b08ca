"""Loading release-format checkpoints: both scale spellings, scales in other shards, ceil-div
block grids, errors that name the tensor or field, and the memory a stage needs while loading."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4ray.config import ConfigError, ModelConfig, QuantConfig
from dsv4ray.config_quant import FP4_MAX_SCALE_BYTE
from dsv4ray.model import load_reference
from dsv4ray.model.loader import load_stage
from dsv4ray.model.quant import QuantizedWeight, quantize_fp4, quantize_fp8
from dsv4ray.model.reference import DSV4Reference
from dsv4ray.model.release import release_quant_fields, save_sharded
from dsv4ray.model.tiny import tiny_config
from dsv4ray.model.weights import CheckpointError, checkpoint_files
from tests.oracle import dequantize_float64, random_release_tensors

IDS = torch.randint(2, 258, (1, 40), generator=torch.Generator().manual_seed(3))


def _write(path, raw: dict, tensors: dict, num_shards: int = 3) -> str:
    os.makedirs(path, exist_ok=True)
    save_sharded(tensors, str(path), num_shards)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return str(path)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(raw config, tensors) of a small V4-Flash-layout checkpoint with random valid bytes."""
    fields = release_quant_fields("fp8+fp4-experts")
    overrides = dict(hidden_size=128, num_hidden_layers=3, compress_ratios=[0, 4, 128, 0])
    cfg = tiny_config("tiny", n_routed_experts=4, num_hash_layers=1, **overrides, **fields)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in DSV4Reference(cfg).state_dict().items()}
    return cfg.to_official_dict(), random_release_tensors(shapes, cfg.quantization, seed=1)


def _logits(path):
    return load_reference(path, torch.float32)(IDS)


def test_scale_spellings_and_cross_shard_scales_load_identically(release, tmp_path):
    raw, tensors = release
    base = _logits(_write(tmp_path / "a", raw, tensors))
    inv = {k.replace(".scale", ".weight_scale_inv"): v for k, v in tensors.items()}
    assert torch.equal(_logits(_write(tmp_path / "b", raw, inv)), base)
    weights_first = dict(sorted(tensors.items(), key=lambda kv: kv[0].endswith(".scale")))
    path = _write(tmp_path / "c", raw, weights_first)  # every scale in a later shard
    weight_map = json.loads(open(f"{path}/model.safetensors.index.json").read())["weight_map"]
    assert weight_map["layers.1.attn.wq_b.weight"] != weight_map["layers.1.attn.wq_b.scale"]
    assert torch.equal(_logits(path), base)


@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((96, 64), (32, 16))])
def test_fp8_ceil_grid_and_block_sizes_match_float64(shape, block):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for scale_fmt in ("float", "ue8m0"):
        codes, scale = quantize_fp8(weight, block, scale_fmt)
        assert scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        got = QuantizedWeight("w.weight", codes, scale, "fp8", block).dequantize()
        assert torch.equal(got, dequantize_float64(codes, scale, block).float())
        assert (got - weight).abs().max() <= weight.abs().max() / 8  # 3 mantissa bits


def test_fp4_rows_match_float64_and_round_to_nearest():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_fp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (64, 48) and scale.shape == (64, 3)
    got = QuantizedWeight("w.weight", packed, scale, "fp4").dequantize()
    assert torch.equal(got, dequantize_float64(packed, scale).float())
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    step = scale.float().repeat_interleave(32, 1)
    nearest = (grid * step[..., None] - weight.abs()[..., None]).abs().min(-1).values
    assert torch.allclose((got - weight).abs(), nearest)


def _edit(release, tmp_path, tensors=None, config=None) -> str:
    raw, base = release
    raw = json.loads(json.dumps(raw))
    if config:
        config(raw)
    edited = dict(base)
    if tensors:
        tensors(edited)
    return _write(tmp_path / "edited", raw, edited)


def _set_block(raw):
    raw["quantization_config"]["weight_block_size"] = [64, 64]


def _add_orphan(t):
    t["layers.1.attn.compressor.wkv.scale"] = torch.ones(8, 1)


def _fp8_experts(raw):
    raw["expert_dtype"] = "fp8"


@pytest.mark.parametrize(
    "tensors,config,match",
    [
        (lambda t: t.pop("layers.1.attn.wq_b.scale"), None, r"layers\.1\.attn\.wq_b\.scale"),
        (lambda t: t.pop("layers.2.ffn.experts.3.w2.scale"), None, r"experts\.3\.w2\.scale"),
        (None, _set_block, r"scale tensor 'layers\..*\.scale'.*weight_block_size \[64, 64\]"),
        (_add_orphan, None, r"layers\.1\.attn\.compressor\.wkv\.scale"),
        (None, _fp8_experts, r"experts\.\d+\.w\d\.weight.*expert_dtype is 'fp8'"),
        (
            lambda t: t.update({"layers.1.attn.wkv.scale": torch.ones(4, 3)}),
            None,
            r"scale tensor 'layers\.1\.attn\.wkv\.scale' has shape \(4, 3\)",
        ),
        (
            lambda t: t.pop("layers.1.attn.wq_b.weight"),
            None,
            r"missing tensor 'layers\.1\.attn\.wq_b\.weight', the weight of the scale",
        ),
        (
            lambda t: t.update({"layers.1.attn.wq_b.weight": t["layers.1.attn.wq_b.weight"][None]}),
            None,
            r"'layers\.1\.attn\.wq_b\.weight' has shape \(1, \d+, \d+\): a quantised weight",
        ),
    ],
    ids=[
        "missing-scale",
        "missing-expert-scale",
        "block-size",
        "orphan-scale",
        "expert-dtype",
        "scale-shape",
        "missing-weight",
        "weight-not-a-matrix",
    ],
)
def test_bad_quantised_checkpoints_name_the_tensor(release, tmp_path, tensors, config, match):
    path = _edit(release, tmp_path, tensors, config)
    with pytest.raises(CheckpointError, match=match):
        load_reference(path, torch.float32)


@pytest.mark.parametrize(
    "qcfg,top,field",
    [
        ({"quant_method": "fp8", "expert_dtype": "fp6"}, {}, "expert_dtype"),
        ({"quant_method": "fp8"}, {"expert_dtype": "int4"}, "expert_dtype"),
        ({"quant_method": "gptq"}, {}, "quant_method"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, {}, "fmt"),
        ({"quant_method": "fp8", "scale_fmt": "e4m3"}, {}, "scale_fmt"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, {}, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, {}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, {}, "weight_block_size"),
    ],
)
def test_unsupported_quantization_fields_are_named(release, qcfg, top, field):
    raw = {k: v for k, v in release[0].items() if k != "expert_dtype"}
    raw.update(quantization_config=qcfg, **top)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(raw)


def test_expert_dtype_inside_quantization_config_wins(release):
    raw = {**release[0], "expert_dtype": "fp8"}
    raw["quantization_config"] = {**raw["quantization_config"], "expert_dtype": "fp4"}
    assert ModelConfig.from_hf(raw).quantization == QuantConfig(
        scale_fmt="ue8m0", expert_dtype="fp4"
    )


_PROBE = r"""
import json, os, resource, sys, torch
torch.set_num_threads(1)
from dsv4ray.config import ModelConfig
from dsv4ray.model.loader import cast_params, load_stage
from dsv4ray.model.stage import StageModel
from dsv4ray.model.weights import checkpoint_files

def vm_data():  # private writable memory: anonymous memory plus the shard files mapped
    lines = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) * 1024 for l in lines if l.startswith("VmData"))

path, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg, out = ModelConfig.from_hf(path), {}
load_stage(path, 0, 1, torch.float32, cfg=cfg)  # warm-up: first-call allocations
mapped = 2 * max(os.path.getsize(f) for f in checkpoint_files(path))  # two open shards
for name, dtype, eager in (("bfloat16", torch.bfloat16, 0), ("float32", torch.float32, 0),
                           ("eager", torch.float32, 1)):
    with torch.device("meta"):
        final = StageModel(cfg, start, end, dtype)
    cast_params(final, dtype)
    final = sum(t.numel() * t.element_size() for t in final.state_dict().values())
    base = vm_data()
    resource.setrlimit(resource.RLIMIT_DATA, (int(base + 1.2 * final + mapped), -1))
    try:
        if eager:  # control: every tensor of the checkpoint read before building
            from safetensors.torch import load_file
            held = [load_file(f) for f in checkpoint_files(path)]
        stage = load_stage(path, start, end, dtype, cfg=cfg)
        out[name] = [True, final]
    except (MemoryError, RuntimeError):
        out[name] = [False, final]
    resource.setrlimit(resource.RLIMIT_DATA, (-1, -1))
    stage = held = None
print(json.dumps(out))
"""


def test_stage_load_stays_within_1_2x_of_its_own_bytes(tmp_path):
    """RLIMIT_DATA caps private writable memory at 1.2x the stage's final bytes plus two mapped
    shard files (a read tensor is a view of its file's mapping). The eager control, which reads
    the whole checkpoint first, must break the same cap, or the cap proves nothing."""
    fields = release_quant_fields("fp8+fp4-experts")
    cfg = tiny_config("tiny", moe_intermediate_size=512, **fields)
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in DSV4Reference(cfg).state_dict().items()}
    tensors = random_release_tensors(shapes, cfg.quantization)
    path = _write(tmp_path, cfg.to_official_dict(), tensors)
    assert len(checkpoint_files(path)) == 3
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed buffers go back to the OS
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, path, "2", "5"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bfloat16"][0] and result["float32"][0], result
    assert not result["eager"][0], result
    assert result["bfloat16"][1] > 15e6  # large enough that 20% is far above allocator noise


@pytest.mark.parametrize("weight_format", ["dequantized", "native"])
def test_a_tensor_the_model_has_no_place_for_is_named_in_both_formats(
    release, tmp_path, weight_format
):
    def extra_expert(t):  # the config has 4 routed experts
        for suffix in (".weight", ".scale"):
            t["layers.2.ffn.experts.4.w1" + suffix] = t[
                "layers.2.ffn.experts.3.w1" + suffix
            ].clone()

    path = _edit(release, tmp_path, extra_expert)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.2\.ffn\.experts\.4"):
        load_stage(path, 0, 3, weight_format=weight_format)


def _plain(t, base: str) -> None:
    """The quantised weight ``base`` stored as plain bf16 instead (its scale gone)."""
    kind = "fp4" if t[base + ".weight"].dtype == torch.int8 else "fp8"
    weight = QuantizedWeight(base + ".weight", t[base + ".weight"], t[base + ".scale"], kind)
    rows, cols = weight.shape
    t[base + ".weight"] = torch.zeros(rows, cols, dtype=torch.bfloat16)
    del t[base + ".scale"]


def test_native_weights_refuse_a_layers_experts_stored_in_different_formats(release, tmp_path):
    """A layer's routed experts run as one stack with native weights: one stored plain among
    FP4 ones is refused at load naming the layer and the way out, which loads it."""
    path = _edit(release, tmp_path, lambda t: _plain(t, "layers.2.ffn.experts.1.w1"))
    with pytest.raises(CheckpointError, match=r"experts of 'layers\.2\.ffn'.*'dequantized'"):
        load_stage(path, 0, 3, weight_format="native")
    load_stage(path, 0, 3, weight_format="dequantized")


def test_native_weights_on_a_checkpoint_that_stores_none_quantised_are_refused(release, tmp_path):
    """A dequantized export that kept its quantization_config."""

    def dequantized(t):
        for name in [n for n in t if n.endswith(".scale")]:
            _plain(t, name[: -len(".scale")])

    path = _edit(release, tmp_path, dequantized)
    with pytest.raises(ValueError, match=r"weight_format 'native' needs quantised weights"):
        load_stage(path, 0, 3, weight_format="native")


def test_fp4_scales_beyond_the_kernels_range_refuse_native_loading(release, tmp_path):
    """An FP4 scale byte above FP4_MAX_SCALE_BYTE cannot be decoded by the native kernels: native
    loading names the scale tensor and the way out, dequantised loading still works."""
    name = "layers.2.ffn.experts.1.w3.scale"

    def huge(t):
        scale = t[name].view(torch.uint8).clone()
        scale[0, 0] = FP4_MAX_SCALE_BYTE + 1
        t[name] = scale.view(torch.float8_e8m0fnu)

    path = _edit(release, tmp_path, huge)
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*'dequantized'"):
        load_stage(path, 0, 3, weight_format="native")
    load_stage(path, 0, 3, weight_format="dequantized")
