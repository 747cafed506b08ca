"""Release-format checkpoints (``make_tiny(quantize=...)``): the layout on disk, dequantisation at
load against an independent float64 decode of the same bytes, transformers 5.23's dequantised
model, and the paged engine's greedy tokens.

transformers 5.23 loads both layouts on CPU (FP8 linears and the packed FP4 experts alike): with
no GPU its FineGrainedFP8 quantizer forces ``dequantize=True``. It refuses to start without the
``accelerate`` package, which only its GPU paths use; where that package is absent the
transformers test lifts that import check and nothing else. Tensors stored in bf16 stay bf16 in
transformers' quantised load whatever ``dtype`` asks, so its model is cast to fp32 after loading.
"""

import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from dsv4ray import LLM
from dsv4ray.__main__ import main
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from dsv4ray.model.weights import checkpoint_files
from tests.oracle import dequantize_float64, max_rel_err, reference_greedy

SMALL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    compress_ratios=[0, 4, 128, 4, 0],
    n_routed_experts=4,
    num_hash_layers=1,
)
LAYOUTS = ["fp8", "fp8+fp4-experts"]


@pytest.fixture(scope="module", params=LAYOUTS)
def quant_ckpt(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    return make_tiny(str(out), "tiny", seed=4, quantize=request.param, **SMALL)


def _stored(path) -> dict:
    """Official name -> (safetensors dtype, shape) of every stored tensor."""
    out = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def test_layout_on_disk_is_the_release_layout(quant_ckpt):
    cfg = json.loads(open(f"{quant_ckpt}/config.json").read())
    fp4 = cfg["expert_dtype"] == "fp4"
    qcfg = cfg["quantization_config"]
    assert qcfg["quant_method"] == "fp8" and qcfg["fmt"] == "e4m3"
    assert qcfg["weight_block_size"] == [128, 128]
    assert qcfg["scale_fmt"] == ("ue8m0" if fp4 else "float")
    index = json.loads(open(f"{quant_ckpt}/model.safetensors.index.json").read())
    assert len(set(index["weight_map"].values())) > 1
    stored = _stored(quant_ckpt)
    assert set(index["weight_map"]) == set(stored)
    scale_dtype = "F8_E8M0" if fp4 else "F32"
    assert stored["layers.1.attn.wq_b.weight"] == ("F8_E4M3", (2048, 128))
    assert stored["layers.1.attn.wq_b.scale"] == (scale_dtype, (16, 1))
    assert stored["mtp.0.e_proj.weight"][0] == "F8_E4M3"
    assert stored["layers.2.ffn.shared_experts.w2.scale"] == (scale_dtype, (1, 1))
    expert, expert_scale = (
        stored["layers.2.ffn.experts.3.w1.weight"],
        stored["layers.2.ffn.experts.3.w1.scale"],
    )
    if fp4:  # [128, 128] logical: 64 bytes per row, one scale per 32 values
        assert expert == ("I8", (128, 64)) and expert_scale == ("F8_E8M0", (128, 4))
    else:
        assert expert == ("F8_E4M3", (128, 128)) and expert_scale == ("F32", (1, 1))
    for name in (
        "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.indexer.compressor.wgate.weight",
        "layers.1.attn.indexer.weights_proj.weight",
        "layers.1.ffn.gate.weight",
        "embed.weight",
        "head.weight",
        "layers.1.attn.kv_norm.weight",
    ):
        assert stored[name][0] == "BF16", name
        assert name[: -len(".weight")] + ".scale" not in stored
    fp32 = ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.3.ffn.gate.bias")
    for name in fp32:
        assert stored[name][0] == "F32", name
    assert stored["layers.0.ffn.gate.tid2eid"][0] == "I64"


def test_dequantised_weights_equal_a_float64_decode_of_the_bytes(quant_ckpt):
    params = load_reference(quant_ckpt, torch.float32).state_dict()
    tensors = {}
    for file in checkpoint_files(quant_ckpt):
        with safe_open(file, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    checked = 0
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.int8):
            want = dequantize_float64(t, tensors[name[: -len(".weight")] + ".scale"]).float()
            checked += 1
        else:
            want = t.to(params[name].dtype)
        assert torch.equal(params[name], want), name
    assert checked > 50


def test_logits_equal_transformers_dequantised_model(quant_ckpt, monkeypatch):
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import DeepseekV4ForCausalLM

    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    hf = DeepseekV4ForCausalLM.from_pretrained(quant_ckpt, dtype=torch.float32).eval().float()
    assert hf.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32  # dequantised
    ours = load_reference(quant_ckpt, torch.float32)
    ids = torch.randint(2, 258, (1, 150), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids).logits
    assert max_rel_err(ours(ids), ref) <= 1e-4


def test_engine_greedy_tokens_equal_the_reference(quant_ckpt):
    from dsv4ray import LLM, SamplingParams

    model = load_reference(quant_ckpt, torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 258, (n,), generator=gen).tolist() for n in (3, 130)]
    llm = LLM(quant_ckpt, kv_cache_dtype="fp32", max_total_tokens=2048)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(model, prompt, 4)


