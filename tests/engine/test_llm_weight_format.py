"""weight_format: a release-format checkpoint served with its FP8 / FP4 weights kept ("native")
gives the tokens of the same checkpoint dequantised at load.

On the torch backend a kept layer dequantises its weight exactly as the loader does, so the two
formats must agree bit for bit: any byte or scale loaded into the wrong place shows. On the Triton
backend (the interpreter here) the kernels apply each FP8 block scale to a K step's fp32 sum
instead of to every weight, and sum in another order, so logits differ in the last fp32 bits; the
greedy tokens must still be the dequantised engine's.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from dsv4ray import LLM, SamplingParams
from dsv4ray.config import ModelConfig
from dsv4ray.engine.config import EngineConfig
from dsv4ray.kernels import dispatch, fp8_act
from dsv4ray.kernels import sparse_mqa as sparse_mqa_kernels
from dsv4ray.model import tiny
from dsv4ray.model.layers.quant_linear import QuantLinear
from dsv4ray.model.tiny import make_tiny

SMALL = dict(num_hidden_layers=2, compress_ratios=[4, 0, 0], num_attention_heads=2,
             index_n_heads=4, num_hash_layers=1)  # fmt: skip
GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def flash_ckpt(tmp_path_factory) -> str:
    """V4-Flash layout: FP8 linears with ue8m0 block scales, FP4 experts, bf16 exceptions."""
    return make_tiny(str(tmp_path_factory.mktemp("flash")), seed=5, quantize="fp8+fp4-experts",
                     **SMALL)  # fmt: skip


def _prompts(lengths, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _serve(path, weight_format, prompts, score=False, **kw):
    llm = LLM(path, kv_cache_dtype="fp32", weight_format=weight_format,
              max_num_batched_tokens=256, **kw)  # fmt: skip
    try:
        stage = llm.core.pipeline.workers[0].model
        if score:
            return stage, llm.score(prompts)
        return stage, [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


def test_native_on_torch_equals_dequantized_bit_for_bit(flash_ckpt):
    prompts = _prompts([9, 140])
    native, got = _serve(flash_ckpt, "native", prompts, score=True)
    dense, want = _serve(flash_ckpt, "dequantized", prompts, score=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    attn, ffn = native.block(0).attn, native.block(1).ffn  # layer 0: C4 with an indexer
    assert isinstance(attn.wq_a, QuantLinear) and attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert attn.wo_a.groups == native.cfg.o_groups
    assert ffn.experts[0].w1.kind == "fp4" and ffn.shared_experts.w1.kind == "fp8"
    assert isinstance(attn.indexer.compressor.wkv, torch.nn.Linear)  # stored in bf16
    nbytes = lambda m: sum(t.nbytes for t in m.state_dict().values())  # noqa: E731
    assert nbytes(native.layers) < 0.6 * nbytes(dense.layers)  # fp32 compute dtype here


def test_the_draft_layer_keeps_its_quantised_weights_and_drafts_the_same(flash_ckpt):
    """The MTP draft worker loads its block as the stages do: FP8 linears and FP4 experts kept
    (a V4-Flash MTP layer dequantised would hold ~4x the bytes), and on the torch backend its
    proposals are those of the dequantised block, so every count matches bit for bit."""
    prompts = _prompts([9, 40])
    runs = {}
    for fmt in ("native", "dequantized"):
        llm = LLM(flash_ckpt, kv_cache_dtype="fp32", weight_format=fmt, use_ray=False,
                  speculative_num_steps=2)  # fmt: skip
        try:
            block = llm.core.pipeline.draft.block
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            stats = llm.core.stats()
            runs[fmt] = block, tokens, [stats[k] for k in ("num_draft_tokens",
                                                         "num_accepted_draft_tokens")]  # fmt: skip
        finally:
            llm.shutdown()
    (native, got, got_counts), (dense, want, want_counts) = runs["native"], runs["dequantized"]
    assert isinstance(native.e_proj, QuantLinear) and native.e_proj.kind == "fp8"
    assert native.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert native.ffn.experts[0].w1.kind == "fp4"
    assert isinstance(dense.e_proj, torch.nn.Linear)
    assert got == want and got_counts == want_counts and got_counts[0] > 0
    nbytes = lambda m: sum(t.nbytes for t in m.state_dict().values())  # noqa: E731
    assert nbytes(native) < 0.6 * nbytes(dense)


def test_native_triton_kernels_give_the_dequantized_tokens(flash_ckpt, monkeypatch):
    """The engine's FP8 linears (every attention projection, the grouped wo_a, the indexer's wq_b,
    the FP8 shared expert) and FP4 grouped experts on the Triton path. Attention itself runs its
    torch reference: its kernel is pinned by test_llm_triton_interpreted.py and costs most of the
    interpreter's time."""
    monkeypatch.setattr(dispatch, "sparse_mqa", sparse_mqa_kernels.sparse_mqa_ref)
    prompts = _prompts([9, 40])
    _, want = _serve(flash_ckpt, "dequantized", prompts)
    with dispatch.use_backend("triton"):
        stage, got = _serve(flash_ckpt, "native", prompts)
    assert stage.block(0).attn.wq_b.matmul is not None  # the kernel ran, not the reference
    assert got == want


def test_weight_format_is_validated_and_resolved(flash_ckpt, tmp_path):
    with pytest.raises(ValueError, match="weight_format must be one of"):
        EngineConfig.build(flash_ckpt, weight_format="fp8")
    plain = make_tiny(str(tmp_path), seed=5, **SMALL)  # fp32 weights, no quantization_config
    with pytest.raises(ValueError, match="weight_format 'native' needs a quantized checkpoint"):
        LLM(plain, weight_format="native")
    stage, _ = _serve(flash_ckpt, "auto", [])  # CPU: dequantised at load
    assert isinstance(stage.block(0).attn.wq_a, torch.nn.Linear)


