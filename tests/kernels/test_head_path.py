"""The head path on kernels (worker/ops.py ``bind_few_row_kernels``): a last stage's logits and an
MTP block's mix and logits equal the torch path's, and a row's logits do not depend on the other
rows (verification rows score as decode rows do)."""

import torch

from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.mtp import MTPBlock
from dsv4ray.model.stage import StageModel
from dsv4ray.model.tiny import tiny_config
from dsv4ray.worker import ops


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():  # hc head weights at their trained scale, not zeros/ones
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 + (p.dim() == 1))
    return module


def _stacks(cfg, rows: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(rows, cfg.hc_mult, cfg.hidden_size, generator=g).to(device)


def test_last_stage_logits_on_kernels_equal_the_torch_path(device):
    cfg = tiny_config("tiny", hidden_size=128)
    layers = cfg.num_hidden_layers
    model = _randomised(StageModel(cfg, layers - 1, layers), 0).to(device)
    x = _stacks(cfg, 4, device)
    ref = model.logits(x)
    assert ops._bind_head(model) == 3
    out = model.logits(x)
    assert out.dtype == torch.float32 and out.shape == (4, cfg.vocab_size)
    assert_close("stage logits", out, ref, 1e-4, 1e-4)
    assert torch.equal(model.logits(x[:1]), out[:1])
    assert torch.equal(model.logits(x.view(2, 2, *x.shape[1:])).view(4, -1), out)


def test_mtp_mix_and_logits_on_kernels_equal_the_torch_path(device):
    cfg = tiny_config("tiny", hidden_size=128)
    block = _randomised(MTPBlock(cfg), 1).to(device)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device) * cfg.hidden_size**-0.5
    h, embed = _stacks(cfg, 4, device), _stacks(cfg, 4, device)[:, 0] * 3
    ref_mix = block.mix(h, embed)
    ref = block.head_logits(ref_mix, head)
    assert ops._bind_head(block) == 5
    mixed = block.mix(h, embed)
    assert_close("mtp mix", mixed, ref_mix, 1e-5, 1e-5)
    out = block.head_logits(mixed, head)
    assert_close("mtp logits", out, ref, 1e-4, 1e-4)
    assert torch.equal(block.head_logits(mixed[:1], head), out[:1])
