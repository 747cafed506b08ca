"""Checkpoint loading: both key spellings, shards, MTP presence, and errors that name the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4ray.model import load_reference
from dsv4ray.model.weights import CheckpointError, canonical_name


def _copy(src, dst, transform):
    """Copies a checkpoint folder, rewriting its tensors through transform(dict) -> dict."""
    shutil.copytree(src, dst)
    tensors = transform(load_file(f"{src}/model.safetensors"))
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def _logits(path, ids):
    return load_reference(path, torch.float32)(ids)


IDS = torch.randint(2, 258, (1, 140), generator=torch.Generator().manual_seed(0))


def test_canonical_names_cover_transformers_spelling():
    assert canonical_name("model.embed_tokens.weight") == "embed.weight"
    assert canonical_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert canonical_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert (
        canonical_name("model.layers.3.attn.compressor.norm.weight")
        == "layers.3.attn.compressor.norm.weight"
    )
    assert canonical_name("head.weight") == "head.weight"
    assert canonical_name("layers.0.ffn.gate.tid2eid") == "layers.0.ffn.gate.tid2eid"


def test_model_prefix_and_transformers_names_load_identically(tiny_ckpt, tiny_model, tmp_path):
    def hf_spelling(t):
        out = {}
        for k, v in t.items():
            if k.startswith("mtp."):  # transformers writes no mtp.*; keep the official names
                out[k] = v
                continue
            k = k.replace("embed.weight", "embed_tokens.weight").replace("hc_head_", "hc_head.hc_")
            k = k.replace(".attn.kv_norm.", ".attn.norm.")
            out[k if k.startswith("head.") else "model." + k] = v
        return out

    path = _copy(tiny_ckpt, tmp_path / "hf", hf_spelling)
    assert torch.equal(_logits(path, IDS), tiny_model(IDS))


def test_sharded_checkpoint_loads(tiny_ckpt, tiny_model, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_ckpt, dst)
    tensors = load_file(f"{tiny_ckpt}/model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / file))
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(_logits(str(dst), IDS), tiny_model(IDS))


def test_checkpoint_without_mtp_loads_without_drafts(tiny_ckpt, tiny_model, tmp_path):
    path = _copy(
        tiny_ckpt,
        tmp_path / "nomtp",
        lambda t: {k: v for k, v in t.items() if not k.startswith("mtp.")},
    )
    model = load_reference(path, torch.float32)
    assert model.draft_block is None and tiny_model.draft_block is not None
    assert torch.equal(model(IDS), tiny_model(IDS))


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda t: t.pop("layers.2.attn.wkv.weight"), "layers.2.attn.wkv.weight"),
        (lambda t: t.update({"layers.1.attn.bogus": torch.zeros(3)}), "layers.1.attn.bogus"),
        (
            lambda t: t.update({"layers.4.ffn.gate.weight": torch.zeros(8, 7)}),
            "layers.4.ffn.gate.weight",
        ),
        (lambda t: t.pop("layers.0.ffn.gate.tid2eid"), "layers.0.ffn.gate.tid2eid"),
    ],
    ids=["missing", "unexpected", "misshaped", "missing-hash-table"],
)
def test_bad_tensors_are_named(tiny_ckpt, tmp_path, edit, key):
    def transform(t):
        edit(t)
        return t

    path = _copy(tiny_ckpt, tmp_path / "bad", transform)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_reference(path, torch.float32)


def test_quantised_tensor_without_quantization_config_is_named(tiny_ckpt, tmp_path):
    def quantise(t):
        t["layers.1.attn.wq_b.weight"] = t["layers.1.attn.wq_b.weight"].to(torch.float8_e4m3fn)
        t["layers.1.attn.wq_b.weight_scale_inv"] = torch.ones(16, 1)
        return t

    path = _copy(tiny_ckpt, tmp_path / "fp8", quantise)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b.*quantization_config"):
        load_reference(path, torch.float32)


def test_bf16_load_keeps_norms_and_mixers_in_fp32(tiny_ckpt):
    model = load_reference(tiny_ckpt, torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    for name in (
        "layers.1.attn.kv_norm.weight",
        "layers.1.hc_attn_fn",
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.ape",
        "layers.3.ffn.gate.bias",
    ):
        assert params[name].dtype == torch.float32, name
    full = load_reference(tiny_ckpt, torch.float32)(IDS)
    top1 = (model(IDS).argmax(-1) == full.argmax(-1)).float().mean()
    assert top1 >= 0.9