def test_fp8_prefill_is_refused_where_it_cannot_run(flash_ckpt, tmp_path, monkeypatch):
    """EngineConfig.fp8_prefill needs a quantised checkpoint, native FP8 linears, a GPU with FP8
    tensor cores and 16-bit compute: asked for elsewhere, the engine does not start and names
    what is missing, the device before the dtype (no dtype helps on a CPU)."""
    with pytest.raises(ValueError, match="fp8_prefill must be True or False"):
        EngineConfig.build(flash_ckpt, fp8_prefill="yes")
    plain = make_tiny(str(tmp_path), seed=5, **SMALL)
    with pytest.raises(ValueError, match="no quantization_config"):
        LLM(plain, fp8_prefill=True)
    with pytest.raises(
        ValueError, match="FP8 linears kept native .* got weight_format 'dequantized'"
    ):
        LLM(flash_ckpt, fp8_prefill=True)  # CPU: "auto" dequantises at load
    for dtype in ("float32", "bfloat16"):
        with dispatch.use_backend("triton"), pytest.raises(ValueError, match="FP8 tensor cores"):
            LLM(flash_ckpt, weight_format="native", fp8_prefill=True, dtype=dtype)
    monkeypatch.setattr(fp8_act, "supported", lambda device: True)  # as on an H100
    with dispatch.use_backend("triton"), pytest.raises(ValueError, match="bf16 or fp16 compute"):
        LLM(flash_ckpt, weight_format="native", fp8_prefill=True, dtype="float32")


def test_the_draft_layer_takes_fp8_prefill_as_the_stages_do(flash_ckpt, monkeypatch):
    """fp8_prefill reaches the draft worker with the engine's weight_format: its FP8 linears
    (e_proj among them) take FP8 activations in prefill-sized calls, as the stages' do."""
    from dsv4ray.worker.spec.draft import DraftWorker
    from dsv4ray.worker.stage_spec import DraftSpec

    monkeypatch.setattr(fp8_act, "supported", lambda device: True)  # as on an H100
    ec = EngineConfig.build(flash_ckpt, weight_format="native", fp8_prefill=True,
                            dtype="bfloat16", speculative_num_steps=1, device="cpu")  # fmt: skip
    spec = DraftSpec.of(ec)
    assert (spec.weight_format, spec.fp8_prefill) == ("native", True)
    with dispatch.use_backend("triton"):
        block = DraftWorker(spec).block
    assert block.e_proj.matmul.keywords["act_fp8"] is None  # None: FP8 from 64 rows up
    assert block.attn.wq_a.matmul.keywords["act_fp8"] is None


def test_streamed_preset_writes_a_sharded_release_checkpoint(tmp_path, monkeypatch):
    """dsv4-flash-layers is written a tensor at a time (shrunk here to the tiny preset's widths,
    its 6-of-N routing and C4 / C128 pattern kept): several shards of at most about SHARD_BYTES,
    an index naming every stored tensor, no temporary file left, and a checkpoint that serves
    the same greedy tokens with native and with dequantised weights."""
    monkeypatch.setattr(tiny, "SHARD_BYTES", 1 << 20)
    widths = {k: tiny.PRESETS["tiny"][k] for k in ("vocab_size", "hidden_size", "q_lora_rank",
              "o_groups", "o_lora_rank", "hc_mult", "index_n_heads", "index_head_dim",
              "index_topk", "moe_intermediate_size")}  # fmt: skip
    path = make_tiny(str(tmp_path / "flash"), "dsv4-flash-layers", seed=3,
                     quantize="fp8+fp4-experts", num_hidden_layers=3, num_attention_heads=2,
                     n_routed_experts=16, num_hash_layers=1, **widths)  # fmt: skip
    cfg = ModelConfig.from_hf(path)
    assert cfg.compress_ratios == (4, 128, 4) and cfg.num_experts_per_tok == 6
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(files) > 2 and set(weight_map.values()) == set(files)
    assert not [f for f in os.listdir(path) if f.startswith(".shard")]
    stored = {}
    for file in files:
        with safe_open(os.path.join(path, file), "pt") as f:
            stored.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    assert set(stored) == set(weight_map)
    assert stored["layers.0.ffn.experts.15.w1.weight"] == "I8"  # packed FP4
    assert stored["layers.0.attn.wq_b.weight"] == "F8_E4M3"
    prompts = _prompts([7, 30])
    _, got = _serve(path, "native", prompts)
    _, want = _serve(path, "dequantized", prompts)
    assert got == want


def test_a_head_stored_quantised_is_refused_by_native_weights_by_name(flash_ckpt, tmp_path):
    """The head's logits come from its plain weight: native weights refuse an FP8 head by name
    (its codes would be read unscaled), and dequantized weights take it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from dsv4ray.model.quant import quantize_fp8

    shutil.copytree(flash_ckpt, tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "m" / index["weight_map"]["head.weight"]
    tensors = load_file(str(shard))
    tensors["head.weight"], tensors["head.scale"] = quantize_fp8(
        tensors["head.weight"].float(), (128, 128), "ue8m0"
    )
    save_file(tensors, str(shard), {"format": "pt"})
    index["weight_map"]["head.scale"] = index["weight_map"]["head.weight"]
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'head.weight' is stored quantised.*dequantized"):
        LLM(str(tmp_path / "m"), use_ray=False, weight_format="native")
    assert _serve(str(tmp_path / "m"), "dequantized", _prompts([9]))[1][0]
