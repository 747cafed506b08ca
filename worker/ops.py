"""The paged forward's fused ops: Triton kernels on the triton backend, the model's torch functions
otherwise (kernels/dispatch.py picks the backend once).

Each op is one kernel (or two) on GPUs where the model's torch code is a chain of small ones:
mHC (kernels/mhc.py), norms and RoPE (kernels/norm.py), the routed and shared experts
(kernels/moe.py, on bf16, FP8 or FP4 expert weights). Linears that keep a checkpoint's FP8 weights
(``QuantLinear``, see ``resolve_weight_format``) are bound to kernels/fp8_linear.py in `prepare`;
dense linears take calls of up to 16 rows in kernels/small_linear.py, and the head path a few
launches (``bind_few_row_kernels``).
The torch side is the reference these kernels are tested against, and what CPU machines run.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from dsv4ray.config import ModelConfig
from dsv4ray.kernels import dispatch, fp8_act, small_linear
from dsv4ray.kernels import fp8_linear as fp8_kernels
from dsv4ray.kernels import mhc as mhc_kernels
from dsv4ray.kernels import moe as moe_kernels
from dsv4ray.kernels import norm as norm_kernels
from dsv4ray.model.block import Block
from dsv4ray.model.layers.attention import Attention, grouped_linear
from dsv4ray.model.layers.common import RMSNorm, unweighted_rms_norm
from dsv4ray.model.layers.common import rms_norm as torch_rms_norm
from dsv4ray.model.layers.mhc import hc_post
from dsv4ray.model.layers.moe import Gate, MoE
from dsv4ray.model.layers.quant_linear import QuantLinear
from dsv4ray.model.layers.rope import apply_rope
from dsv4ray.model.mtp import MTPBlock
from dsv4ray.model.stage import StageModel

log = logging.getLogger("dsv4ray.worker")


def fused() -> bool:
    return dispatch.backend() == "triton"


def resolve_weight_format(requested: str, cfg: ModelConfig, device: torch.device) -> str:
    """EngineConfig.weight_format -> how a stage loads its linears, "native" or "dequantized".

    "auto": native (FP8 / FP4 weights kept, the kernels of kernels/fp8_linear.py and
    kernels/moe.py) on CUDA with the Triton backend for a quantized checkpoint; else dequantized.
    """
    quant = cfg.quantization
    if requested == "native" and quant is None:
        raise ValueError("weight_format 'native' needs a quantized checkpoint (config.json has no "
                         "quantization_config)")  # fmt: skip
    if quant is not None and quant.weight_block_size[1] % 16 and fused():
        if requested == "native":
            raise ValueError(f"weight_format 'native': the FP8 kernels need scale blocks of a "
                             f"multiple of 16 columns, weight_block_size is "
                             f"{list(quant.weight_block_size)}")  # fmt: skip
        requested = "dequantized"
    if requested == "auto":
        native = quant is not None and device.type == "cuda" and fused()
        requested = "native" if native else "dequantized"
    log.info("weights: %s (%s)", requested, "quantized checkpoint" if quant else "bf16/fp32")
    return requested


def check_fp8_prefill(requested: bool, weight_format: str, cfg: ModelConfig,
                      device: torch.device, dtype: torch.dtype) -> bool:  # fmt: skip
    """EngineConfig.fp8_prefill for a stage: True needs native FP8 linears whose scale blocks
    span a multiple of 128 columns, bf16 or fp16 compute, and a GPU with FP8 tensor cores (a
    clear error names what is missing)."""
    if not requested:
        return False
    quant = cfg.quantization
    if quant is None:
        raise ValueError("fp8_prefill needs a checkpoint with FP8 linears; this checkpoint has "
                         "no quantization_config (its weights are not quantised)")  # fmt: skip
    if weight_format != "native":
        raise ValueError(f"fp8_prefill needs the FP8 linears kept native (weight_format "
                         f"'native'), got weight_format {weight_format!r}")  # fmt: skip
    if quant.weight_block_size[1] % fp8_act.ACT_GROUP:
        raise ValueError(f"fp8_prefill needs FP8 scale blocks of a multiple of "
                         f"{fp8_act.ACT_GROUP} columns, weight_block_size is "
                         f"{list(quant.weight_block_size)}")  # fmt: skip
    if not (fused() and fp8_act.supported(device)):  # first: no dtype helps on other devices
        raise ValueError(
            f"fp8_prefill needs a GPU with FP8 tensor cores (compute capability 8.9 or newer) "
            f"and the Triton backend; this stage runs on {device}"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_prefill needs bf16 or fp16 compute, the model runs in {dtype}")
    log.info("FP8 linears: prefill-sized calls on FP8 activations (1 x 128 blocks)")
    return True


def prepare(blocks, dtype: torch.dtype | None = None, fp8_prefill: bool = False) -> None:
    """One-time weight layouts the fused ops read: each MoE's experts stacked (the experts'
    parameters become views, so nothing is held twice; scales stored as `stored_scales` lays
    them out), and FP8 linears kept quantised bound to their kernel (with fp8_prefill,
    prefill-sized calls on FP8 activations); on CUDA the experts' and the FP8 linears' kernel
    variants are compiled here for the model dtype, so serving compiles nothing. Call before
    sizing pools."""
    if not fused():
        return
    matmul = functools.partial(fp8_kernels.fp8_linear, act_fp8=None if fp8_prefill else False)
    for block in blocks:
        ffn = block.ffn
        fmt, block_shape = ffn.expert_format
        w13, w2 = ffn.stack_experts(functools.partial(moe_kernels.stored_scales, fmt))
        if w13.is_cuda and dtype is not None:
            num_slots = ffn.gate.k + int(ffn.shared_in_stack)
            moe_kernels.compile_variants(w13, w2, ffn.stacked_scales, fmt, block_shape,
                                         num_slots, dtype)  # fmt: skip
        stacked = list(ffn.experts) + ([ffn.shared_experts] if ffn.shared_in_stack else [])
        in_stack = {id(layer) for expert in stacked for layer in expert.modules()}
        for layer in block.modules():  # the rest run one by one
            if isinstance(layer, QuantLinear) and layer.kind == "fp8" and id(layer) not in in_stack:
                layer.matmul = matmul
                if layer.weight.is_cuda and dtype is not None:
                    fp8_kernels.compile_variants(
                        layer.weight, layer.scale, layer.block, layer.groups, dtype, fp8_prefill
                    )


def bind_few_row_kernels(module: nn.Module) -> int:
    """On the Triton backend, for module's parts with weights on a GPU: every bias-free dense
    linear, MoE gate and grouped attention output projection computes calls of up to SMALL_M rows
    with kernels/small_linear.py (one launch; a row's result independent of the other rows, so
    verification rows equal decode rows bit for bit), larger ones in torch; the hc head's
    collapse, norm and lm head of a last stage or an MTP block (and the MTP block's input norms)
    run as one launch each (kernels/mhc.py, kernels/norm.py, small_linear) where torch runs a
    dozen. CPU weights stay on torch (the interpreter pays tens of ms a launch). Returns how many
    parts it bound."""
    if not fused():
        return 0
    bound = 0
    for layer in module.modules():
        if type(layer) is nn.Linear and layer.bias is None and layer.weight.is_cuda:
            layer.forward = _few_rows(layer.weight)
            bound += 1
        elif isinstance(layer, Gate) and layer.weight.is_cuda:
            layer.linear = _few_rows_linear
            bound += 1
        elif isinstance(layer, Attention) and type(layer.wo_a) is nn.Linear:
            if layer.wo_a.weight.is_cuda:
                layer.grouped_linear = _few_rows_grouped
                bound += 1
        elif isinstance(layer, (StageModel, MTPBlock)) and hasattr(layer, "hc_head_fn"):
            if layer.hc_head_fn.is_cuda:
                bound += _bind_head(layer)
    return bound


def _bind_head(owner: nn.Module) -> int:
    """The head path of a last stage or an MTP block (model/stage.py ``logits``, model/mtp.py
    ``head_logits`` and ``mix``) on kernels."""
    owner.collapse = _fused_collapse
    owner.head_linear = _few_rows_any
    norms = [owner.norm] + ([owner.enorm, owner.hnorm] if isinstance(owner, MTPBlock) else [])
    for norm in norms:
        norm.forward = _fused_norm(norm)
    return 2 + len(norms)


def _fused_collapse(x, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """model/layers/mhc.py ``hc_head``: x [..., hc, hidden] -> [..., hidden]."""
    hc, hidden = x.shape[-2:]
    y = mhc_kernels.mhc_head(x.reshape(-1, hc, hidden).contiguous(), fn, base, scale, hc_eps,
                             norm_eps)  # fmt: skip
    return y.view(*x.shape[:-2], hidden)


def _fused_norm(norm: RMSNorm):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return norm_kernels.rms_norm(x.contiguous(), norm.weight, norm.eps)

    return forward


def _few_rows_any(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear for x [..., K]: small_linear when it fits."""
    y = _few_rows_linear(x.reshape(-1, x.shape[-1]), weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def _few_rows_grouped(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """attention.grouped_linear: small_linear when it fits."""
    if small_linear.fits(x, weight):
        return small_linear.small_linear(x, weight, groups)
    return grouped_linear(x, weight, groups)


def _few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear for x [M, K]: small_linear when it fits."""
    if small_linear.fits(x, weight):
        return small_linear.small_linear(x, weight)
    return F.linear(x, weight)


def _few_rows(weight: torch.Tensor):
    """A bound linear's forward: x [..., K] -> [..., N]."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _few_rows_any(x, weight)

    return forward


def pre_mix(block: Block, x: torch.Tensor, site: str):
    """mHC before a sublayer: (post [T, hc], comb [T, hc, hc], collapsed [T, hidden])."""
    if not fused():
        return block.pre_mix(x, site)
    c = block.cfg
    return mhc_kernels.mhc_pre(
        x.contiguous(),
        getattr(block, f"hc_{site}_fn"),
        getattr(block, f"hc_{site}_base"),
        getattr(block, f"hc_{site}_scale"),
        c.hc_eps,
        c.rms_norm_eps,
        c.hc_sinkhorn_iters,
    )


def post_mix(x, out, post, comb) -> torch.Tensor:
    """mHC after a sublayer: x [T, hc, hidden], out [T, hidden] -> the new streams."""
    if not fused():
        return hc_post(x, out, post, comb)
    return mhc_kernels.mhc_post(x.contiguous(), out.contiguous(), post, comb)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    if not fused():
        return norm(x)
    return norm_kernels.rms_norm(x.contiguous(), norm.weight, norm.eps)


def norm_rope(x, tables, positions, eps=None, weight=None, conjugate=False, out_dtype=None):
    """x [T, H, D]: the RMS norm of each head vector (eps given; weighted when weight is), then
    RoPE on its last channels at positions (conjugate: the de-rotation), in out_dtype (default
    x's). tables: the (cos, sin) [P, R/2] fp32 tables of the layer's rope."""
    cos_t, sin_t = tables
    out_dtype = out_dtype or x.dtype
    if fused():
        return norm_kernels.norm_rope(
            x.contiguous(), cos_t, sin_t, positions, weight, eps, conjugate, out_dtype
        )
    if eps is None:
        y = x.to(out_dtype)
    elif weight is None:
        y = unweighted_rms_norm(x, eps)
    else:
        y = torch_rms_norm(x, weight, eps)
    cos, sin = cos_t[positions][:, None], sin_t[positions][:, None]
    return apply_rope(y, cos, -sin if conjugate else sin).to(out_dtype)


def moe(ffn: MoE, x: torch.Tensor, token_ids: torch.Tensor, static: bool) -> torch.Tensor:
    """Routed + shared experts of x [T, hidden]. static: no host synchronisation (CUDA graphs;
    the fused path never synchronises)."""
    if not fused():
        return ffn.forward_static(x, token_ids) if static else ffn(x, token_ids)
    weights, ids = ffn.gate(x, token_ids)
    w13, w2 = ffn.stack_experts()
    if ffn.shared_in_stack:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], len(ffn.experts))], dim=1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
    fmt, block = ffn.expert_format
    out = moe_kernels.fused_moe(
        x.contiguous(), ids, weights, w13, w2, ffn.limit, ffn.stacked_scales, fmt, block
    )
    return out if ffn.shared_in_stack else out + ffn.shared_experts(x)