def test_make_tiny_command_writes_the_release_layout(tmp_path, capsys, monkeypatch):
    import dsv4ray.model.tiny as tiny

    real = tiny.make_tiny
    monkeypatch.setattr(tiny, "make_tiny", lambda *a, **kw: real(*a, **kw, **SMALL))  # smaller
    out = tmp_path / "q"
    assert main(["make-tiny", "--out", str(out), "--quantize", "fp8+fp4-experts"]) == 0
    assert "fp8+fp4-experts" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    assert (out / "model.safetensors.index.json").is_file()
    assert load_reference(str(out)).cfg.quantization.expert_dtype == "fp4"


@pytest.mark.parametrize("first,second", [(None, "fp8"), ("fp8", None)])
def test_a_checkpoint_written_over_another_replaces_it(tmp_path, first, second):
    """One file then shards, or shards then one file, into the same folder: the folder holds
    the second checkpoint alone and loads as it (the loader prefers an index to one file)."""
    out = str(tmp_path / "ckpt")
    make_tiny(out, "tiny", seed=1, quantize=first, **SMALL)
    make_tiny(out, "tiny", seed=2, quantize=second, **SMALL)
    alone = make_tiny(str(tmp_path / "alone"), "tiny", seed=2, quantize=second, **SMALL)
    assert sorted(os.listdir(out)) == sorted(os.listdir(alone))
    ids = torch.tensor([[0, 74, 103, 55]])
    torch.testing.assert_close(
        load_reference(out, torch.float32)(ids),
        load_reference(alone, torch.float32)(ids),
        rtol=0,
        atol=0,
    )


def test_a_scale_stored_as_another_integer_type_is_refused_by_name(quant_ckpt, tmp_path):
    """Exponent bytes relabelled I8, or multipliers stored as I32, would decode as other values:
    the tensor is named instead."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(quant_ckpt, path)
    file = checkpoint_files(str(path))[0]
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith(".scale"))
    tensors[name] = tensors[name].view(torch.int8) if tensors[name].element_size() == 1 else (
        tensors[name].to(torch.int32))  # fmt: skip
    save_file(tensors, file, {"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor '{re.escape(name)}' is stored as I"):
        LLM(str(path), use_ray=False, kv_cache_dtype="fp32")


@pytest.mark.parametrize("weight_format", ["dequantized", "native"])
def test_a_scale_that_is_nan_or_infinite_is_refused_by_name(quant_ckpt, tmp_path, weight_format):
    """A NaN scale (ue8m0 byte 255) turns its whole block into NaN weights: every later token
    would be garbage, so the load names the tensor instead."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(quant_ckpt, path)
    file = checkpoint_files(str(path))[0]
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith(".scale"))
    scale = tensors[name].clone()
    flat = scale.view(torch.uint8).view(-1) if scale.element_size() == 1 else scale.view(-1)
    flat[-1] = 255 if scale.element_size() == 1 else float("nan")
    tensors[name] = scale
    save_file(tensors, file, {"format": "pt"})
    with pytest.raises(ValueError, match=f"'{re.escape(name)}' holds NaN or infinite"):
        LLM(str(path), use_ray=False, kv_cache_dtype="fp32", weight_format=weight_format)
